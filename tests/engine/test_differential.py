"""Our greedy tokens equal transformers ``generate()``'s, method for method.

Tiny random models of four architectures in float64; prompt lengths 1, 2, 3, 17;
``max_new_tokens`` 1, 2 and 50.
"""

from __future__ import annotations

import warnings

import pytest

from pipeline.engine import GenerationSettings, SpeculationSettings, SpeculativeEngine

from tiny_models import build, check_stats, perturbed_copy, prompt_of

from coverage import DIFFERENTIAL_ARCHS as ARCHS, DIFFERENTIAL_METHODS
PROMPT_LENGTHS = [1, 2, 3, 17]
BUDGETS = [1, 2, 50]
K = 3


@pytest.fixture(scope="module", params=ARCHS)
def arch_models(request):
    target = build(request.param, seed=0)
    drafter = perturbed_copy(target, 0.3)  # agrees often, not always
    drafter.generation_config.num_assistant_tokens = K
    drafter.generation_config.num_assistant_tokens_schedule = "constant"
    drafter.generation_config.assistant_confidence_threshold = 0.0
    return request.param, target, drafter


def hf_generate(target, prompt, max_new_tokens, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = target.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False, **kw)
    return out[0, prompt.shape[1]:].tolist()


@pytest.mark.parametrize("prompt_len", PROMPT_LENGTHS)
@pytest.mark.parametrize("max_new_tokens", BUDGETS)
def test_greedy_matches_generate(arch_models, prompt_len, max_new_tokens):
    arch, target, drafter = arch_models
    prompt = prompt_of(prompt_len, seed=prompt_len)
    settings = GenerationSettings(max_new_tokens=max_new_tokens)
    plain_ref = hf_generate(target, prompt, max_new_tokens)
    cases = {
        "plain": (SpeculativeEngine(target, SpeculationSettings(method="plain")), plain_ref),
        "draft_model": (
            SpeculativeEngine(target, SpeculationSettings(method="draft_model", num_assistant_tokens=K), drafter=drafter),
            hf_generate(target, prompt, max_new_tokens, assistant_model=drafter),
        ),
        "prompt_lookup": (
            SpeculativeEngine(target, SpeculationSettings(method="prompt_lookup", prompt_lookup_num_tokens=K)),
            hf_generate(target, prompt, max_new_tokens, prompt_lookup_num_tokens=K, max_matching_ngram_size=2),
        ),
    }
    assert list(cases) == DIFFERENTIAL_METHODS  # what the architecture list of docs/engine.md claims
    for method, (engine, reference) in cases.items():
        result = engine.generate(prompt, settings)
        assert result.token_ids == reference, (arch, method)
        assert result.token_ids == plain_ref, (arch, method)  # lossless
        assert result.finish_reason == "length"
        assert result.stats.prompt_tokens == prompt_len
        check_stats(result, K)


def test_partial_acceptance_is_exercised(arch_models):
    """The noisy drafter is neither always right nor always wrong, so rollback paths run."""
    _, target, drafter = arch_models
    engine = SpeculativeEngine(target, SpeculationSettings(method="draft_model", num_assistant_tokens=K), drafter=drafter)
    stats = [engine.generate(prompt_of(17, seed=s), GenerationSettings(max_new_tokens=50)).stats for s in range(3)]
    accepted = sum(s.accepted_tokens for s in stats)
    drafted = sum(s.draft_tokens for s in stats)
    assert 0 < accepted < drafted


def test_heuristic_schedule_is_lossless_and_adapts(llama_pair):
    target, _ = llama_pair
    engine = SpeculativeEngine(
        target,
        SpeculationSettings(method="draft_model", num_assistant_tokens=2, num_assistant_tokens_schedule="heuristic"),
        drafter=target,
    )
    prompt = prompt_of(5)
    result = engine.generate(prompt, GenerationSettings(max_new_tokens=40))
    assert result.token_ids == hf_generate(target, prompt, 40)
    # an oracle drafter is always fully accepted: k grows 2, 4, 6, ... (capped by the budget)
    assert len(result.stats.drafted_per_position) > 2
    assert result.stats.acceptance_rate == 1.0
    # state is per row: a second row starts again from k=2
    again = engine.generate(prompt, GenerationSettings(max_new_tokens=40))
    assert again.stats.to_dict()["drafted_per_position"] == result.stats.to_dict()["drafted_per_position"]


def test_repetition_penalty_greedy_matches_generate(llama_pair):
    target, drafter = llama_pair
    drafter.generation_config.num_assistant_tokens = 4
    drafter.generation_config.num_assistant_tokens_schedule = "constant"
    drafter.generation_config.assistant_confidence_threshold = 0.0
    prompt = prompt_of(9, seed=3)
    settings = GenerationSettings(max_new_tokens=30, repetition_penalty=1.5)
    ref = hf_generate(target, prompt, 30, repetition_penalty=1.5)
    for method, kw in [("plain", {}), ("draft_model", {"drafter": drafter}), ("prompt_lookup", {})]:
        engine = SpeculativeEngine(target, SpeculationSettings(method=method, num_assistant_tokens=4), **kw)
        assert engine.generate(prompt, settings).token_ids == ref, method


def test_drafter_with_padded_vocabulary(llama_pair):
    """A drafter whose embedding matrix is padded to more (or fewer) ids than the target's."""
    target, _ = llama_pair
    prompt = prompt_of(8, seed=4)
    ref = hf_generate(target, prompt, 30)
    for vocab in (target.config.vocab_size + 32, target.config.vocab_size - 6):
        drafter = build("llama", vocab=vocab, seed=5, layers=1)
        engine = SpeculativeEngine(target, SpeculationSettings(method="draft_model", num_assistant_tokens=3), drafter=drafter)
        result = engine.generate(prompt, GenerationSettings(max_new_tokens=30))
        assert result.token_ids == ref
        check_stats(result, 3)
