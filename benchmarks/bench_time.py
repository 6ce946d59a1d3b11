"""asv: forward and forward+backward time per backend x sequence length x causal."""
from ._common import PreparedBenchmark


class TimeForward(PreparedBenchmark):
    def time_forward(self, backend, seq_len, causal):
        self.fn()


class TimeForwardBackward(PreparedBenchmark):
    backward = True

    def time_forward_backward(self, backend, seq_len, causal):
        self.fn()
