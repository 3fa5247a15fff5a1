"""Per-row statistics follow shared/METRICS.md: ``mean_accepted_length`` is vLLM's mean
acceptance length, 1 + accepted / draft_steps (steps without a draft left out), and
``tokens_per_step`` = new_tokens / verify_steps counts every step."""

from __future__ import annotations

import pytest

from pipeline.engine import GenerationSettings, RowStats, SpeculationSettings, SpeculativeEngine

from tiny_models import build, check_stats, perturbed_copy, prompt_of


def test_row_stats_definitions():
    s = RowStats(new_tokens=9, verify_steps=5)
    s.record_draft(3, 3)  # fully accepted: 4 tokens from one step
    s.record_draft(2, 0)  # rejected at once: 1 token
    # three more steps without a draft (prompt-lookup misses): 1 token each
    assert s.draft_steps == 2
    assert s.mean_accepted_length == pytest.approx(1 + 3 / 2)
    assert s.tokens_per_step == pytest.approx(9 / 5)
    d = s.to_dict()
    assert d["draft_steps"] == 2 and d["mean_accepted_length"] == 2.5 and d["tokens_per_step"] == 1.8
    assert d["drafted_per_position"] == [2, 2, 1] and d["accepted_per_position"] == [1, 1, 1]


def test_plain_row_has_no_accepted_length_and_one_token_per_step():
    target = build("llama", seed=0)
    result = SpeculativeEngine(target).generate(prompt_of(9), GenerationSettings(max_new_tokens=12))
    d = result.stats.to_dict()
    assert d["draft_steps"] == 0 and d["mean_accepted_length"] is None and d["tokens_per_step"] == 1.0


def test_prompt_lookup_misses_are_not_draft_steps():
    """A prompt-lookup miss is a plain step: it counts in tokens_per_step, not in the mean
    accepted length, which therefore exceeds tokens_per_step."""
    target = build("llama", seed=0)
    engine = SpeculativeEngine(target, SpeculationSettings(method="prompt_lookup", prompt_lookup_num_tokens=4))
    drafts = []
    propose = engine.proposer.propose

    def counting(requests):
        out = propose(requests)
        drafts.extend(len(d) for d in out)
        return out

    engine.proposer.propose = counting
    prompt = prompt_of(12, seed=1)
    result = engine.generate(prompt, GenerationSettings(max_new_tokens=60))
    s = result.stats
    check_stats(result, 4)
    assert s.draft_steps == sum(1 for n in drafts if n) and 0 < s.draft_steps < s.verify_steps
    assert s.accepted_tokens > 0
    assert s.mean_accepted_length == pytest.approx(1 + s.accepted_tokens / s.draft_steps)
    assert s.mean_accepted_length > s.tokens_per_step == pytest.approx(s.new_tokens / s.verify_steps)


def test_draft_model_drafts_every_step():
    """A draft model drafts at every step but the last (budget), so both figures nearly agree."""
    target = build("llama", seed=0)
    engine = SpeculativeEngine(target, SpeculationSettings(method="draft_model", num_assistant_tokens=3),
                               drafter=perturbed_copy(target, 0.3))
    result = engine.generate(prompt_of(9), GenerationSettings(max_new_tokens=40))
    check_stats(result, 3)
    s = result.stats
    assert s.verify_steps - 1 <= s.draft_steps <= s.verify_steps
