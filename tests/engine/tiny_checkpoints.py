"""Tiny random checkpoints written in the real layout (``save_pretrained``) and loaded back
through ``from_pretrained`` / ``AutoTokenizer``, for early exit and universal assisted
decoding: a LayerSkip-style Llama and two different byte-level BPE tokenizers trained on
tinyshakespeare, with Llama models of matching vocabularies."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

# ../shared/data beside the checkout (as in CI); SHARED_DATA overrides
SHARED_DATA = Path(os.environ.get("SHARED_DATA", Path(__file__).resolve().parents[3] / "shared" / "data"))
SHAKESPEARE = SHARED_DATA / "tinyshakespeare" / "input.txt"


def shakespeare_lines(n: int = 400, start: int = 0) -> list[str]:
    lines = [line for line in SHAKESPEARE.read_text().splitlines() if line.strip()]
    return lines[start : start + n]


def load_model(path, dtype=torch.float64):
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def layerskip_llama(path, layers: int = 4, vocab: int = 96, hidden: int = 32, seed: int = 0, deep_scale: float = 0.3,
                   initializer_range: float = 0.2):
    """A LayerSkip-style Llama 3.2 checkpoint in miniature (tied embeddings, llama3 RoPE
    scaling, ``LlamaForCausalLM``), saved to ``path`` and loaded back in float64.

    LayerSkip trains the early layers to predict through the final norm and LM head; here
    the later layers' residual contributions are scaled by ``deep_scale`` instead, so an
    early exit agrees with the full model often but not always.
    """
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        initializer_range=initializer_range, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers[layers // 2 :]:
            layer.self_attn.o_proj.weight.mul_(deep_scale)
            layer.mlp.down_proj.weight.mul_(deep_scale)
    model.save_pretrained(path)
    return load_model(path)


def bpe_tokenizer(path, vocab_size: int, lines: list[str], bos: str, eos: str):
    """A byte-level BPE tokenizer trained on ``lines`` that adds ``bos``; saved to
    ``path`` and loaded back with ``AutoTokenizer``.  Byte-level: any text round-trips."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[bos, eos], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(lines, trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos)
    fast.save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def llama_for(tokenizer, path, hidden: int = 32, layers: int = 2, seed: int = 0, dtype=torch.float64):
    """A random Llama whose vocabulary is the tokenizer's, saved with it and loaded back."""
    cfg = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=None, pad_token_id=None,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return load_model(path, dtype)


def train_lm(model, tokenizer, lines: list[str], steps: int = 150, seq: int = 48, batch: int = 16, lr: float = 1e-2,
             seed: int = 0):
    """A few hundred steps of next-token training on ``lines`` (so two models trained on
    the same text agree on common continuations).  In place; returns the model in eval mode."""
    ids = tokenizer("\n".join(lines), add_special_tokens=False, return_tensors="pt").input_ids[0]
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, ids.numel() - seq - 1, (batch,), generator=gen)
        x = torch.stack([ids[s : s + seq] for s in starts.tolist()])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()
