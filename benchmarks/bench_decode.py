"""asv: the decode workload, Tq new queries (1 and 16) against a KV length Tk, bottom-right causal.

Time per call, and bytes moved per second with their fraction of this machine's measured memory bandwidth
(decode is memory-bound), from the same metrics function as ``mha-harness bench --workload decode``.
"""
from ._common import BACKENDS, DECODE_QUERY_LENS, KV_LENS, median_call_s, prepared, roofs


class _DecodeCall:
    params = [BACKENDS, list(DECODE_QUERY_LENS), KV_LENS]
    param_names = ["backend", "tq", "kv_len"]
    timeout = 600

    def setup(self, backend, tq, kv_len):
        self.backend, self.fn, self.shape = prepared(backend, kv_len, True, tq=tq)


class Decode(_DecodeCall):
    def time_decode(self, backend, tq, kv_len):
        self.fn()


class DecodeBandwidth(_DecodeCall):
    def setup(self, backend, tq, kv_len):
        from mha_harness.bench.metrics import metrics
        super().setup(backend, tq, kv_len)
        self.metrics = metrics(self.shape, median_call_s(self.fn), **roofs())

    def track_gbytes_per_s(self, backend, tq, kv_len):
        return self.metrics["gbytes_per_s"]

    track_gbytes_per_s.unit = "GB/s"

    def track_fraction_of_memory_bandwidth(self, backend, tq, kv_len):
        return self.metrics["fraction_of_memory_bandwidth"]

    track_fraction_of_memory_bandwidth.unit = "fraction"
