"""Tiny random models for the engine tests, built from configs (no hub), in float64."""

from __future__ import annotations

import copy

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

VOCAB = 96
NO_SPECIAL = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _llama(vocab=VOCAB, hidden=32, layers=2, seed=0, **kw):
    heads = dict(num_attention_heads=4, num_key_value_heads=2)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      max_position_embeddings=256, **{**NO_SPECIAL, **heads, **kw})
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def _qwen2(vocab=VOCAB, hidden=32, layers=2, seed=0, **kw):
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, **{**NO_SPECIAL, **kw})
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg)


def _neox(vocab=VOCAB, hidden=32, layers=2, seed=0, **kw):
    cfg = GPTNeoXConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                        num_attention_heads=4, max_position_embeddings=256, **{**NO_SPECIAL, **kw})
    torch.manual_seed(seed)
    return GPTNeoXForCausalLM(cfg)


def _gpt2(vocab=VOCAB, hidden=32, layers=2, seed=0, **kw):
    cfg = GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=4, n_positions=256, **{**NO_SPECIAL, **kw})
    torch.manual_seed(seed)
    return GPT2LMHeadModel(cfg)


BUILDERS = {"llama": _llama, "qwen2": _qwen2, "gpt_neox": _neox, "gpt2": _gpt2}


def build(arch: str, **kw):
    """A tiny random causal LM of ``arch`` in float64, eval mode."""
    return BUILDERS[arch](**kw).double().eval()


def perturbed_copy(model, scale: float, seed: int = 1):
    """A drafter that agrees with ``model`` often but not always: its weights plus noise."""
    drafter = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale * p.std().clamp_min(1e-3))
    return drafter


def bracket_tokenizer(vocab: int = VOCAB) -> PreTrainedTokenizerFast:
    """Ids 0-5 are the letters ``a``-``f``; the others are ``<xy>`` bracket tokens.

    Decoding concatenates token strings, so a bracket token's text occurs in a decoded
    text only where that token is: stop strings are easy to place.  transformers'
    ``StopStringCriteria`` handles it (it tokenizes ``abcdef``).
    """
    from itertools import product

    from tokenizers import Tokenizer, decoders, models

    letters = "abcdef"
    pieces = list(letters) + [f"<{x}{y}>" for x, y in product("ghijklmnopqrstuvwxyz", repeat=2)]
    tok = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces[:vocab])}, merges=[], unk_token="a"))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="a")


def prompt_of(length: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    """``(1, length)`` int64 prompt with repeats, so n-grams recur."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randint(0, vocab, (max(1, length // 3 + 1),), generator=gen)
    return base.repeat(4)[:length].view(1, -1)


def check_stats(result, k: int | None = None) -> None:
    """The statistics add up (docs/metrics.md)."""
    s = result.stats
    assert s.new_tokens == len(result.token_ids)
    assert 0 <= s.accepted_tokens <= s.draft_tokens
    assert s.finish_reason == result.finish_reason
    assert sum(s.drafted_per_position) == s.draft_tokens
    assert sum(s.accepted_per_position) == s.accepted_tokens
    assert all(a <= d for a, d in zip(s.accepted_per_position, s.drafted_per_position))
    # accepted counts can only fall with the position
    assert all(x >= y for x, y in zip(s.accepted_per_position, s.accepted_per_position[1:]))
    if result.finish_reason == "length":
        assert s.new_tokens == s.accepted_tokens + s.verify_steps
    else:  # a stop inside the last block cuts its target token (and counts only emitted drafts)
        assert s.new_tokens in (s.accepted_tokens + s.verify_steps, s.accepted_tokens + s.verify_steps - 1)
    # draft steps: verify steps with a non-empty draft (every draft reaches position 1)
    assert s.draft_steps == (s.drafted_per_position[0] if s.drafted_per_position else 0) <= s.verify_steps
    if s.draft_steps:
        assert s.mean_accepted_length == 1 + s.accepted_tokens / s.draft_steps
    else:
        assert s.mean_accepted_length is None
    assert s.tokens_per_step == s.new_tokens / s.verify_steps
    if k is not None:
        assert len(s.drafted_per_position) <= k
    assert s.wall_time_s >= s.draft_time_s + s.prefill_time_s + s.verify_time_s - 1e-6
    assert s.prefill_time_s > 0 or s.prompt_tokens == 1  # a 1-token prompt needs no prefill


#: the JSON tokenizer's pieces longer than one character (each is also built from its prefixes)
JSON_PIECES = ('{"', '": ', '": "', '", "', '"}', '"]', '["', '", ', '"name', '"tags', '"kind', '"n"', 'red', 'green',
               'blue', 'alpha', 'beta', '], "')


def json_tokenizer(vocab: int = VOCAB, pieces: tuple[str, ...] = JSON_PIECES) -> PreTrainedTokenizerFast:
    """A BPE tokenizer for JSON with real token strings (the grammar library reads them):
    ``<eos>`` (id 0, the EOS token), the characters of JSON (braces, quotes, digits, letters,
    space), and merged ``pieces`` (:data:`JSON_PIECES` and their prefixes), so that a text has
    several tokenizations, as a real vocabulary does (``pieces=()``: characters only, one
    tokenization per text); ids up to ``vocab`` (unused ids are
    ``<uN>`` specials).  Byte-level, as GPT-2's and SmolLM2's are (a space is ``Ġ``)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    chars = list('{}[]":, -.') + [str(d) for d in range(10)] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    merged, (pieces, merges) = pieces, (["<eos>"] + chars, [])
    for p in merged:
        for j in range(2, len(p) + 1):
            if p[:j] not in pieces:
                pieces.append(p[:j])
                merges.append((p[: j - 1], p[j - 1]))
    assert len(pieces) <= vocab, len(pieces)
    pieces += [f"<u{i}>" for i in range(vocab - len(pieces))]
    byte = str.maketrans(" ", "\u0120")  # GPT-2's byte-to-unicode map on this alphabet: only the space moves
    pieces = [p.translate(byte) for p in pieces]
    merges = [(a.translate(byte), b.translate(byte)) for a, b in merges]
    tok = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<eos>", special=True)] + [AddedToken(p, special=True) for p in pieces
                                                                  if p.startswith("<u")])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
