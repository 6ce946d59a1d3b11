"""Each mutant: numpy-naive (or its gradients) with one deliberate, realistic bug."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mha_harness.contract.api import AttentionConfig, AttentionInputs, Capabilities
from mha_harness.contract.conventions import causal_offset
from mha_harness.contract.reference import reference_vjp
from mha_harness.implementations.numpy_naive import NumpyNaive, NumpyNaiveLoaded
from mha_harness.toolkit.masks import full_mask


@dataclass(frozen=True)
class Mutant:
    """A broken backend, the bug it carries, and what a catching failure message must mention."""

    name: str
    bug: str
    loaded: type
    message_mentions: str
    gradients: bool = False
    parameter_shapes: object = None


class SplitTokens(NumpyNaiveLoaded):
    def split_heads(self, x, n_heads):
        b, t, w = x.shape
        return x.reshape(b, n_heads, t, w // n_heads)

    def merge_heads(self, heads):
        b, h, t, dh = heads.shape
        return heads.reshape(b, t, h * dh)


class ScaleByDModel(NumpyNaiveLoaded):
    def scale(self):
        return 1.0 / np.sqrt(self.config.d_model)


class NoScale(NumpyNaiveLoaded):
    def scale(self):
        return 1.0


class NoOutputProjection(NumpyNaiveLoaded):
    def output_projection(self, concat):
        return concat


def _with_mask(allowed, extra):
    return extra if allowed is None else allowed & extra


class CausalOneFutureToken(NumpyNaiveLoaded):
    def masks(self, inputs):
        allowed, additive = full_mask(inputs.replace(causal=None))
        if inputs.causal:
            offset = causal_offset(inputs.causal, inputs.tq, inputs.tk)
            allowed = _with_mask(allowed, np.arange(inputs.tk)[None, :] <= np.arange(inputs.tq)[:, None] + offset + 1)
        return allowed, additive


class CausalExcludesDiagonal(NumpyNaiveLoaded):
    def masks(self, inputs):
        allowed, additive = full_mask(inputs.replace(causal=None))
        if inputs.causal:
            offset = causal_offset(inputs.causal, inputs.tq, inputs.tk)
            allowed = _with_mask(allowed, np.arange(inputs.tk)[None, :] < np.arange(inputs.tq)[:, None] + offset)
        return allowed, additive


class CausalAlwaysTopLeft(NumpyNaiveLoaded):
    def masks(self, inputs):
        return full_mask(inputs.replace(causal="top-left" if inputs.causal else None))


class PaddingIgnored(NumpyNaiveLoaded):
    def masks(self, inputs):
        return full_mask(inputs.replace(key_padding_mask=None))


class AdditiveMaskIgnored(NumpyNaiveLoaded):
    def masks(self, inputs):
        allowed, _ = full_mask(inputs)
        return allowed, None


class MaskPolarityInverted(NumpyNaiveLoaded):
    def masks(self, inputs):
        return full_mask(inputs, invert_attn_mask=True)


class SoftmaxWithoutMaxSubtraction(NumpyNaiveLoaded):
    def softmax(self, scores):
        e = np.exp(scores)
        total = e.sum(axis=-1, keepdims=True)
        return e / np.where(total == 0, 1, total)


class FullyMaskedRowsNaN(NumpyNaiveLoaded):
    def softmax(self, scores):
        e = np.exp(scores - scores.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)


class HeadsConcatenatedReversed(NumpyNaiveLoaded):
    def merge_heads(self, heads):
        return super().merge_heads(heads[:, ::-1])


class BatchNormalisedTogether(NumpyNaiveLoaded):
    def softmax(self, scores):
        e = np.exp(scores - scores.max(axis=(0, -1), keepdims=True))
        total = e.sum(axis=(0, -1), keepdims=True) / scores.shape[0]
        return e / np.where(total == 0, 1, total)


class ValueBiasDropped(NumpyNaiveLoaded):
    def project(self, x, which):
        if which == "v":
            return x @ self.weights["W_v"]
        return super().project(x, which)


class DropoutAtInference(NumpyNaiveLoaded):
    def softmax(self, scores):
        weights = super().softmax(scores)
        keep = np.random.default_rng().random(weights.shape) >= 0.1
        return weights * keep / 0.9


class NaNPoisonLeaks(NumpyNaiveLoaded):
    """Masked keys get weight 0, but P @ V still multiplies 0 by the NaN stored there."""

    def attend(self, inputs, need_weights):
        import mha_harness.contract.numerics as numerics
        original = numerics.weighted_values
        try:
            from mha_harness.implementations import numpy_naive
            numpy_naive.weighted_values = lambda w, v: w @ v
            return super().attend(inputs, need_weights)
        finally:
            numpy_naive.weighted_values = original


class NoInputValidation(NumpyNaiveLoaded):
    def forward(self, inputs, *, need_weights=False):
        try:
            return self.compute(inputs, need_weights=need_weights)
        except Exception as exc:  # an IndexError / broadcasting error leaks out instead of a named ValueError
            raise RuntimeError(f"broadcast failure: {exc}") from None


class _GradientMutant(NumpyNaiveLoaded):
    """numpy-naive forward with reference gradients, so gradient cases have something to catch."""

    def compute_vjp(self, inputs: AttentionInputs, cotangent):
        return reference_vjp(self._params, inputs, cotangent)


class GradientFlowsToFutureKeys(_GradientMutant):
    def compute_vjp(self, inputs, cotangent):
        return reference_vjp(self._params, inputs.replace(causal=None), cotangent)


class GradientOfWoTransposed(_GradientMutant):
    def compute_vjp(self, inputs, cotangent):
        grads = super().compute_vjp(inputs, cotangent)
        grads["W_o"] = grads["W_o"].T.copy()
        return grads


def _full_width_kv(config: AttentionConfig):
    d = config.d_model
    shapes = {"W_q": (d, d), "W_k": (d, d), "W_v": (d, d), "W_o": (d, d)}
    if config.bias:
        shapes.update(b_q=(d,), b_k=(d,), b_v=(d,), b_o=(d,))
    return shapes


MUTANTS = (
    Mutant("mutant-split-tokens", "splits tokens instead of features (reshape(h, T, d_head))", SplitTokens, "head"),
    Mutant("mutant-scale-sqrt-d-model", "divides scores by sqrt(d_model)", ScaleByDModel, "sqrt(d_model)"),
    Mutant("mutant-no-scale", "leaves scores unscaled", NoScale, "no scaling"),
    Mutant("mutant-no-output-projection", "forgets W_o", NoOutputProjection, "W_o"),
    Mutant("mutant-causal-one-future-token", "causal mask lets one future token through", CausalOneFutureToken,
           "causal leak"),
    Mutant("mutant-causal-excludes-diagonal", "causal mask hides the diagonal (query i cannot see key i)",
           CausalExcludesDiagonal, "diagonal"),
    Mutant("mutant-causal-always-top-left", "bottom-right causal treated as top-left when Tq != Tk",
           CausalAlwaysTopLeft, "top-left alignment"),
    Mutant("mutant-padding-ignored", "ignores the key padding mask", PaddingIgnored, "padding"),
    Mutant("mutant-additive-mask-ignored", "drops the finite values of a float attn_mask (keeps only -inf)",
           AdditiveMaskIgnored, "additive-masked output"),
    Mutant("mutant-mask-polarity-inverted", "reads attn_mask True as 'masked out'", MaskPolarityInverted, "INVERTED"),
    Mutant("mutant-softmax-no-max-subtraction", "softmax without subtracting the row maximum",
           SoftmaxWithoutMaxSubtraction, "row maximum"),
    Mutant("mutant-fully-masked-rows-nan", "fully masked rows divide 0 by 0 (NaN)", FullyMaskedRowsNaN,
           "fully masked rows"),
    Mutant("mutant-heads-reversed", "concatenates heads in reverse order", HeadsConcatenatedReversed, "head"),
    Mutant("mutant-batch-normalised-together", "softmax normaliser shared across batch items",
           BatchNormalisedTogether, "batch"),
    Mutant("mutant-value-bias-dropped", "drops the bias of the V projection", ValueBiasDropped, "output"),
    Mutant("mutant-dropout-at-inference", "leaves dropout on at inference", DropoutAtInference, "determinism"),
    Mutant("mutant-nan-poison-leaks", "masked keys holding NaN poison outputs via 0 * NaN in P @ V",
           NaNPoisonLeaks, "nan"),
    Mutant("mutant-no-input-validation", "skips input validation (bad shapes crash or pass silently)",
           NoInputValidation, "bad input"),
    Mutant("mutant-kv-not-shrunk", "allocates full-width K/V projections for grouped-query heads",
           NumpyNaiveLoaded, "parameter count", parameter_shapes=_full_width_kv),
    Mutant("mutant-gradient-flows-to-future", "backward ignores the causal mask", GradientFlowsToFutureKeys,
           "causal leak in gradients", gradients=True),
    Mutant("mutant-gradient-w-o-transposed", "returns the W_o gradient transposed", GradientOfWoTransposed,
           "gradient of W_o", gradients=True),
)


class MutantBackend(NumpyNaive):
    """A registered-looking backend that carries one mutant's bug."""

    def __init__(self, mutant: Mutant):
        self.mutant = mutant
        self.name = mutant.name
        self.capabilities = Capabilities(dtypes=("float32", "float64"), gradients=mutant.gradients)
        self.loaded_class = mutant.loaded

    def native_parameter_shapes(self, config):
        if self.mutant.parameter_shapes:
            return self.mutant.parameter_shapes(config)
        return super().native_parameter_shapes(config)

    def load_native(self, params, dtype):
        loaded = self.loaded_class(params, dtype)
        loaded._params = params
        return loaded


def mutant_backends() -> list[MutantBackend]:
    """Every mutant as a backend (an entry-point-style factory; not registered by default)."""
    return [MutantBackend(m) for m in MUTANTS]
