"""Speculative sampling leaves the target's output distribution unchanged.

On a 16-token vocabulary, the first two generated tokens of thousands of seeded rows are
compared (chi-square) with the exact distribution the target defines under the same
logits processors (temperature != 1, top-k < vocabulary, top-p, repetition penalty; and
min-p with a no-repeat n-gram ban).  Seeds are fixed, so the test is deterministic.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from pipeline.engine import GenerationSettings, SpeculationSettings, SpeculativeEngine
from pipeline.engine.sampling import LogitsShaper

from tiny_models import build, perturbed_copy

V = 16
RUNS = 2000
SETTINGS = dict(do_sample=True, temperature=0.7, top_k=11, top_p=0.95, repetition_penalty=1.2)
PROMPT = torch.tensor([[3, 7, 3, 7, 3, 7, 3]])  # repeats, so prompt lookup always proposes


@pytest.fixture(scope="module")
def tiny_vocab_pair():
    target = build("llama", vocab=V, hidden=32, seed=11, initializer_range=0.3)
    drafter = perturbed_copy(target, 1.0, seed=12)
    return target, drafter


def exact_two_token_distribution(target, settings: dict = SETTINGS, prompt=PROMPT) -> dict[tuple[int, int], float]:
    """P(first two tokens) under ``settings``; the second token's processors see the first."""
    shaper = LogitsShaper(GenerationSettings(max_new_tokens=2, **settings), prompt_length=prompt.shape[1])
    with torch.no_grad():
        p1 = shaper.probs(prompt, target(prompt).logits[0, -1:])[0]
        dist = {}
        for t1 in range(V):
            if p1[t1] == 0:
                continue
            seq = torch.cat([prompt, torch.tensor([[t1]])], dim=1)
            p2 = shaper.probs(seq, target(seq).logits[0, -1:])[0]
            for t2 in range(V):
                dist[(t1, t2)] = float(p1[t1] * p2[t2])
    return dist


def chi_square_p_value(samples: Counter, exact: dict) -> float:
    observed, expected, rest_o, rest_e = [], [], 0, 0.0
    for cell, prob in exact.items():
        e = prob * RUNS
        if e >= 5:
            observed.append(samples.get(cell, 0))
            expected.append(e)
        else:
            rest_o += samples.get(cell, 0)
            rest_e += e
    if any(cell not in exact for cell in samples) or (rest_o and not rest_e):
        return 0.0  # a pair the target can never produce was sampled
    if rest_e:
        observed.append(rest_o)
        expected.append(rest_e)
    return chisquare(observed, expected).pvalue


def sample_first_two_tokens(engine, settings: dict = SETTINGS, prompt=PROMPT) -> tuple[Counter, int, int]:
    """Run ``RUNS`` seeded rows (budget 3, so with k=2 both tokens come from one
    verification: positions 1 and 2 of a draft); return the counts of the first two
    generated tokens, and the drafted and accepted totals."""
    samples: Counter = Counter()
    drafted = accepted = 0
    for seed in range(RUNS):
        result = engine.generate(prompt, GenerationSettings(max_new_tokens=3, seed=seed, **settings))
        samples[tuple(result.token_ids[:2])] += 1
        drafted += result.stats.draft_tokens
        accepted += result.stats.accepted_tokens
    return samples, drafted, accepted


@pytest.mark.parametrize("method", ["plain", "draft_model", "prompt_lookup"])
@pytest.mark.slow
def test_first_two_tokens_follow_target_distribution(tiny_vocab_pair, method):
    target, drafter = tiny_vocab_pair
    exact = exact_two_token_distribution(target)
    assert len(exact) > 20  # a real distribution, not near one-hot
    engine = SpeculativeEngine(
        target,
        SpeculationSettings(method=method, num_assistant_tokens=2, prompt_lookup_num_tokens=2),
        drafter=drafter if method == "draft_model" else None,
    )
    samples, drafted, accepted = sample_first_two_tokens(engine)
    if method != "plain":
        assert 50 < accepted < drafted - 50  # acceptance and rejection paths both ran
    assert chi_square_p_value(samples, exact) > 1e-3


#: min-p and a trigram ban.  On this prompt prompt lookup copies 10, 11 after the last 12,
#: and 10 is the target's likeliest first token; the ban removes 11 after (12, 10) (the
#: trigram 12 10 11 is in the prompt), so at draft position 2 the verifier (and the
#: drafter) must see the drafted 10 in the prefix.
FILTERS = dict(do_sample=True, temperature=0.8, min_p=0.08, no_repeat_ngram_size=3)
FILTER_PROMPT = torch.tensor([[5, 6, 1, 12, 10, 11, 12]])


@pytest.mark.slow
@pytest.mark.parametrize("method", ["draft_model", "prompt_lookup"])
def test_min_p_and_no_repeat_ngram_follow_target_distribution(tiny_vocab_pair, method):
    target, drafter = tiny_vocab_pair
    exact = exact_two_token_distribution(target, FILTERS, FILTER_PROMPT)
    unfiltered = exact_two_token_distribution(target, dict(do_sample=True, temperature=0.8), FILTER_PROMPT)
    possible = {cell for cell, p in exact.items() if p > 0}
    # both processors act: min-p removes unlikely tokens, the ban removes 11 after 12 10
    assert (10, 11) not in possible and unfiltered[(10, 11)] > 0.1
    assert len(possible) < len([c for c, p in unfiltered.items() if p > 0]) - 20
    engine = SpeculativeEngine(
        target,
        SpeculationSettings(method=method, num_assistant_tokens=2, prompt_lookup_num_tokens=2),
        drafter=drafter if method == "draft_model" else None,
    )
    samples, drafted, accepted = sample_first_two_tokens(engine, FILTERS, FILTER_PROMPT)
    assert 50 < accepted < drafted - 50  # acceptance and rejection paths both ran
    assert not set(samples) - possible  # nothing min-p or the ban removed was emitted
    assert chi_square_p_value(samples, exact) > 1e-3


def test_sampling_is_reproducible_per_seed(tiny_vocab_pair):
    target, drafter = tiny_vocab_pair
    engine = SpeculativeEngine(target, SpeculationSettings(method="draft_model", num_assistant_tokens=3), drafter=drafter)
    runs = [engine.generate(PROMPT, GenerationSettings(max_new_tokens=20, seed=s, **SETTINGS)).token_ids for s in (1, 1, 2)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


@pytest.mark.slow
def test_wrong_verifier_is_detected(tiny_vocab_pair, monkeypatch):
    """The test has teeth: a verifier that accepts every draft token fails it."""
    import pipeline.engine.verify as verify

    target, drafter = tiny_vocab_pair
    exact = exact_two_token_distribution(target)
    monkeypatch.setattr(verify, "verify_sampling", lambda d, p, q, g, w=None: (len(d), int(torch.multinomial(p[len(d)], 1, generator=g))))
    engine = SpeculativeEngine(target, SpeculationSettings(method="draft_model", num_assistant_tokens=2), drafter=drafter)
    samples = Counter(
        tuple(engine.generate(PROMPT, GenerationSettings(max_new_tokens=3, seed=s, **SETTINGS)).token_ids[:2])
        for s in range(RUNS)
    )
    assert chi_square_p_value(samples, exact) < 1e-6
