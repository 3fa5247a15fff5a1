"""Attention of short query blocks with grouped key/value heads, on the CPU.

With an explicit mask and more than one query, transformers' SDPA path copies every key/value
head to each of its query heads (``repeat_kv``) in every layer and pass, which at 8 rows and an
800-token context is most of a verification pass.  :func:`small_query_attention` runs SDPA with
``enable_gqa=True`` instead for blocks of up to :data:`SMALL_QUERY` queries, reading each
key/value head once for its group; it is registered with transformers under
:data:`ATTENTION_NAME`, and the runner switches a model's masked passes to it
(:func:`attention_implementation`).  Prefill passes keep SDPA's causal kernel.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

#: query blocks up to this many tokens use :func:`small_query_attention` (verification passes)
SMALL_QUERY = 16
#: the attention implementation name registered with transformers
ATTENTION_NAME = "specbatch_small_query"


def small_query_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                          is_causal: bool | None = None, **kwargs):
    """Attention of a short query block against a KV cache with grouped KV heads, without
    copying the KV heads: PyTorch's SDPA with ``enable_gqa=True``.

    Args:
        query: ``(b, H_q, q, d)``; key, value: ``(b, H_kv, S, d)`` with ``H_q = g * H_kv``.
        attention_mask: additive float mask ``(b or 1, 1, q, S)`` (0 = read, a large
            negative value = hidden), as the runner builds it.

    Returns:
        ``((b, q, H_q, d) output, None)``, the signature of transformers' attention functions.
        Anything this path does not cover (a long query block, no mask, dropout,
        soft-capping, attention sinks, position bias, another device) goes to transformers'
        own SDPA function.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q = query.shape[2]
    if (q > SMALL_QUERY or attention_mask is None or dropout or kwargs.get("softcap") is not None
            or kwargs.get("s_aux") is not None or kwargs.get("position_bias") is not None
            or query.device.type != "cpu" or query.shape[1] % key.shape[1]):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask[..., : key.shape[2]],
                                         scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register :func:`small_query_attention` with transformers (once; transformers' registry is per process)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if AttentionInterface._global_mapping.get(ATTENTION_NAME) is not small_query_attention:
        AttentionInterface.register(ATTENTION_NAME, small_query_attention)
        AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def _configs(model) -> list:
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return list({id(c): c for c in (config, text)}.values())


def applies(model) -> bool:
    """Whether ``model``'s masked passes can take :func:`small_query_attention`: it uses SDPA
    and sits on the CPU."""
    config = getattr(model, "config", None)
    if config is None:
        return False
    impl = getattr(_configs(model)[-1], "_attn_implementation", None)
    return impl == "sdpa" and getattr(model, "device", torch.device("cpu")).type == "cpu"


@contextlib.contextmanager
def attention_implementation(model, active: bool):
    """Run ``model``'s attention layers with :func:`small_query_attention` inside the block
    (when ``active``): its configs' ``_attn_implementation`` is switched for the call and
    restored after it."""
    if not active:
        yield
        return
    register()
    saved = [(c, c._attn_implementation_internal) for c in _configs(model)]
    for c, _ in saved:
        c._attn_implementation_internal = ATTENTION_NAME
    try:
        yield
    finally:
        for c, old in saved:
            c._attn_implementation_internal = old
