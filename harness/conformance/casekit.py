"""What a conformance case is, how it is declared, and the helpers every case shares.

A case is a plain function ``check_<property>(backend, **params)`` whose docstring states
the property. It raises :class:`CaseFailure` (with a message saying what was expected,
what came out, where and by how much) or :class:`CaseSkipped` (with the reason), and
returns an optional dict of measurements (``max_error``, ``observed``...).
Variants (explicit, seeded parameters) are generated from the backend's capabilities.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mha_harness.conformance.diagnoses import (
    MISTAKE_MATCH,
    SCALE_MATCH,
    SOFTCAP_MATCH,
    cache_kv_swapped_hint,
    cache_order_hint,
    layer_mistake,
    mask_mistake,
    scores_fit_hint,
    single_key_rows_hint,
)
from mha_harness.conformance.diagnosing import diagnosing
from mha_harness.conformance.gradient_diagnoses import gradient_hint
from mha_harness.contract.alibi_diagnoses import ALIBI_MATCH, alibi_hint
from mha_harness.contract.api import (
    FULLY_MASKED_ROWS,
    INPUT_FORMS,
    AttentionBackend,
    AttentionInputs,
    AttentionOutput,
    AttentionParams,
    Capabilities,
    as_kv_cache_call,
    implicitly_causal,
    supported,
)
from mha_harness.contract.conventions import EPS
from mha_harness.contract.expected import (  # noqa: F401 - part of casekit's API
    gradient_bounds,
    gradient_reduction_length,
    gradient_tolerances,
    input_gradient_terms,
    input_gradients,
    naive_forwards,
    naive_gradients,
    tolerance_for,
)
from mha_harness.contract.mistakes import distance, explains_as_a_scale, with_score_scale, wrong_scales
from mha_harness.contract.qk_norm_diagnoses import QK_NORM_MATCH, qk_norm_hint, qk_norm_match
from mha_harness.contract.reference import (
    allowed_and_bias,
    reference_attention,
    score_scale_declared,
)
from mha_harness.contract.rotary_diagnoses import ROTARY_MATCH, rotary_hint
from mha_harness.contract.scoped import scoped
from mha_harness.contract.scores_fit import scale_sentence, scores_mismatch_fit
from mha_harness.contract.tolerance import Tolerance
from mha_harness.contract.window_diagnoses import window_hint


class CaseFailure(AssertionError):
    """The backend violates the property the case proves."""

    def __init__(self, message: str, max_error: float | None = None, observed: str | None = None,
                 diagnosis: str = "", guess: str = ""):
        super().__init__(message)
        self.max_error = max_error
        self.observed = observed
        self.diagnosis = diagnosis  # the known mistake the output matches, when one does (also in the message)
        self.guess = guess  # the part of the message that guesses a cause from the error's size alone
        self.precision = precision_diagnosis(guess)  # that guess in one line, for the summary's "diagnosed:"

    def with_hint(self, hint: str, diagnosis: str | None = None) -> CaseFailure:
        """This failure with ``hint``, a diagnosis suffix ("; the output matches ..."), appended to its message and
        kept as its diagnosis (the diagnosis it had when ``hint`` is empty); ``diagnosis``: a shorter one to keep
        instead, for the summary's "diagnosed:" line, or "" when the hint names no mistake (a list of the wrong
        gradients): the failure keeps the diagnosis it had. A hint that names a known mistake the output matches
        ("the output matches ...", one or several), a soft cap on the scores or another score scale
        (:data:`~mha_harness.conformance.diagnoses.SOFTCAP_MATCH`, ``SCALE_MATCH``) names the cause the message's
        guess from the error's size (a precision, :attr:`guess`) would misname: the guess is dropped (a causal mask
        one key too wide beside an additive mask moved two rows by 0.009 and was first offered a precision
        declaration that would have hidden it: an outside user's FlexAttention layer)."""
        if diagnosis is None:
            diagnosis = hint.removeprefix("; ").strip()
        message, guess = str(self), self.guess
        if (MISTAKE_MATCH in hint or SOFTCAP_MATCH in hint or SCALE_MATCH in hint or QK_NORM_MATCH in hint
                or ROTARY_MATCH in hint or ALIBI_MATCH in hint) and guess:
            message, guess = message.replace(guess, ""), ""
        return CaseFailure(message + hint, self.max_error, self.observed, diagnosis or self.diagnosis, guess)

    def without_guess(self) -> CaseFailure:
        """This failure without its guess of a precision from the error's size: for a comparison of the backend
        with its own earlier output (the same layer in the same dtype, where no precision explains a change), or
        one whose layer is wrong at ordinary inputs too."""
        if not self.guess:
            return self
        return CaseFailure(str(self).replace(self.guess, ""), self.max_error, self.observed, self.diagnosis)


class CaseSkipped(Exception):
    """The case does not apply to this backend; the message is the reason."""


class FormSkipped(CaseSkipped):
    """The case's property is not defined for the input form the backend takes (``Capabilities.inputs``)."""


#: the ``observed`` of a result skipped for its input form: the report counts these per backend
FORM_SKIP = "skipped for its input form"


class FormRefusal(str):
    """A variant generator's skip reason (the ``unsupported`` parameter) saying the variant is not defined for the
    backend's input form (a self-attention layer has no Tq != Tk): skipped and counted like :class:`FormSkipped`."""


@dataclass(frozen=True)
class Case:
    name: str
    func: Callable[..., Any]
    requires: tuple[str, ...]
    variants: Callable[[AttentionBackend], list[dict]]
    doc: str
    slow: bool = False
    #: the input forms (``Capabilities.inputs``) in which the case's property is defined
    forms: tuple[str, ...] = ("separate",)

    def variants_for(self, backend: AttentionBackend) -> list[dict]:
        """The variants for this backend, each recording the input form it runs in as ``form``.

        A backend whose form the case is not defined for gets one variant that skips naming the form."""
        form = backend.capabilities.inputs
        if form not in self.forms:
            return [{"form": form}]
        variants = self.variants(backend)
        if not variants:  # the runner reports it as skipped: no parameters this case can run with
            return [{"form": form, "unsupported": True}]
        return [{**v, "form": form} for v in variants]


_REGISTRY: dict[str, Case] = {}


def primary_dtype(backend: AttentionBackend) -> str:
    dtypes = backend.capabilities.dtypes
    return "float32" if "float32" in dtypes else dtypes[0]


def on_primary_dtype(backend: AttentionBackend) -> list[dict]:
    return [{"dtype": primary_dtype(backend)}]


FORM_WORDS = {"separate": "separate query/key/value", "shared_kv": "one x_q and one x_kv", "self": "one x",
              "kv_cache": "a KV-cache step (x_new, the last Tq rows of x_kv)"}


_OP_WORDS = {"forward": "forward", "vjp": "backward (vjp)", "decode_step": "decode step"}


def describe_call(op: str, inputs: AttentionInputs) -> str:
    """The plugin call ``op`` on ``inputs`` in words, for an error it raised: its shapes and masks, e.g. "forward
    of batch 3, Tq = 7 queries against Tk = 300 keys (one x_q and one x_kv), with key_padding_mask (3, 300)"."""
    if not all(getattr(x, "ndim", 0) == 3 for x in (inputs.query, inputs.key)):
        return f"{_OP_WORDS.get(op, op)} of malformed inputs (the bad-input case's)"
    masks = []
    if inputs.causal is not None:
        masks.append(f"a causal mask ({inputs.causal})")
    if inputs.key_padding_mask is not None:
        masks.append(f"key_padding_mask {tuple(np.shape(inputs.key_padding_mask))}")
    if inputs.attn_mask is not None:
        kind = "bool" if np.asarray(inputs.attn_mask).dtype == np.bool_ else "additive"
        masks.append(f"a {kind} attn_mask {tuple(np.shape(inputs.attn_mask))}")
    shape = f"Tq = {inputs.tq} queries against Tk = {inputs.tk} keys" if inputs.tq != inputs.tk else \
        f"Tq = Tk = {inputs.tq}"
    return (f"{_OP_WORDS.get(op, op)} of batch {inputs.batch}, {shape} ({FORM_WORDS.get(inputs.form, inputs.form)})"
            + (f", with {' and '.join(masks)}" if masks else ", without masks"))


def _in_form(func: Callable[..., Any], forms: tuple[str, ...]) -> Callable[..., Any]:
    """``func`` called with the variant's ``form`` (when it takes one) after checking the case is defined for it;
    for a backend declaring ``always_causal``, with every input it makes causal (:func:`always_causal_alignment`)."""
    takes_form = "form" in inspect.signature(func).parameters

    @functools.wraps(func)
    def run_in_form(backend, *, form: str | None = None, **params):
        form = form or backend.capabilities.inputs
        reason = form_skip_reason(func.__name__, forms, backend, form)
        if reason:
            raise FormSkipped(reason)
        with implicitly_causal(always_causal_alignment(backend)):
            return func(backend, form=form, **params) if takes_form else func(backend, **params)
    return run_in_form


def always_causal_alignment(backend: AttentionBackend) -> str | None:
    """The alignment every call of a case takes for a backend that declares ``always_causal`` (its first declared
    alignment), else None: the case's inputs stay as the case makes them."""
    caps = backend.capabilities
    return caps.causal_alignments[0] if caps.always_causal else None


def form_skip_reason(name: str, forms: tuple[str, ...], backend: AttentionBackend, form: str) -> str | None:
    """Why case ``name`` (defined for ``forms``) skips in ``form`` for this backend, from its declarations alone."""
    if form not in forms:
        return (f"{name} is defined only for {' or '.join(FORM_WORDS[f] for f in forms)}; "
                f"{backend.name} declares inputs={form!r} ({FORM_WORDS.get(form, form)})")
    if not backend.capabilities.accepts_form(form):
        return (f"{backend.name} declares inputs={backend.capabilities.inputs!r}, which does not "
                f"accept {FORM_WORDS.get(form, form)} (form={form!r})")
    return None


def case(*, requires: Iterable[str] = (), variants: Callable[[AttentionBackend], list[dict]] = on_primary_dtype,
         slow: bool = False, forms: Iterable[str] = ("separate",)):
    """Register a ``check_*`` function as a conformance case.

    ``forms``: the input forms (:data:`mha_harness.contract.api.INPUT_FORMS`) the property is defined for; a
    backend declaring another form skips the case with a reason naming its form. A function that takes a
    ``form`` keyword builds its inputs in that form (every variant records it)."""
    forms = tuple(forms)
    unknown = [f for f in forms if f not in INPUT_FORMS]
    if unknown or not forms:
        raise ValueError(f"forms: got {forms!r}; accepted: a non-empty subset of {INPUT_FORMS}")
    requires = (requires,) if isinstance(requires, str) else tuple(requires)
    for feature in requires:  # a misspelt capability is refused at registration, not an error on every backend
        try:
            Capabilities().has(feature)
        except ValueError as exc:
            raise ValueError(f"requires: {exc}") from None

    def register(func):
        if not func.__name__.startswith("check_"):
            raise ValueError(f"case name: got {func.__name__!r}; accepted: a name starting with 'check_'")
        existing = _REGISTRY.get(func.__name__)
        if existing is not None and existing.func.__module__ != func.__module__:  # a re-import replaces itself
            raise ValueError(f"case name: {func.__name__!r} is registered twice, by {existing.func.__module__} "
                             f"and {func.__module__}")
        _REGISTRY[func.__name__] = Case(func.__name__, _in_form(func, forms), requires, variants,
                                        inspect.cleandoc(func.__doc__ or ""), slow, forms)
        return func
    return register


CASE_ENTRY_POINT_GROUP = "mha_harness.cases"
BUILTIN_CASES = "mha_harness.cases"
_LOADED_CASE_MODULES: set[str] = set()
#: case plugin module -> why it could not be imported (reported by check, never raised)
_CASE_PLUGIN_ERRORS: dict[str, str] = {}


def load_case_modules() -> None:
    """Import every module that registers cases: the built-in ``mha_harness.cases`` and each module named in the
    ``mha_harness.cases`` entry-point group (a third party's own cases). Importing a module registers its
    ``@case`` functions. Done once per process.

    A third party's module is imported under the plugin guard (:func:`mha_harness.util.guard.call_guarded`):
    anything it raises (``SystemExit`` included), a hang past the plugin timeout or a case name that is taken
    is recorded in :func:`case_plugin_errors` -- the run goes on without its cases and is not OK."""
    import importlib
    from importlib import metadata

    from mha_harness.util import integrity
    from mha_harness.util.guard import PluginFault, call_guarded, plugin_timeout
    if BUILTIN_CASES not in _LOADED_CASE_MODULES:
        importlib.import_module(BUILTIN_CASES)
        _LOADED_CASE_MODULES.add(BUILTIN_CASES)
    try:
        plugins = sorted({ep.value.split(":")[0] for ep in metadata.entry_points(group=CASE_ENTRY_POINT_GROUP)}
                         - {BUILTIN_CASES})
    except Exception as exc:  # noqa: BLE001 - broken distribution metadata: reported like a broken plugin
        _CASE_PLUGIN_ERRORS.setdefault(f"entry points {CASE_ENTRY_POINT_GROUP!r}", f"{type(exc).__name__}: {exc}")
        plugins = []
    for name in plugins:
        if name in _LOADED_CASE_MODULES or name in _CASE_PLUGIN_ERRORS:
            continue
        integrity.take_snapshot()  # before plugin code runs here (adds what was loaded since)
        before = dict(_REGISTRY)
        try:
            call_guarded(lambda n=name: importlib.import_module(n), "import", plugin_timeout())
            _LOADED_CASE_MODULES.add(name)
        except PluginFault as fault:
            # all of a plugin or none of it: the cases it registered before it failed do not run either
            _REGISTRY.clear()
            _REGISTRY.update(before)
            _CASE_PLUGIN_ERRORS[name] = f"failed to load: {fault}"


def case_plugin_errors() -> dict[str, str]:
    """Case plugin modules (entry-point group ``mha_harness.cases``) that could not be imported, with the reason."""
    load_case_modules()
    return dict(_CASE_PLUGIN_ERRORS)


def all_cases() -> dict[str, Case]:
    """Every registered case: the built-in ones and those of installed case plugins."""
    load_case_modules()
    return dict(_REGISTRY)


def variant_id(backend_name: str, params: Mapping[str, Any]) -> str:
    """Readable id such as ``torch-sdpa-float32-b3-h8-t129``."""
    short = {"batch": "b", "heads": "h", "seq": "t", "tk": "tk", "d_head": "dh", "kv_heads": "kv"}
    parts = [backend_name]
    for key, value in params.items():
        if key == "form":  # one form per backend: it never tells two variants of a backend apart
            continue
        if key == "variant":
            parts.append(str(value).replace("_", "-"))
        elif key == "dtype":
            parts.append(str(value))
        elif key in short:
            parts.append(f"{short[key]}{value}")
        elif isinstance(value, bool):
            if value:
                parts.append(key.replace("_", ""))
        else:
            parts.append(f"{key.replace('_', '')}{value}")
    return "-".join(parts)


def require(backend: AttentionBackend, *features: str) -> None:
    reason = supported(backend, features)
    if reason:
        raise CaseSkipped(reason)


#: the behaviours of the declared divergences being verified now (empty: the case runs strictly)
_DECLARED: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("declared", default=())
#: (largest error, bound) of each comparison a running case made (None outside :func:`comparisons_recorded`)
_COMPARISONS: contextvars.ContextVar[list | None] = contextvars.ContextVar("comparisons", default=None)


@contextlib.contextmanager
def comparisons_recorded():
    """Collect (largest error, bound) of every :func:`assert_close` made while the block runs, passed or failed:
    the runner keeps the comparison closest to its bound, so a user sees how near a passing variant came."""
    seen: list[tuple[float, float]] = []
    token = _COMPARISONS.set(seen)
    try:
        yield seen
    finally:
        _COMPARISONS.reset(token)


def record_comparison(error: float, bound: float) -> None:
    """Count one comparison of a case that compares without :func:`assert_close` (its largest finite error against
    its bound) for the runner's ``extra["bound"]`` and ``extra["error_to_bound"]``; nothing outside a run."""
    recorded = _COMPARISONS.get()
    if recorded is not None and bound > 0 and np.isfinite(error):
        recorded.append((float(error), float(bound)))


@contextlib.contextmanager
def verifying(*behaviours: str):
    """Run a case under declared behaviours (see :class:`mha_harness.Divergence`), every one a variant's
    declarations match at once (a float64 row with no key of a layer computing in float32: an empty-row output
    and a precision): precision declarations change the tolerance bound (the loosest of them), fully-masked-row
    declarations the reference, ``masked_poison`` what :func:`run` accepts from the backend."""
    from mha_harness.contract.reference import empty_rows_as
    from mha_harness.contract.tolerance import bound_of
    precisions = sorted((b.partition(":")[2] for b in behaviours if b.startswith("precision:")), key=EPS.get)
    with scoped(_DECLARED, tuple(behaviours)), contextlib.ExitStack() as stack:
        if precisions:
            stack.enter_context(bound_of(precisions[-1]))
        for behaviour in behaviours:
            kind, _, value = behaviour.partition(":")
            if kind == "fully_masked_rows":
                stack.enter_context(empty_rows_as(value))
        yield


def expected_fully_masked_rows() -> str:
    """What rows with every key masked must output now, in words: "zeros", or a declared alternative."""
    from mha_harness.contract.reference import empty_rows_convention
    return FULLY_MASKED_ROWS[empty_rows_convention()]


def _accept_masked_poison(loaded, params: AttentionParams, inputs: AttentionInputs, output: np.ndarray,
                          need_weights: bool) -> np.ndarray:
    """Under a declared ``masked_poison``: NaN/inf may come out only in batch items where a key/value held
    NaN/inf, or in rows with no key to attend at all (their output is the empty-row convention, which the
    fully-masked-rows and causal output cases hold to the zeros or the declared one); those rows are replaced by the
    backend's own output with those inputs made finite (zeros), so the case still checks that the masked positions
    do not leak."""
    key, value = np.asarray(inputs.key, np.float64), np.asarray(inputs.value, np.float64)
    poisoned = ~np.isfinite(key).all(axis=(1, 2)) | ~np.isfinite(value).all(axis=(1, 2))
    allowed, _ = allowed_and_bias(params, inputs)
    keyless = np.broadcast_to(~allowed.any(axis=-1).any(axis=1), output.shape[:2])  # (batch, Tq): no key in any head
    bad_rows = ~np.isfinite(output).all(axis=-1)
    stray = bad_rows & ~poisoned[:, None] & ~keyless
    if stray.any():
        b, t = (int(i) for i in np.argwhere(stray)[0])
        raise CaseFailure(f"declared masked_poison (NaN/inf from a masked key/value); got {output[b, t, 0]:.6g} at "
                          f"batch {b}, position {t}, where no key or value held NaN/inf")
    if not bad_rows.any():
        return output
    cleaned: dict[int, np.ndarray] = {}  # one cleaned array per distinct input: the input form (x, x_kv) is kept

    def clean(array):
        return cleaned.setdefault(id(array), np.where(np.isfinite(array), array, 0.0))
    finite = inputs.replace(query=clean(inputs.query), key=clean(inputs.key), value=clean(inputs.value))
    clean = np.asarray(loaded.forward(finite, need_weights=need_weights).output, np.float64)
    return np.where(bad_rows[..., None], clean, output)


def run(backend: AttentionBackend, params: AttentionParams, inputs: AttentionInputs, dtype: str,
        *, need_weights: bool = False, loaded=None) -> AttentionOutput:
    """Load ``params`` into the backend and run one forward. The output (and weights) arrive validated: real
    floating arrays of exactly the expected shapes (see :mod:`mha_harness.conformance.proxy`)."""
    require(backend, *inputs.features(), f"dtype:{dtype}")
    if need_weights:
        require(backend, "attention_weights")
    loaded = loaded or backend.load(params, dtype=dtype)
    out = loaded.forward(inputs, need_weights=need_weights)
    output = np.asarray(out.output)
    expected = (inputs.batch, inputs.tq, params.config.d_model)
    if output.shape != expected:
        raise CaseFailure(f"output shape: expected {expected}, got {output.shape}")
    output = output.astype(np.float64)
    if "masked_poison" in _DECLARED.get():
        output = _accept_masked_poison(loaded, params, inputs, output, need_weights)
    weights = None
    if need_weights:
        if out.weights is None:
            raise CaseFailure("weights: the backend declares attention_weights but returned None")
        weights = np.asarray(out.weights, np.float64)
        w_expected = (inputs.batch, params.config.num_heads, inputs.tq, inputs.tk)
        if weights.shape != w_expected:
            raise CaseFailure(f"weights shape: expected (batch, heads, Tq, Tk) = {w_expected}, got {weights.shape}")
    return AttentionOutput(output, weights)


def assert_close(actual: np.ndarray, expected: np.ndarray, tol: Tolerance, what: str,
                 labels=("batch", "position", "feature"), row_ids=None, own_output: bool = False) -> float:
    """Fail with location and size of the largest error when ``actual`` is outside ``tol`` of ``expected``; the
    message guesses a lower precision from an error of that size unless ``own_output`` (``expected`` is the
    backend's own earlier output, in the same dtype: no precision explains a change)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    nan_expected = np.isnan(expected)
    if "fully_masked_rows:nan" not in _DECLARED.get() and not np.all(np.isfinite(expected)):
        # the baseline is the backend's own earlier output in the invariance cases: NaN there is no excuse
        bad = tuple(int(i) for i in np.argwhere(~np.isfinite(expected))[0])
        where = ", ".join(f"{label} {i}" for label, i in zip(labels, bad))
        raise CaseFailure(f"{what}: expected finite values, got {expected[bad]} (in the output compared against) "
                          f"at {where}")
    if nan_expected.any():  # only while a declared fully_masked_rows:nan is verified
        wrong = nan_expected & ~np.isnan(actual)
        if wrong.any():
            bad = tuple(int(i) for i in np.argwhere(wrong)[0])
            where = ", ".join(f"{label} {i}" for label, i in zip(labels, bad))
            raise CaseFailure(f"{what}: expected NaN (declared), got {actual[bad]:.6g} at {where}")
        actual, expected = np.where(nan_expected, 0.0, actual), np.where(nan_expected, 0.0, expected)
    if not np.all(np.isfinite(actual)):
        bad = tuple(int(i) for i in np.argwhere(~np.isfinite(actual))[0])
        where = ", ".join(f"{label} {i}" for label, i in zip(labels, bad))
        raise CaseFailure(f"{what}: expected finite values, got {actual[bad]} at {where}")
    diff = np.abs(actual - expected)
    err = float(diff.max()) if diff.size else 0.0
    record_comparison(err, tol.bound)
    if err > tol.bound:
        idx = np.unravel_index(int(diff.argmax()), diff.shape)
        where = ", ".join(f"{label} {int(row_ids[i]) if (row_ids is not None and label == 'position') else int(i)}"
                          for label, i in zip(labels, idx))
        guess = "" if own_output else precision_level_hint(err, tol)
        raise CaseFailure(f"{what}: expected {expected[idx]:.6g}, got {actual[idx]:.6g} at {where}; "
                          f"max error {err:.3g} ({err / tol.bound:.3g} x the bound) exceeds {tol.describe()}"
                          f"{_rows_outside(diff, tol.bound, labels, row_ids)}{guess}", max_error=err, guess=guess)
    return err


def _rows_outside(diff: np.ndarray, bound: float, labels, row_ids=None, shown: int = 8) -> str:
    """Which (batch, position) rows of an output have an error past ``bound``, when only some do: a bug at a tile's
    boundary or at one position shows as a few rows (e.g. "0:31, 0:63"), a wrong scale as every row but those with
    one visible key (listed as the rows within, the fewer); "" for arrays other than (batch, position, feature)."""
    if diff.ndim != 3 or tuple(labels[:2]) != ("batch", "position"):
        return ""
    outside = (diff > bound).any(axis=-1)
    count, total = int(outside.sum()), outside.size
    if count == total:
        return f"; all {total} (batch, position) rows are outside it"
    listed = outside if 2 * count <= total else ~outside  # the fewer: the rows outside, or those within
    rows = [(int(b), int(row_ids[t]) if row_ids is not None else int(t)) for b, t in np.argwhere(listed)]
    text = ", ".join(f"{b}:{t}" for b, t in rows[:shown]) + (", ..." if len(rows) > shown else "")
    boundary = _at_block_boundary({t for _, t in rows}) if listed is outside else ""
    positions = np.asarray(row_ids) if row_ids is not None else np.arange(outside.shape[1])
    return (f"; {count} of {total} (batch, position) rows are outside it ("
            f"{'' if listed is outside else 'within it: '}batch:position {text}){boundary}"
            f"{_from_a_position(outside, positions, 'checked row' if row_ids is not None else 'row')}")


def _from_a_position(outside: np.ndarray, positions: np.ndarray, row: str = "row") -> str:
    """A clause when the rows outside are exactly those from one position on (in every batch item, at least two
    on each side): the error appears once a row sees enough keys, a limit on how far back a query looks or an error
    that grows with the row's length; "" otherwise (an outside user's sliding window of 4096 keys was told only of
    half precision at T = 8192)."""
    first = int(positions[outside.any(axis=0)].min())
    later = positions >= first
    if not np.array_equal(outside, np.broadcast_to(later, outside.shape)) or later.sum() < 2 or (~later).sum() < 2:
        return ""
    before = int(positions[~later].max())
    size = f"{first}" if before + 1 == first else f"{before + 1} to {first}"
    return (f"; every {row} up to position {before} is right and every {row} from {first} on is wrong: under a causal "
            f"mask a row there sees more keys, so a limit on how far back a query looks (a sliding window, a maximum "
            f"length or a positional table) that first changes the row at position {size}, or an error that grows "
            "with the number of keys a row sums (an accumulation in lower precision), shows so")


#: the block sizes a tiled kernel's rows are compared with when only some rows fail
_TILE_ROWS = (256, 128, 64, 32, 16)


def _at_block_boundary(positions: set[int]) -> str:
    """A clause when every failing position is the first or last row of a block of 16 to 256 rows (the largest such
    size): an error at a tiled kernel's block bound, as a causal key range one key short at each query block's
    first row; "" otherwise."""
    for size in _TILE_ROWS:
        if all(t > 0 and t % size == 0 for t in positions):
            return (f"; every row outside it is the first of a {size}-row block: if the kernel is tiled, check the "
                    "bounds at a block's start (the keys a block's first query may see)")
        if all((t + 1) % size == 0 for t in positions):
            return (f"; every row outside it is the last of a {size}-row block: if the kernel is tiled, check the "
                    "bounds at a block's end")
    return ""


#: a float64 error at least this fraction of the float32 bound is float32-sized: a float32 computation errs by about
#: a third of that bound (the naive float32 error), a float64 one by ~2^-29 of it, so the two never meet here
FLOAT32_LEVEL_FRACTION = 1e-3


#: what a float64 failure within the float32 bound says (:func:`precision_level_hint`)
FLOAT32_SIZED = "the float64 call computes in float32 somewhere"
#: what a failure of half precision's size says, after "the <dtype> call" (:func:`_half_level_hint`)
HALF_SIZED = "may compute in float16 or bfloat16 somewhere"


def precision_diagnosis(guess: str) -> str:
    """A failure's guess of a lower precision (:func:`precision_level_hint`) in one line without its numbers, so
    that the variants it explains share one line of the summary's "diagnosed:" (an outside user's float32 kernel
    had its hint in each of 20 failures and none in the summary); "" for no guess."""
    if FLOAT32_SIZED in guess:
        return ("float64 calls err by float32's size: the layer computes in float32 somewhere; compute in float64, "
                "or declare precision_divergences(\"float64\", \"float32\", \"why\", cases=[...]) naming the failing "
                "cases")
    half = re.search(rf"the (\w+) call {HALF_SIZED}", guess)
    if half:
        return (f"{half[1]} calls err by half precision's size: the layer {HALF_SIZED}, or changes its scores by "
                "design (the failures say more)")
    return ""


def precision_level_hint(err: float, tol: Tolerance) -> str:
    """A message suffix when a float64 run misses its bound with an error of float32 size: within the float32 bound
    of the same call (both terms of the rule scale with the unit roundoff) and not a float64 rounding difference
    (at least FLOAT32_LEVEL_FRACTION of that bound): somewhere it computes in float32. A float32 run's error, or a
    float64 run's past the float32 bound, of half precision's size gets :func:`_half_level_hint`."""
    if tol.dtype not in ("float64", "float32"):
        return ""
    float32_bound = tol.bound * EPS["float32"] / EPS["float64"]
    if tol.dtype == "float32" or err > float32_bound:
        return _half_level_hint(err, tol)
    if err < FLOAT32_LEVEL_FRACTION * float32_bound:
        return ""
    return (f"; the error is within the float32 bound ({float32_bound:.3g}): {FLOAT32_SIZED} (a cast of the inputs "
            "or weights, a float32 softmax or RMSNorm (Hugging Face's q/k "
            "norms compute in float32), a float32 table the layer builds itself such as rotary cos/sin; in JAX, "
            "float64 needs jax_enable_x64, which mha_harness.configure_jax() sets); compute in float64, or declare it: "
            "divergences = precision_divergences(\"float64\", \"float32\", \"why\", cases=[...]) from "
            "mha_harness.toolkit.divergences, naming every case the summary's 'failing cases:' line lists for it")


def _half_level_hint(err: float, tol: Tolerance) -> str:
    """A message suffix when a float32 (or float64) run misses its bound with an error of half precision's size:
    within the float16 bound of the same call and at least FLOAT32_LEVEL_FRACTION of it (a float32 rounding
    difference is about 1e-4 of it): it may compute in half precision somewhere (a stranger's JAX layer took its
    softmax in bfloat16 and got numbers only). Which half dtype is not told: a bfloat16 softmax alone errs within
    the float16 bound; a wrong scale or mask errs far past it. Worded as a possibility: a small bug of another kind
    can err by as much."""
    float16_bound = tol.bound * EPS["float16"] / EPS[tol.dtype]
    if not FLOAT32_LEVEL_FRACTION * float16_bound <= err <= float16_bound:
        return ""
    return (f"; the error is of half precision's size (within the float16 bound {float16_bound:.3g}): the "
            f"{tol.dtype} call {HALF_SIZED} (a "
            "half-precision cast of the inputs, weights or scores, a softmax or accumulation in half precision); "
            f"compute in {tol.dtype}, or, if the kernel does so by design, declare it: divergences = "
            f"precision_divergences(\"{tol.dtype}\", \"bfloat16\", \"why\", cases=[...]) from "
            "mha_harness.toolkit.divergences (the dtype it computes in; every case the summary's 'failing cases:' "
            "line lists for it); a size alone cannot tell this from scores "
            "the layer changes by design (a norm on q or k, a scale of its own, rotary frequencies rescaled by "
            "another factor: docs/plugins.md, 'Layers that "
            "cannot run every call') or from a bug that moves this call's scores little (at one head an ALiBi "
            "slope is 1/256: a bias added after the softmax), which a precision declaration would hide")


def scores_hint(got: np.ndarray, params: AttentionParams, inputs: AttentionInputs, bound: float,
                compare: np.ndarray | None = None) -> str:
    """What changed the scores of a failed whole output ``got``: a q/k norm gone wrong, or one in a layer built
    without it (:func:`~mha_harness.contract.qk_norm_diagnoses.qk_norm_hint`), or a soft cap or scale fitted to
    it (:func:`~mha_harness.conformance.diagnoses.scores_fit_hint`), whichever reproduces it closer (under large
    logits a norm kept on was fitted as a scale of 0.001, and an undeclared cap came within the margin of a norm);
    ``compare``: the (batch, Tq) rows that are specified; "" when none."""
    norm = qk_norm_match(got, params, inputs, bound, compare)
    fit = scores_mismatch_fit(got, params, inputs, bound, compare=compare)
    found = [f for f in (norm, fit) if f is not None]
    return min(found, key=lambda f: f[1])[0] if found else ""


def scores_fit_named(failure: CaseFailure, got: np.ndarray, params: AttentionParams, inputs: AttentionInputs,
                     bound: float, compare: np.ndarray | None = None) -> CaseFailure:
    """``failure`` with what changed the scores of its whole output ``got`` named (:func:`scores_hint`) and its
    guess of a precision dropped; unchanged when nothing fits."""
    hint = scores_hint(got, params, inputs, bound, compare)
    return failure.with_hint(hint) if hint else failure


def check_against_reference(backend: AttentionBackend, params: AttentionParams, inputs: AttentionInputs,
                            dtype: str, what: str = "output", rows=None,
                            hint: Callable[[np.ndarray], str] | None = None, got: np.ndarray | None = None) -> float:
    """Run the backend and compare its output (or the sampled ``rows``) with the reference. On a failure,
    ``hint(output)`` (the compared output, float64) is appended to the message: what known mistake it matches.
    ``got``: the backend's output for these inputs, when the caller already has it from ``run`` (not run again)."""
    got = run(backend, params, inputs, dtype).output if got is None else got
    if rows is not None:
        got = got[:, rows]
    expected, tol = tolerance_for(params, inputs, dtype, rows=rows)
    return assert_output_close(backend, params, inputs, dtype, got, expected, tol, what, rows, hint)


def assert_output_close(backend: AttentionBackend, params: AttentionParams, inputs: AttentionInputs, dtype: str,
                        got: np.ndarray, expected: np.ndarray, tol: Tolerance, what: str = "output", rows=None,
                        hint: Callable[[np.ndarray], str] | None = None) -> float:
    """:func:`assert_close` for a backend's output, whose failure also names the known mistake the output matches
    (:func:`common_mistake`, then ``hint(got)``; neither inside
    :func:`~mha_harness.conformance.diagnosing.undiagnosed`); returns the worst error."""
    try:
        return assert_close(got, expected, tol, what, row_ids=rows)
    except CaseFailure as failure:
        if not diagnosing():
            raise
        extra = common_mistake(backend, params, inputs, dtype, got, expected, tol, rows) + (hint(got) if hint else "")
        if not extra:
            raise
        raise failure.with_hint(extra) from None


_ATTENDS_BEFORE_WRITING = ("; the second call is right: the step attends before it writes x_new's keys and values "
                           "into the cache, so the first call's new queries saw the cache's empty slots (write, "
                           "then attend)")
_NOT_THE_SAME_SLOTS = ("; the first call is right: a later step no longer attends over the same positions (it "
                       "writes past the last Tq slots, or adds into the cache instead of overwriting them, or a cache "
                       "grown by concatenation, torch.cat([past_k, k_new]), is kept as the next call's past: each "
                       "call starts from the same filled past)")


def assert_decode_step_close(backend: AttentionBackend, params: AttentionParams, inputs: AttentionInputs, dtype: str,
                             first: np.ndarray, second: np.ndarray) -> float:
    """Fail unless the first and the second call of a decode step for the KV-cache call ``inputs`` both return the
    float64 reference's output: wrong on the first call only is a step that attends before it writes, on the second
    only one that does not write the same slots each call, on both the step's own bug, named where it matches a
    known mistake (:func:`common_mistake`: the alignment, tiled K/V heads, a wrong scale ...). Returns the worst
    error."""
    expected, tol = tolerance_for(params, inputs, dtype)
    errors: dict[str, Any] = {}
    for call, got in (("first", first), ("second", second)):
        try:
            errors[call] = assert_close(got, expected, tol, f"decode step, {call} call")
        except CaseFailure as failure:
            errors[call] = failure
    failed = [call for call, e in errors.items() if isinstance(e, CaseFailure)]
    if failed == ["first"]:
        raise errors["first"].with_hint(_ATTENDS_BEFORE_WRITING)
    if failed == ["second"]:
        raise errors["second"].with_hint(_NOT_THE_SAME_SLOTS)
    if failed:
        return assert_output_close(backend, params, inputs, dtype, first, expected, tol, "decode step, first call")
    return max(errors.values())


def common_mistake(backend: AttentionBackend, params: AttentionParams, inputs: AttentionInputs, dtype: str,
                   got: np.ndarray, expected: np.ndarray, tol: Tolerance, rows=None) -> str:
    """The known mistake a failing output ``got`` matches, as a sentence to append to the failure ('' when none):
    biases added by a bias-free layer (the layer called again with every input zero), an output off by one
    constant vector, and on whole outputs (``rows`` None) a wrong score scale, a known wrong layer
    (:func:`~mha_harness.conformance.diagnoses.layer_mistake`: heads split by tokens, heads concatenated
    feature-major, a softmax over the queries, no W_o), a q/k-norm mistake
    (:func:`~mha_harness.contract.qk_norm_diagnoses.qk_norm_hint`), a rotary mistake
    (:func:`~mha_harness.contract.rotary_diagnoses.rotary_hint`), a sliding-window mistake
    (:func:`~mha_harness.contract.window_diagnoses.window_hint`), an ALiBi mistake
    (:func:`~mha_harness.contract.alibi_diagnoses.alibi_hint`) or a mask mistake
    (:func:`~mha_harness.conformance.diagnoses.mask_mistake`, its wrong calls' rows without a key under the empty-row
    convention the backend follows), else right only where a row sees a single key
    (:func:`~mha_harness.conformance.diagnoses.single_key_rows_hint`). '' inside
    :func:`~mha_harness.conformance.diagnosing.undiagnosed`."""
    if not diagnosing():
        return ""
    stray = "" if params.config.bias else zero_input_hint(backend, params, inputs, dtype)
    offset = stray or constant_offset_hint(got, expected, params.config.bias)
    if offset or rows is not None:  # the others cost reference calls: only when no bias diagnosis came first, on
        return offset               # whole outputs
    got = np.asarray(got, np.float64)
    return (_scale_or_qk_norm_hint(got, params, inputs, tol.bound) or layer_mistake(got, params, inputs, tol.bound)
            or qk_norm_hint(got, params, inputs, tol.bound) or rotary_hint(got, params, inputs, tol.bound)
            or window_hint(got, params, inputs, tol.bound) or alibi_hint(got, params, inputs, tol.bound)
            or mask_mistake(got, params, inputs)
            or cache_order_hint(got, params, inputs) or cache_kv_swapped_hint(got, params, inputs)
            or scores_fit_hint(got, params, inputs, tol.bound)
            or single_key_rows_hint(got, expected, tol.bound, params, inputs))


def _scale_or_qk_norm_hint(got: np.ndarray, params: AttentionParams, inputs: AttentionInputs, bound: float) -> str:
    """A wrong score scale (:func:`scale_match`), or, where a q/k-norm mistake also matches, the closer of the two
    (in half precision a LayerNorm kept on in a layer built without one came within a 1/sqrt(d_model) scale's margin
    at d_head 64 and 80, and was named a scale); "" when no scale matches."""
    scale = scale_match(got, params, inputs, bound)
    if scale is None:
        return ""
    norm = qk_norm_match(got, params, inputs, bound)
    return norm[0] if norm is not None and norm[1] < scale[1] else scale[0]


def wrong_scale(got: np.ndarray, params: AttentionParams, inputs: AttentionInputs, bound: float) -> str | None:
    """The common score scale (1/sqrt(d_head), 1/sqrt(d_model), none, 1/d_head, 1/d_model) other than the one the
    reference holds (:func:`~mha_harness.contract.reference.score_scale_as`) whose float64 output ``got`` matches
    within ``max(10 * bound, 1e-3)`` and explains better than the right scale and uniform weights do
    (:func:`~mha_harness.contract.mistakes.explains_as_a_scale`), or None when it matches none of them."""
    found = _wrong_scale(got, params, inputs, bound)
    return None if found is None else found[0]


def _wrong_scale(got, params, inputs, bound) -> tuple[str, float] | None:
    """:func:`wrong_scale`'s label and its factor over the scale the reference holds."""
    found = _wrong_scale_match(got, params, inputs, bound)
    return None if found is None else found[:2]


def _wrong_scale_match(got, params, inputs, bound) -> tuple[str, float, float] | None:
    """:func:`wrong_scale`'s label, its factor over the scale the reference holds and its output's distance from
    ``got``."""
    scales = wrong_scales(params.config, score_scale_declared())
    if not np.all(np.isfinite(got)) or not scales:
        return None
    outputs = {f: reference_attention(with_score_scale(params, f), inputs).output for f in scales}
    factor, wrong = min(outputs.items(), key=lambda item: float(np.max(np.abs(got - item[1]))))
    if float(np.max(np.abs(got - wrong))) > max(bound * 10, 1e-3):
        return None
    truth = reference_attention(params, inputs).output
    uniform = reference_attention(with_score_scale(params, 0.0), inputs).output
    return (scales[factor], factor, distance(got, wrong)) if explains_as_a_scale(got, wrong, truth, uniform) else None


def scale_hint(got: np.ndarray, params: AttentionParams, inputs: AttentionInputs, bound: float) -> str:
    """The diagnosis of an output right for another of the common score scales (:func:`wrong_scale`) than the one
    the layer declares (1/sqrt(d_head) unless declared otherwise); "" if none. An undeclared unscaled or 1/d_head
    scale also says how to declare a layer built with it on purpose (T5, muP)."""
    found = scale_match(got, params, inputs, bound)
    return "" if found is None else found[0]


def scale_match(got: np.ndarray, params: AttentionParams, inputs: AttentionInputs, bound: float
                ) -> tuple[str, float] | None:
    """:func:`scale_hint`'s sentence and its candidate's distance from ``got``, for choosing between it and another
    diagnosis; None when no other scale matches."""
    found = _wrong_scale_match(got, params, inputs, bound)
    if found is None:
        return None
    label, factor, far = found
    return scale_sentence(label, factor, params), far


def zero_input_hint(backend: AttentionBackend, params: AttentionParams, inputs: AttentionInputs, dtype: str) -> str:
    """The diagnosis of a layer that adds biases although the config has none: with every input zero, attention
    without biases outputs exactly 0 (zero queries, keys and values, whatever the weights and masks), so any
    finite nonzero output is a bias. Calls the backend once more, only for a failure; "" when the call fails or
    its output is 0."""
    zeroed = _with_query(inputs, np.zeros_like(inputs.query))  # with one x, also the keys and values
    if inputs.form != "self":
        zk = np.zeros_like(inputs.key)
        zeroed = zeroed.replace(key=zk, value=zk if inputs.key is inputs.value else np.zeros_like(inputs.value))
    try:
        out = np.asarray(run(backend, params, zeroed, dtype).output, np.float64)
    except Exception:  # noqa: BLE001 - a diagnosis only: the failure is reported as it is
        return ""
    finite = np.abs(out[np.isfinite(out)])
    if finite.size == 0 or finite.max() == 0:
        return ""
    return (f"; with every input zero the layer outputs values up to {finite.max():.3g}, where attention without "
            "biases outputs exactly 0: it adds biases although the config has none (bias=False); load zeros into "
            "the module's biases, or build it without them")


def constant_offset_hint(got: np.ndarray, expected: np.ndarray, bias: bool) -> str:
    """The diagnosis of an output that is off by one vector, the same at every batch item and position: a constant
    added after the softmax (weights sum to 1, so a value-projection bias comes out whole, as an output bias does);
    "" when the difference is not such a constant. ``got`` and ``expected`` are (batch, T, d_model)."""
    diff = np.asarray(got, np.float64) - np.asarray(expected, np.float64)
    positions = diff.reshape(-1, diff.shape[-1])
    if positions.shape[0] < 2 or not np.isfinite(positions).all():
        return ""
    rows = np.asarray(expected, np.float64).reshape(positions.shape)
    if float(np.abs(rows - rows.mean(axis=0)).max()) <= 1e-3 * float(np.abs(rows).max()):
        return ""  # every position's right output is the same: any wrong one is off by one vector, a sign of nothing
    offset = positions.mean(axis=0)
    size = float(np.abs(offset).max())
    if size == 0 or float(np.abs(positions - offset).max()) > 1e-3 * size:
        return ""
    advice = ("the config has no biases (bias=False): the layer must add none, so load zeros into its biases or "
              "build it without them" if not bias else "check that b_v and b_o are loaded where they belong")
    return (f"; the output is off by one vector, the same at every position (up to {size:.3g}): a constant added "
            f"after the softmax, as a value or output projection bias does; {advice}")


@dataclass
class Measurement:
    """What a case may return besides pass/fail."""

    max_error: float | None = None
    observed: str | None = None
    extra: dict = field(default_factory=dict)


def _with_query(inputs, query):
    """``inputs`` with a new query, keeping the form: with one x the same array is also key and value; in a
    KV-cache call x_kv's last Tq rows take a query of the same shape (one of another shape is malformed on its
    own, which validation names)."""
    if inputs.form == "self":
        return inputs.replace(query=query, key=query, value=query)
    if inputs.form == "kv_cache" and np.shape(query) == np.shape(inputs.query):
        return as_kv_cache_call(inputs.replace(query=query))
    return inputs.replace(query=query)


def bad_calls(inputs: AttentionInputs) -> list[tuple[str, str, AttentionInputs]]:
    """Malformed calls built from well-formed ``inputs`` (batch >= 2, Tq >= 3, Tk >= 2), each in the inputs' form:
    (the parameter the error message must name, a description, the modified inputs). The last one of a one-x or
    shared-K/V form, separate arrays (parameter ``inputs``), is malformed only for a backend that declares that
    form, not for a separate-form backend called with one x (as the search calls it)."""
    q, k, v, form = inputs.query, inputs.key, inputs.value, inputs.form
    nan_query = np.where(np.arange(q.shape[1])[None, :, None] == 2, np.nan, q)
    calls = [
        ("query", "query of width d_model + 1", _with_query(inputs, np.concatenate([q, q[..., :1]], -1))),
        ("query", "query of rank 2", _with_query(inputs, q[0])),
        ("query", "empty query sequence", _with_query(inputs, q[:, :0])),
        ("query", "NaN in the query", _with_query(inputs, nan_query)),
        ("key_padding_mask", "key_padding_mask of the wrong shape",
         inputs.replace(key_padding_mask=np.zeros((1, 3), bool))),
        ("key_padding_mask", "float key_padding_mask", inputs.replace(key_padding_mask=np.zeros(k.shape[:2]))),
        ("attn_mask", "attn_mask of the wrong shape", inputs.replace(attn_mask=np.ones((2, 2), bool))),
        ("attn_mask", "integer attn_mask", inputs.replace(attn_mask=np.ones((q.shape[1], k.shape[1]), np.int64))),
        ("causal", "causal='diagonal'", inputs.replace(causal="diagonal")),
    ]
    if form == "separate":
        calls += [("key", "key with another batch size", inputs.replace(key=k[:1], value=v[:1])),
                  ("value", "value shorter than key", inputs.replace(value=v[:, :-1]))]
    if form == "shared_kv":
        calls.append(("key", "x_kv with another batch size", inputs.replace(key=k[:1], value=k[:1])))
    if form != "separate":  # a form the backend did not declare is refused by validation, naming inputs
        calls.append(("inputs", "separate query/key/value arrays", inputs.replace(key=k.copy(), value=v.copy() + 1)))
    return calls


def bad_call_problem(loaded, parameter: str, description: str, bad: AttentionInputs) -> str | None:
    """None when ``loaded.forward(bad)`` raises ValueError/TypeError naming ``parameter``, else what went wrong."""
    try:
        loaded.forward(bad)
    except (ValueError, TypeError) as exc:
        if parameter not in str(exc):
            return f"{description}: raised {type(exc).__name__}({exc}) which does not name {parameter!r}"
        return None
    except Exception as exc:  # noqa: BLE001 - any other exception is the finding
        return f"{description}: raised {type(exc).__name__} instead of ValueError/TypeError: {exc}"
    return f"{description}: accepted silently (no error)"


def parameter_count_problem(shapes: Mapping[str, Any], config) -> str | None:
    """None when the parameter ``shapes`` a backend allocates for ``config`` number its expected count."""
    count = int(sum(int(np.prod(s)) for s in shapes.values()))
    expected = config.expected_parameter_count()
    if count == expected:
        return None
    listing = ", ".join(f"{k}{tuple(v)}" for k, v in shapes.items())
    return (f"parameter count: expected {expected} for d_model={config.d_model}, heads={config.num_heads}, "
            f"kv_heads={config.kv_heads}, bias={config.bias}"
            + (f", qk_norm={config.qk_norm!r}" if config.qk_norm else "")
            + f"; the backend allocates {count} ({listing})")


def assert_gradients_close(got: Mapping[str, np.ndarray], exact: Mapping[str, np.ndarray],
                           naive: Mapping[str, np.ndarray] | Sequence[Mapping[str, np.ndarray]], dtype: str,
                           length: int, terms: Mapping[str, np.ndarray] | None = None) -> float:
    """Every gradient in ``exact`` present in ``got`` with its shape and within the tolerance rule applied to the
    naive backward in ``dtype`` (reductions of ``length`` terms); returns the worst error.

    ``naive``: one same-dtype backward, or several valid ones (:func:`naive_gradients`: the textbook backward and
    FlashAttention's), each gradient's bound then from the one farthest from ``exact``. ``terms``: the size of
    what each gradient's computation sums (:func:`input_gradient_terms` of
    :func:`~mha_harness.contract.reference.reference_vjp_magnitudes`, in the same form as ``exact``), which the
    floor scales with; without it, |exact| (too tight where the softmax backward
    cancels: correct backends then fail by a few times the bound)."""
    estimates = [naive] if isinstance(naive, Mapping) else list(naive)
    return _assert_within(got, gradient_bounds(exact, estimates, dtype, length, terms))


def _assert_within(got: Mapping[str, np.ndarray], bounds: Mapping[str, tuple]) -> float:
    """Every gradient of ``bounds`` (name -> (reference, tolerance)) present in ``got`` with its shape and within its
    tolerance; returns the worst error, raises CaseFailure naming the gradient."""
    worst = 0.0
    for name, (expected, tol) in bounds.items():
        actual = _gradient_of(got, name, expected.shape)
        labels = ("batch", "position", "feature") if expected.ndim == 3 else ("row", "column")[:expected.ndim]
        worst = max(worst, assert_close(actual, expected, tol, f"gradient of {name}", labels=labels))
    return worst


def _gradient_of(got: Mapping[str, np.ndarray], name: str, shape: tuple) -> np.ndarray:
    """The backend's gradient ``name`` as float64, failing the case when it is missing or has another shape."""
    if name not in got:
        raise CaseFailure(f"gradients: the backend returned no gradient for {name}; returned {sorted(got)}")
    actual = np.asarray(got[name], np.float64)
    if actual.shape != shape:
        raise CaseFailure(f"gradient of {name}: expected shape {shape}, got {actual.shape}")
    return actual


def forward_also_wrong(forward: Callable[[], np.ndarray] | None, params: AttentionParams, inputs: AttentionInputs,
                       dtype: str, cotangent: np.ndarray) -> str:
    """A sentence for a gradient failure when the same call's forward output (``forward()``, run on a failure only)
    is outside its tolerance too, on the rows the ``cotangent`` weighs (a padded query's output, which a gradient
    case leaves unspecified, is not compared), with the rotary mistake, other score scale or soft cap it matches (a
    YaRN layer without its attention factor is also a layer with scores scaled by its inverse square: the rotary
    mistake is named first, as the output cases name it): the gradients
    follow the forward, so the backward is not to blame first; "" when the forward is right, not given, or cannot
    be run (a diagnosis only)."""
    if forward is None:
        return ""
    try:
        weighed = np.any(cotangent != 0, axis=-1)  # (batch, Tq)
        whole = np.asarray(forward(), np.float64)
        output = whole[weighed]
        expected, tol = tolerance_for(params, inputs, dtype)
        error = float(np.max(np.abs(output - expected[weighed]), initial=0.0)) if np.all(np.isfinite(output)) \
            else np.inf
        named = ""
        if error > tol.bound:  # a rotary mistake or another score scale (on whole outputs), else another soft cap,
            # else a mask mistake (an outside user's padding mask applied to the first Tq keys only)
            named = ((rotary_hint(whole, params, inputs, tol.bound) or scale_hint(whole, params, inputs, tol.bound)
                      if weighed.all() else "") or scores_hint(whole, params, inputs, tol.bound, compare=weighed)
                     or mask_mistake(whole, params, inputs, rows=weighed))
    except Exception:  # noqa: BLE001 - a diagnosis only: the failure is reported as it is
        return ""
    if error <= tol.bound:
        return ""
    where = ("" if named else f" (this call: {describe_call('forward', inputs)}; where the output and mask cases "
             "pass, the forward is wrong at this shape or with these masks only)")
    return (f"the forward's output for this call is wrong too (max error {error:.3g}, bound {tol.bound:.3g}"
            f"{named.replace('; ', ': ', 1)}): the gradients follow it, so fix the forward first{where}")


def gradient_mistake_hint(got: Mapping[str, np.ndarray], params: AttentionParams, inputs: AttentionInputs,
                          cotangent: np.ndarray, dtype: str, form: str,
                          forward: Callable[[], np.ndarray] | None = None) -> tuple[str, str]:
    """For a case that found a backward wrong by another property (a gradient where the causal mask says exactly 0):
    what the same call's gradients get wrong against the reference, as ``(hint, diagnosis)`` for
    :meth:`CaseFailure.with_hint` -- which gradients are wrong and which right, where that places the error, the
    known mistake that explains them (:func:`~mha_harness.conformance.gradient_diagnoses.gradient_hint`), or that
    the call's forward output (``forward()``) is wrong too (:func:`forward_also_wrong`); the diagnosis is "" when
    the hint names no mistake; ``("", "")`` when every gradient is within the tolerance or the comparison cannot be
    made (a diagnosis only)."""
    try:
        bounds = gradient_tolerances(params, inputs, cotangent, dtype, form)
        try:
            _assert_within(got, bounds)
            return "", ""
        except CaseFailure:
            return _gradient_diagnosis(got, params, inputs, cotangent, dtype, form, bounds, forward)
    except Exception:  # noqa: BLE001 - a diagnosis only: the failure is reported as it is
        return "", ""


def assert_gradients_match_reference(got: Mapping[str, np.ndarray], params: AttentionParams, inputs: AttentionInputs,
                                     cotangent: np.ndarray, dtype: str, form: str,
                                     forward: Callable[[], np.ndarray] | None = None,
                                     diagnose: bool = True) -> float:
    """A backend's gradients ``got`` (for ``sum(output * cotangent)``, per argument of its declared input ``form``)
    against the reference under the tolerance rule
    (:func:`~mha_harness.contract.expected.gradient_tolerances`); returns the worst error, raises CaseFailure naming
    the gradient and what the backward got wrong
    (:func:`~mha_harness.conformance.gradient_diagnoses.gradient_hint`; not with ``diagnose=False`` nor inside
    :func:`~mha_harness.conformance.diagnosing.undiagnosed`, as in a strict run whose failure a declared divergence
    will be verified on)."""
    bounds = gradient_tolerances(params, inputs, cotangent, dtype, form)
    try:
        return _assert_within(got, bounds)
    except CaseFailure as failure:
        if not diagnose or not diagnosing():
            raise
        raise failure.with_hint(*_gradient_diagnosis(got, params, inputs, cotangent, dtype, form, bounds,
                                                     forward)) from None


def _gradient_diagnosis(got: Mapping[str, np.ndarray], params: AttentionParams, inputs: AttentionInputs,
                        cotangent: np.ndarray, dtype: str, form: str, bounds: Mapping[str, tuple],
                        forward: Callable[[], np.ndarray] | None) -> tuple[str, str]:
    """:func:`~mha_harness.conformance.gradient_diagnoses.gradient_hint` of gradients that failed ``bounds``, with
    the call's forward output checked (:func:`forward_also_wrong`) only where a backward mistake would be named."""
    return gradient_hint(got, params, inputs, cotangent, form, bounds,
                         lambda: forward_also_wrong(forward, params, inputs, dtype, cotangent))


