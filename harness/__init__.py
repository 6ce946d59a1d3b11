"""mha-harness: a conformance and benchmark suite for multi-head attention implementations.

Public API::

    harness.check(backend_or_name, ...) -> Report   # run the conformance cases
    harness.AttentionBackend, harness.LoadedAttention, harness.Capabilities, harness.Divergence
    harness.function_backend(...)                   # the few-line adapter for a plain NumPy function
    harness.load_registry()                         # every built-in and plugin backend
"""
from .api import (AttentionBackend, AttentionConfig, AttentionInputs, AttentionOutput, AttentionParams,
                  Capabilities, Divergence, LoadedAttention, Unsupported)
from .checking import check, repro
from .function_backend import function_backend
from .params import make_inputs, make_params
from .reference import reference_attention, reference_vjp
from .registry import load_registry
from .report import Report

__version__ = "0.1.0"
__all__ = ["AttentionBackend", "AttentionConfig", "AttentionInputs", "AttentionOutput", "AttentionParams",
           "Capabilities", "Divergence", "LoadedAttention", "Report", "check", "function_backend", "load_registry",
           "make_inputs", "make_params", "reference_attention", "reference_vjp", "repro", "Unsupported"]
