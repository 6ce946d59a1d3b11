"""The Annotated Transformer's MultiHeadedAttention (Harvard NLP), a separate-form torch nn.Module with one boolean
mask argument, wrapped as an mha-harness backend without changing it: padding, causal and boolean masks all go
in through that argument, gradients come from autograd, and what the module truly does differently (a finite -1e9
mask value, a dense P @ V) is declared and verified."""
import copy
import math

import numpy as np
import torch
import torch.nn as nn

import mha_harness
from mha_harness.masks import combined_mask
from mha_harness.toolkit.divergences import masked_poison_divergences, uniform_fully_masked_divergences


def clones(module, N):  # the model code, as it is
    return nn.ModuleList([copy.deepcopy(module) for _ in range(N)])


def attention(query, key, value, mask=None, dropout=None):
    d_k = query.size(-1)
    scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(d_k)
    if mask is not None:
        scores = scores.masked_fill(mask == 0, -1e9)
    p_attn = scores.softmax(dim=-1)
    if dropout is not None:
        p_attn = dropout(p_attn)
    return torch.matmul(p_attn, value), p_attn


class MultiHeadedAttention(nn.Module):
    def __init__(self, h, d_model, dropout=0.1):
        super().__init__()
        assert d_model % h == 0
        self.d_k = d_model // h
        self.h = h
        self.linears = clones(nn.Linear(d_model, d_model), 4)  # W_q, W_k, W_v, W_o, each with a bias
        self.attn = None
        self.dropout = nn.Dropout(p=dropout)

    def forward(self, query, key, value, mask=None):  # mask: (batch, Tq or 1, Tk), 1 = may attend
        if mask is not None:
            mask = mask.unsqueeze(1)  # the same mask for every head
        nbatches = query.size(0)
        query, key, value = [lin(x).view(nbatches, -1, self.h, self.d_k).transpose(1, 2)
                             for lin, x in zip(self.linears, (query, key, value))]
        x, self.attn = attention(query, key, value, mask=mask, dropout=self.dropout)
        x = x.transpose(1, 2).contiguous().view(nbatches, -1, self.h * self.d_k)
        return self.linears[-1](x)


TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
PROJECTIONS = ("q", "k", "v", "o")  # self.linears[0..3]


def _tensor(array, dtype):
    return torch.from_numpy(np.ascontiguousarray(array)).to(dtype)


def _np(tensor, transpose=False):  # float64 NumPy (reads bfloat16 too, which NumPy lacks); None stays None
    return None if tensor is None else (tensor.T if transpose else tensor).detach().double().numpy()


class LoadedAnnotatedAttention(mha_harness.LoadedAttention):
    def __init__(self, params, dtype):
        c, self.dtype = params.config, TORCH_DTYPES[dtype]
        # dropout is off in eval mode (in training mode it would make every call different); cast first, then copy
        # the float64 weights in, so float64 layers hold them exactly
        self.module = MultiHeadedAttention(c.num_heads, c.d_model).to(self.dtype).eval()
        with torch.no_grad():
            for p, linear in zip(PROJECTIONS, self.module.linears):
                # the harness's weights act as x @ W, W of shape (d_model, d_out); nn.Linear stores W.T
                linear.weight.copy_(_tensor(getattr(params, f"W_{p}").T, self.dtype))
                bias = getattr(params, f"b_{p}")  # None in bias-free configs: the module always has biases, so zeros
                linear.bias.copy_(_tensor(bias, self.dtype) if bias is not None else torch.zeros(c.d_model))

    def module_inputs(self, inputs, requires_grad=False):
        """query, key, value as three tensors (three leaves even when the call passes one x: the separate form's
        gradients are per argument) and every mask of the call (padding, causal, boolean attn_mask) as the
        module's one mask: True = may attend, (batch or 1, Tq, Tk)."""
        tensors = [_tensor(a, self.dtype).requires_grad_(requires_grad)
                   for a in (inputs.query, inputs.key, inputs.value)]
        keep = combined_mask(inputs, polarity="attend")  # (B|1, H|1, Tq, Tk), or None without masks
        if keep is not None and keep.shape[1] != 1:
            raise mha_harness.Unsupported("the module's mask is the same for every head (no per-head mask)")
        return tensors, None if keep is None else torch.from_numpy(np.ascontiguousarray(keep[:, 0]))

    def compute(self, inputs, *, need_weights=False):
        (q, k, v), mask = self.module_inputs(inputs)
        with torch.no_grad():
            out = self.module(q, k, v, mask=mask)
        return mha_harness.AttentionOutput(_np(out), _np(self.module.attn) if need_weights else None)

    def compute_vjp(self, inputs, cotangent):  # gradients of sum(output * cotangent), in the harness's layout
        (q, k, v), mask = self.module_inputs(inputs, requires_grad=True)
        self.module.zero_grad(set_to_none=True)
        self.module(q, k, v, mask=mask).backward(_tensor(cotangent, self.dtype))
        return self.native_gradients((q, k, v))

    def native_gradients(self, leaves):  # the .grad of query, key, value and of every parameter, as NumPy
        grads = {name: _np(t.grad) for name, t in zip(("query", "key", "value"), leaves)}
        for p, linear in zip(PROJECTIONS, self.module.linears):
            grads[f"W_{p}"] = _np(linear.weight.grad, transpose=True)
            grads[f"b_{p}"] = _np(linear.bias.grad)
        return grads

    def prepare(self, inputs, *, backward=False):  # for the benchmarks: tensors and mask made once
        (q, k, v), mask = self.module_inputs(inputs, requires_grad=backward)
        if backward:
            def train_step():  # returns the leaves, whose .grad and the parameters' native_gradients reads
                self.module.zero_grad(set_to_none=True)
                for t in (q, k, v):
                    t.grad = None  # fresh gradients every call, as a training step's
                self.module(q, k, v, mask=mask).sum().backward()
                return q, k, v
            return train_step

        def forward():  # returns the output: bench checks one call's output against the reference
            with torch.no_grad():
                return self.module(q, k, v, mask=mask)
        return forward

    def native_output(self, value):
        return _np(value)


class AnnotatedAttention(mha_harness.AttentionBackend):
    name = "annotated-transformer-mha"
    capabilities = mha_harness.Capabilities(
        inputs="separate",  # forward(query, key, value, mask): three arrays, Tq != Tk too (cross-attention)
        causal_alignments=("top-left", "bottom-right"),  # no causal flag: the causal mask goes in through `mask`
        key_padding_mask=True, bool_attn_mask=True,  # both through `mask`
        additive_attn_mask=False,  # `mask` is boolean: no float mask to add
        grouped_query=False,  # every head has its own K and V
        attention_weights=True,  # the module keeps them in self.attn
        dtypes=("float32", "float64", "bfloat16"),  # float16 cannot hold -1e9: masked_fill raises an overflow error
        gradients=True)
    divergences = (
        # masked_fill(mask == 0, -1e9): a row with no key to attend softmaxes equal scores, the average of V
        uniform_fully_masked_divergences("the module masks with a finite -1e9: a row with every key masked gets "
                                         "equal weights, the average of V, instead of zeros")
        # P @ V over every key: a weight of exactly 0 times a NaN or inf stored in a masked value is NaN
        + masked_poison_divergences("the module computes P @ V over every key: 0 * NaN = NaN"))
    native_causal = "none: a causal mask goes in through `mask` (both alignments)"
    native_mask_polarity = "mask == 0 is masked (1 / True = may attend)"

    def load_native(self, params, dtype):
        return LoadedAnnotatedAttention(params, dtype)

    def native_parameter_shapes(self, config):  # four nn.Linear(d_model, d_model), biases always
        if not config.bias:
            raise mha_harness.Unsupported("nn.Linear(d_model, d_model) always allocates a bias")
        module = MultiHeadedAttention(config.num_heads, config.d_model)
        return {name: tuple(p.shape) for name, p in module.named_parameters()}

    def versions(self):  # recorded with every result
        return {"numpy": np.__version__, "torch": torch.__version__}
