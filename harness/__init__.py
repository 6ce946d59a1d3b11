"""mha-harness: a conformance and benchmark suite for multi-head attention implementations.

Public API::

    mha_harness.check(backend_or_name, ...) -> Report   # run the conformance cases
    mha_harness.case_names()                            # every registered case, plugins' included
    mha_harness.AttentionBackend, mha_harness.LoadedAttention, mha_harness.Capabilities, mha_harness.Divergence
    mha_harness.function_backend(...)                   # the few-line adapter for a plain NumPy function
    mha_harness.masks.causal_mask / padding_mask / combined_mask / additive_mask   # the public mask builder
    mha_harness.configure_jax()                         # the built-in JAX backends' compile cache + float64
    mha_harness.load_registry()                         # every built-in and plugin backend
"""
from __future__ import annotations

import importlib

#: public name -> the module that defines it. Loaded on first use (PEP 562), so that importing a submodule
#: that needs none of them -- the pytest plugin, which pytest loads in every run of the environment -- pays
#: nothing for the core, NumPy included.
_PUBLIC = {
    "check": "mha_harness.checking", "repro": "mha_harness.checking", "search": "mha_harness.checking",
    "case_names": "mha_harness.checking",
    "Report": "mha_harness.conformance.report",
    **{name: "mha_harness.contract.api" for name in (
        "AttentionBackend", "AttentionConfig", "AttentionInputs", "AttentionOutput", "AttentionParams",
        "Capabilities", "Divergence", "LoadedAttention", "Unsupported", "as_kv_cache_call", "implicitly_causal")},
    "causal_offset": "mha_harness.contract.conventions",
    "make_inputs": "mha_harness.contract.params", "make_params": "mha_harness.contract.params",
    "reference_attention": "mha_harness.contract.reference", "reference_vjp": "mha_harness.contract.reference",
    "reference_vjp_magnitudes": "mha_harness.contract.reference", "logit_softcap_as": "mha_harness.contract.reference",
    "score_scale_as": "mha_harness.contract.reference",
    "load_registry": "mha_harness.registry",
    "function_backend": "mha_harness.toolkit.function_backend",
    "configure_jax": "mha_harness.toolkit.jax_setup",
    "parametrize_with_cases": "mha_harness.pytest_plugin",
    "rotary_positions": "mha_harness.contract.conventions",
    "alibi_slopes": "mha_harness.contract.conventions",
    "alibi_bias": "mha_harness.contract.conventions",
    "RotaryScaling": "mha_harness.contract.conventions",
}

__version__ = "0.1.0"
__all__ = ["AttentionBackend", "AttentionConfig", "AttentionInputs", "AttentionOutput", "AttentionParams",
           "alibi_bias", "alibi_slopes",
           "Capabilities", "Divergence", "LoadedAttention", "Report", "Unsupported", "as_kv_cache_call",
           "case_names", "causal_offset", "check",
           "configure_jax", "function_backend", "implicitly_causal", "load_registry", "logit_softcap_as", "make_inputs",
           "make_params",
           "masks",
           "parametrize_with_cases", "reference_attention", "reference_vjp", "reference_vjp_magnitudes", "repro",
           "search",
           "RotaryScaling", "rotary_positions", "score_scale_as"]


def load_core() -> None:
    """Import the core (the modules the public API comes from) and take the integrity snapshot
    (:mod:`mha_harness.util.integrity`) before any plugin is imported: the registry calls this before it imports
    a plugin, and so does the first use of a public name."""
    importlib.import_module("mha_harness.checking")  # its import loads the engine and takes the snapshot


def __getattr__(name: str):
    """The public API, imported on first use (the core's import also takes the integrity snapshot)."""
    if name == "masks":
        load_core()
        return importlib.import_module("mha_harness.toolkit.masks")
    if name in _PUBLIC:
        if name != "parametrize_with_cases":  # the pytest decorator needs no snapshot before it
            load_core()
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'mha_harness' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The module's names, with those loaded on first use."""
    return sorted(set(globals()) | set(__all__))
