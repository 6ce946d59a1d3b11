"""One search example: explicit, JSON-able parameters -> a layer and its inputs, and the property they must satisfy.

An *example* is a plain dict (what ``mha-harness search`` draws, shrinks, prints and saves)::

    {"dtype": "float32", "form": "separate", "batch": 1, "tq": 1, "tk": 2, "heads": 1, "kv_heads": 1,
     "d_head": 2, "bias": false, "causal": null, "padding": null, "attn_mask": null, "logit_scale": 1,
     "cut": 0, "poison": "random", "gradients": false, "malformed": null, "seed": 0}

(plus ``"decode_step": true``, ``"qk_norm": "rms_per_head"`` or ``"rotary": "half_split", "rotary_base": 500000.0``
a partial rotary's ``"rotary_dims": 4``, a rescaling's ``"rotary_scaling": "llama3"`` and a sliding window's
``"sliding_window": 3`` and ALiBi's ``"alibi": "symmetric"`` where drawn).

:func:`build` rebuilds the parameters and inputs from it deterministically (seeded NumPy), and
:func:`check_example` states the property: the backend's output equals the float64 reference under the one
tolerance rule; keys and values no query may attend to (plus those after ``cut``), set to ``poison``, leave every
query row that cannot see them unchanged; with ``gradients`` the VJPs equal the reference's; with ``malformed``
one of the bad calls of ``check_bad_input_raises_clear_error`` raises a clear error; the parameters the backend
allocates number the expected count. Whatever a backend's declared divergences cover is not asserted
(:class:`Coverage`). No hypothesis here: a saved example replays without it.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mha_harness.conformance.casekit import (
    CaseFailure,
    assert_close,
    assert_decode_step_close,
    assert_gradients_match_reference,
    assert_output_close,
    bad_call_problem,
    bad_calls,
    parameter_count_problem,
    run,
    tolerance_for,
)
from mha_harness.conformance.proxy import LoadedProxy, as_proxy
from mha_harness.contract.api import (
    AttentionBackend,
    AttentionConfig,
    AttentionInputs,
    AttentionParams,
    Unsupported,
    as_kv_cache_call,
)
from mha_harness.contract.conventions import BOTTOM_RIGHT, COMMON_ROTARY_SCALINGS
from mha_harness.contract.params import make_inputs, make_params
from mha_harness.contract.reference import (
    WINDOW_FIELD,
    allowed_and_bias,
    empty_rows_as,
    scores_as_declared,
    without_masks,
)

SCHEMA = "mha-harness/search-regression"
SCHEMA_VERSION = 1
SEARCH_DIR_ENV = "MHA_HARNESS_SEARCH_DIR"
#: the poison a key/value no query may see is set to, in the leakage invariant
POISONS = ("random", "nan", "inf")


# --- input forms: the one place a new form (shared_kv, self, kv_cache) is added ---------------------------------
def _separate_form(config: AttentionConfig, batch: int, tq: int, tk: int, seed: int, **masks) -> AttentionInputs:
    return make_inputs(config, batch, tq, tk, seed=seed, self_attention=False, **masks)


def _shared_kv_form(config: AttentionConfig, batch: int, tq: int, tk: int, seed: int, **masks) -> AttentionInputs:
    separate = make_inputs(config, batch, tq, tk, seed=seed, self_attention=False, **masks)
    return separate.replace(value=separate.key)  # key is value: one memory array


def _self_form(config: AttentionConfig, batch: int, tq: int, tk: int, seed: int, **masks) -> AttentionInputs:
    if tq != tk:
        raise ValueError(f"form: 'self' needs Tq == Tk; got tq={tq}, tk={tk}")
    return make_inputs(config, batch, tq, tq, seed=seed, self_attention=True, **masks)


def _kv_cache_form(config: AttentionConfig, batch: int, tq: int, tk: int, seed: int, **masks) -> AttentionInputs:
    if tq > tk:
        raise ValueError(f"form: 'kv_cache' needs Tq <= Tk; got tq={tq}, tk={tk}")
    return as_kv_cache_call(_shared_kv_form(config, batch, tq, tk, seed, **masks))


#: form name -> builder of the inputs (the names of ``Capabilities.inputs``): separate
#: query/key/value; key is value (encoder-decoder memory); query is key is value (self-attention, Tq == Tk);
#: a KV-cache step (x_new is x_kv's last Tq rows, Tq <= Tk)
FORMS = {"separate": _separate_form, "shared_kv": _shared_kv_form, "self": _self_form, "kv_cache": _kv_cache_form}


# --- what declared divergences cover --------------------------------------------------------------------------------
_EMPTY_ROW_CASES = ("check_fully_masked_rows_output_zeros",)
_POISON_CASES = ("check_causal_mask_blocks_future_keys", "check_padding_mask_blocks_padded_keys")


def _declared(backend: AttentionBackend, case: str, **params) -> bool:
    """A declared divergence of ``case`` applies to ``params`` (:func:`_covers`)."""
    return any(d.case == case and _covers(d, **params) for d in backend.divergences)


def _covers(d, **params) -> bool:
    """Declaration ``d`` applies to ``params``. Only the ``when`` keys the search shares with the cases (dtype,
    poison, and the gradient case's ``empty_row``: a row with no key) restrict it: other keys name the grid points
    where the behaviour was verified."""
    shared = {k: v for k, v in d.when.items() if k in ("dtype", "poison", "empty_row")}
    return all(params.get(k) in (v if isinstance(v, (list, tuple, set, frozenset)) else (v,))
               for k, v in shared.items())


@dataclass(frozen=True)
class Coverage:
    """The inputs a backend's declared divergences cover, which the search does not draw or does not assert."""

    #: (dtype, output) of query rows with no key in some head, where a declaration says other than zeros
    empty_rows: tuple[tuple[str, str], ...] = ()
    poisons: tuple[str, ...] = POISONS  # poisons whose leakage is not declared
    output_dtypes: tuple[str, ...] = ()  # dtypes whose output is held to the reference (not declared otherwise)
    #: dtypes whose gradients are held to the reference: a declaration of the gradient case's ``empty_row``
    #: variant (the fully-masked helpers add one) covers rows with no key only, whose gradients the search never
    #: checks (an outside user's backward bug went unsearched behind it)
    gradient_dtypes: tuple[str, ...] = ()

    @property
    def compare_empty_rows(self) -> bool:
        """Rows with no key in some head are held to the reference's zeros in every dtype (no other output is
        declared)."""
        return not self.empty_rows

    def empty_rows_in(self, dtype: str) -> str:
        """What a row with no key in some head outputs in ``dtype``: "zeros" (the convention) or the declared one."""
        return dict(self.empty_rows).get(dtype, "zeros")

    @classmethod
    def of(cls, backend: AttentionBackend) -> Coverage:
        dtypes = backend.capabilities.dtypes
        declared = {}
        for dtype in dtypes:  # the first declaration of the fully-masked case that covers the dtype
            value = next((d.behaviour.split(":", 1)[1] for d in backend.divergences
                          if d.case in _EMPTY_ROW_CASES and d.behaviour.startswith("fully_masked_rows:")
                          and _covers(d, dtype=dtype)), None)
            if value is not None and value != "zeros":
                declared[dtype] = value
        return cls(
            empty_rows=tuple(declared.items()),
            poisons=tuple(p for p in POISONS if not any(_declared(backend, c, poison=p) for c in _POISON_CASES)),
            output_dtypes=tuple(d for d in dtypes if not _declared(backend, "check_output_matches_reference", dtype=d)),
            # the search checks no gradients of an example with a row without keys (empty_row=False)
            gradient_dtypes=tuple(d for d in dtypes
                                  if not _declared(backend, "check_gradients_match_reference", dtype=d,
                                                   empty_row=False)),
        )


# --- building the layer and inputs ----------------------------------------------------------------------------------
def _padding(spec: Mapping[str, Any], batch: int, tk: int) -> np.ndarray:
    """(batch, Tk) True = padding: the last Tk - valid keys (side "end") or the first ones (side "start")."""
    valid = [int(v) for v in spec["valid"]][:batch]
    valid += [valid[-1]] * (batch - len(valid))
    k = np.arange(tk)[None, :]
    v = np.clip(np.array(valid), 0, tk)[:, None]
    return k >= v if spec.get("side", "end") == "end" else k < tk - v


def _attn_mask(spec: Mapping[str, Any], batch: int, heads: int, tq: int, tk: int) -> np.ndarray:
    """Random "may attend" pattern of ``density`` (shared (Tq, Tk) or per (batch, head)); ``empty_rows`` are fully
    masked (every batch item when shared, the last batch item's head 0 when per (batch, head)); additive masks
    put -inf where not allowed and N(0, magnitude) elsewhere."""
    rng = np.random.default_rng(int(spec.get("seed", 0)) + 7)
    shape = (tq, tk) if spec.get("per", "shared") == "shared" else (batch, heads, tq, tk)
    allow = rng.random(shape) < float(spec.get("density", 1.0))
    rows = [r for r in spec.get("empty_rows", []) if r < tq]
    if rows:
        if len(shape) == 2:
            allow[rows, :] = False
        else:
            allow[-1, 0, rows, :] = False
    if spec.get("kind", "bool") == "bool":
        return allow
    return np.where(allow, rng.standard_normal(shape) * float(spec.get("magnitude", 1.0)), -np.inf)


def build(example: Mapping[str, Any]) -> tuple[AttentionParams, AttentionInputs]:
    """The layer and the inputs an example names, rebuilt deterministically from its explicit parameters.

    ``logit_scale`` s multiplies W_q, b_q, W_k and b_k by sqrt(s), so every logit is s times its unscaled value
    (unscaled logits are O(1): s = 1000 reaches the range where exp overflows float64 without max subtraction); a
    layer with a q/k norm (``qk_norm``), which the norm would bring back to O(1), has its norm's gains g_q and g_k
    (and a LayerNorm's biases beta_q and beta_k) multiplied so instead."""
    e = example
    heads, kv = int(e["heads"]), int(e["kv_heads"])
    config = AttentionConfig(heads * int(e["d_head"]), heads, None if kv == heads else kv, bias=bool(e["bias"]),
                             qk_norm=e.get("qk_norm"), rotary=e.get("rotary"),
                             rotary_base=float(e.get("rotary_base", 10_000.0)), rotary_dims=e.get("rotary_dims"),
                             rotary_scaling=COMMON_ROTARY_SCALINGS.get(e.get("rotary_scaling")),
                             sliding_window=e.get("sliding_window"), alibi=e.get("alibi"))
    params = make_params(config, seed=int(e["seed"]))
    g = float(np.sqrt(float(e.get("logit_scale", 1))))
    if g != 1.0:
        scaled = ("g_q", "g_k", "beta_q", "beta_k") if config.qk_norm else ("W_q", "W_k", "b_q", "b_k")
        params = params.replace(**{n: a * g for n, a in params.arrays().items() if n in scaled})
    batch, tq, tk = int(e["batch"]), int(e["tq"]), int(e["tk"])
    masks = {"causal": e.get("causal")}
    if e.get("padding"):
        masks["key_padding_mask"] = _padding(e["padding"], batch, tk)
    if e.get("attn_mask"):
        masks["attn_mask"] = _attn_mask(e["attn_mask"], batch, heads, tq, tk)
    form = e.get("form", "separate")
    if form not in FORMS:
        raise ValueError(f"form: got {form!r}; accepted: {', '.join(FORMS)}")
    return params, FORMS[form](config, batch, tq, tk, int(e["seed"]) + 1, **masks)


# --- the property ---------------------------------------------------------------------------------------------------
def _allowed(params: AttentionParams, inputs: AttentionInputs) -> np.ndarray:
    allowed, _ = allowed_and_bias(params, inputs)
    return np.broadcast_to(allowed, (inputs.batch, params.config.num_heads, inputs.tq, inputs.tk))


def _ignoring(actual: np.ndarray, expected: np.ndarray, rows: np.ndarray | None) -> np.ndarray:
    """``actual`` with the (batch, position) ``rows`` replaced by ``expected``'s: those rows are not compared."""
    if rows is None or not rows.any():
        return actual
    out = actual.copy()
    out[rows] = expected[rows]
    return out


_COUNTED: dict = {}


def check_example(backend: AttentionBackend, example: Mapping[str, Any]) -> float:
    """:func:`_check_example` against the reference of the scores the backend declares (its ``logit_softcap`` and
    ``score_scale``)."""
    with scores_as_declared(backend.capabilities):
        return _check_example(backend, example)


def _check_example(backend: AttentionBackend, example: Mapping[str, Any]) -> float:
    """Raise :class:`CaseFailure` where ``backend`` breaks the search property on ``example``; else the worst
    output error. The backend may be a proxy whose ``load``/``forward`` run in a worker: every comparison is here."""
    coverage = Coverage.of(backend)
    params, inputs = build(example)
    config, dtype = params.config, example["dtype"]
    if backend.capabilities.native_parameters:
        key = (backend.name, config)
        if key not in _COUNTED:
            try:
                _COUNTED[key] = parameter_count_problem(backend.native_parameter_shapes(config), config)
            except Unsupported:  # no native parameters reported (the base class's answer): not counted, as the
                _COUNTED[key] = None  # parameter-count case skips it; the example's other properties still run
        if _COUNTED[key]:
            raise CaseFailure(_COUNTED[key])
    loaded = backend.load(params, dtype=dtype)
    if example.get("malformed") is not None:
        calls = bad_calls(FORMS[example.get("form", "separate")](config, 2, 6, 6, int(example["seed"])))
        call = calls[int(example["malformed"]) % len(calls)]
        # separate arrays are a well-formed call for a backend that declares the separate form (searched with one x)
        problem = None if call[0] == "inputs" and backend.capabilities.inputs == "separate" else \
            bad_call_problem(loaded, *call)
        if problem:
            raise CaseFailure(f"bad input not rejected clearly: {problem}")
    allowed = _allowed(params, inputs)
    convention = coverage.empty_rows_in(dtype)
    # (batch, Tq): rows with no key to attend to in some head, whose output there the backend declares otherwise
    # (per-head masks empty a row in one head only: an outside user's Gemma layer, uniform declared, failed there)
    empty = None if convention == "zeros" else (~allowed.any(axis=3)).any(axis=1)
    got = run(backend, params, inputs, dtype, loaded=loaded).output
    with empty_rows_as(convention):  # the declared output of such rows (verified by the fully-masked case)
        return _check_calls(backend, params, inputs, example, loaded, coverage, allowed, empty, got)


def _check_calls(backend, params, inputs, example, loaded, coverage, allowed, empty, got) -> float:
    """:func:`_check_example`'s comparisons of the output ``got``, its leakage, gradients and decode step, under the
    empty-row output the backend declares: a uniform average is compared (its forward is defined), a NaN row is not
    (``empty``'s rows are left out)."""
    dtype = example["dtype"]
    expected, tol = tolerance_for(params, inputs, dtype)
    worst = 0.0
    if dtype in coverage.output_dtypes:
        # named like check's failures: the known mistake the output matches; a declared NaN row is compared on
        # neither side (the reference's is NaN under that convention too)
        if coverage.empty_rows_in(dtype) == "nan":
            expected = _ignoring(expected, np.zeros_like(expected), empty)
        shown = got if coverage.empty_rows_in(dtype) == "uniform_average" else _ignoring(got, expected, empty)
        worst = assert_output_close(backend, params, inputs, dtype, shown, expected, tol)
    _check_leakage(backend, params, inputs, example, loaded, allowed, empty, got, tol)
    if example.get("gradients") and backend.capabilities.gradients and dtype in coverage.gradient_dtypes \
            and (empty is None or not empty.any()):
        cotangent = np.random.default_rng(int(example["seed"]) + 3).standard_normal(got.shape)
        declared = backend.capabilities.inputs  # per argument of the module's own call, whatever the call's form
        assert_gradients_match_reference(loaded.vjp(inputs, cotangent), params, inputs, cotangent, dtype, declared,
                                         forward=lambda: got)
    if example.get("decode_step") and dtype in coverage.output_dtypes:
        worst = max(worst, _check_decode_step(backend, params, inputs, dtype, loaded))
    return worst


def _check_decode_step(backend, params, inputs, dtype, loaded) -> float:
    """The example's shape as a decode step (a cache filled from its first Tk - Tq positions, bottom-right causal,
    no other mask): its first two calls return the reference's output. Nothing to check (0) for a backend without
    a decode step, or one that refuses this call."""
    step_inputs = as_kv_cache_call(inputs.replace(key_padding_mask=None, attn_mask=None, causal=BOTTOM_RIGHT))
    if not isinstance(loaded, LoadedProxy):  # a backend searched in this process: the proxy's two calls, compared
        loaded = as_proxy(backend).load(params, dtype=dtype)
    try:
        first, second = loaded.decode_step(step_inputs)
    except Unsupported:
        return 0.0
    return assert_decode_step_close(backend, params, step_inputs, dtype, first, second)


def _check_leakage(backend, params, inputs, example, loaded, allowed, empty, base, tol) -> None:
    """Keys/values no query of a batch item may attend to, and those after ``cut``, set to ``poison``: every query
    row that may attend to none of them keeps its output (within the tolerance; NaN counts as a change)."""
    if inputs.query is inputs.key or inputs.query is inputs.value:
        return  # poisoning keys would change the queries too
    coupled = inputs.form == "kv_cache"  # x_kv's last Tq rows are the queries: poisoning one moves its query
    start = inputs.tk - inputs.tq
    never = ~allowed.any(axis=(1, 2))  # (batch, Tk)
    poisoned = never | (np.arange(inputs.tk) > int(example.get("cut", inputs.tk)))[None, :]
    kind = example.get("poison", "random")
    if kind != "random":  # NaN/inf may only sit at keys every query's mask hides (validate_inputs): not at keys
        if params.config.sliding_window is not None:  # only the layer's window hides, which the call cannot know
            never = ~allowed_and_bias(*without_masks(params, inputs, (WINDOW_FIELD,)))[0].any(axis=(1, 2))
        poisoned &= never
        if coupled:  # ... and never at a query's own row
            poisoned[:, start:] = False
    clean = ~(allowed & poisoned[:, None, None, :]).any(axis=(1, 3))  # (batch, Tq)
    if coupled:
        clean &= ~poisoned[:, start:]  # a row whose own query was poisoned may change
    if empty is not None:
        clean &= ~empty
    if not poisoned.any() or not clean.any():
        return
    rng = np.random.default_rng(int(example["seed"]) + 11)
    key = inputs.key.copy()
    value = key if inputs.value is inputs.key else inputs.value.copy()  # a shared key/value stays one array
    for arr in ((key,) if value is key else (key, value)):
        n = int(poisoned.sum())
        arr[poisoned] = {"nan": np.full((n, arr.shape[-1]), np.nan), "inf": np.full((n, arr.shape[-1]), np.inf)}.get(
            kind, rng.standard_normal((n, arr.shape[-1])) * 100.0)
    moved = inputs.replace(key=key, value=value, query=key[:, start:].copy() if coupled else inputs.query)
    after = run(backend, params, moved, example["dtype"], loaded=loaded).output
    keys = [f"b{b}:k{k}" for b, k in zip(*np.nonzero(poisoned))][:6]
    keep = clean[..., None]  # the other rows on neither side (a declared NaN row is NaN in ``base`` too)
    assert_close(np.where(keep, after, 0.0), np.where(keep, base, 0.0), tol,
                 f"leak: keys/values that the compared query rows may not attend to (masked for every one of them: "
                 f"batch:key {', '.join(keys)}{'...' if poisoned.sum() > 6 else ''}) were set to {kind}, and the "
                 "output of those rows changed")


# --- regression cases and repro lines --------------------------------------------------------------------------------
def search_dir(results: str | Path | None = None) -> Path:
    """Where search regressions live: ``<results>/search``, else ``$MHA_HARNESS_SEARCH_DIR``, else results/search."""
    if results is not None:
        return Path(results) / "search"
    return Path(os.environ.get(SEARCH_DIR_ENV) or "results/search")


def example_id(example: Mapping[str, Any]) -> str:
    return hashlib.sha1(json.dumps(example, sort_keys=True).encode()).hexdigest()[:12]


def saved_regressions(backend_name: str, directory: str | Path | None = None) -> list[Path]:
    folder = (Path(directory) if directory is not None else search_dir()) / backend_name
    return sorted(folder.glob("*.json")) if folder.is_dir() else []


def load_regression(path: str | Path) -> dict:
    data = json.loads(Path(path).read_text())
    if data.get("schema") != SCHEMA:
        raise ValueError(f"regression file {path}: schema is {data.get('schema')!r}; accepted: {SCHEMA!r}")
    return data


def save_regression(backend_name: str, spec: str | None, example: Mapping[str, Any], message: str,
                    directory: str | Path) -> Path:
    from mha_harness.util.atomic import write_json_atomic
    path = Path(directory) / backend_name / f"{example_id(example)}.json"
    write_json_atomic(path, {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "backend": backend_name,
                             "spec": spec, "example": dict(example), "message": message,
                             "repro": repro_line(backend_name, spec, example)})
    return path


def _literal(value) -> str:
    """A Python literal with double-quoted strings only (so it can sit inside single quotes in a shell)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {_literal(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_literal(v) for v in value) + "]"
    if isinstance(value, str):
        return json.dumps(value)
    if value is None or isinstance(value, (bool, int)):
        return repr(value)
    if isinstance(value, float):
        return repr(value) if np.isfinite(value) else f'float("{value}")'
    raise TypeError(f"example: cannot write {type(value).__name__} {value!r} as a literal")


def repro_line(backend_name: str, spec: str | None, example: Mapping[str, Any]) -> str:
    """A shell-safe one-liner that rebuilds the example from its parameters, calls the backend and raises."""
    target = _literal(spec or backend_name)
    name = f", name={_literal(backend_name)}" if spec else ""
    code = (f"from mha_harness.checking import replay; "
            f"replay({target}, {_literal(dict(example))}{name})")
    if "'" in code:
        raise ValueError(f"example: {code!r} contains a single quote; it cannot be written shell-safe")
    return f"python -c '{code}'"
