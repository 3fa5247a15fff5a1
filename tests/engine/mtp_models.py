"""Tiny random checkpoints with MTP layers, written in the released checkpoints' layout.

DeepSeek-V3 and GLM-4.5 (``Glm4Moe``) keep their ``num_nextn_predict_layers`` MTP layers
after the last decoder layer: ``model.layers.{num_hidden_layers + i}.*`` holds a full
decoder layer (attention, MoE with per-expert ``mlp.experts.{e}.{gate,up,down}_proj``)
plus ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``, ``shared_head.head`` and
``embed_tokens``.  A plain ``save_pretrained()`` writes none of that, so the fixture
builds a model with ``num_hidden_layers + num_mtp`` layers, saves it (transformers writes
the per-expert layout), adds the MTP-only tensors, splits the files into two shards with
an index (MTP layers in the last shard, as released), and rewrites ``config.json`` with
the real depth.  Loading then takes the real path: ``from_pretrained`` for the target,
``MtpModel.from_pretrained`` (``use_mtp=True``) for the MTP layers.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Glm4MoeConfig, Glm4MoeForCausalLM

NO_SPECIAL = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _deepseek_v3(vocab, hidden, layers, num_mtp, **kw):
    cfg = DeepseekV3Config(**{
        **dict(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
            num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
            q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
            max_position_embeddings=256, num_nextn_predict_layers=num_mtp, **NO_SPECIAL,
        ),
        **kw,
    })
    return DeepseekV3ForCausalLM, cfg


def _glm4_moe(vocab, hidden, layers, num_mtp, **kw):
    cfg = Glm4MoeConfig(**{
        **dict(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
            n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
            use_qk_norm=True, max_position_embeddings=256, num_nextn_predict_layers=num_mtp, **NO_SPECIAL,
        ),
        **kw,
    })
    return Glm4MoeForCausalLM, cfg


ARCHS = {"deepseek_v3": _deepseek_v3, "glm4_moe": _glm4_moe}


def write_mtp_checkpoint(path, arch: str, vocab=96, hidden=32, layers=2, num_mtp=1, seed=0, with_mtp=True, **kw) -> str:
    """Write a tiny random ``arch`` checkpoint with ``num_mtp`` MTP layers to ``path``.

    ``with_mtp=False`` writes the same config (``num_nextn_predict_layers=num_mtp``) but
    no MTP weights, like ``save_pretrained()`` of a plain model.
    """
    path = str(path)
    cls, cfg = ARCHS[arch](vocab, hidden, layers + num_mtp, num_mtp, **kw)
    torch.manual_seed(seed)
    cls(cfg).save_pretrained(path)
    single = os.path.join(path, "model.safetensors")
    tensors = load_file(single)
    os.remove(single)
    gen = torch.Generator().manual_seed(seed + 1000)
    mtp_prefixes = tuple(f"model.layers.{layers + i}." for i in range(num_mtp))
    main = {k: v for k, v in tensors.items() if not k.startswith(mtp_prefixes)}
    mtp = {}
    if with_mtp:
        mtp = {k: v for k, v in tensors.items() if k.startswith(mtp_prefixes)}
        for p in mtp_prefixes:
            mtp[p + "enorm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=gen)
            mtp[p + "hnorm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=gen)
            mtp[p + "eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=gen) * 0.15
            mtp[p + "shared_head.norm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=gen)
            # released checkpoints repeat the shared embedding and head in every MTP layer
            mtp[p + "shared_head.head.weight"] = main["lm_head.weight"].clone()
            mtp[p + "embed_tokens.weight"] = main["model.embed_tokens.weight"].clone()
    shards = [("model-00001-of-00002.safetensors", main), ("model-00002-of-00002.safetensors", mtp)]
    weight_map = {}
    for name, part in shards:
        if part:
            save_file(part, os.path.join(path, name), metadata={"format": "pt"})
            weight_map.update({k: name for k in part})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        config = json.load(f)
    config["num_hidden_layers"] = layers
    with open(cfg_path, "w") as f:
        json.dump(config, f, indent=2)
    return path


def load_target(path, dtype=torch.float64, **kw):
    """The target as a user loads it (eager experts: grouped_mm has no float64 kernel)."""
    cls = DeepseekV3ForCausalLM if "deepseek" in json.load(open(os.path.join(path, "config.json")))["model_type"] else Glm4MoeForCausalLM
    return cls.from_pretrained(path, dtype=dtype, experts_implementation="eager", **kw).eval()
