"""asv: achieved GFLOP/s (flash-attention formula) and its fraction of this machine's float32 GEMM peak."""
from ._common import PreparedBenchmark, median_call_s, roofs


class Throughput(PreparedBenchmark):
    def setup(self, backend, seq_len, causal):
        from mha_harness.bench.metrics import metrics
        super().setup(backend, seq_len, causal)
        self.metrics = metrics(self.shape, median_call_s(self.fn), **roofs())

    def track_gflops(self, backend, seq_len, causal):
        return self.metrics["gflops"]

    track_gflops.unit = "GFLOP/s"

    def track_fraction_of_gemm_peak(self, backend, seq_len, causal):
        return self.metrics["fraction_of_gemm_peak"]

    track_fraction_of_gemm_peak.unit = "fraction"
