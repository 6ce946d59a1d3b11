"""The backend a conformance case sees: a proxy whose calls go to wherever the plugin's code runs.

Cases, the float64 reference, the tolerance and the comparison run in the harness's process; every call that
runs plugin code (load, forward, vjp, decode_step, native_parameter_shapes) goes through a *transport*: the
backend's own worker process (:mod:`mha_harness.conformance.isolation`), or this process when isolation is off
(:class:`InProcess`, which cannot protect the verdict from a plugin that patches NumPy or the harness).

What comes back is validated here before any case looks at it: the output, weights and gradients must be
NumPy arrays of a real floating dtype (complex, integer, bool or object output is a failure that says so;
nothing is cast silently) and of exactly the expected shape.
"""
from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import traceback
from typing import Any

import numpy as np

from mha_harness.conformance.casekit import CaseFailure, describe_call
from mha_harness.contract.api import (
    AttentionBackend,
    AttentionConfig,
    AttentionInputs,
    AttentionOutput,
    AttentionParams,
    LoadedAttention,
    Unsupported,
)
from mha_harness.util.wire import UnsendableArray


class PluginError(Exception):
    """An exception the plugin raised where it runs (its worker), brought back as its type name and message."""

    def __init__(self, type_name: str, message: str, where: str = ""):
        super().__init__(f"{type_name}: {message}")
        self.type_name, self.where = type_name, where


class WorkerLost(BaseException):
    """The worker gave no answer (timeout, death, garbage). A BaseException so no case code can swallow it."""

    def __init__(self, status, message: str):
        super().__init__(message)
        self.status = status


#: exception kinds whose class a case may rely on (bad input must raise ValueError/TypeError; a failure found where
#: the plugin runs, such as a write into its inputs, fails the case)
_KINDS = (("unsupported", Unsupported), ("value", ValueError), ("type", TypeError),
          ("notimplemented", NotImplementedError), ("failure", CaseFailure))


def describe_exception(exc: BaseException) -> dict:
    """Any exception, even a hostile one (a ``__str__`` that raises), as plain data."""
    try:
        message = str(exc)
    except BaseException:  # noqa: BLE001
        message = "<unprintable message>"
    tb = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ else []
    kind = next((k for k, cls in _KINDS if isinstance(exc, cls)), "other")
    return {"type": type(exc).__name__, "message": message, "kind": kind,
            "where": f"{tb[-1].filename}:{tb[-1].lineno}" if tb else ""}


def raise_described(error: dict) -> None:
    """Raise, in the harness, the exception a worker described: the builtin class a case may catch, else PluginError."""
    kind, type_name, message = error.get("kind"), str(error.get("type")), str(error.get("message"))
    cls = dict(_KINDS).get(kind)
    if cls is None:
        exc = PluginError(type_name, message, str(error.get("where", "")))
    else:
        exc = cls(message if type_name == cls.__name__ else f"{type_name}: {message}")
        exc.where = str(error.get("where", ""))
    raise exc


def as_array(value, what: str = "output") -> Any:
    """The backend's array as NumPy without any dtype conversion (a tensor converts through its __array__). A value
    with no dtype of its own (a Python list, tuple or number, whose dtype NumPy would choose) is refused: converting
    it would cast silently."""
    if value is None or isinstance(value, (np.ndarray, UnsendableArray)):
        return value
    if not hasattr(value, "dtype"):
        raise TypeError(f"{what}: got {type(value).__name__}; accepted: a NumPy array (or an array with its own "
                        "dtype, such as a JAX array, which converts keeping it); a Python "
                        f"{type(value).__name__} would take the dtype NumPy chooses for it: a silent cast")
    return np.asarray(value)


def step_output(loaded, value, what: str):
    """A decode step's returned ``value`` as the loaded layer's ``decode_step_output`` reads it, copied (a step may
    return a buffer it reuses); None is refused naming the step."""
    if value is None:
        raise TypeError(f"{what}: the step returned None; accepted: the step's output (batch, Tq, d_model), "
                        "returned by each call")
    got = as_array(loaded.decode_step_output(value), what)
    return got.copy() if isinstance(got, np.ndarray) else got


def current_context() -> dict:
    """The harness settings a call must carry to where the plugin runs (the validation rule the case chose)."""
    from mha_harness.contract.validation import _CAUSAL_FUTURE_POISON
    return {"causal_future_poison": bool(_CAUSAL_FUTURE_POISON.get())}


@contextlib.contextmanager
def harness_context(context: dict | None):
    """Re-establish, where the plugin runs (a worker, or :class:`InProcess`'s fresh context), the settings
    :func:`current_context` captured: the only ones of the case's that reach the plugin's code."""
    from mha_harness.contract.validation import causal_future_poison_allowed
    with contextlib.ExitStack() as stack:
        if context and context.get("causal_future_poison"):
            stack.enter_context(causal_future_poison_allowed())
        yield


def _arrays_of(value) -> dict[str, np.ndarray]:
    """The NumPy arrays a call hands the plugin, by name: the fields of an AttentionInputs or AttentionParams, or
    the array itself."""
    if isinstance(value, np.ndarray):
        return {"": value}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: a for f in dataclasses.fields(value) if isinstance(a := getattr(value, f.name), np.ndarray)}
    return {}


@contextlib.contextmanager
def left_unchanged(call: str, **handed):
    """Fail the case when the plugin's ``call`` writes into an array it was handed: a layer that modifies its
    caller's tensors (an in-place scale of the query, W_q folded in place at load) breaks the model around it,
    and where the plugin runs in the harness's process it would change the arrays the verdict is computed from."""
    kept, seen = [], set()
    for arg, value in handed.items():
        for name, array in _arrays_of(value).items():
            if id(array) not in seen:  # one x is query, key and value: copied and compared once
                seen.add(id(array))
                kept.append((arg, name, array, array.tobytes()))
    yield
    for arg, name, array, data in kept:
        if array.tobytes() != data:
            raise CaseFailure(f"{call} wrote into its {arg}{'.' + name if name else ''}: a layer must leave the arrays "
                              "it is given as they were (copy before an in-place operation)")


class Server:
    """Runs the plugin's side of each call on the real backend object; used inside the worker and in-process."""

    def __init__(self, backend: AttentionBackend):
        self.backend = backend
        self.loaded: dict[int, Any] = {}

    def load(self, params: AttentionParams, dtype: str) -> int:
        handle = len(self.loaded)
        with left_unchanged("load", params=params):
            self.loaded[handle] = self.backend.load(params, dtype=dtype)
        return handle

    def forward(self, handle: int, inputs: AttentionInputs, need_weights: bool, context: dict | None = None) -> dict:
        with harness_context(context), left_unchanged("forward", inputs=inputs):
            out = self.loaded[handle].forward(inputs, need_weights=need_weights)
        if not hasattr(out, "output"):
            hint = " (a compute without a return statement gives None)" if out is None else ""
            raise TypeError(f"forward: {type(self.loaded[handle]).__name__} returned {type(out).__name__}{hint}; "
                            "accepted: mha_harness.AttentionOutput(output, weights)")
        return {"output": as_array(out.output, "forward: AttentionOutput.output"),
                "weights": as_array(getattr(out, "weights", None), "forward: AttentionOutput.weights")}

    def vjp(self, handle: int, inputs: AttentionInputs, cotangent: np.ndarray, context: dict | None = None) -> dict:
        with harness_context(context), left_unchanged("vjp", inputs=inputs, cotangent=cotangent):
            grads = self.loaded[handle].vjp(inputs, cotangent)
        if not isinstance(grads, dict):
            raise TypeError(f"vjp: returned {type(grads).__name__}; accepted: a dict of gradients by name")
        return {str(k): as_array(v, f"vjp: the gradient of {k}") for k, v in grads.items()}

    def decode_step(self, handle: int, inputs: AttentionInputs, context: dict | None = None) -> dict:
        """The outputs of the first two calls of the loaded layer's decode step for ``inputs``, each copied as it
        came back (a step may return a buffer it reuses)."""
        loaded = self.loaded[handle]
        if not callable(getattr(loaded, "decode_step", None)):
            raise Unsupported(f"{type(loaded).__name__} is not a LoadedAttention: no decode step")
        with harness_context(context), left_unchanged("decode_step", inputs=inputs):
            try:
                step = loaded.decode_step(inputs)
                calls = {}
                for call in ("first", "second"):
                    calls[call] = step_output(loaded, step(), f"decode step: the {call} call's output")
            except NotImplementedError as exc:
                if type(loaded).prepare_decode_step is LoadedAttention.prepare_decode_step:
                    raise Unsupported(f"no decode step: {type(loaded).__name__} does not implement "
                                      "LoadedAttention.prepare_decode_step (bench --workload decode leaves it out "
                                      "too)") from None
                raise Unsupported(f"the decode step refused this call: NotImplementedError: {exc}") from None
        return calls

    def native_parameter_shapes(self, config: AttentionConfig) -> dict:
        shapes = self.backend.native_parameter_shapes(config)
        return {str(k): [int(s) for s in v] for k, v in dict(shapes).items()}

    def release(self) -> None:
        self.loaded.clear()


class PluginExited(Exception):
    """A plugin called ``sys.exit`` inside a call made in this process: reported as the case's error."""


class InProcess:
    """Transport for ``isolate=False``: plugin code runs in this process (it can reach the verdict)."""

    isolated = False

    def __init__(self, backend: AttentionBackend):
        self.server = Server(backend)

    def call(self, op: str, *args):
        # the plugin gets copies and the case gets copies back, as across a worker's pipe: nothing the plugin does
        # later (a thread left running after a timeout) reaches the arrays a verdict is computed from; one deepcopy
        # keeps query is key is value. In a fresh contextvars context, as in a worker: none of the case's settings
        # reach the plugin's code but those the call carries (current_context). Under the case's implicit causal
        # mask, an always-causal layer's own masks.additive_mask(inputs, causal=False) gave the harness's causal
        # mask back, joined to the layer's own: a GPT-2 mask one key too wide passed in-process, failed isolated
        try:
            return _own_copy(contextvars.Context().run(getattr(self.server, op), *_own_copy(args)))
        except SystemExit as exc:  # sys.exit() in the plugin is that case's error, not the end of the whole run
            raise PluginExited(f"SystemExit({exc.code!r}) from the plugin's {op}: the plugin called sys.exit (or "
                               "raised SystemExit); in this process it would have ended the run") from None

    def begin_case(self, timeout: float | None) -> None:
        pass

    def end_case(self) -> None:
        self.server.release()


def _own_copy(value):
    try:
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001 - an object that cannot be copied (a malformed call's odd argument) goes as is
        return value


def real_float(value, what: str, shape: tuple | None = None) -> np.ndarray:
    """``value`` as it came back, required to be a real floating NumPy array (of ``shape``): never cast. None (a
    ``compute`` that forgot to return, a dict without the entry) is named as None, not as an array of dtype object."""
    if value is None:
        expected = f" of shape {tuple(shape)}" if shape is not None else ""
        raise CaseFailure(f"{what}: got None; accepted: a real floating array{expected} (float16, float32, float64)")
    if isinstance(value, UnsendableArray):
        raise CaseFailure(f"{what} dtype: got {value.dtype}; accepted: a real floating dtype "
                          "(float16, float32, float64)")
    array = value if isinstance(value, np.ndarray) else np.asarray(value)
    if array.dtype.kind != "f":
        note = "; the imaginary part would be lost by a cast" if array.dtype.kind == "c" else ""
        raise CaseFailure(f"{what} dtype: got {array.dtype}; accepted: a real floating dtype "
                          f"(float16, float32, float64){note}")
    if shape is not None and array.shape != tuple(shape):
        raise CaseFailure(f"{what} shape: expected {tuple(shape)}, got {array.shape}")
    return array


def _reached(gradient, name: str):
    """``gradient`` of ``name`` as it came back; None (what autograd leaves for a tensor its backward never reached)
    is a failure that says so, not a dtype of object."""
    if gradient is None:
        raise CaseFailure(f"gradient of {name}: got None: the backward did not reach {name} (a parameter that does "
                          "not require grad, an input detached or not requiring grad, or a layer that does not use "
                          f"it); accepted: a real floating array of {name}'s shape")
    return gradient


class LoadedProxy:
    """A loaded backend as a case sees it; each call runs in the transport and returns validated arrays."""

    def __init__(self, proxy: BackendProxy, handle: int, config: AttentionConfig):
        self._proxy, self._handle, self.config = proxy, handle, config

    def _call(self, op: str, inputs: AttentionInputs, *args) -> Any:
        """The transport's answer to ``op`` on ``inputs``; an exception it raises carries the call it was raised by
        (``mha_call``, :func:`describe_call`), which an error result names: a plugin's shape error alone does not say
        which variant's call (Tq != Tk, which masks) it could not take."""
        try:
            return self._proxy.transport.call(op, self._handle, inputs, *args)
        except Exception as exc:
            with contextlib.suppress(Exception):  # an exception that takes no attribute is reported as it is
                exc.mha_call = describe_call(op, inputs)
            raise

    def forward(self, inputs: AttentionInputs, *, need_weights: bool = False) -> AttentionOutput:
        got = self._call("forward", inputs, need_weights, current_context())
        output = real_float(got.get("output"), "output",
                            (inputs.batch, inputs.tq, self.config.d_model) if _shaped(inputs) else None)
        weights = got.get("weights")
        if need_weights and weights is not None:
            weights = real_float(weights, "weights", (inputs.batch, self.config.num_heads, inputs.tq, inputs.tk)
                                 if _shaped(inputs) else None)
        return AttentionOutput(output, weights if need_weights else None)

    def vjp(self, inputs: AttentionInputs, cotangent: np.ndarray) -> dict[str, np.ndarray]:
        got = self._call("vjp", inputs, np.asarray(cotangent), current_context())
        return {name: real_float(_reached(value, name), f"gradient of {name}") for name, value in got.items()}

    def decode_step(self, inputs: AttentionInputs) -> tuple[np.ndarray, np.ndarray]:
        """The outputs of the first and the second call of the backend's decode step for ``inputs`` (see
        :meth:`mha_harness.LoadedAttention.prepare_decode_step`)."""
        got = self._call("decode_step", inputs, current_context())
        shape = (inputs.batch, inputs.tq, self.config.d_model) if _shaped(inputs) else None
        return tuple(real_float(got.get(call), f"decode step's {call} output", shape) for call in ("first", "second"))


def fault_message(exc: BaseException) -> str:
    """An exception of a plugin's code as a result reports it: its type and message, where it was raised (the
    worker's file:line, carried across; else this process's last frame) and the plugin call that raised it with its
    shapes and masks (:func:`describe_call`), one form for check and search."""
    if isinstance(exc, PluginError):
        text, where = str(exc), exc.where
    else:
        text, where = f"{type(exc).__name__}: {exc}", getattr(exc, "where", "")
        if not where:
            frames = traceback.extract_tb(exc.__traceback__)
            where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    call = getattr(exc, "mha_call", None)
    return text + (f" at {where}" if where else "") + (f"; raised by the plugin's {call}" if isinstance(call, str)
                                                        else "")


def _shaped(inputs: AttentionInputs) -> bool:
    return all(getattr(x, "ndim", 0) == 3 for x in (inputs.query, inputs.key))


class BackendProxy:
    """What a case gets as ``backend``: the backend's declarations as data, and calls that go to its transport.

    Only data attributes (name, capabilities, divergences, device...) are read from the backend object; no
    method of the plugin runs here unless the transport is :class:`InProcess`."""

    def __init__(self, backend: AttentionBackend, transport=None):
        self._backend = backend
        self.transport = transport or InProcess(backend)
        self.name = backend.name
        self.capabilities = backend.capabilities
        self.divergences = tuple(backend.divergences)

    def __getattr__(self, attr: str):
        value = getattr(self._backend, attr)
        if callable(value):
            raise AttributeError(f"{attr}: a case may only call load and native_parameter_shapes on a backend")
        return value

    def load(self, params: AttentionParams, *, dtype: str = "float32") -> LoadedProxy:
        handle = self.transport.call("load", params, dtype)
        return LoadedProxy(self, handle, params.config)

    def native_parameter_shapes(self, config: AttentionConfig) -> dict[str, tuple[int, ...]]:
        return {name: tuple(shape) for name, shape in self.transport.call("native_parameter_shapes", config).items()}

    def __repr__(self) -> str:
        return f"<proxy of {self.name!r}{' in its worker' if self.transport.isolated else ''}>"


def as_proxy(backend) -> BackendProxy:
    """A proxy for ``backend`` (in-process unless it is one already)."""
    return backend if isinstance(backend, BackendProxy) else BackendProxy(backend)
