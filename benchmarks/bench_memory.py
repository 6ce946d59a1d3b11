"""asv: peak extra memory of one forward call, measured with each backend's own method."""
from ._common import PreparedBenchmark


class PeakMemory(PreparedBenchmark):
    unit = "bytes"
    for_memory = True  # glibc's mmap threshold pinned (asv runs this benchmark in its own process)

    def track_peak_extra_memory(self, backend, seq_len, causal):
        from mha_harness.bench.memory import peak_extra_bytes
        return peak_extra_bytes(self.fn, self.backend.memory_method)
