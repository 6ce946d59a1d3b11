"""asv: achieved GFLOP/s (flash-attention formula) and its fraction of this machine's float32 GEMM peak."""
import statistics
import time

from ._common import PreparedBenchmark

_PEAK = {}


def _gemm_peak() -> float:
    if "gflops" not in _PEAK:
        from mha_harness.bench.sweep import gemm_peak_gflops
        _PEAK["gflops"] = gemm_peak_gflops()
    return _PEAK["gflops"]


class Throughput(PreparedBenchmark):
    def setup(self, backend, seq_len, causal):
        from mha_harness.bench.sweep import attention_flops
        super().setup(backend, seq_len, causal)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            self.fn()
            times.append(time.perf_counter() - start)
        self.gflops = attention_flops(self.config, seq_len, causal, False) / statistics.median(times) / 1e9

    def track_gflops(self, backend, seq_len, causal):
        return self.gflops

    track_gflops.unit = "GFLOP/s"

    def track_fraction_of_gemm_peak(self, backend, seq_len, causal):
        return self.gflops / _gemm_peak()

    track_fraction_of_gemm_peak.unit = "fraction"
