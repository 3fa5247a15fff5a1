"""The shared speedup formula (pipeline/engine/cost_model.py), the engine's draft length by
load that uses it, and the cost profile of an engine (pipeline/engine/profile.py)."""

from __future__ import annotations

import pytest
import torch

from pipeline.engine import GenerationSettings, SpeculationSettings, SpeculativeEngine
from pipeline.engine.cost_model import (
    expected_tokens,
    per_token_acceptance,
    reach_from_counts,
    step_time,
    tokens_per_second,
)
from pipeline.engine.draft_length import DraftLengthPolicy
from pipeline.engine.profile import profile_engine
from pipeline.engine.stats import RowStats
from pipeline.report import speedup_bound

from tiny_models import build, perturbed_copy, prompt_of


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.77, 0.95])
@pytest.mark.parametrize("k", [0, 1, 4, 9])
def test_expected_tokens_is_leviathans_closed_form(alpha, k):
    reach = [alpha ** i for i in range(1, k + 1)]
    assert expected_tokens(reach, k) == pytest.approx((1 - alpha ** (k + 1)) / (1 - alpha))


@pytest.mark.parametrize("alpha,k,c", [(0.5, 3, 0.1), (0.77, 5, 0.19), (0.9, 8, 0.02), (0.2, 1, 0.5)])
def test_one_step_cost_gives_leviathans_speedup(alpha, k, c):
    """With one batch row, a verification that costs t whatever it verifies and a drafter
    at c·t per token, tokens/s × t is Leviathan's S(α, k, c) (computed by the report)."""
    t = 0.0125
    reach = [alpha ** i for i in range(1, k + 1)]
    got = tokens_per_second(1, k, reach, verify_s=t, draft_token_s=c * t) * t
    assert got == pytest.approx(speedup_bound(alpha, k, c))


def test_step_time_charges_drafting_only_when_drafting():
    assert step_time(0.01, 0, draft_token_s=0.002, draft_step_s=0.003, overhead_s=0.001) == pytest.approx(0.011)
    assert step_time(0.01, 4, draft_token_s=0.002, draft_step_s=0.003, overhead_s=0.001) == pytest.approx(0.022)
    with pytest.raises(ValueError, match="k must be >= 0"):
        expected_tokens([0.5], -1)


def test_acceptance_by_position_from_a_rows_counts():
    """Drafts of 3 tokens accepted as prefixes of length 0, 1, 2, 3, 3: α_i = accepted at i
    / drafts that reached i (every earlier token accepted)."""
    s = RowStats()
    for accepted in (0, 1, 2, 3, 3):
        s.record_draft(3, accepted)
    assert s.drafted_per_position == [5, 5, 5] and s.accepted_per_position == [4, 3, 2]
    assert per_token_acceptance(s.drafted_per_position, s.accepted_per_position) == pytest.approx([4 / 5, 3 / 4, 2 / 3])
    # per verify step (7 steps, two without a draft): A_i = accepted at i / 7
    assert reach_from_counts(s.accepted_per_position, 7) == pytest.approx([4 / 7, 3 / 7, 2 / 7])
    # a draft cut to 2 tokens by the budget, both accepted: the counts cannot tell it from a
    # 3-token draft rejected at 3, so position 3 counts it as evaluated (the documented estimate)
    s.record_draft(2, 2)
    assert per_token_acceptance(s.drafted_per_position, s.accepted_per_position) == pytest.approx([5 / 6, 4 / 5, 2 / 4])
    assert per_token_acceptance([4, 0], [0, 0]) == [0.0, None]


def _policy(k_max, alpha, verify, draft_s):
    """A policy fed synthetic observations: drafts accepted with per-token α, passes of
    ``B`` rows of width ``W`` costing ``verify(B, W)`` seconds, a proposer call costing
    ``draft_s`` per draft position."""
    p = DraftLengthPolicy(k_max)
    for i in range(1000):  # accepted prefix j with probability α^j (1 − α), capped at k_max
        u, j = (i + 0.5) / 1000, 0
        while j < k_max and u < alpha ** (j + 1):
            j += 1
        p.observe_draft(k_max, j)
    for rows in (1, 4, 8):
        for width in range(1, k_max + 2):
            p.observe_verify(rows, width, verify(rows, width))
            p.observe_propose([width - 1] * rows, draft_s * (width - 1))
    return p


def test_engine_policy_predicts_with_the_shared_formula():
    """With one k for every row, the policy's rate is the tuner's formula
    (cost_model.tokens_per_second) on the same measured costs."""
    verify = lambda b, w: 0.01 + 0.001 * b + 0.002 * b * w
    p = _policy(6, 0.8, verify, 0.0005)
    reach = reach_from_counts(p.accepted, p.drafted)
    assert p.pooled_reach() == pytest.approx(reach)
    for rows in (1, 4, 8):
        for k in range(7):
            expected = tokens_per_second(rows, k, reach, verify(rows, k + 1), 0.0005 if k else 0.0)
            assert p.rate([reach] * rows, [k] * rows) == pytest.approx(expected, rel=1e-6)
    assert expected_tokens(p.pooled_reach(), 3) == pytest.approx(1 + 0.8 + 0.64 + 0.512, rel=0.01)


def test_engine_policy_picks_the_known_optimum():
    """A flat verification cost (a memory-bound GPU) drafts the full K; a cost that grows
    with every token as fast as a plain step (a CPU at large batch) drafts nothing; in
    between, the optimum of B·E(k) / (t(B, k + 1) + k·t_d) computed by hand.  The proposer
    is free (t_d = 0), so every row asks for K and trim() decides on the drafts."""
    reach = lambda p: [p.pooled_reach()] * 8
    p = _policy(6, 0.8, lambda b, w: 0.01, 0.0)
    assert p.plan(reach(p), [6] * 8) == [6] * 8 and p.trim(reach(p), [6] * 8) == 6
    p = _policy(6, 0.8, lambda b, w: 0.01 * b * w, 0.0)
    assert p.plan(reach(p), [6] * 8) == [6] * 8 and p.trim(reach(p), [6] * 8) == 0
    # t = 10 ms + 1 ms per token, 8 rows: 8·E(k) / (0.01 + 0.008 (k + 1)); α = 0.8:
    # k = 1: 14.4/0.026 = 554, k = 2: 19.5/0.034 = 574, k = 3: 23.6/0.042 = 562 -> k = 2
    p = _policy(6, 0.8, lambda b, w: 0.01 + 0.001 * b * w, 0.0)
    assert p.trim(reach(p), [6] * 8) == 2
    # the same costs with a proposer of 3 ms per draft position: the plan itself weighs it and
    # asks for less (k = 1: 14.4/0.029 = 497, k = 2: 19.5/0.040 = 488, plain 8/0.018 = 444)
    p = _policy(6, 0.8, lambda b, w: 0.01 + 0.001 * b * w, 0.003)
    ks = p.plan(reach(p), [6] * 8)
    assert max(ks) <= 2 and p.rate(reach(p), ks) >= max(p.rate(reach(p), [k] * 8) for k in range(7)) - 1e-9


# ---------------------------------------------------------------------------- profile
@pytest.fixture(scope="module")
def pair():
    target = build("llama", seed=0)
    return target, perturbed_copy(target, 0.0)  # an oracle drafter: every draft token accepted


def test_profile_measures_every_batch_size_width_and_draft_length(pair):
    target, drafter = pair
    prompts = [prompt_of(n, seed=n).tolist()[0] for n in (5, 30, 12)]
    plain = SpeculativeEngine(target)
    p = profile_engine(plain, prompts, [1, 2, 4], widths=[1, 2, 3], repeats=1)
    assert set(p.verify_s) == {1, 2, 4} and all(set(row) == {1, 2, 3} for row in p.verify_s.values())
    assert all(v > 0 for row in p.verify_s.values() for v in row.values())
    assert [(s.rows, s.k, s.width, s.drafted) for s in p.steps] == [(1, 0, 1, 0), (2, 0, 1, 0), (4, 0, 1, 0)]
    assert p.prefill_s_per_token > 0 and p.admit_s_per_token == 0

    engine = SpeculativeEngine(target, SpeculationSettings(method="draft_model", num_assistant_tokens=4),
                               drafter=drafter, adaptive_draft_length=True)
    policy = engine.policy
    q = profile_engine(engine, prompts, [1, 3], draft_lengths=[1, 4], repeats=2)
    assert engine.policy is policy  # switched off while measuring, then restored
    assert [(s.rows, s.k) for s in q.steps] == [(1, 1), (1, 4), (3, 1), (3, 4)]
    for s in q.steps:  # the oracle drafts the full k for every row, every step
        assert s.width == s.k + 1 and s.drafted == s.k
        assert s.propose_s > 0 and s.verify_s > 0 and s.overhead_s >= 0
    assert q.admit_s_per_token > 0  # the drafter's prefill

    # profiling leaves the engine as it was: it still decodes exactly as plain decoding
    settings = GenerationSettings(max_new_tokens=12)
    want = [r.token_ids for r in plain.generate_batch(prompts, settings)]
    assert [r.token_ids for r in engine.generate_batch(prompts, settings, max_batch_size=2)] == want


def test_profile_stops_the_batch_sweep_where_batching_stops_paying(pair):
    """With a stop ratio the sizes are measured in increasing order and the sweep ends after
    the first B whose per-row cost exceeds ratio × the cheapest so far: ratio 0 stops after
    the second size, a huge ratio never stops."""
    target, _ = pair
    prompts = [prompt_of(n, seed=n).tolist()[0] for n in (5, 9)]
    stopped = profile_engine(SpeculativeEngine(target), prompts, [4, 1, 2], widths=[1, 2], repeats=1, stop_ratio=0.0)
    assert sorted(stopped.verify_s) == [1, 2] and [s.rows for s in stopped.steps] == [1, 2]
    full = profile_engine(SpeculativeEngine(target), prompts, [4, 1, 2], widths=[1, 2], repeats=1, stop_ratio=1e9)
    assert sorted(full.verify_s) == [1, 2, 4] and [s.rows for s in full.steps] == [1, 2, 4]


def test_profile_cuts_prompts_to_the_context_and_refuses_a_context_too_small(pair):
    target, _ = pair
    engine = SpeculativeEngine(target)
    long = prompt_of(250, seed=1).tolist()[0]  # the context is 256 positions
    p = profile_engine(engine, [long], [1], widths=[1, 2], repeats=1)
    assert p.verify_s[1][2] > 0
    with pytest.raises(ValueError, match="no room to profile"):
        profile_engine(engine, [long], [1], widths=list(range(1, 300)), repeats=1)
    assert torch.is_inference_mode_enabled() is False
