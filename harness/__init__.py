"""mha-harness: a conformance and benchmark suite for multi-head attention implementations.

Public API::

    mha_harness.check(backend_or_name, ...) -> Report   # run the conformance cases
    mha_harness.AttentionBackend, mha_harness.LoadedAttention, mha_harness.Capabilities, mha_harness.Divergence
    mha_harness.function_backend(...)                   # the few-line adapter for a plain NumPy function
    mha_harness.masks.causal_mask / padding_mask / combined_mask / additive_mask   # the public mask builder
    mha_harness.configure_jax()                         # the built-in JAX backends' compile cache + float64
    mha_harness.load_registry()                         # every built-in and plugin backend
"""
from mha_harness.checking import check, repro
from mha_harness.conformance.report import Report
from mha_harness.contract.api import (
    AttentionBackend,
    AttentionConfig,
    AttentionInputs,
    AttentionOutput,
    AttentionParams,
    Capabilities,
    Divergence,
    LoadedAttention,
    Unsupported,
)
from mha_harness.contract.conventions import causal_offset
from mha_harness.contract.params import make_inputs, make_params
from mha_harness.contract.reference import reference_attention, reference_vjp
from mha_harness.registry import load_registry
from mha_harness.toolkit import masks
from mha_harness.toolkit.function_backend import function_backend
from mha_harness.toolkit.jax_setup import configure_jax
from mha_harness.util import integrity

integrity.take_snapshot()  # before any plugin is imported: see mha_harness.util.integrity

__version__ = "0.1.0"
__all__ = ["AttentionBackend", "AttentionConfig", "AttentionInputs", "AttentionOutput", "AttentionParams",
           "Capabilities", "Divergence", "LoadedAttention", "Report", "Unsupported", "causal_offset", "check",
           "configure_jax", "function_backend", "load_registry", "make_inputs", "make_params", "masks",
           "parametrize_with_cases", "reference_attention", "reference_vjp", "repro"]


def __getattr__(name: str):
    """``parametrize_with_cases`` lives in the pytest plugin; loaded on first use so importing mha_harness does not
    import pytest."""
    if name == "parametrize_with_cases":
        from mha_harness.pytest_plugin import parametrize_with_cases
        return parametrize_with_cases
    raise AttributeError(f"module 'mha_harness' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The module's names, with the lazily loaded ``parametrize_with_cases``."""
    return sorted(set(globals()) | {"parametrize_with_cases"})
