"""The lazy output layer (pipeline/engine/lazy_head.py): greedy verification that evaluates
the target's head only where it reads it gives plain greedy's output, alone and in batches,
position by position or in stages, with EOS and stop strings inside accepted blocks and
budgets that end mid-draft; and it evaluates fewer positions than the full head."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM

from pipeline.engine import GenerationSettings, SpeculationSettings, SpeculativeEngine
from pipeline.engine.lazy_head import LazyHead, best_chunk

from tiny_models import build, perturbed_copy, prompt_of

K = 4


def _gemma2():
    cfg = Gemma2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, max_position_embeddings=256, sliding_window=8,
                       final_logit_softcapping=3.0, attn_implementation="eager", bos_token_id=None, eos_token_id=None,
                       pad_token_id=None)
    torch.manual_seed(5)
    return Gemma2ForCausalLM(cfg).double().eval()


@pytest.fixture(scope="module", params=["llama", "gemma2"])
def pair(request):
    target = build("llama", seed=0) if request.param == "llama" else _gemma2()
    return request.param, target, perturbed_copy(target, 0.3)


def _engines(target, drafter, batch):
    for chunk in (1, 2, True):
        for method, spec in (("draft_model", SpeculationSettings(method="draft_model", num_assistant_tokens=K)),
                             ("prompt_lookup", SpeculationSettings(method="prompt_lookup", prompt_lookup_num_tokens=K))):
            yield chunk, method, SpeculativeEngine(target, spec, drafter=drafter if method == "draft_model" else None,
                                                   max_batch_size=batch, lazy_output_layer=chunk,
                                                   adaptive_draft_length=False)


def test_lazy_head_probe_passes_and_outputs_equal_plain(pair):
    name, target, drafter = pair
    prompts = [prompt_of(n, seed=n, vocab=target.config.vocab_size) for n in (3, 17, 9, 30, 5)]
    budgets = [1, 2, 7, 25, 40]  # some end mid-draft
    plain = [SpeculativeEngine(target).generate(p, GenerationSettings(max_new_tokens=b)).token_ids
             for p, b in zip(prompts, budgets)]
    for chunk, method, engine in _engines(target, drafter, 3):
        results = engine.generate_batch(prompts, [GenerationSettings(max_new_tokens=b) for b in budgets])
        assert engine.lazy is not None, (name, chunk, method)  # the probe reproduced the model's logits
        assert [r.token_ids for r in results] == plain, (name, chunk, method)
        alone = engine.generate(prompts[3], GenerationSettings(max_new_tokens=25))
        assert alone.token_ids == plain[3]
    # drafts were made and partly rejected, so the early stop was exercised
    stats = [r.stats for r in results]
    assert 0 < sum(s.accepted_tokens for s in stats) < sum(s.draft_tokens for s in stats)


def test_eos_and_stop_strings_inside_accepted_blocks():
    target = build("llama", seed=0)
    oracle = perturbed_copy(target, 0.0)  # every draft accepted: stops land inside blocks
    prompt = prompt_of(12, seed=4)
    free = SpeculativeEngine(target).generate(prompt, GenerationSettings(max_new_tokens=30)).token_ids
    eos = free[9]
    want = SpeculativeEngine(target).generate(prompt, GenerationSettings(max_new_tokens=30, eos_token_id=eos)).token_ids
    engine = SpeculativeEngine(target, SpeculationSettings(method="draft_model", num_assistant_tokens=K), drafter=oracle,
                               lazy_output_layer=1, adaptive_draft_length=False)
    got = engine.generate(prompt, GenerationSettings(max_new_tokens=30, eos_token_id=eos))
    assert got.token_ids == want and got.finish_reason == "stop"


def test_it_evaluates_fewer_positions_than_the_full_head(pair, monkeypatch):
    name, target, drafter = pair
    noisy = perturbed_copy(target, 2.0, seed=3)  # drafts mostly rejected at once
    evaluated = []
    real = LazyHead.logits

    def counting(self, hidden):
        evaluated.append(hidden.shape[0] if hidden.dim() == 2 else hidden.shape[0] * hidden.shape[1])
        return real(self, hidden)

    monkeypatch.setattr(LazyHead, "logits", counting)
    engine = SpeculativeEngine(target, SpeculationSettings(method="draft_model", num_assistant_tokens=K), drafter=noisy,
                               max_batch_size=4, lazy_output_layer=1, adaptive_draft_length=False)
    prompts = [prompt_of(n, seed=n, vocab=target.config.vocab_size) for n in (4, 8, 12, 16)]
    evaluated.clear()
    results = engine.generate_batch(prompts, GenerationSettings(max_new_tokens=20))
    steps = max(r.stats.verify_steps for r in results)
    full = sum(r.stats.verify_steps for r in results) * (K + 1)  # at most what the full head would compute
    assert 0 < sum(evaluated) < 0.6 * full, (sum(evaluated), full, steps)


def test_best_chunk_follows_the_measured_costs():
    # a head whose call costs the same up to 16 positions (memory-bound): one stage of everything
    flat = {1: 1.0, 16: 1.0, 64: 4.0}
    assert best_chunk([0.5, 0.25, 0.1], flat, rows=1, keep=4) == 4
    # a head whose cost grows with every position (compute-bound): position by position
    linear = {1: 1.0, 64: 64.0}
    assert best_chunk([0.5, 0.25, 0.1], linear, rows=8, keep=4) == 1
