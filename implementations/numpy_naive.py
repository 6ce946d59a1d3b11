"""numpy-naive: the lesson's algorithm, vectorised over batch and heads.

Project, split the feature axis into heads, softmax(Q K^T / sqrt(d_head)) V per head,
concatenate, multiply by W_o. Materialises the (batch, heads, Tq, Tk) score matrix.
Each step is a method so the mutant zoo can break exactly one of them.
"""
from __future__ import annotations

import numpy as np

from mha_harness.contract.api import (
    AttentionBackend,
    AttentionConfig,
    AttentionInputs,
    AttentionOutput,
    AttentionParams,
    Capabilities,
    LoadedAttention,
)
from mha_harness.contract.conventions import (
    ALIBI_KINDS,
    MASK_POLARITY,
    QK_NORMS,
    QK_NORMS_CENTRED,
    QK_NORMS_PER_HEAD,
    ROTARY_KINDS,
    ROTARY_SCALING_KINDS,
    alibi_bias,
    rotary_pairs,
    rotary_positions,
)
from mha_harness.contract.numerics import weighted_values
from mha_harness.toolkit.masks import full_mask


class NumpyNaiveLoaded(LoadedAttention):
    def __init__(self, params: AttentionParams, dtype: str):
        self.config = params.config
        self.dtype = np.dtype(dtype)
        self.weights = {name: array.astype(self.dtype) for name, array in params.arrays().items()}

    # --- the algorithm, one overridable step each -------------------------------------
    def project(self, x: np.ndarray, which: str) -> np.ndarray:
        """x @ W (+ b); for q and k then the layer's q/k norm (:meth:`qk_norm`), when its config has one."""
        y = x @ self.weights[f"W_{which}"]
        bias = self.weights.get(f"b_{which}")
        y = y if bias is None else y + bias
        return self.qk_norm(y, which) if which in ("q", "k") and self.config.qk_norm else y

    def norm_gain(self, which: str) -> np.ndarray:
        """The gain the q or k norm multiplies by: the loaded ``g_q`` or ``g_k``."""
        return self.weights[f"g_{which}"]

    def norm_bias(self, which: str) -> np.ndarray | None:
        """The bias the q or k LayerNorm adds after its gain: the loaded ``beta_q`` or ``beta_k`` (None without)."""
        return self.weights.get(f"beta_{which}")

    def norm_centred(self, groups: np.ndarray) -> np.ndarray:
        """What the q or k norm divides: a LayerNorm's ``groups`` less their mean (``layer_per_head``); an RMSNorm's
        ``groups`` as they are."""
        if self.config.qk_norm in QK_NORMS_CENTRED:
            return groups - np.mean(groups, axis=-1, keepdims=True)
        return groups

    def qk_norm(self, y: np.ndarray, which: str) -> np.ndarray:
        """The q or k projection y (B, T, width) normed: ``x / sqrt(mean(x^2) + eps) * g`` over each head's d_head
        features (``rms_per_head``, the LayerNorms) or over the whole width (``rms_over_projection``), x being
        :meth:`norm_centred`'s (y, or y less its mean for a LayerNorm); a LayerNorm's bias (:meth:`norm_bias`)
        added last."""
        c = self.config
        b, t, width = y.shape
        groups = y.reshape(b, t, width // c.d_head, c.d_head) if c.qk_norm in QK_NORMS_PER_HEAD else y
        groups = self.norm_centred(groups)
        gain = self.norm_gain(which)
        inv = 1.0 / np.sqrt(np.mean(np.square(groups), axis=-1, keepdims=True) + self.dtype.type(c.qk_norm_eps))
        normed = groups * inv * gain
        bias = self.norm_bias(which)
        return (normed if bias is None else normed + bias).reshape(b, t, width)

    def rotary_width(self) -> int:
        """How many of each head's leading features the rotary embeddings turn (``config.rotary_width``: d_head, or
        a partial rotary's ``rotary_dims``)."""
        return self.config.rotary_width

    def rotary_pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """The feature indices (a, b) of each pair the rotary embeddings turn (``config.rotary``'s pairing among the
        first :meth:`rotary_width` features of each head)."""
        return rotary_pairs(self.config.rotary, self.rotary_width())

    def rotary_base(self) -> float:
        """The base of the rotary frequencies: ``config.rotary_base``."""
        return self.config.rotary_base

    def rotary_scaling(self):
        """The rescaling of the rotary frequencies (``config.rotary_scaling``: a RotaryScaling, or None)."""
        return self.config.rotary_scaling

    def rotary_frequencies(self, work: type) -> np.ndarray:
        """The frequencies ``base ** (-2i / r)`` (i = 0 .. r/2 - 1) over the r = :meth:`rotary_width` features
        turned, rescaled by :meth:`rotary_scaling` (:meth:`RotaryScaling.frequencies`) if any, in ``work``."""
        width, scaling = self.rotary_width(), self.rotary_scaling()
        inv_freq = work(1.0) / work(self.rotary_base()) ** (np.arange(0, width, 2, dtype=work) / work(width))
        return inv_freq if scaling is None else scaling.frequencies(inv_freq, self.rotary_base()).astype(work)

    def rotary_angles(self, positions: np.ndarray) -> np.ndarray:
        """The angles (T, r/2), each position times each frequency: in float32 for a float32 layer (as kernels
        compute them), in float64 for a float64 one."""
        work = np.float64 if self.dtype == np.float64 else np.float32
        return positions.astype(work)[:, None] * self.rotary_frequencies(work)[None, :]

    def rotate(self, x: np.ndarray, positions: np.ndarray, which: str) -> np.ndarray:
        """Heads ``x`` (B, n, T, d_head) of q or k (``which``) at ``positions`` turned by the layer's rotary
        embeddings, each pair (x_a, x_b) to (x_a cos - x_b sin, x_b cos + x_a sin) (cos and sin times YaRN's
        attention factor under its rescaling), a partial rotary's other features unturned; ``x`` without them."""
        if self.config.rotary is None:
            return x
        a, b = self.rotary_pairs()
        angles = self.rotary_angles(positions)
        scale = 1.0 if self.rotary_scaling() is None else self.rotary_scaling().attention_scale  # YaRN's factor
        cos, sin = (np.cos(angles) * scale).astype(self.dtype), (np.sin(angles) * scale).astype(self.dtype)
        out = x.copy()
        out[..., a] = x[..., a] * cos - x[..., b] * sin
        out[..., b] = x[..., b] * cos + x[..., a] * sin
        return out

    def positions(self, tq: int, tk: int) -> tuple[np.ndarray, np.ndarray]:
        """The rotary positions of a call's queries and keys (:func:`rotary_positions`)."""
        return rotary_positions(tq, tk)

    def split_heads(self, x: np.ndarray, n_heads: int) -> np.ndarray:
        """(B, T, n*d_head) -> (B, n, T, d_head): split the *feature* axis."""
        b, t, w = x.shape
        return x.reshape(b, t, n_heads, w // n_heads).transpose(0, 2, 1, 3)

    def scale(self) -> float:
        return 1.0 / np.sqrt(self.config.d_head)

    def masks(self, inputs: AttentionInputs):
        """(allowed, additive): the call's masks and the layer's own, its sliding window in ``allowed`` and its ALiBi
        bias (:meth:`alibi`) added to the float mask."""
        allowed, additive = full_mask(inputs, sliding_window=self.config.sliding_window)
        bias = self.alibi(inputs.tq, inputs.tk)
        if bias is not None:
            additive = bias if additive is None else bias + additive
        return allowed, additive

    def alibi(self, tq: int, tk: int) -> np.ndarray | None:
        """The layer's ALiBi bias (1, H, Tq, Tk) by each query's and key's positions (``config.alibi``'s kind, the
        paper's slopes: :func:`~mha_harness.contract.conventions.alibi_bias`), in float64; None without ALiBi."""
        if self.config.alibi is None:
            return None
        return alibi_bias(self.config.alibi, self.config.num_heads, tq, tk)[None]

    def softmax(self, scores: np.ndarray) -> np.ndarray:
        """Row softmax with the row maximum subtracted; a row of -inf (all masked) gives zeros.

        Three score-sized arrays are live at the peak: ``scores``, ``scores - max`` and its exp.
        """
        row_max = scores.max(axis=-1, keepdims=True)
        row_max = np.where(np.isfinite(row_max), row_max, 0)
        e = np.exp(scores - row_max)
        total = e.sum(axis=-1, keepdims=True)
        e /= np.where(total == 0, 1, total)
        return e

    def masked_softmax(self, scores: np.ndarray, allowed, additive) -> np.ndarray:
        """Add the additive mask, set disallowed scores to -inf, then :meth:`softmax` (masks BEFORE the softmax)."""
        if additive is not None:
            scores += additive.astype(self.dtype)
        if allowed is not None:
            np.copyto(scores, -np.inf, where=~allowed)
        return self.softmax(scores)

    def weighted_values(self, weights: np.ndarray, v: np.ndarray) -> np.ndarray:
        """P @ V where a zero weight contributes nothing even if the masked value is NaN or inf."""
        return weighted_values(weights, v)

    def merge_heads(self, heads: np.ndarray) -> np.ndarray:
        """(B, H, T, d_head) -> (B, T, H*d_head): heads side by side in order."""
        b, h, t, dh = heads.shape
        return heads.transpose(0, 2, 1, 3).reshape(b, t, h * dh)

    def output_projection(self, concat: np.ndarray) -> np.ndarray:
        return self.project(concat, "o")

    def prepare(self, inputs: AttentionInputs, *, backward: bool = False):
        if backward:
            raise NotImplementedError(f"{type(self).__name__} computes no gradients")
        ready = inputs.replace(**{n: np.asarray(getattr(inputs, n), self.dtype) for n in ("query", "key", "value")})
        return lambda: self.compute(ready)

    def compute(self, inputs: AttentionInputs, *, need_weights: bool = False) -> AttentionOutput:
        with np.errstate(invalid="ignore", over="ignore"):  # poison in masked keys is expected, and handled
            return self.attend(inputs, need_weights)

    def heads(self, inputs: AttentionInputs):
        """Projected Q (B, H, Tq, d_head), K and V (B, kv_heads, Tk, d_head) in this layer's dtype."""
        c = self.config
        q, k, v = (self.split_heads(self.project(np.asarray(getattr(inputs, name), self.dtype), which), n)
                   for name, which, n in (("query", "q", c.num_heads), ("key", "k", c.kv_heads),
                                          ("value", "v", c.kv_heads)))
        q_pos, k_pos = self.positions(inputs.tq, inputs.tk)
        return self.rotate(q, q_pos, "q"), self.rotate(k, k_pos, "k"), v

    def expand_kv_heads(self, kv: np.ndarray) -> np.ndarray:
        """Grouped-query K or V (B, kv_heads, T, d_head) as (B, heads, T, d_head): each key/value head repeated for
        its group of consecutive query heads (query head h reads key/value head h // group)."""
        return np.repeat(kv, self.config.group, axis=1)

    def attend(self, inputs: AttentionInputs, need_weights: bool) -> AttentionOutput:
        heads, weights = self.attend_projected(*self.heads(inputs), self.masks(inputs), inputs)
        return AttentionOutput(self.output_projection(self.merge_heads(heads)), weights if need_weights else None)

    def attend_projected(self, q, k, v, masks, inputs: AttentionInputs):
        """Each head's softmax(scale * Q K^T, masked) V from projected heads (K and V with kv_heads heads) and the
        call's ``masks`` (:meth:`masks`): (heads output (B, H, Tq, d_head), weights (B, H, Tq, Tk) or None)."""
        if self.config.group > 1:
            k, v = self.expand_kv_heads(k), self.expand_kv_heads(v)
        scores = q @ k.transpose(0, 1, 3, 2)
        scores *= self.dtype.type(self.scale())
        weights = self.masked_softmax(scores, *masks)
        return self.weighted_values(weights, v), weights

    def prepare_decode_step(self, inputs: AttentionInputs):
        """The cached positions' keys and values projected (keys turned at their positions) once into a zeroed cache
        of all Tk slots; each step projects x_new, writes its keys and values into the last Tq slots, attends over the
        cache and applies W_o."""
        c, start = self.config, inputs.tk - inputs.tq
        x_new = np.asarray(inputs.query, self.dtype)
        cache = {which: np.zeros((inputs.batch, c.kv_heads, inputs.tk, c.d_head), self.dtype) for which in "kv"}
        q_pos, k_pos = self.positions(inputs.tq, inputs.tk)
        turned = {"k": lambda heads, at: self.rotate(heads, k_pos[at], "k"), "v": lambda heads, at: heads}
        with np.errstate(invalid="ignore", over="ignore"):
            for which, kv in cache.items():
                kv[:, :, :start] = turned[which](
                    self.split_heads(self.project(np.asarray(inputs.cached, self.dtype), which), c.kv_heads),
                    slice(0, start))
        masks = self.masks(inputs)

        def write():
            for which, kv in cache.items():
                kv[:, :, start:] = turned[which](self.split_heads(self.project(x_new, which), c.kv_heads),
                                                 slice(start, None))

        def attend():
            q = self.rotate(self.split_heads(self.project(x_new, "q"), c.num_heads), q_pos, "q")
            return self.output_projection(self.merge_heads(self.attend_projected(q, cache["k"], cache["v"], masks,
                                                                                 inputs)[0]))

        def step():
            with np.errstate(invalid="ignore", over="ignore"):
                return self.write_then_attend(write, attend)
        return step

    def write_then_attend(self, write, attend):
        """One decode step's order: write x_new's keys and values into the cache, then attend (the new queries see
        the new keys)."""
        write()
        return attend()


class NumpyNaive(AttentionBackend):
    name = "numpy-naive"
    native_causal = "explicit masks in both alignments"
    native_mask_polarity = MASK_POLARITY  # its compute takes the harness's masks as they are
    memory_method = "tracemalloc"
    capabilities = Capabilities(dtypes=("float32", "float64"), attention_weights=True, qk_norms=QK_NORMS,
                                rotary=ROTARY_KINDS, partial_rotary=True,
                                rotary_scalings=ROTARY_SCALING_KINDS, sliding_window=True, alibi=ALIBI_KINDS)
    loaded_class = NumpyNaiveLoaded

    def native_parameter_shapes(self, config: AttentionConfig) -> dict[str, tuple[int, ...]]:
        from mha_harness.contract.params import make_params
        return {name: array.shape for name, array in self.load_native(make_params(config), "float32").weights.items()}

    def load_native(self, params: AttentionParams, dtype: str) -> LoadedAttention:
        return self.loaded_class(params, dtype)
