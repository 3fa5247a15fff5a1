"""Stops inside an accepted block, and budgets that end mid-draft, match plain decoding."""

from __future__ import annotations

import math
import warnings

import pytest

from pipeline.engine import GenerationSettings, SpeculationSettings, SpeculativeEngine

from tiny_models import check_stats, prompt_of, bracket_tokenizer

K = 4


def engines(target, drafter, tokenizer=None):
    return {
        "plain": SpeculativeEngine(target, SpeculationSettings(method="plain"), tokenizer=tokenizer),
        "oracle": SpeculativeEngine(target, SpeculationSettings(method="draft_model", num_assistant_tokens=K),
                                    drafter=target, tokenizer=tokenizer),
        "draft_model": SpeculativeEngine(target, SpeculationSettings(method="draft_model", num_assistant_tokens=K),
                                         drafter=drafter, tokenizer=tokenizer),
        "prompt_lookup": SpeculativeEngine(target, SpeculationSettings(method="prompt_lookup", prompt_lookup_num_tokens=K),
                                           tokenizer=tokenizer),
    }


def first_inside_block(tokens, k=K, start=1):
    """A position j whose token occurs first at j and lies inside an oracle block of k+1."""
    for j in range(start, len(tokens)):
        if tokens[j] not in tokens[:j] and j % (k + 1) != k and tokens[j] >= 6:
            return j
    pytest.skip("no suitable stop position in this random output")


@pytest.mark.parametrize("new_tokens", [7, 11, 23, 50])
def test_oracle_drafter_accepts_everything(llama_pair, new_tokens):
    target, _ = llama_pair
    engine = SpeculativeEngine(target, SpeculationSettings(method="draft_model", num_assistant_tokens=K), drafter=target)
    plain = SpeculativeEngine(target).generate(prompt_of(6), GenerationSettings(max_new_tokens=new_tokens))
    result = engine.generate(prompt_of(6), GenerationSettings(max_new_tokens=new_tokens))
    assert result.token_ids == plain.token_ids
    assert result.stats.acceptance_rate == 1.0
    assert result.stats.verify_steps == math.ceil(new_tokens / (K + 1))
    # the budget ends mid-draft: the last draft was capped to the remaining budget minus one
    assert result.stats.new_tokens == new_tokens
    check_stats(result, K)


def test_eos_inside_accepted_block(llama_pair):
    target, drafter = llama_pair
    prompt = prompt_of(6)
    free = SpeculativeEngine(target).generate(prompt, GenerationSettings(max_new_tokens=60)).token_ids
    j = first_inside_block(free)
    eos = free[j]
    settings = GenerationSettings(max_new_tokens=60, eos_token_id=[1000, eos])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = target.generate(prompt, max_new_tokens=60, do_sample=False, eos_token_id=eos, pad_token_id=eos)[0, 6:].tolist()
    assert ref == free[: j + 1]
    for name, engine in engines(target, drafter).items():
        result = engine.generate(prompt, settings)
        assert result.token_ids == ref, name
        assert result.finish_reason == "stop"
        check_stats(result, K)
        if name == "oracle":
            steps = j // (K + 1) + 1
            assert result.stats.verify_steps == steps
            # the stop landed on a draft token: the block's target token was cut
            assert result.stats.new_tokens == result.stats.accepted_tokens + steps - 1
            assert result.stats.accepted_tokens == (steps - 1) * K + j % (K + 1) + 1


def test_stop_string_inside_accepted_block(llama_pair):
    target, drafter = llama_pair
    tok = bracket_tokenizer(target.config.vocab_size)
    prompt = prompt_of(6)
    free = SpeculativeEngine(target).generate(prompt, GenerationSettings(max_new_tokens=60)).token_ids
    j = first_inside_block(free, start=2)
    # one-token stop string: transformers' StopStringCriteria agrees
    stop = tok.decode([free[j]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = target.generate(prompt, max_new_tokens=60, do_sample=False, stop_strings=[stop], tokenizer=tok)[0, 6:].tolist()
    assert ref == free[: j + 1]
    # two-token stop string, completed by the token at j: compared with our plain decoding
    two = tok.decode(free[j - 1 : j + 1])
    for stops, expected in (([stop], ref), ([two, "never"], free[: j + 1])):
        for name, engine in engines(target, drafter, tok).items():
            result = engine.generate(prompt, GenerationSettings(max_new_tokens=60, stop_strings=stops))
            assert result.token_ids == expected, (name, stops)
            assert result.finish_reason == "stop"
            assert result.text == tok.decode(expected)
            assert result.text.endswith(stops[0])
            check_stats(result, K)


def test_budget_ends_mid_draft_for_every_method(llama_pair):
    target, drafter = llama_pair
    prompt = prompt_of(12, seed=7)
    for budget in (1, 2, 3, 6, 9):
        plain = SpeculativeEngine(target).generate(prompt, GenerationSettings(max_new_tokens=budget))
        for name, engine in engines(target, drafter).items():
            result = engine.generate(prompt, GenerationSettings(max_new_tokens=budget))
            assert result.token_ids == plain.token_ids, (name, budget)
            assert result.finish_reason == "length"
            assert result.stats.new_tokens == budget
            check_stats(result, K)


def test_budget_capped_by_context(llama_pair):
    """A full context window ends the row with finish reason ``context``; ``length`` stays
    for ``max_new_tokens``, even when both end at the same token."""
    target, drafter = llama_pair
    context = target.config.max_position_embeddings
    prompt = prompt_of(context - 3)
    for engine in (SpeculativeEngine(target),
                   SpeculativeEngine(target, SpeculationSettings(method="draft_model", num_assistant_tokens=K),
                                     drafter=drafter)):
        result = engine.generate(prompt, GenerationSettings(max_new_tokens=50))
        assert result.stats.new_tokens == 3 and result.finish_reason == "context"
        assert engine.generate(prompt, GenerationSettings(max_new_tokens=3)).finish_reason == "length"
        assert engine.generate(prompt, GenerationSettings(max_new_tokens=2)).finish_reason == "length"
    with pytest.raises(ValueError, match="max_position_embeddings"):
        SpeculativeEngine(target).generate(prompt_of(context), GenerationSettings(max_new_tokens=5))
