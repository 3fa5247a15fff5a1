"""The draft-length-by-load model (pipeline/engine/draft_length.py) on synthetic costs:
it returns the known optimum."""

from __future__ import annotations

import pytest

from pipeline.engine.draft_length import MIN_OBSERVATIONS, PROBE_EVERY, DraftLengthPolicy


def _policy(k_max, alpha, verify, draft_s, rows):
    """A policy that has seen per-position acceptance ``alpha ** (i + 1)``, verification
    passes costing ``verify(tokens)`` seconds, and ``draft_s`` seconds per drafted position."""
    p = DraftLengthPolicy(k_max)
    for _ in range(1000):  # drafts of k_max tokens with the given acceptance by position
        p.drafted = [d + 1 for d in p.drafted]
    p.accepted = [1000 * alpha ** (i + 1) for i in range(k_max)]
    for tokens in range(rows, rows * (k_max + 1) + 1, rows):
        for _ in range(3):
            p.observe_verify(rows, tokens, verify(tokens))
    p.observe_propose(rows, 1, draft_s)
    assert p.verify_passes >= MIN_OBSERVATIONS
    return p


def expected_best(k_max, alpha, verify, draft_s, rows):
    def rate(k):
        e = 1 + sum(alpha ** (i + 1) for i in range(k))
        return rows * e / (verify(rows * (k + 1)) + k * draft_s)

    return max(range(k_max + 1), key=rate)


@pytest.mark.parametrize("alpha, base, per_token, draft_s, rows, best", [
    (0.8, 0.010, 0.0, 0.001, 4, 6),      # verification free (memory-bound GPU): draft all the way
    (0.8, 0.010, 0.0020, 0.001, 16, 1),  # compute-bound at 16 rows: short drafts
    (0.3, 0.010, 0.0005, 0.003, 8, 0),   # drafts rarely accepted and not free: plain steps
    (0.9, 0.010, 0.0010, 0.002, 8, 3),   # an interior optimum
])
def test_the_policy_picks_the_optimum_of_its_model(alpha, base, per_token, draft_s, rows, best):
    verify = lambda tokens: base + per_token * tokens
    p = _policy(6, alpha, verify, draft_s, rows)
    assert expected_best(6, alpha, verify, draft_s, rows) == best
    assert p.verify_time(rows * 3) == pytest.approx(verify(rows * 3))
    p.steps = 1  # not a probe step
    assert p.limit(rows) == best


def test_it_drafts_the_full_length_until_it_has_measured_and_probes_now_and_then():
    p = DraftLengthPolicy(5)
    first = [p.limit(8) for _ in range(8)]
    assert first.count(5) >= 6 and min(first) < 5  # mostly K, a few shorter passes to measure
    p = _policy(5, 0.1, lambda t: 0.01 + 0.002 * t, 0.003, 8)
    choices = [p.limit(8) for _ in range(2 * PROBE_EVERY)]
    assert set(choices) == {0, 5} and choices.count(5) == 2
