"""asv: forward and forward+backward time per backend x sequence length x causal."""
from ._common import PARAM_NAMES, PARAMS, prepared


class TimeForward:
    params = PARAMS
    param_names = PARAM_NAMES
    timeout = 600

    def setup(self, backend, seq_len, causal):
        self.backend, self.fn, _ = prepared(backend, seq_len, causal)

    def time_forward(self, backend, seq_len, causal):
        self.fn()


class TimeForwardBackward:
    params = PARAMS
    param_names = PARAM_NAMES
    timeout = 600

    def setup(self, backend, seq_len, causal):
        self.backend, self.fn, _ = prepared(backend, seq_len, causal, backward=True)

    def time_forward_backward(self, backend, seq_len, causal):
        self.fn()
