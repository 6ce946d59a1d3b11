"""asv: peak extra memory of one forward call, measured with each backend's own method."""
from ._common import PARAM_NAMES, PARAMS, prepared


class PeakMemory:
    params = PARAMS
    param_names = PARAM_NAMES
    timeout = 600
    unit = "bytes"

    def setup(self, backend, seq_len, causal):
        self.backend, self.fn, _ = prepared(backend, seq_len, causal)

    def track_peak_extra_memory(self, backend, seq_len, causal):
        from harness.memory import peak_extra_bytes
        return peak_extra_bytes(self.fn, self.backend.memory_method)
