"""asv: the layers people write, with the features `mha-harness bench` times under --rotary, --kv-heads,
--sliding-window and --alibi: Llama's (rotary embeddings, grouped-query heads, causal), Mistral's (a sliding window
of WINDOW keys, causal) and BLOOM's (an ALiBi bias by distance, causal), for every backend that declares them (the
others skip, naming the capability).

A kernel that skips the keys behind its window grows as T * WINDOW, not T^2: SlidingWindow tracks that across
commits, at the sequence lengths MHA_ASV_FEATURE_SEQ_LENS gives (default 1024, 4096) and the decode KV lengths
MHA_ASV_FEATURE_KV_LENS (default 4096, 65536) with one new query.
"""
from ._common import BACKENDS, _ints, prepared

#: Mistral 7B's window is 4096 keys; a shorter one shows the difference at CPU lengths
WINDOW = 256
DECODE_WINDOW = 4096
LLAMA = dict(rotary="half_split", num_kv_heads=2)
#: BLOOM's bias -m_h (p - s); on a causal layer's visible keys it is also MPT's and flash-attn's -m_h |p - s|
BLOOM = dict(alibi="linear")
FEATURE_SEQ_LENS = _ints("MHA_ASV_FEATURE_SEQ_LENS", (1024, 4096))
FEATURE_KV_LENS = _ints("MHA_ASV_FEATURE_KV_LENS", (4096, 65536))


class SlidingWindow:
    """One causal prefill call of a layer with a sliding window of WINDOW keys."""

    params = [BACKENDS, FEATURE_SEQ_LENS]
    param_names = ["backend", "seq_len"]
    timeout = 600

    def setup(self, backend, seq_len):
        self.backend, self.fn, self.shape = prepared(backend, seq_len, True, sliding_window=WINDOW)

    def time_sliding_window(self, backend, seq_len):
        self.fn()


class SlidingWindowDecode:
    """One decode step (one new query) over a KV cache under a sliding window of DECODE_WINDOW keys."""

    params = [BACKENDS, FEATURE_KV_LENS]
    param_names = ["backend", "kv_len"]
    timeout = 600

    def setup(self, backend, kv_len):
        self.backend, self.fn, self.shape = prepared(backend, kv_len, True, tq=1, sliding_window=DECODE_WINDOW)

    def time_sliding_window_decode(self, backend, kv_len):
        self.fn()


class LlamaLayer:
    """One causal prefill call of a Llama layer: half_split rotary embeddings, 2 key/value heads for 8 query heads."""

    params = [BACKENDS, FEATURE_SEQ_LENS]
    param_names = ["backend", "seq_len"]
    timeout = 600

    def setup(self, backend, seq_len):
        self.backend, self.fn, self.shape = prepared(backend, seq_len, True, **LLAMA)

    def time_llama_layer(self, backend, seq_len):
        self.fn()


class BloomLayer:
    """One causal prefill call of a BLOOM layer: the paper's ALiBi slopes times the key's distance on the scores."""

    params = [BACKENDS, FEATURE_SEQ_LENS]
    param_names = ["backend", "seq_len"]
    timeout = 600

    def setup(self, backend, seq_len):
        self.backend, self.fn, self.shape = prepared(backend, seq_len, True, **BLOOM)

    def time_bloom_layer(self, backend, seq_len):
        self.fn()


class BloomDecode:
    """One decode step (one new query, at the last position) of a BLOOM layer over a KV cache: its bias spans every
    cached key."""

    params = [BACKENDS, FEATURE_KV_LENS]
    param_names = ["backend", "kv_len"]
    timeout = 600

    def setup(self, backend, kv_len):
        self.backend, self.fn, self.shape = prepared(backend, kv_len, True, tq=1, **BLOOM)

    def time_bloom_decode(self, backend, kv_len):
        self.fn()
