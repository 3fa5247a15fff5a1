"""The shared speedup formula and the measured cost curve (pipeline/engine/cost_model.py),
and the cost profile of an engine (pipeline/engine/profile.py)."""

from __future__ import annotations

import pytest
import torch

from pipeline.engine import GenerationSettings, SpeculationSettings, SpeculativeEngine
from pipeline.engine.cost_model import (
    CostCurve,
    expected_tokens,
    per_token_acceptance,
    reach_from_counts,
    step_time,
    tokens_per_second,
)
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


def _curve(verify, rows=(1, 4, 8), widths=range(1, 6), repeats=3) -> CostCurve:
    c = CostCurve()
    for _ in range(repeats):
        for b in rows:
            for w in widths:
                c.observe(b, w, verify(b, w))
    return c


def test_the_cost_curve_fits_a_line_and_replaces_it_by_measured_medians():
    """A shape measured once or more (its first step not counted) is predicted by the fit
    ``a + b*B + c*B*W`` (here exactly: the steps lie on such a line) until its own steps are
    :data:`TABLE_AFTER`; then by their lower median (a CPU's cost is not linear in the tokens)."""
    line = lambda b, w: 0.010 + 0.001 * b + 0.002 * b * w
    c = _curve(line)
    assert c.ready and c.seconds(16, 3) == pytest.approx(line(16, 3), rel=1e-6)  # never measured: the line
    for _ in range(5):
        c.observe(8, 2, 0.050)  # far above the line's 0.042
    assert c.seconds(8, 2) == pytest.approx(0.050)
    assert c.seconds(8, 3) == pytest.approx(line(8, 3), rel=0.05)


def test_a_shapes_first_step_and_a_stray_step_are_not_counted():
    """A shape's first step pays its one-time costs (a kernel compiled for it): it is not
    counted; a stray slow step among others moves the median nothing."""
    c = _curve(lambda b, w: 0.010 + 0.001 * b * w)
    c.observe(2, 6, 1.9)  # the first pass of width 6: compiled
    c.observe(2, 6, 0.022)
    c.observe(2, 6, 0.023)
    assert c._seconds(2, 6) == pytest.approx(0.022)
    c.observe(2, 6, 0.9)  # a stray step: the median is the slower of the two others, not it
    assert c._seconds(2, 6) == pytest.approx(0.023)
    assert c.ready and not CostCurve().ready


def test_a_wider_pass_is_never_predicted_cheaper_than_a_narrower_one():
    c = _curve(lambda b, w: 0.010 + 0.001 * b * w, repeats=3)
    for _ in range(9):
        c.observe(1, 3, 0.016)
        c.observe(1, 4, 0.012)  # noise: below the width-3 passes' cost
    assert c._seconds(1, 4) < c._seconds(1, 3)  # what was measured
    assert c.seconds(1, 4) == c.seconds(1, 3) == pytest.approx(0.016)  # what the controller uses
    assert all(c.seconds(1, w + 1) >= c.seconds(1, w) for w in range(1, 6))


def test_the_cost_curve_follows_the_machine_and_needs_two_widths():
    c = CostCurve()
    for _ in range(10):
        c.observe(1, 1, 0.010)
    assert not c.ready  # one width: the cost of a token is unknown
    for _ in range(3):
        c.observe(1, 2, 0.012)
    assert c.ready
    for _ in range(5):  # the machine got twice as slow: the median of the last steps follows
        c.observe(1, 1, 0.020)
    assert c.seconds(1, 1) == pytest.approx(0.020)
    c.observe_propose([3, 0, 1], 0.004)
    c.observe_propose([1, 1, 1], 0.002)
    c.observe_propose([2, 2, 0], 0.003)
    assert c.propose_seconds([0, 0]) == 0.0 and c.propose_seconds([2, 1]) > 0


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
                               drafter=drafter, draft_length="auto")
    q = profile_engine(engine, prompts, [1, 3], ks=[1, 4], repeats=2)
    assert not engine.controller.fixed  # its steps were fixed steps, the controller itself is not
    assert [(s.rows, s.k) for s in q.steps] == [(1, 1), (1, 4), (3, 1), (3, 4)]
    for s in q.steps:  # the oracle drafts the full k for every row, every step
        assert s.width == s.k + 1 and s.drafted == s.k
        assert s.propose_s > 0 and s.verify_s > 0 and s.overhead_s >= 0
    assert q.admit_s_per_token > 0  # the drafter's prefill

    # profiling leaves the engine as it was: it still decodes exactly as plain decoding
    settings = GenerationSettings(max_new_tokens=12)
    want = [r.token_ids for r in plain.generate_batch(prompts, settings)]
    assert [r.token_ids for r in engine.generate_batch(prompts, settings, max_batch_size=2)] == want


def test_profile_puts_b_rows_in_slots_0_to_b_minus_1_as_the_loops_full_batch(pair):
    """The loop steps a full batch in slot order, reading its caches in place: the profile's
    passes at B rows use slots 0 .. B-1 too (scattered slots gathered every row's cache in
    every layer, which put t(1, 16) at 1.3x the loop's step, issue 54)."""
    target, _ = pair
    engine = SpeculativeEngine(target)
    seen = []
    real = engine.target_pass

    def spy(slots, *a, **k):
        seen.append(list(slots))
        return real(slots, *a, **k)

    engine.target_pass = spy
    profile_engine(engine, [prompt_of(n, seed=n).tolist()[0] for n in (5, 9, 7)], [1, 2, 3], widths=[1, 2], repeats=1)
    # each row's prefill in its own slot, then the passes of 1, 2 and 3 rows
    assert {tuple(s) for s in seen} == {(0,), (1,), (2,), (0, 1), (0, 1, 2)}


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
