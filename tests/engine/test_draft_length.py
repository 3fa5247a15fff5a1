"""Draft length by expected gain (pipeline/engine/draft_length.py) on synthetic costs and
acceptance: per row, at every batch size, 0 when nothing pays; and in a real engine."""

from __future__ import annotations

import itertools

import pytest

from pipeline.engine import GenerationSettings, SpeculationSettings, SpeculativeEngine
from pipeline.engine.draft_length import MIN_OBSERVATIONS, PRIOR_DRAFTS, PROBE_EVERY, DraftLengthPolicy

from tiny_models import build, prompt_of


def _policy(k_max, verify, draft_s=0.0):
    """A policy whose cost fits have seen passes of every width at 1, 4 and 8 rows costing
    ``verify(rows, width)`` and proposer calls costing ``draft_s`` per draft position."""
    p = DraftLengthPolicy(k_max)
    for rows in (1, 2, 4, 8):
        for width in range(1, k_max + 2):
            for _ in range(2):
                p.observe_verify(rows, width, verify(rows, width))
                p.observe_propose([width - 1] * rows, draft_s * (width - 1))
    assert p.verify_passes >= MIN_OBSERVATIONS and p.measured
    p.steps = 1  # not a probe step
    return p


def geometric(alpha, k):
    return [alpha ** (j + 1) for j in range(k)]


def brute_force_best(p, reach, caps):
    return max(p.rate(reach, ks) for ks in itertools.product(*[range(c + 1) for c in caps]))


@pytest.mark.parametrize("verify, draft_s, alphas", [
    (lambda b, w: 0.010 + 0.001 * b + 0.0020 * b * w, 0.001, [0.9, 0.2]),     # a CPU: costs grow with tokens
    (lambda b, w: 0.010, 0.0005, [0.8, 0.5, 0.0]),                               # verification free (a GPU)
    (lambda b, w: 0.010 + 0.0001 * b + 0.0005 * b * w, 0.003, [0.95, 0.6, 0.3]),
    (lambda b, w: 0.020 + 0.005 * b * w, 0.002, [0.3, 0.3]),                     # nothing pays
])
def test_the_plan_is_the_best_choice_of_per_row_lengths(verify, draft_s, alphas):
    k = 4
    p = _policy(k, verify, draft_s)
    reach = [geometric(a, k) for a in alphas]
    caps = [k] * len(alphas)
    ks = p.plan(reach, caps)
    assert p.rate(reach, ks) == pytest.approx(brute_force_best(p, reach, caps), rel=1e-9)
    # a row never drafts further than another row with better acceptance at every position
    for (ra, ka), (rb, kb) in itertools.combinations(zip(reach, ks), 2):
        if all(x >= y for x, y in zip(ra, rb)):
            assert ka >= kb


def test_one_row_drafts_leviathans_optimum_and_zero_when_nothing_pays():
    """One row, t(1, W) = 10 ms + 4 ms per extra token, drafter 1 ms per position:
    E(k) / T(k) with E = 1 + α + … + α^k; α = 0.8 → k = 3 (by hand: 1.8/0.015 = 120,
    2.44/0.020 = 122, 2.95/0.025 = 118.1 → k = 2)."""
    p = _policy(6, lambda b, w: 0.010 + 0.004 * (w - 1) * b, 0.001)
    assert p.plan([geometric(0.8, 6)], [6]) == [2]
    assert p.plan([geometric(0.2, 6)], [6]) == [0]  # 1.2 / 0.015 = 80 < 1 / 0.010 = 100
    assert p.plan([geometric(0.99, 6)], [3]) == [3]  # capped by the row's own limit


def test_rows_that_do_not_pay_do_not_draft_while_the_others_do():
    p = _policy(4, lambda b, w: 0.010 + 0.001 * b * w, 0.0002)
    ks = p.plan([geometric(0.9, 4), [0.0] * 4, geometric(0.9, 4)], [4, 4, 4])
    assert ks[1] == 0 and ks[0] == ks[2] > 0


def test_trim_keeps_the_width_that_pays_once_the_drafts_are_known():
    """Prompt lookup drafts for free: the decision is how much of the drafts to verify.
    A wide pass costs 5 ms per token per row: a 10-token draft for one row of eight, with
    acceptance 0.9, is worth a few of its tokens at most; short drafts are kept."""
    p = _policy(10, lambda b, w: 0.010 + 0.005 * b * w)
    reach = [geometric(0.9, 10)] + [geometric(0.5, 10)] * 7
    lengths = [10] + [0] * 7
    w = p.trim(reach, lengths)
    gains = {x: (8 + sum(reach[0][:x])) / (0.010 + 0.005 * 8 * (x + 1)) for x in range(11)}
    assert w == max(gains, key=gains.get) and w < 10
    assert p.trim(reach, [1] * 8) in (0, 1)
    assert p.trim(reach, [0] * 8) == 0


def test_a_row_starts_from_the_engine_and_moves_with_its_own_evidence():
    p = DraftLengthPolicy(3)
    for _ in range(100):
        p.observe_draft(3, 2)  # the engine: positions 1 and 2 always accepted, 3 never
    assert p.pooled_reach() == pytest.approx([1.0, 1.0, 0.0])
    assert p.row_reach([], [], p.pooled_reach()) == pytest.approx([1.0, 1.0, 0.0])
    bad = p.row_reach([20, 20, 20], [0, 0, 0])  # this row's drafts all failed
    assert bad[0] == pytest.approx(PRIOR_DRAFTS / (20 + PRIOR_DRAFTS)) and bad[0] < 0.2
    assert all(a >= b for a, b in zip(bad, bad[1:]))  # never increasing with the position


def test_it_explores_cheaply_until_it_has_measured_and_probes_now_and_then():
    p = DraftLengthPolicy(5)
    first = [p.plan([[0.0] * 5], [5])[0] for _ in range(9)]
    assert sorted(set(first)) == [0, 1, 2]  # cheap passes of three widths until the costs are measured
    p = _policy(5, lambda b, w: 0.01 + 0.01 * b * w, 0.003)  # nothing pays
    p.steps = 0
    choices = [p.plan([[0.1] * 5], [5])[0] for _ in range(8 * PROBE_EVERY)]
    assert set(choices) == {0, 1}
    # probes whose drafts are all rejected come ever less often: at 32, then 64 and 128 steps later
    probes = [i + 1 for i, k in enumerate(choices) if k]
    assert probes == [PROBE_EVERY, 3 * PROBE_EVERY, 7 * PROBE_EVERY]
    # accepted tokens in a probe do not keep the interval while drafting still does not pay ...
    p = _policy(5, lambda b, w: 0.01 + 0.01 * b * w, 0.003)
    p.steps = 0
    steps = []
    for i in range(8 * PROBE_EVERY):
        if p.plan([[0.1] * 5], [5])[0]:
            steps.append(i + 1)
            p.observe_draft(1, 1)
    assert steps == [PROBE_EVERY, 3 * PROBE_EVERY, 7 * PROBE_EVERY]
    # ... and when drafting pays (here one token a step) the probes, one token more, come every PROBE_EVERY steps
    p = _policy(5, lambda b, w: 0.01 + 0.004 * b * w, 0.0001)
    p.steps = 0
    plans = [p.plan([geometric(0.5, 5)], [5])[0] for _ in range(3 * PROBE_EVERY)]
    assert set(plans) == {1, 2} and p.probe_every == PROBE_EVERY
    assert [i + 1 for i, k in enumerate(plans) if k == 2] == [PROBE_EVERY, 2 * PROBE_EVERY, 3 * PROBE_EVERY]


def test_in_the_engine_a_useless_drafter_falls_back_to_plain_steps():
    """A drafter whose drafts are never accepted (a random one) ends up drafting on a small
    share of steps at one row in flight, and the output is plain's."""
    target = build("llama", seed=0)
    drafter = build("llama", seed=7, hidden=32, layers=1)
    prompt = prompt_of(12, seed=3)
    plain = SpeculativeEngine(target).generate(prompt, GenerationSettings(max_new_tokens=120)).token_ids
    engine = SpeculativeEngine(target, SpeculationSettings(method="draft_model", num_assistant_tokens=4), drafter=drafter,
                               adaptive_draft_length=None)  # the default, which the engine tests' fixture changes
    out = engine.generate(prompt, GenerationSettings(max_new_tokens=120))
    assert out.token_ids == plain
    assert out.stats.draft_steps < 0.5 * out.stats.verify_steps


def test_a_draft_that_would_gain_less_than_the_margin_is_not_made():
    """Near break-even the cost model's errors could make a method slower than plain: a draft
    predicted to gain less than MIN_GAIN is not made, one that gains more is."""
    from pipeline.engine.draft_length import MIN_GAIN

    p = _policy(1, lambda b, w: 0.010 + 0.002 * (w - 1) * b)  # one row: a second token costs 20 % more
    # one token drafted with acceptance A: (1 + A) / 0.012 against 1 / 0.010, a gain of (1 + A) / 1.2
    below, above = 1.2 * (1 + MIN_GAIN) - 1 - 0.01, 1.2 * (1 + MIN_GAIN) - 1 + 0.01
    assert 1.0 < (1 + below) / 1.2 < 1 + MIN_GAIN  # drafting would pay, but by less than the margin
    assert p.trim([[below]], [1]) == 0 and p.trim([[above]], [1]) == 1
    # a proposer that costs 1 ms a position: the plan weighs it too, (1 + A) / 0.013 against 1 / 0.010
    p = _policy(1, lambda b, w: 0.010 + 0.002 * (w - 1) * b, draft_s=0.001)
    below, above = 1.3 * (1 + MIN_GAIN) - 1 - 0.01, 1.3 * (1 + MIN_GAIN) - 1 + 0.01
    assert p.plan([[below]], [1]) == [0] and p.plan([[above]], [1]) == [1]


def test_a_free_proposer_asks_for_its_longest_drafts_and_trim_decides():
    """Prompt lookup costs a search: asking it for fewer tokens saves nothing, so every row asks
    for its cap whatever its acceptance, and the drafts as they came are cut by trim (here to
    nothing, as no position pays)."""
    from pipeline.engine.draft_length import FREE_PROPOSER

    verify = lambda b, w: 0.010 + 0.002 * (w - 1) * b
    free = _policy(4, verify, draft_s=0.5 * FREE_PROPOSER * 0.010 / 4)
    costly = _policy(4, verify, draft_s=2 * FREE_PROPOSER * 0.010)
    hopeless, good = [[0.01] * 4, [0.01] * 4], [[0.9, 0.8, 0.7, 0.6]] * 2
    assert free.plan(hopeless, [4, 2]) == [4, 2] and costly.plan(hopeless, [4, 2]) == [0, 0]
    assert free.trim(hopeless, [4, 2]) == 0 and free.trim(good, [4, 2]) > 0


def test_a_wider_pass_is_never_predicted_cheaper_than_a_narrower_one():
    p = _policy(4, lambda b, w: 0.010 + 0.001 * b * w)
    for _ in range(20):
        p.observe_verify(1, 3, 0.016)
        p.observe_verify(1, 4, 0.012)  # noise: below the width-3 passes' cost
    assert p._verify_time(1, 4) < p._verify_time(1, 3)  # what was measured
    assert p.verify_time(1, 4) == p.verify_time(1, 3) == pytest.approx(0.016, rel=0.05)  # what the policy uses
    assert all(p.verify_time(1, w + 1) >= p.verify_time(1, w) for w in range(1, 5))


def test_measured_passes_of_a_shape_replace_the_fit():
    """Once a (rows, width) has been measured a few times, its own mean is the prediction,
    whatever the linear fit says (a CPU's cost is not linear in the tokens)."""
    p = _policy(3, lambda b, w: 0.010 + 0.001 * b * w)
    for _ in range(40):
        p.observe_verify(8, 2, 0.050)  # far above the line's 0.026
    assert p.verify_time(8, 2) == pytest.approx(0.050, rel=0.05)
    assert p._verify_time(8, 3) == pytest.approx(p.verify.predict((1.0, 8, 24)))  # not measured: the fit
    assert p.verify_time(8, 3) == p.verify_time(8, 2)  # ... but never below a narrower pass's


def test_a_probe_asks_one_row_at_a_time_in_turn():
    """At 8 rows in flight with nothing paying, each probe asks one row for a token, a
    different row each time (a proposer that catches up on rows it has not drafted for does
    it for one row per probe, not for all)."""
    p = _policy(5, lambda b, w: 0.01 + 0.01 * b * w, 0.003)  # nothing pays
    p.steps = 0
    probed = []
    for _ in range(8 * PROBE_EVERY):
        ks = p.plan([[0.1] * 5] * 8, [5] * 8)
        if any(ks):
            assert sum(ks) == 1
            probed.append(ks.index(1))
    assert len(probed) >= 3 and len(set(probed)) == len(probed)


def test_a_trimmed_drafts_cut_token_is_judged_against_the_targets():
    """A greedy draft trimmed away still tells the policy whether its first token was right:
    the target's next token decides it, for free.  Every draft trimmed to nothing here: each
    counts once at position 1, accepted exactly when its first token is the output's next one
    (and the row's statistics, which count verified drafts, see none)."""
    target = build("llama", seed=0)
    prompt = prompt_of(6, seed=3).repeat(1, 4)  # repeated: prompt lookup finds matches
    settings = GenerationSettings(max_new_tokens=40)
    plain = SpeculativeEngine(target).generate(prompt, settings).token_ids
    engine = SpeculativeEngine(target, SpeculationSettings(method="prompt_lookup", prompt_lookup_num_tokens=3),
                               adaptive_draft_length=True)
    proposed = []
    propose = engine.proposer.propose

    def recording(requests):
        drafts = propose(requests)
        proposed.extend((r.sequence.shape[1], int(d.tokens[0])) for r, d in zip(requests, drafts) if len(d))
        return drafts

    engine.proposer.propose = recording
    engine.policy.trim = lambda reach, lengths: 0
    out = engine.generate(prompt, settings)
    assert out.token_ids == plain
    text = prompt[0].tolist() + out.token_ids
    hits = sum(text[length] == token for length, token in proposed)
    assert len(proposed) > 10 and 0 < hits
    assert engine.policy.drafted[0] == len(proposed) and engine.policy.accepted[0] == hits
    assert engine.policy.drafted[1:] == [0, 0] and out.stats.draft_steps == 0


@pytest.mark.parametrize("fastest", ["gain", "fixed", "plain"])
def test_the_measured_check_runs_the_fastest_way_and_still_looks_at_the_others(fastest):
    """Whatever the cost model says, the way that measures the most tokens per second (by
    expected gain, a fixed k, plain steps) takes over once each has run its blocks, and the
    others keep one block in CHECK_EXPLORE; rates are kept per number of rows in flight."""
    from pipeline.engine.draft_length import CHECK_BLOCK, CHECK_EXPLORE, CHECK_MIN_BLOCKS

    p = _policy(4, lambda b, w: 0.010 + 0.001 * b * w, 0.0001)
    reach, caps = [geometric(0.7, 4)], [4]
    speed = {"gain": 1.0, "fixed": 1.0, "plain": 1.0, fastest: 1.1}  # tokens per second, measured
    ways = []
    for _ in range(3 * CHECK_MIN_BLOCKS * CHECK_BLOCK + 60 * CHECK_BLOCK):
        ks = p.plan(reach, caps)
        way = p.way
        ways.append(way)
        assert ks == {"plain": [0], "fixed": caps}.get(way, ks)
        if way == "gain":
            assert 0 < ks[0] <= 4  # drafting pays by the model here
            assert p.trim(reach, ks) <= ks[0]
        else:
            assert p.trim(reach, [4]) == 4  # no trimming outside the plan's own way
        p.observe_step(1, 10, 10 / speed[way])
    first = ways[: 3 * CHECK_MIN_BLOCKS * CHECK_BLOCK]
    assert all(first.count(w) == CHECK_MIN_BLOCKS * CHECK_BLOCK for w in ("gain", "fixed", "plain"))
    later = ways[3 * CHECK_MIN_BLOCKS * CHECK_BLOCK:]
    assert p.check.leader(1) == fastest
    others = [w for w in later if w != fastest]
    assert len(others) == len(later) // (CHECK_EXPLORE * CHECK_BLOCK) * CHECK_BLOCK  # one block in CHECK_EXPLORE
    assert set(others) == {"gain", "fixed", "plain"} - {fastest}  # in turn
    assert all(len(set(ways[i:i + CHECK_BLOCK])) == 1 for i in range(0, len(ways), CHECK_BLOCK))  # whole blocks
    # another number of rows in flight has measured nothing yet: its ways are measured afresh
    p.check._left = 0
    p.plan(reach * 2, caps * 2)
    assert p.check.leader(2) is None and p.way == "gain"


def test_in_the_engine_every_way_of_the_check_keeps_the_output_plain():
    """The measured check's ways (gain, fixed k, plain steps) follow one another in blocks on
    one row; the output stays plain's token for token and each way ran."""
    from pipeline.engine.draft_length import CHECK_BLOCK

    target = build("llama", seed=0)
    prompt = prompt_of(36, seed=3)  # with repeats: prompt lookup finds drafts
    plain = SpeculativeEngine(target).generate(prompt, GenerationSettings(max_new_tokens=160)).token_ids
    engine = SpeculativeEngine(target, SpeculationSettings(method="prompt_lookup", prompt_lookup_num_tokens=4),
                               adaptive_draft_length=True)
    seen = []
    real_plan = engine.policy.plan
    engine.policy.plan = lambda *a: (lambda ks: seen.append(engine.policy.way) or ks)(real_plan(*a))
    out = engine.generate(prompt, GenerationSettings(max_new_tokens=160))
    assert out.token_ids == plain
    assert {"gain", "fixed", "plain"} <= set(seen) and len(seen) > 3 * CHECK_BLOCK


def test_a_way_far_slower_than_another_after_one_block_is_not_warmed_up_further():
    """Whole token trees at 8 rows run at about half of plain's speed: one block tells, and the
    warm-up goes on with the other ways; the leader then explores it in turn as before."""
    from pipeline.engine.draft_length import CHECK_BLOCK, CHECK_CLEAR_LOSS, CHECK_MIN_BLOCKS

    p = _policy(4, lambda b, w: 0.010 + 0.001 * b * w, 0.0001)
    reach, caps = [geometric(0.7, 4)], [4]
    speed = {"gain": 1.0, "fixed": 0.5, "plain": 0.95}
    assert speed["plain"] > CHECK_CLEAR_LOSS * speed["gain"] > speed["fixed"]
    ways = []
    for _ in range((2 * CHECK_MIN_BLOCKS + 1) * CHECK_BLOCK):
        p.plan(reach, caps)
        ways.append(p.way)
        p.observe_step(1, 10, 10 / speed[p.way])
    assert ways.count("fixed") == CHECK_BLOCK  # one block, then no more warm-up
    assert ways.count("gain") == ways.count("plain") == CHECK_MIN_BLOCKS * CHECK_BLOCK
    assert p.check.leader(1) == "gain"
