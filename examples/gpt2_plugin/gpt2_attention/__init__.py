"""GPT-2's causal self-attention (nanoGPT's CausalSelfAttention), a torch nn.Module as model code writes it,
wrapped as an mha-harness backend without changing it."""
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import mha_harness


class CausalSelfAttention(nn.Module):  # the model code, as it is
    def __init__(self, d_model, n_head, bias=True):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(d_model, 3 * d_model, bias=bias)  # q, k, v in one matmul
        self.c_proj = nn.Linear(d_model, d_model, bias=bias)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(~torch.tril(torch.ones(T, T, dtype=torch.bool)), float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def _tensor(array, dtype):
    return torch.from_numpy(np.ascontiguousarray(array)).to(dtype)


def _np(grad, transpose=False):  # a .grad as float64 NumPy; None stays None (a backward that did not reach it)
    return None if grad is None else (grad.T if transpose else grad).double().numpy()


class LoadedGPT2Attention(mha_harness.LoadedAttention):
    def __init__(self, params, dtype):
        c, self.dtype = params.config, TORCH_DTYPES[dtype]
        self.module = CausalSelfAttention(c.d_model, c.num_heads, bias=c.bias).to(self.dtype).eval()
        # the harness's weights act as x @ W, W of shape (d_model, d_out); nn.Linear stores W.T, (out, in)
        with torch.no_grad():
            self.module.c_attn.weight.copy_(_tensor(np.concatenate([params.W_q, params.W_k, params.W_v], 1).T,
                                                    self.dtype))
            self.module.c_proj.weight.copy_(_tensor(params.W_o.T, self.dtype))
            if c.bias:
                self.module.c_attn.bias.copy_(_tensor(np.concatenate([params.b_q, params.b_k, params.b_v]),
                                                      self.dtype))
                self.module.c_proj.bias.copy_(_tensor(params.b_o, self.dtype))

    def compute(self, inputs, *, need_weights=False):  # one x: inputs.query is inputs.key is inputs.value
        with torch.no_grad():
            return mha_harness.AttentionOutput(self.module(_tensor(inputs.query, self.dtype)).numpy())

    def compute_vjp(self, inputs, cotangent):  # d/dx and every parameter's gradient, in the harness's layout
        x = _tensor(inputs.query, self.dtype).requires_grad_(True)
        self.module.zero_grad(set_to_none=True)
        self.module(x).backward(_tensor(cotangent, self.dtype))
        return self.native_gradients(x)

    def native_gradients(self, x):  # the .grad of x and of every parameter, as NumPy in the harness's layout
        d, attn, proj = x.shape[-1], self.module.c_attn, self.module.c_proj
        w = _np(attn.weight.grad, transpose=True)  # (d_model, 3 d_model) = [W_q | W_k | W_v]
        grads = {"query": _np(x.grad), "W_o": _np(proj.weight.grad, transpose=True),
                 **{n: None if w is None else w[:, i * d:(i + 1) * d] for i, n in enumerate(("W_q", "W_k", "W_v"))}}
        if attn.bias is not None:
            b = _np(attn.bias.grad)
            grads.update({n: None if b is None else b[i * d:(i + 1) * d] for i, n in enumerate(("b_q", "b_k", "b_v"))},
                         b_o=_np(proj.bias.grad))
        return grads

    def prepare(self, inputs, *, backward=False):  # for the benchmarks: tensors made once, one call per run
        x = _tensor(inputs.query, self.dtype).requires_grad_(backward)
        if backward:
            def train_step():  # returns x, whose .grad and the parameters' native_gradients reads
                self.module.zero_grad(set_to_none=True)
                x.grad = None  # fresh gradients every call, as a training step's
                self.module(x).sum().backward()
                return x
            return train_step

        def forward():  # returns the output: bench checks one call's output against the reference
            with torch.no_grad():
                return self.module(x)
        return forward

    def native_output(self, value):  # what forward() returned, as NumPy (float64 reads bfloat16 too, which NumPy lacks)
        return value.double().numpy()


class GPT2Attention(mha_harness.AttentionBackend):
    name = "gpt2-attention"
    capabilities = mha_harness.Capabilities(
        inputs="self",  # forward(x): one x
        always_causal=True, causal_alignments=("top-left",),  # its tril mask, on every call
        key_padding_mask=False, bool_attn_mask=False, additive_attn_mask=False,  # forward takes no masks
        grouped_query=False,  # c_attn makes as many K/V heads as query heads
        dtypes=("float32", "float64"), gradients=True)
    native_causal = "always: torch.tril on every call (top-left)"
    native_mask_polarity = "no masks"

    def load_native(self, params, dtype):
        return LoadedGPT2Attention(params, dtype)

    def native_parameter_shapes(self, config):  # what the module allocates: checked against 4 d_model^2 (+ 4 d_model)
        module = CausalSelfAttention(config.d_model, config.num_heads, bias=config.bias)
        return {name: tuple(p.shape) for name, p in module.named_parameters()}

    def versions(self):  # recorded with every result
        return {"numpy": np.__version__, "torch": torch.__version__}
