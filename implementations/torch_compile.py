"""torch-compile: the torch-eager layer through ``torch.compile`` (inductor), as users speed up their own attention.

The layer is torch-eager's pure function (mha_harness.implementations.torch_eager.eager_layer) compiled once
per process; weights, inputs and masks are its arguments, so a new set of parameters reuses the compiled
graph. ``dynamic=True``: sizes are symbolic from the first call, so every length, batch and width shares one
graph per dtype and mask kind (sizes 0 and 1 are still specialised by dynamo), and dynamo's recompile limit is
raised so the conformance grid never falls back to eager. The check that lets a
masked NaN/inf value contribute nothing (``bool(values.isfinite().all())``) is data-dependent: dynamo splits
the graph there, as it would in a user's model. Compilation happens on the first call of a shape, outside
the prepared callable's timings; inductor's on-disk cache serves later processes. On CPU inductor writes
C++, so the backend needs a C++ compiler.
"""
from __future__ import annotations

import functools

from mha_harness.contract.api import AttentionConfig, AttentionInputs, AttentionParams, Capabilities
from mha_harness.contract.conventions import MASK_POLARITY
from mha_harness.implementations._torch_common import TorchBackend, use_private_inductor_cache
from mha_harness.implementations.torch_eager import TorchEagerLoaded, eager_layer
from mha_harness.implementations.torch_flex import cxx_compiler, raise_recompile_limit

# float16 on CPU works but compiles every op of the grid's shapes a second time for little insight
DTYPES = ("float32", "float64", "bfloat16")


def compile_reason(device: str) -> str | None:
    from mha_harness.implementations._torch_common import torch_reason
    reason = torch_reason(device)
    if reason:
        return reason
    import torch
    if not hasattr(torch, "compile"):
        return f"torch {torch.__version__} has no torch.compile (torch >= 2.0 has it)"
    if device == "cpu" and cxx_compiler() is None:
        return "no C++ compiler for torch.compile's CPU code (set CXX, or install g++ / clang++)"
    return None


@functools.cache
def compiled_layer():
    import logging

    import torch
    use_private_inductor_cache()
    raise_recompile_limit(torch)
    # the data-dependent graph break in weighted_values is expected (module docstring): no warning per shape
    logging.getLogger("torch._dynamo.variables.tensor").setLevel(logging.ERROR)
    # dynamic=True: one graph per (dtype, mask kinds, GQA) instead of a static graph for the first shape and a
    # dynamic one from the second on (what automatic dynamic shapes would do anyway in a sweep over lengths)
    return torch.compile(eager_layer, dynamic=True)


class TorchCompileLoaded(TorchEagerLoaded):
    def setup(self, params: AttentionParams) -> None:
        super().setup(params)
        self.layer = compiled_layer()

    def prepare_decode_step(self, inputs: AttentionInputs):
        raise NotImplementedError("torch-compile-cpu compiles the whole layer only: its decode step would be "
                                  "torch-eager's, uncompiled")


class TorchCompile(TorchBackend):
    opt_in = ("torch.compile (inductor) compiles the layer per dtype and mask kind: minutes on 2 cores, "
              "even from its cache")
    compiles_per_shape = True  # inductor compiles per dtype and mask kind
    native_causal = "explicit masks in both alignments (the eager layer's)"
    native_mask_polarity = MASK_POLARITY  # the eager layer takes the harness's masks as they are

    def __init__(self, device: str = "cpu"):
        self.device = device
        self.name = f"torch-compile-{device}"
        self.capabilities = Capabilities(gradients=True, dtypes=DTYPES, devices=(device,))

    def availability(self) -> str | None:
        return compile_reason(self.device)

    def native_parameter_shapes(self, config: AttentionConfig):
        from mha_harness.contract.params import make_params
        return {n: tuple(t.shape) for n, t in TorchCompileLoaded(self, make_params(config), "float32").w.items()}

    def load_native(self, params: AttentionParams, dtype: str) -> TorchCompileLoaded:
        return TorchCompileLoaded(self, params, dtype)


def backends():
    return [TorchCompile("cpu")]
