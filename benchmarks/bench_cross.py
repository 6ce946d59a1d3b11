"""asv: the cross workload, Tq queries of one sequence (128 and 4096, or MHA_ASV_CROSS_QUERY_LENS) against Tk keys and
values of another (77, 1024, 4096, or MHA_ASV_CROSS_KV_LENS), unmasked: an encoder-decoder's cross-attention, a
diffusion model's image tokens attending to its text. Not in regenerate_results.sh's default asv set: ASV_BENCH=Cross.

Time per call and peak extra memory, the call built as ``mha-harness bench --workload cross`` builds it (x_q and one
x_kv that makes both K and V, every projection in the call); backends that cannot take another sequence's keys and
values (``inputs="self"`` or ``"kv_cache"``, ``cross_attention=False``) are skipped with the reason.
"""
from ._common import BACKENDS, CROSS_LENS, CROSS_QUERIES, prepared


class _CrossCall:
    params = [BACKENDS, CROSS_QUERIES, CROSS_LENS]
    param_names = ["backend", "tq", "kv_len"]
    timeout = 600
    for_memory = False

    def setup(self, backend, tq, kv_len):
        self.backend, self.fn, self.shape = prepared(backend, kv_len, False, tq=tq, cross=True,
                                                     for_memory=self.for_memory)


class Cross(_CrossCall):
    def time_cross(self, backend, tq, kv_len):
        self.fn()


class CrossPeakMemory(_CrossCall):
    unit = "bytes"
    for_memory = True  # glibc's mmap threshold pinned (asv runs this benchmark in its own process)

    def track_cross_peak_extra_memory(self, backend, tq, kv_len):
        from mha_harness.bench.memory import peak_extra_bytes
        return peak_extra_bytes(self.fn, self.backend.memory_method)
