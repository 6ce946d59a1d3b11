"""numpy-tiled: online softmax over key blocks (the flash-attention recurrence) in NumPy.

Queries are processed in blocks of ``block_q`` rows and keys in blocks of ``block_k``;
for each query block a running row maximum ``m``, normaliser ``l`` and accumulator are
updated per key block, so no Tq x Tk matrix is ever materialised: the extra memory per
call is O(batch * heads * block_q * block_k) besides the projections. Key blocks wholly
above the causal diagonal are skipped, and under a sliding window of w keys
(``config.sliding_window``) so are the keys before a query block's window: a call's work grows
as T * w, not T^2, and a decode step reads only the cache rows its window sees. Rows whose keys
are all masked output zeros.
"""
from __future__ import annotations

import numpy as np

from mha_harness.contract.api import AttentionInputs, AttentionOutput, AttentionParams, Capabilities
from mha_harness.contract.numerics import weighted_values
from mha_harness.implementations.numpy_naive import NumpyNaive, NumpyNaiveLoaded
from mha_harness.toolkit.masks import block_mask, causal_key_limit, window_key_start


class NumpyTiledLoaded(NumpyNaiveLoaded):
    def __init__(self, params: AttentionParams, dtype: str, block_q: int, block_k: int):
        super().__init__(params, dtype)
        self.block_q, self.block_k = block_q, block_k

    def attend(self, inputs: AttentionInputs, need_weights: bool) -> AttentionOutput:
        heads, _ = self.attend_projected(*self.heads(inputs), None, inputs)
        return AttentionOutput(self.output_projection(self.merge_heads(heads)), None)

    def attend_projected(self, q, k, v, masks, inputs: AttentionInputs):
        """The tiled kernel over projected heads, its masks made block by block from ``inputs`` (``masks`` is
        unused): (heads output (B, H, Tq, d_head), None)."""
        c = self.config
        heads = self.attend_heads(*self.group_heads(q, k, v, inputs), inputs)
        return heads.reshape(inputs.batch, c.num_heads, inputs.tq, c.d_head), None

    def grouped_heads(self, inputs: AttentionInputs):
        """:meth:`group_heads` of the call's projected heads."""
        return self.group_heads(*self.heads(inputs), inputs)

    def group_heads(self, q, k, v, inputs: AttentionInputs):
        """Scaled queries (B, kv, group, Tq, dh), keys and values (B, kv, 1, Tk, dh): each kv head serves its group
        of query heads without copying K/V."""
        c = self.config
        q = q.reshape(inputs.batch, c.kv_heads, c.group, inputs.tq, c.d_head) * self.dtype.type(self.scale())
        return q, k[:, :, None], v[:, :, None]

    def attend_heads(self, q, k, v, inputs: AttentionInputs) -> np.ndarray:
        """Each head's softmax(QK^T)V, (B, kv, group, Tq, dh), one block of queries at a time."""
        out = np.empty(q.shape, dtype=self.dtype)
        for q0 in range(0, inputs.tq, self.block_q):
            q1 = min(inputs.tq, q0 + self.block_q)
            out[:, :, :, q0:q1] = self._query_block(q[:, :, :, q0:q1], k, v, inputs, q0, q1)
        return out

    #: the running row maximum before the first key block: -inf, so that the first block's own maximum replaces it
    #: whatever its sign (a kernel starting at 0 underflows every exp(s - 0) of a row whose scores are all far below 0)
    initial_max = -np.inf

    def key_limit(self, inputs: AttentionInputs, q1: int) -> int:
        """Exclusive bound of the keys that queries below q1 may see: key blocks from there on are skipped."""
        return causal_key_limit(inputs, q1)

    def key_start(self, inputs: AttentionInputs, q0: int) -> int:
        """The first key that queries from q0 on may see: the keys before it lie behind every one's sliding window
        and are skipped (0 without a window)."""
        return window_key_start(inputs, q0, self.config.sliding_window)

    def block_mask(self, inputs: AttentionInputs, q0: int, q1: int, k0: int, k1: int):
        """The masks of queries q0:q1 and keys k0:k1, the layer's sliding window among them
        (:func:`~mha_harness.toolkit.masks.block_mask`)."""
        return block_mask(inputs, q0, q1, k0, k1, sliding_window=self.config.sliding_window)

    def _query_block(self, qb, k, v, inputs, q0, q1):
        c = self.config
        b = qb.shape[0]
        rows = q1 - q0
        m = np.full((b, c.kv_heads, c.group, rows, 1), self.initial_max, dtype=self.dtype)
        l = np.zeros((b, c.kv_heads, c.group, rows, 1), dtype=self.dtype)
        acc = np.zeros((b, c.kv_heads, c.group, rows, c.d_head), dtype=self.dtype)
        # one scores buffer per query block, reused by every full key block: the exponentials are taken in place, so
        # a key block allocates no block-sized temporaries (fresh ones cost as much as the exp itself)
        scores = np.empty((b, c.kv_heads, c.group, rows, self.block_k), dtype=self.dtype)
        for k0 in range(self.key_start(inputs, q0), self.key_limit(inputs, q1), self.block_k):
            k1 = min(inputs.tk, k0 + self.block_k)
            keys = k[:, :, :, k0:k1].swapaxes(-1, -2)
            s = np.matmul(qb, keys, out=scores) if k1 - k0 == self.block_k else qb @ keys
            allowed, additive = self.block_mask(inputs, q0, q1, k0, k1)
            if additive is not None:
                s += self._group_view(additive).astype(self.dtype)
            if allowed is not None:
                np.copyto(s, -np.inf, where=~self._group_view(allowed))
            m_new = np.maximum(m, s.max(axis=-1, keepdims=True))
            m_safe, correction = self.rescale(m, m_new)
            s -= m_safe
            p = np.exp(s, out=s)
            l = l * correction + p.sum(axis=-1, keepdims=True)
            acc *= self.accumulator_rescale(correction)
            acc += weighted_values(p, v[:, :, :, k0:k1])
            m = m_new
        return acc / np.where(l == 0, 1, l)

    def rescale(self, m: np.ndarray, m_new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the maximum a key block's scores are shifted by, the factor the accumulator and row sum are rescaled by)
        when the running maximum goes from ``m`` to ``m_new``: a row that has seen no key yet (-inf) shifts by 0 and
        keeps its zeros, so a key block with no visible key changes nothing."""
        m_safe = np.where(np.isfinite(m_new), m_new, 0).astype(self.dtype)
        return m_safe, np.exp(np.where(np.isfinite(m), m - m_safe, -np.inf))

    def accumulator_rescale(self, correction: np.ndarray) -> np.ndarray:
        """The factor the accumulator is rescaled by: the row sum's own ``correction`` (a mutant's hook)."""
        return correction

    def _group_view(self, mask: np.ndarray) -> np.ndarray:
        """Reshape a (B|1, H|1, q, k) mask to broadcast against (B, kv, group, q, k)."""
        c = self.config
        if mask.shape[1] == 1:
            return mask[:, :, None]
        return mask.reshape(mask.shape[0], c.kv_heads, c.group, *mask.shape[2:])


class NumpyTiled(NumpyNaive):
    name = "numpy-tiled"
    capabilities = Capabilities(dtypes=("float32", "float64"), attention_weights=False, sliding_window=True)

    def __init__(self, block_q: int = 256, block_k: int = 512):
        for label, value in (("block_q", block_q), ("block_k", block_k)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{label}: got {value!r}; accepted: a positive integer")
        self.block_q, self.block_k = block_q, block_k

    def load_native(self, params: AttentionParams, dtype: str) -> NumpyTiledLoaded:
        return NumpyTiledLoaded(params, dtype, self.block_q, self.block_k)
