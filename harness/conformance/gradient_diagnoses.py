"""What a failed backward computes, in words: a backward that never reaches the parameters, input gradients in another
form's convention than the declared one, which gradients are wrong and which are right (so where in the backward the
error lies: the softmax's backward, the value path or the output projection), a gradient that is zero, transposed or
a constant multiple of the true one (the score scale left out or applied twice, the sign flipped), the softmax's
backward without its row term, weights recomputed as exp(s - m) without the log of the row sum, or a constant times
the forward's (W_o's gradient right), the heads' dK and dV swapped, and a backward that ignores a mask the forward
applies (the causal mask, the key padding mask, the attn_mask; in the whole backward, or only where it recomputes the
weights, as a softmax or as FlashAttention-2's exp(s - lse)). Computed in NumPy from the float64 reference; a mistake
is named only where its gradients are at most 1/20 as far from the backend's as the true ones are (a bug that merely
resembles one, such as a row term summed over the wrong axis, is not named after it)."""
from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from mha_harness.contract.api import AttentionInputs, AttentionParams
from mha_harness.contract.expected import gradient_names, input_gradients
from mha_harness.contract.mistakes import distance, frozen_parameters_hint
from mha_harness.contract.reference import (
    MASK_FIELDS,
    WINDOW_FIELD,
    mistaken_vjp,
    reference_vjp,
    score_scale,
    score_scale_named,
    without_masks,
)
from mha_harness.contract.score_scale import score_scale_at

#: the parameter gradients each part of the backward produces: a wrong group with the others right places the error
#: (the input gradients of a one-x or shared-K/V layer sum several paths, so they place nothing)
_PATHS = (("the softmax's backward (dS = P * (dP - rowsum(dP * P)), and dQ, dK from it, back through a rotary or q/k "
           "norm if any)",
           ("W_q", "b_q", "W_k", "b_k", "g_q", "g_k", "beta_q", "beta_k")),
          ("the value path (dV = P^T dO)", ("W_v", "b_v")),
          ("the output projection (dW_o)", ("W_o", "b_o")))

#: the multiples of a gradient that have a name whatever the shape (the score scale's are added per d_head)
_MULTIPLES = {-1.0: "the sign flipped (the negative gradient returned)", 2.0: "twice the gradient (summed twice)",
              0.5: "half the gradient"}

#: why a backward gives NaN in rows that see no key while its forward gives them finite zeros, and the fix (a
#: stranger's JAX layer passed every forward case so)
DOUBLE_WHERE_TRAP = ("A where (masked_fill, jnp.where) that selects 0 over a branch computing 0 / 0 or "
                     "exp(-inf - -inf) still differentiates that branch, and its NaN gradient times 0 is NaN (the "
                     "double-where trap): make the branch's input finite before the operation (divide by "
                     "where(sum > 0, sum, 1), subtract where(isfinite(max), max, 0)), or guard the custom backward "
                     "the same way")

#: how close a known mistake's gradient must come to the backend's, relative to the true gradient's distance
_CLOSE = 0.05

#: how each mask reads in a diagnosis, and the keys it hides
_MASK_WORDS = {"causal": ("the causal mask", "future keys"),
               "key_padding_mask": ("the key padding mask", "padded keys"),
               "attn_mask": ("the attn_mask", "masked keys"),
               WINDOW_FIELD: ("the layer's sliding window", "the keys behind each query's window")}


def gradient_hint(got: Mapping[str, np.ndarray], params: AttentionParams, inputs: AttentionInputs,
                  cotangent: np.ndarray, form: str, bounds: Mapping[str, tuple],
                  forward_wrong: Callable[[], str] | None = None) -> tuple[str, str]:
    """(the message suffix "; ...", the diagnosis a summary shows) of gradients ``got`` that failed their
    ``bounds``: every parameter's gradient zero (:func:`~mha_harness.contract.mistakes.frozen_parameters_hint`),
    else input gradients that follow another form's convention than ``form`` (:func:`form_mixup`), else
    :func:`gradient_mistake`'s lists, placement and named mistake, whose summary is the named mistake alone (else
    the placement; the lists alone name nothing, so no summary). ``forward_wrong()``, asked only when some gradient
    is wrong: a sentence when the same call's forward output is wrong too (else ""): the lists are kept, and that
    sentence replaces the placement and the named backward mistake, which presuppose a right forward (a forward that
    reads its mask inverted gives gradients that resemble a backward ignoring the mask); no summary then, since the
    forward's own cases name what it got wrong."""
    early = frozen_parameters_hint(got, params) or form_mixup(got, reference_vjp(params, inputs, cotangent), form)
    if early:
        return early, early.removeprefix("; ")
    parts = gradient_mistake_parts(got, params, inputs, cotangent, form, bounds)
    if not parts:
        return "", ""
    forward = forward_wrong() if forward_wrong else ""
    if forward:
        return _message([parts[0], [forward]]), ""  # the forward's own cases carry its diagnosis
    return _message(parts), "; ".join(parts[-1]) if len(parts) > 1 else ""


def form_mixup(got: Mapping[str, np.ndarray], separate: dict, declared: str) -> str:
    """A message suffix when the input gradients ``got`` match another form's convention than the ``declared`` one
    (``separate``: the reference's d/dquery, d/dkey, d/dvalue): a KV-cache step's d/dx_new through its queries alone,
    a separate-form layer's total d/dx per argument, a one-x layer's d/dquery alone."""
    if declared == "kv_cache" and "query" in got and np.shape(got["query"]) == separate["query"].shape \
            and np.allclose(got["query"], separate["query"], atol=1e-4):
        return ("; the x_new gradient is through its queries alone: x_new also makes the new keys and values (the "
                "last Tq rows of x_kv), so with inputs='kv_cache' return d/dx_new, the sum of its query, key and "
                "value parts (a cache that stores the new keys and values detached drops the last two)")
    if separate["query"].shape != separate["key"].shape:  # Tq != Tk: no one-x call, no mix-up to name
        return ""
    total = input_gradients(separate, "self")["query"]  # d/dx: the query, key and value parts summed
    if declared == "separate" and "query" in got and np.shape(got["query"]) == total.shape \
            and np.allclose(got["query"], total, atol=1e-4):
        return ("; the query gradient is the total d/dx (query, key and value parts summed): a separate-form "
                "backend returns d/dquery, d/dkey and d/dvalue, also when query is key is value (three leaves)")
    if declared == "self" and "query" in got and np.shape(got["query"]) == total.shape \
            and np.allclose(got["query"], separate["query"], atol=1e-4):
        return ("; the query gradient is d/dquery alone: with one x (inputs='self') return d/dx, the sum of the "
                "query, key and value parts")
    return ""


def gradient_mistake(got: Mapping[str, np.ndarray], params: AttentionParams, inputs: AttentionInputs,
                     cotangent: np.ndarray, form: str, bounds: Mapping[str, tuple]) -> str:
    """A message suffix ("; ...") for gradients ``got`` (per argument of ``form``) that failed their ``bounds`` (name
    -> (float64 reference, tolerance), as :func:`~mha_harness.contract.expected.gradient_tolerances` gives): the
    wrong and right gradients, where in the backward the wrong parameter gradients place the error, and the known
    mistake that explains the wrong ones, if any; empty when nothing can be said (a gradient missing or of another
    shape is named by the comparison itself)."""
    return _message(gradient_mistake_parts(got, params, inputs, cotangent, form, bounds))


def _message(parts: list[list[str]]) -> str:
    """:func:`gradient_mistake_parts`' clauses as a message suffix ("; ..."); empty when there are none."""
    return "; " + "; ".join(p for part in parts for p in part) if parts else ""


def gradient_mistake_parts(got: Mapping[str, np.ndarray], params: AttentionParams, inputs: AttentionInputs,
                           cotangent: np.ndarray, form: str, bounds: Mapping[str, tuple]) -> list[list[str]]:
    """:func:`gradient_mistake`'s clauses, most specific last: [the lists], [the placement] if any, [the named
    mistakes] if any; [] when no gradient is wrong."""
    order = [n for n in gradient_names(params, inputs, form) if n in bounds]  # the inputs, then the parameters
    arrays = {name: np.asarray(got[name], np.float64) for name in order
              if name in got and np.shape(got[name]) == np.shape(bounds[name][0])}
    wrong = [n for n, a in arrays.items() if not _within(a, *bounds[n])]
    if not wrong:
        return []
    right = [n for n in arrays if n not in wrong]
    missing = [n for n in order if n not in got]  # named by the comparison only when every other gradient is right
    parts = [[f"wrong gradients: {', '.join(wrong)}" + (f"; right: {', '.join(right)}" if right else "")
              + (f"; not returned: {', '.join(missing)}" if missing else "")]]
    # a gradient that is zero for every layer (the key bias's: softmax ignores a per-row constant) places nothing
    telling = {n for n in arrays if np.abs(bounds[n][0]).max(initial=0.0) > bounds[n][1].bound}
    placed = _placed([n for n in wrong if n in telling], [n for n in right if n in telling])
    if placed:
        parts.append(placed)
    whole = _whole_backward_mistake(arrays, [n for n in wrong if n in telling] or wrong, right, params, inputs,
                                    cotangent, form, bounds)
    swapped = _gains_swapped(wrong, arrays, bounds)
    named = [swapped] if swapped else [whole] if whole else (_weights_multiple(wrong, right, arrays, bounds)
                                                            or _each_gradient_mistake(wrong, arrays, bounds, params))
    if named:
        parts.append(named)
    return parts


#: the q/k norm's gains loaded into each other's norms, which the forward cannot show
GAINS_SWAPPED = ("the gradients of g_q and g_k are each other's: the gains are loaded into each other's norms (q_norm "
                 "holds g_k, k_norm g_q), which no forward of the harness's layer shows (every score sums g_q[i] * "
                 "g_k[i] terms; a layer with rotary positions tells them apart)")


def _gains_swapped(wrong: list[str], arrays: dict, bounds: Mapping[str, tuple]) -> str:
    """:data:`GAINS_SWAPPED` when the returned g_q and g_k gradients are the reference's g_k and g_q; ""."""
    if not {"g_q", "g_k"} <= set(wrong) or arrays["g_q"].shape != arrays["g_k"].shape:
        return ""
    return GAINS_SWAPPED if (_within(arrays["g_q"], bounds["g_k"][0], bounds["g_q"][1])
                             and _within(arrays["g_k"], bounds["g_q"][0], bounds["g_k"][1])) else ""


def _close(got: np.ndarray, candidate: np.ndarray, truth: np.ndarray) -> bool:
    """Whether a known mistake's gradient ``candidate`` is the backend's: at most :data:`_CLOSE` as far from it as
    the true gradient is; never when it too is infinitely far (NaN where the mistake is finite: inf <= inf would
    name any mistake for a NaN backward)."""
    far = distance(got, candidate)
    return far < np.inf and far <= _CLOSE * distance(got, truth)


def _within(actual: np.ndarray, expected: np.ndarray, tol) -> bool:
    """Whether ``actual`` is within the tolerance of ``expected`` and finite."""
    return bool(np.all(np.isfinite(actual))) and distance(actual, expected) <= tol.bound


def _placed(wrong: list[str], right: list[str]) -> list[str]:
    """Where the error lies: the parts of the backward whose parameter gradients are wrong, when another part's
    are all right."""
    def part_of(names):
        return [label for label, members in _PATHS if any(n in members for n in names)]
    bad = part_of(wrong)
    good = [label for label in part_of(right) if label not in bad]
    if not bad or not good:
        return []
    return [f"the parameters' gradients place the error in {' and '.join(bad)}; right in {' and '.join(good)}"]


def _whole_backward_mistake(arrays: dict, wrong: list[str], right: list[str], params: AttentionParams,
                            inputs: AttentionInputs, cotangent: np.ndarray, form: str,
                            bounds: Mapping[str, tuple]) -> str:
    """The known wrong backward, of several gradients at once, that explains every ``wrong`` gradient and leaves the
    right ones right (within their tolerance); empty if none. The caller leaves out of ``wrong`` a gradient that is
    zero for every layer (the key bias's): a backward's float noise there, amplified by a mistake, is what no
    mistake's float64 gradient can match."""
    for text, compute in _backward_mistakes(params, inputs, cotangent):
        candidate = input_gradients(compute(), form)
        if all(n in candidate and _close(arrays[n], candidate[n], bounds[n][0]) for n in wrong) \
                and all(n in candidate and _within(candidate[n], *bounds[n]) for n in right):
            return text
    return ""


def _backward_mistakes(params: AttentionParams, inputs: AttentionInputs, cotangent: np.ndarray):
    """(what the mistake is, its gradients computed when called) for each backward mistake that applies to this
    call: the softmax's row term left out; the key and value gradients swapped; a rotary layer's q and k gradients
    turned forward again; each set of the masks the call applies ignored by the whole backward,
    or only where it recomputes the weights (as a softmax, or as exp(s - lse) with the forward's log-sum-exp)."""
    yield ("the softmax's backward has no row term: dS = P * dP where dS = P * (dP - rowsum(dP * P)) belongs (the "
           "softmax differentiated as if each weight depended on its own score alone)",
           lambda: mistaken_vjp(params, inputs, cotangent, row_term=False))
    yield ("the key and value gradients swapped: the heads' dK returned where dV belongs and dV where dK belongs (a "
           "custom backward's results in the wrong order), each then projected as the other's",
           lambda: mistaken_vjp(params, inputs, cotangent, kv_swapped=True))
    if params.config.rotary is not None:
        yield ("the gradients of q and k turned by the rotary angles again where the backward turns them back, by "
               "minus the angle (a hand-written rotary backward that reuses the forward's sin: the transpose of a "
               "rotation is the rotation back)",
               lambda: mistaken_vjp(params, inputs, cotangent, rotary_turned_forward=True))
    for row_from in ("output", "weights"):
        yield ("the backward recomputes the weights as exp(s - m) with the row maximum m where the log-sum-exp "
               "belongs (the forward saves its running maximum without + log(rowsum): the weights are not "
               "normalised; the forward is right, so W_o's gradient is right)",
               lambda row_from=row_from: mistaken_vjp(params, inputs, cotangent, recompute="max", row_from=row_from))
    present = [f for f in MASK_FIELDS if getattr(inputs, f) is not None]
    present += [WINDOW_FIELD] if params.config.sliding_window is not None else []
    subsets = [tuple(f for i, f in enumerate(present) if bits >> i & 1) for bits in range(1, 2 ** len(present))]
    for fields in sorted(subsets, key=len):
        what = " and ".join(_MASK_WORDS[f][0] for f in fields)
        where = " and ".join(_MASK_WORDS[f][1] for f in fields)
        yield (f"the backward ignores {what} the forward applies: gradient flows to and from {where} (the whole "
               f"backward computed as if unmasked)",
               lambda fields=fields: reference_vjp(*without_masks(params, inputs, fields), cotangent))
        for row_from in ("weights", "output"):  # the row term from the recomputed weights, or from dO * O
            yield (f"the backward recomputes the weights without {what} (a softmax over every key; the forward "
                   f"applies it, so W_o's gradient is right): gradient flows to and from {where}",
                   lambda fields=fields, row_from=row_from: mistaken_vjp(
                       params, inputs, cotangent, recomputed_without=fields, row_from=row_from))
            yield (f"the backward recomputes the weights as exp(s - lse) without re-applying {what} "
                   f"(FlashAttention-2 style: {where} get exp(s - lse) instead of 0; the forward applies it, so W_o's "
                   f"gradient is right)",
                   lambda fields=fields, row_from=row_from: mistaken_vjp(
                       params, inputs, cotangent, recomputed_without=fields, recompute="lse", row_from=row_from))


def _weights_multiple(wrong: list[str], right: list[str], arrays: dict, bounds: Mapping[str, tuple]) -> list[str]:
    """The backward's weights a constant c times the forward's, when W_o's gradient is right and every wrong one, the
    value path's among them, is one c times its reference: dV = P^T dO and dS = P * (dP - rowsum(dO * O)) both
    scale with P, W_o's gradient does not (a stranger's flash backward from a log-sum-exp off by log 2 was named
    "twice the gradient (summed twice)", which W_o's right gradient rules out). Empty otherwise."""
    if "W_o" not in right or "W_v" not in wrong:
        return []
    factors = [_constant_multiple(arrays[name], bounds[name][0]) for name in wrong]
    if None in factors:
        return []
    c = factors[0]
    if c <= 0 or not np.allclose(factors, c, rtol=1e-2):
        return []
    return [f"the gradients of {', '.join(wrong)} are all {c:.4g} x the reference's while W_o's is right: the "
            f"backward's weights are {c:.4g} x the forward's (recomputed as exp(s - lse) from a log-sum-exp off by "
            f"{-np.log(c):+.3g}, not the one the forward saved), or dO is scaled by {c:.4g} on its way back through "
            "W_o"]


def _each_gradient_mistake(wrong: list[str], arrays: dict, bounds: Mapping[str, tuple],
                           params: AttentionParams) -> list[str]:
    """What each wrong gradient is, when it is the reference zeroed, transposed or times a constant; gradients
    that are the same thing are named together."""
    alike: dict[str, list[str]] = {}
    for name in wrong:
        what = _one_gradient_mistake(arrays[name], bounds[name][0], params, bounds[name][1].bound)
        if what:
            alike.setdefault(what, []).append(name)
    return [(f"the gradient of {names[0]} is " if len(names) == 1 else f"the gradients of {', '.join(names)} are ")
            + what for what, names in alike.items()]


def _one_gradient_mistake(got: np.ndarray, expected: np.ndarray, params: AttentionParams, bound: float) -> str:
    """What one wrong gradient is, when it is the reference zeroed (within its tolerance ``bound`` of zero: a
    gradient that is always zero, returned in its place, holds float noise), transposed or multiplied by a
    constant."""
    if not np.all(np.isfinite(got)):
        return ""
    if np.any(expected) and float(np.max(np.abs(got), initial=0.0)) <= bound:  # zero, or float noise around it
        return ("zero everywhere (to float noise): nothing flows there (detached, stop_gradient, a no_grad block, an "
                "input that does not require grad, or a gradient that is always zero returned in its place)")
    if got.ndim == 2 and got.shape[0] == got.shape[1] and _close(got, expected.T, expected):
        return "the reference's transposed (d_in x d_out where d_out x d_in belongs)"
    factor = _constant_multiple(got, expected)
    return "" if factor is None else _multiple_named(factor, params)


def _constant_multiple(got: np.ndarray, expected: np.ndarray) -> float | None:
    """The constant c for which ``got`` is c times ``expected`` (the least-squares c, :func:`_close` to it), or None:
    a zero reference, a gradient not finite, or no such c."""
    norm = float(np.vdot(expected, expected))
    if norm == 0.0 or not np.all(np.isfinite(got)):
        return None
    factor = float(np.vdot(got, expected)) / norm
    return factor if _close(got, factor * expected, expected) else None


def _multiple_named(factor: float, params: AttentionParams) -> str:
    """The reference times ``factor``, with the common reason for that factor."""
    scale, label = score_scale(params.config.d_head), score_scale_named()
    named = {value: f"{value:g} x the reference's: {text}" for value, text in _MULTIPLES.items()}
    if scale != 1.0:  # the score scale's factors win where they coincide with another (d_head = 4: 2 and 1/2)
        inverse = label[2:] if label.startswith("1/") else f"1/{scale:g}"
        named[1 / scale] = (f"{inverse} = {1 / scale:.4g} x the reference's: the backward leaves out the {label} "
                            f"score scale (dQ = dS K * {label}, dK = dS^T Q * {label})")
        named[scale] = (f"{label} = {scale:.4g} x the reference's: the backward applies the score scale twice")
    standard = score_scale_at(None, params.config.d_head)
    if not np.isclose(standard, scale, rtol=1e-9):  # a declared scale: a backward copied from a standard layer
        named[standard / scale] = (f"{standard / scale:.4g} x the reference's: the backward applies 1/sqrt(d_head) "
                                   f"where the declared score_scale {label} belongs (dQ = dS K * {label}, "
                                   f"dK = dS^T Q * {label})")
    for value, text in named.items():
        if np.isclose(factor, value, rtol=1e-2):
            return text
    return (f"{factor:.4g} x the reference's: a constant multiple of the true gradient (a scale, a mean where a sum "
            f"belongs, or a count applied twice)")
