"""Scaling, head separation, the output projection and the parameter count."""
from __future__ import annotations

import numpy as np

from mha_harness.cases._fixtures import ALL_FORMS, SHORT_BATCH, SHORT_SEQ, form_inputs, short_layer, small_layer
from mha_harness.conformance.casekit import (
    CaseFailure,
    Measurement,
    assert_close,
    case,
    parameter_count_problem,
    primary_dtype,
    run,
    scale_hint,
    scores_hint,
    tolerance_for,
)
from mha_harness.conformance.diagnoses import layer_mistake, single_key_rows_hint
from mha_harness.contract.api import AttentionConfig, AttentionInputs, AttentionParams
from mha_harness.contract.params import make_params


@case(forms=ALL_FORMS)
def check_scores_scaled_by_sqrt_d_head(backend, *, form, dtype):
    """Scores are divided by sqrt(d_head), not by sqrt(d_model) and not left unscaled (a layer that declares a score
    scale of its own, ``Capabilities(score_scale=...)``, scales by that one); on failure the message names the
    wrong scale the output matches."""
    # d_head 16: 1/sqrt(d_model), 1, 1/d_head and 1/d_model are 1/2x, 4x, 1/4x and 1/16x the scale
    config = AttentionConfig(64, 4)
    params = make_params(config, seed=2, scale=0.6)  # large enough that softmax is far from uniform
    inputs = form_inputs(form, config, 2, 12)
    got = run(backend, params, inputs, dtype).output
    expected, tol = tolerance_for(params, inputs, dtype)
    try:
        return Measurement(max_error=assert_close(got, expected, tol, "scaled attention output"))
    except CaseFailure as failure:
        hint = (scale_hint(got, params, inputs, tol.bound) or scores_hint(got, params, inputs, tol.bound)
                or single_key_rows_hint(got, expected, tol.bound, params, inputs))
        raise failure.with_hint(hint) from None


def _identity_output(params: AttentionParams) -> AttentionParams:
    return params.replace(W_o=np.eye(params.config.d_model))


def _split_hint(backend, params, inputs, dtype) -> str:
    return layer_mistake(run(backend, params, inputs, dtype).output, params, inputs,
                            tolerance_for(params, inputs, dtype)[1].bound)


#: the diagnosis of grouped-query heads that changed as h % kv_heads
TILED = ("the key/value heads are expanded by tiling (torch .repeat, np.tile, jnp.tile) where each must be repeated "
         "for its group of consecutive query heads (repeat_interleave, np.repeat)")


def _grouping_note(c: AttentionConfig, block: int, moved: list[int]) -> str:
    """What grouped-query heads should share key/value head ``block``, which ones changed, and the tiling mistake
    when the changed ones are exactly those of ``h % kv_heads``."""
    owners = list(range(block * c.group, (block + 1) * c.group))
    note = (f" (with {c.num_heads} query heads over {c.kv_heads} key/value heads, key/value head {block} serves query "
            f"heads {owners}, h // {c.group}; the heads that changed: {moved})")
    tiled = [h for h in range(c.num_heads) if h % c.kv_heads == block]
    if c.group > 1 and c.kv_heads > 1 and moved == tiled:
        note += f"; the changed heads are h % kv_heads: {TILED}"
    return note


@case(variants=lambda b: [{"dtype": primary_dtype(b), "kv_heads": kv}
                          for kv in ((4, 2) if b.capabilities.grouped_query else (4,))], forms=ALL_FORMS)
def check_heads_are_separated(backend, *, form, dtype, kv_heads):
    """With W_o = identity, perturbing only head k's block of W_q, W_k or W_v changes only head k's
    slice of the concatenated output (for grouped-query: the query heads sharing that kv head)."""
    params = _identity_output(small_layer(backend, num_kv_heads=kv_heads))
    c = params.config
    inputs = form_inputs(form, c, 2, 7)
    loaded = backend.load(params, dtype=dtype)
    base = run(backend, params, inputs, dtype, loaded=loaded).output
    _, tol = tolerance_for(params, inputs, dtype)
    rng = np.random.default_rng(9)
    for name in ("W_q", "W_k", "W_v"):
        n_blocks = c.num_heads if name == "W_q" else c.kv_heads
        for block in range(n_blocks):
            w = getattr(params, name).copy()
            w[:, block * c.d_head:(block + 1) * c.d_head] += rng.standard_normal((c.d_model, c.d_head))
            changed = params.replace(**{name: w})
            after = run(backend, changed, inputs, dtype).output
            owners = [block] if name == "W_q" else list(range(block * c.group, (block + 1) * c.group))
            diffs = [float(np.nanmax(np.abs(after[..., h * c.d_head:(h + 1) * c.d_head]
                                            - base[..., h * c.d_head:(h + 1) * c.d_head]))) for h in range(c.num_heads)]
            moved = [h for h, diff in enumerate(diffs) if not diff <= tol.bound]  # NaN counts as a change
            stray = [h for h in moved if h not in owners]
            still = [h for h in owners if h not in moved]
            if not stray and not still:
                continue
            grouping = "" if name == "W_q" else _grouping_note(c, block, moved)
            if stray:
                head = stray[0]
                hint = "" if TILED in grouping else _split_hint(backend, params, inputs, dtype)
                raise CaseFailure(f"head separation: changing head {block}'s block of {name} changed head {head}'s "
                                  f"output slice (features {head * c.d_head}:{(head + 1) * c.d_head}) by "
                                  f"{diffs[head]:.3g}; expected no change ({tol.describe()}){grouping}{hint}",
                                  diagnosis=(TILED if TILED in grouping else hint.removeprefix("; ")))
            raise CaseFailure(f"head separation: changing head {block}'s block of {name} left head {still[0]}'s "
                              f"own output slice unchanged; expected it to change{grouping}")
    return Measurement()


@case(forms=ALL_FORMS)
def check_head_split_keeps_features_together(backend, *, form, dtype):
    """The lesson's labelled-numbers test: with W_q = W_k = 0 (uniform attention) and W_v = W_o = I, head k
    must hold features k*d_head..(k+1)*d_head of every token, so each output row is the column mean of X."""
    c = AttentionConfig(8, 2)
    zeros = np.zeros((8, 8))
    params = AttentionParams(c, W_q=zeros, W_k=zeros, W_v=np.eye(8), W_o=np.eye(8))
    t = 5
    x = np.array([[[10.0 * tok + f for f in range(8)] for tok in range(t)]]) / 10.0  # entry = token + feature/10
    kv = x if form == "self" else x.copy()
    inputs = AttentionInputs(x, kv, kv if form != "separate" else x.copy())
    got = run(backend, params, inputs, dtype).output
    expected, tol = tolerance_for(params, inputs, dtype)
    try:
        return Measurement(max_error=assert_close(got, expected, tol, "labelled-numbers head split"))
    except CaseFailure as failure:
        raise failure.with_hint(_split_hint(backend, params, inputs, dtype)) from None


@case(forms=ALL_FORMS)
def check_output_projection_mixes_heads(backend, *, form, dtype):
    """The output is concat(heads) @ W_o + b_o with a random W_o, not the bare concatenation: W_o mixes the heads.
    Heads that are wrong themselves (a wrong score scale, heads split by tokens) fail it too, named as such."""
    params = short_layer(backend)
    inputs = form_inputs(form, params.config, SHORT_BATCH, SHORT_SEQ)
    no_bias = None if params.b_o is None else np.zeros_like(params.b_o)
    concat = run(backend, _identity_output(params).replace(b_o=no_bias), inputs, dtype).output
    got = run(backend, params, inputs, dtype).output
    expected, tol = tolerance_for(params, inputs, dtype)
    with_bias = params.b_o is not None and np.allclose(got, concat + params.b_o, atol=1e-6)
    # heads of (near) zeros make every output W_o could give zeros too: equal to them says nothing about W_o (a
    # stranger's layer that attended over an empty cache was told W_o was not applied)
    heads_carry_signal = float(np.abs(concat).max(initial=0.0)) > tol.bound
    if heads_carry_signal and (np.allclose(got, concat, atol=1e-6) or with_bias):
        raise CaseFailure("output projection: the output equals the concatenated heads: W_o was not applied",
                          max_error=float(np.max(np.abs(got - expected))))
    mixed = concat @ params.W_o + (0 if params.b_o is None else params.b_o)
    assert_close(got, mixed, tol, "output vs concat(heads) @ W_o")
    try:
        return Measurement(max_error=assert_close(got, expected, tol, "output projection"))
    except CaseFailure as failure:  # W_o mixes the heads as it should, but the heads are wrong: say how, if known
        hint = (scale_hint(got, params, inputs, tol.bound) or layer_mistake(got, params, inputs, tol.bound)
                or scores_hint(got, params, inputs, tol.bound)
                or single_key_rows_hint(got, expected, tol.bound, params, inputs))
        raise failure.with_hint(hint) from None


def _count_variants(backend):
    caps = backend.capabilities
    out = [{"bias": False, "kv_heads": 8}]
    if caps.bias:
        out.append({"bias": True, "kv_heads": 8})
    if caps.grouped_query:
        out += [{"bias": False, "kv_heads": 2}, {"bias": False, "kv_heads": 1}]
    out += [{"bias": False, "kv_heads": 2 if caps.grouped_query else 8, "qk_norm": norm} for norm in caps.qk_norms]
    return out


@case(requires=("native_parameters",), variants=_count_variants, forms=ALL_FORMS)
def check_parameter_count_is_4_d_model_squared(backend, *, bias, kv_heads, qk_norm=None):
    """The parameters the backend itself allocates number 4*d_model^2 (+4*d_model with biases); with
    num_kv_heads < num_heads, 2*d_model^2 + 2*d_model*kv_heads*d_head (+ biases of those widths); a declared norm
    on q and k adds its gains: 2*d_head for a per-head norm (one gain vector shared by all heads, not one per head),
    d_model + kv_heads*d_head for a norm over the projections."""
    config = AttentionConfig(64, 8, None if kv_heads == 8 else kv_heads, bias=bias, qk_norm=qk_norm)
    shapes = backend.native_parameter_shapes(config)
    problem = parameter_count_problem(shapes, config)
    if problem:
        raise CaseFailure(problem)
    count = int(sum(int(np.prod(s)) for s in shapes.values()))
    return Measurement(observed=str(count))
