"""Static ensemble verification (``assistant_ensemble_weight=w``) with the draft model and
early exit: drafts are accepted against the mixture ``w*p + (1-w)*q`` (lossy).

Greedy equals transformers ``generate(..., assistant_ensemble_weight=w)``; acceptance is
higher than lossless verification on the same seeds; on a 16-token vocabulary the first
two sampled tokens follow the mixture-verified distribution computed exactly (and not the
target's).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import test_sampling as ts
from pipeline.engine import GenerationSettings, SpeculationSettings, SpeculativeEngine
from pipeline.engine.sampling import LogitsShaper
from tiny_models import build, check_stats, perturbed_copy, prompt_of

K = 3
W = 0.7


@pytest.fixture(scope="module")
def models():
    target = build("llama", layers=3, seed=0)
    drafter = perturbed_copy(target, 0.5)
    for m in (target, drafter):  # the assistant's config for draft_model, the target's own for early exit
        m.generation_config.num_assistant_tokens = K
        m.generation_config.num_assistant_tokens_schedule = "constant"
        m.generation_config.assistant_confidence_threshold = 0.0
    return target, drafter


def engines(target, drafter, weight):
    return {
        "draft_model": SpeculativeEngine(
            target, SpeculationSettings(method="draft_model", num_assistant_tokens=K, assistant_ensemble_weight=weight),
            drafter=drafter),
        "early_exit": SpeculativeEngine(
            target, SpeculationSettings(method="early_exit", assistant_early_exit=1, num_assistant_tokens=K,
                                        assistant_ensemble_weight=weight)),
    }


def hf_generate(target, prompt, max_new_tokens, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = target.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False, **kw)
    return out[0, prompt.shape[1]:].tolist()


@pytest.mark.parametrize("weight", [0.3, W])
def test_greedy_matches_generate(models, weight):
    target, drafter = models
    hf_kw = {"draft_model": dict(assistant_model=drafter), "early_exit": dict(assistant_early_exit=1)}
    changed = 0
    for seed in range(3):
        prompt = prompt_of(12, seed=seed)
        plain = hf_generate(target, prompt, 40)
        for method, engine in engines(target, drafter, weight).items():
            result = engine.generate(prompt, GenerationSettings(max_new_tokens=40))
            assert result.token_ids == hf_generate(target, prompt, 40, assistant_ensemble_weight=weight,
                                                   **hf_kw[method]), (method, seed)
            check_stats(result, K)
            changed += result.token_ids != plain
    assert changed > 0  # lossy: it does change outputs


@pytest.mark.parametrize("do_sample", [False, True])
def test_acceptance_is_higher_than_lossless(models, do_sample):
    target, drafter = models
    settings = dict(max_new_tokens=40, do_sample=do_sample, temperature=0.8)
    lossless, ensemble = engines(target, drafter, None), engines(target, drafter, W)
    for method in lossless:
        rates = []
        for engs in (lossless, ensemble):
            results = [engs[method].generate(prompt_of(12, seed=s), GenerationSettings(seed=s, **settings))
                       for s in range(4)]
            for r in results:
                check_stats(r, K)
            rates.append(sum(r.stats.accepted_tokens for r in results) / sum(r.stats.draft_tokens for r in results))
        assert rates[0] < rates[1] < 1, (method, do_sample, rates)


def exact_mixture_two_token_distribution(target, drafter, weight) -> dict[tuple[int, int], float]:
    """P(t1, t2) = v(t1 | prompt) * v(t2 | prompt, t1), v = w*p + (1-w)*q, p and q after the
    same logits processors (both tokens lie at draft positions: k = 2, budget 3)."""
    shaper = LogitsShaper(GenerationSettings(max_new_tokens=2, **ts.SETTINGS))

    def mix(seq):
        p = shaper.probs(seq, target(seq).logits[0, -1:])[0]
        q = shaper.probs(seq, drafter(seq).logits[0, -1:])[0]
        return weight * p + (1 - weight) * q

    dist = {}
    with torch.no_grad():
        v1 = mix(ts.PROMPT)
        for t1 in range(ts.V):
            if v1[t1] == 0:
                continue
            v2 = mix(torch.cat([ts.PROMPT, torch.tensor([[t1]])], dim=1))
            for t2 in range(ts.V):
                if v2[t2] > 0:
                    dist[(t1, t2)] = float(v1[t1] * v2[t2])
    return dist


@pytest.mark.slow
def test_output_follows_the_mixture_distribution():
    target = build("llama", vocab=ts.V, hidden=32, seed=11, initializer_range=0.3)
    drafter = perturbed_copy(target, 1.0, seed=12)
    weight = 0.5
    exact = exact_mixture_two_token_distribution(target, drafter, weight)
    assert abs(sum(exact.values()) - 1) < 1e-9 and len(exact) > 20
    engine = SpeculativeEngine(target, SpeculationSettings(method="draft_model", num_assistant_tokens=2,
                                                           assistant_ensemble_weight=weight), drafter=drafter)
    samples, drafted, accepted = ts.sample_first_two_tokens(engine)
    assert 50 < accepted < drafted - 50  # acceptance and rejection paths both ran
    assert ts.chi_square_p_value(samples, exact) > 1e-3
    # teeth: the same samples do not follow the target's own (lossless) distribution
    assert ts.chi_square_p_value(samples, ts.exact_two_token_distribution(target)) < 1e-6


@pytest.mark.parametrize("method", ["plain", "prompt_lookup"])
def test_refused_without_draft_logits(models, method):
    target, _ = models
    with pytest.raises(ValueError, match="assistant_ensemble_weight"):
        SpeculativeEngine(target, SpeculationSettings(method=method, assistant_ensemble_weight=W))


def test_batched_rows_equal_their_single_row_ensemble_output(models):
    """In a batch each row gets the (lossy) output it gets alone: the draft length is fixed
    (the controller is, since the mixture's output depends on it), even when asked for "auto"."""
    target, drafter = models
    prompts = [prompt_of(n, seed=n) for n in (12, 3, 30, 7, 1)]
    settings = GenerationSettings(max_new_tokens=25)
    for method, engine in engines(target, drafter, W).items():
        alone = [engine.generate(p, settings).token_ids for p in prompts]
        batched = SpeculativeEngine(target, engine.spec, drafter=drafter if method == "draft_model" else None,
                                    max_batch_size=3, draft_length="auto")
        assert batched.controller.fixed
        assert [r.token_ids for r in batched.generate_batch(prompts, settings)] == alone, method
