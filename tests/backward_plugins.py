"""Torch layers whose benchmarked forward + backward call is broken in one way each, while their vjp (what
conformance runs) is right: gradients accumulated over calls, parameters left out of the backward, a backward fast
path that drops the causal mask, and a layer that does not read its call's gradients at all."""
from __future__ import annotations

from mha_harness.implementations.torch_eager import TorchEager, TorchEagerLoaded


class _TorchEagerVariant(TorchEager):
    """torch-eager with another loaded class and name (``plugin_name``, ``loaded_class``)."""

    plugin_name, loaded_class = "", TorchEagerLoaded

    def __init__(self):
        super().__init__()
        self.name = self.plugin_name

    def load_native(self, params, dtype):
        return self.loaded_class(self, params, dtype)


class _BackwardCall(TorchEagerLoaded):
    """torch-eager's forward + backward call written out as a user writes it: ``inputs_for``, ``trained`` and
    ``reset`` are the places each mutant goes wrong."""

    def inputs_for(self, inputs):
        return inputs

    def trained(self):
        return self.parameter_tensors()

    def reset(self, leaves):
        for leaf in leaves:
            leaf.grad = None

    def prepare(self, inputs, *, backward=False):
        if not backward:
            return super().prepare(inputs)
        torch = self.torch
        q, k, v = (self.tensor(getattr(inputs, n), requires_grad=True) for n in ("query", "key", "value"))
        params = self.trained()
        leaves = [q, k, v] + [t for t, _ in params.values()]
        grad = torch.ones((inputs.batch, inputs.tq, self.config.d_model), dtype=self.dtype)
        call_inputs = self.inputs_for(inputs)

        def call():
            self.reset(leaves)
            out, _ = self.forward_tensors(q, k, v, call_inputs, False)
            out.backward(grad)
            return {"query": q.grad, "key": k.grad, "value": v.grad, **{n: t.grad for n, (t, _) in params.items()}}
        return call


class _AccumulatesGradients(_BackwardCall):
    def reset(self, leaves):  # never zeroed: each call adds its gradients to the last ones
        pass


class AccumulatesGradients(_TorchEagerVariant):
    """Its first forward + backward call returns the right gradients; every later one adds them again."""

    plugin_name, loaded_class = "bench-accumulates-gradients", _AccumulatesGradients


class _FreezesParameters(_BackwardCall):
    def trained(self):  # the weights do not require grad here: the backward reaches the inputs only
        for t in self.w.values():
            t.requires_grad_(False)
        return {name: (t, None) for name, t in self.w.items()}

    def native_gradients(self, value):  # reads what the call returned as it is, Nones included
        return {name: None if g is None else self.to_numpy(g) for name, g in value.items()}


class FreezesParameters(_TorchEagerVariant):
    """Its benchmarked backward computes the inputs' gradients only: the parameters' stay None."""

    plugin_name, loaded_class = "bench-freezes-parameters", _FreezesParameters


class _BackwardDropsCausalMask(_BackwardCall):
    def inputs_for(self, inputs):
        return inputs.replace(causal=None)


class BackwardDropsCausalMask(_TorchEagerVariant):
    """Its forward call and vjp apply the causal mask; its benchmarked forward + backward call does not."""

    plugin_name, loaded_class = "bench-backward-drops-causal-mask", _BackwardDropsCausalMask


class _ReadsNoGradients(TorchEagerLoaded):
    def native_gradients(self, value):
        raise NotImplementedError("no native_gradients")


class ReadsNoGradients(_TorchEagerVariant):
    """A layer without native_gradients: its forward + backward points are timed unchecked, saying so."""

    plugin_name, loaded_class = "bench-reads-no-gradients", _ReadsNoGradients
