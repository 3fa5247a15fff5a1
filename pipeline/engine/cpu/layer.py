"""A Llama decoder layer outside attention as three graphs compiled by inductor, for the lean
pass's passes of 1-2 tokens in all by default, up to COMPILED_MAX_TOKENS (:mod:`.lean`).

Around its three matrix products the eager layer runs about thirty small ops (RMSNorm, RoPE,
residuals, SiLU), a few microseconds of dispatch each whatever their size.  Compiled, the
layer is ``rms_norm -> QKV -> RoPE`` (:func:`attention_in`), ``o_proj + residual``
(:func:`attention_out`) and ``rms_norm -> gate/up -> silu * up -> down + residual``
(:func:`mlp`), each product a dot product per weight row and token
(:func:`.compiling.products`) fused with the element-wise ops around it.  The products' inputs
(the norms' outputs, ``silu * up``) are graph outputs too, so that inductor computes each once
into a buffer instead of inlining it into every weight row's loop (which cost 2-3x from 3
tokens on).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from .compiling import compile_graph, products
from .measure import Costs


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm``, op for op: computed in float32 whatever ``x``'s dtype."""
    h = x.to(torch.float32)
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def attention_in(x, norm, w_qkv, cos, sin, *, eps: float, nq: int, nk: int, d: int):
    """``(n, H)`` hidden states, ``(n, d)`` cos/sin -> ``(n, heads, d)`` queries and keys after
    RoPE, ``(n, kv heads, d)`` values (and the norm's output, to keep it one buffer)."""
    h = rms(x, norm, eps)
    qkv = products(w_qkv, h)
    qk = qkv[:, : nq + nk].reshape(x.shape[0], -1, d)
    qk = qk * cos[:, None] + rotate_half(qk) * sin[:, None]
    return qk[:, : nq // d], qk[:, nq // d:], qkv[:, nq + nk:].reshape(x.shape[0], -1, d), h


def attention_out(x, o, w_o):
    """``x + o_proj(o)`` for ``(n, H)`` ``x`` and the ``(n, heads * d)`` attention output ``o``."""
    return x + products(w_o, o)


def mlp(x, norm, w_gate_up, w_down, *, eps: float, inter: int):
    """``x + down(silu(gate(h)) * up(h))``, ``h = rms_norm(x)``, for ``(n, H)`` ``x`` (and ``h``
    and ``silu(gate) * up``, to keep each one buffer)."""
    h = rms(x, norm, eps)
    gu = products(w_gate_up, h)
    a = F.silu(gu[:, :inter]) * gu[:, inter:]
    return x + products(w_down, a), a, h


def compile_layer(*, tokens: int, hidden: int, splits: tuple[int, int, int], inter: int, head_dim: int, eps: float,
                  dtype: torch.dtype, costs: Costs | None = None):
    """The three compiled graphs (``attention_in``, ``attention_out``, ``mlp``) of a layer of
    these sizes for passes of ``tokens`` tokens in all, or ``None`` where inductor cannot make
    them.  They take the layer's weights as inputs: one set serves every layer."""
    nq, nk, nv = splits

    def zeros(*shape):
        return torch.zeros(shape, dtype=dtype)

    n = tokens
    graphs = (
        compile_graph(partial(attention_in, eps=eps, nq=nq, nk=nk, d=head_dim),
                      (zeros(n, hidden), zeros(hidden), zeros(nq + nk + nv, hidden), zeros(n, head_dim), zeros(n, head_dim)),
                      f"layer input for {tokens} tokens", costs),
        compile_graph(attention_out, (zeros(n, hidden), zeros(n, nq), zeros(hidden, nq)),
                      f"attention output for {tokens} tokens", costs),
        compile_graph(partial(mlp, eps=eps, inter=inter),
                      (zeros(n, hidden), zeros(hidden), zeros(2 * inter, hidden), zeros(hidden, inter)),
                      f"MLP for {tokens} tokens", costs),
    )
    return None if any(g is None for g in graphs) else graphs
