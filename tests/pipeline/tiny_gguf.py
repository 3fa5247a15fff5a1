"""A tiny Llama written as a GGUF file (llama.cpp's layout), for tests of ``models.gguf_file``
that need no download.

:func:`write_tiny_llama_gguf` takes a small random ``LlamaForCausalLM`` and a byte-level BPE
tokenizer (``tokenizer.json`` of a demo model) and writes them with the ``gguf`` package the way
llama.cpp's ``convert_hf_to_gguf.py`` does for Llama: ``llama.*`` metadata, a ``gpt2``
tokenizer (tokens, token types, merges, special ids), float32 tensors named ``token_embd``,
``blk.N.attn_q`` ... ``output_norm``, ``output``, with the query and key projections permuted
(llama.cpp's rotary layout; transformers undoes it on load).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` for the rotary halves of q/k weights."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_llama_gguf(model, tokenizer_json: Path, path: Path, bos: int, eos: int, unk: int, pad: int) -> Path:
    """Write ``model`` (a ``LlamaForCausalLM``, float32) and the BPE tokenizer to ``path``."""
    import gguf

    cfg = model.config
    tok = json.loads(Path(tokenizer_json).read_text())
    vocab = tok["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert len(tokens) == cfg.vocab_size, (len(tokens), cfg.vocab_size)
    # transformers builds a byte-level GGUF tokenizer as GPT2Tokenizer, whose unknown token
    # "<|endoftext|>" is appended when the vocabulary lacks it (SmolLM2's has it, at id 0):
    # name the unknown token so, keeping the vocabulary at the model's size
    tokens[unk] = "<|endoftext|>"
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    special = {a["id"] for a in tok.get("added_tokens", [])}

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(len(tokens))])
    w.add_token_merges(merges)
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_unk_token_id(unk)
    w.add_pad_token_id(pad)
    w.add_add_bos_token(True)

    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        w.add_tensor("output.weight", sd["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], heads))
        w.add_tensor(f"blk.{i}.attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], kv_heads))
        w.add_tensor(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        w.add_tensor(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_non_gguf_files(folder: Path) -> dict[str, Path]:
    """Files that are not loadable GGUF checkpoints, by what is wrong with them."""
    import gguf

    folder.mkdir(parents=True, exist_ok=True)
    out = {"text": folder / "notes.gguf", "header_only": folder / "header.gguf", "architecture": folder / "arch.gguf"}
    out["text"].write_text("this is not a model\n")
    out["header_only"].write_bytes(b"GGUF\x03\x00\x00\x00")  # the magic and a version, then nothing
    w = gguf.GGUFWriter(str(out["architecture"]), "no-such-architecture")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 2), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
