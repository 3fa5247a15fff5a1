"""The draft-length controller (pipeline/engine/draft_control.py): admission by marginal value
on synthetic cost curves, calibrated confidence, sources, the sampled rows' stopping rule,
and in a real engine: lossless with EOS and budgets inside blocks, no draft when a token
costs more than it can gain, every row its cap when verifying is free."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pipeline.engine import GenerationSettings, SpeculationSettings, SpeculativeEngine
from pipeline.engine.cost_model import CostCurve, tokens_per_second
from pipeline.engine.draft_control import (CALIBRATION_PRIOR, MIN_GAIN, ROW_PRIOR, Acceptance, DraftController,
                                          RowEvidence)
from pipeline.engine.proposers.base import Draft

from tiny_models import build, check_stats, perturbed_copy, prompt_of


class Costs(CostCurve):
    """A cost curve fixed by formulas (seconds): a step's verification ``verify(rows, width)``
    and a proposer call ``propose(longest, total)``; nothing measured changes it."""

    ready = True

    def __init__(self, verify, propose=lambda longest, total: 0.0):
        super().__init__()
        self.verify, self.propose_fn = verify, propose

    def observe(self, *args) -> None:
        pass

    def observe_propose(self, *args) -> None:
        pass

    def seconds(self, rows: int, width: int) -> float:
        return self.verify(rows, width)

    def proposing(self, longest: int, total: int) -> float:
        return self.propose_fn(longest, total) if total else 0.0


#: a CPU-like curve: a plain step of B rows costs 10 ms + 1 ms per row, each token of width 1.5 ms per row
CPU = Costs(lambda b, w: 0.010 + 0.001 * b + 0.0015 * b * (w - 1))
#: a GPU-like curve: a token of width costs 3 % of a plain step per row
GPU = Costs(lambda b, w: 0.010 + 0.001 * b + 0.0003 * b * (w - 1))
#: one more token of width costs as much as a whole plain step: no draft can pay
DEAR = Costs(lambda b, w: 0.010 * w)
#: verification that costs the same at any width (a memory-bound GPU)
FLAT = Costs(lambda b, w: 0.010)


def budget(k, costs, fixed=False) -> DraftController:
    b = DraftController(k, fixed=fixed)
    b.curve = costs
    return b


def draft(tokens, confidence=None, source="prompt", probs=None, alternatives=()) -> Draft:
    conf = None if confidence is None else torch.tensor(confidence, dtype=torch.float64)
    return Draft(torch.tensor(tokens, dtype=torch.long), probs, None, conf, source, tuple(alternatives))


def calibrated(source="prompt", rate=None, n=400) -> Acceptance:
    """Acceptance that has measured ``rate`` in every confidence bin of ``source`` (``None``:
    each bin's own confidence: a calibrated proposer)."""
    a = Acceptance()
    for i in range(n):
        c = (i % 10 + 0.5) / 10
        a.observe(source, c, 0, (i * 0.618) % 1 < (c if rate is None else rate))
    return a


# ---------------------------------------------------------------------------- admission
def test_a_token_that_costs_more_than_any_row_can_gain_is_never_verified():
    b = budget(4, DEAR)
    b.acceptance = calibrated(rate=1.0)
    rows = [RowEvidence() for _ in range(3)]
    plan = b.lengths(rows, [4, 4, 4])
    drafts = [draft([5, 6, 7, 8], [0.99] * 4), draft([1, 2], [0.95, 0.9]), draft([3], [0.97])]
    cut = b.cut(plan, drafts, rows).drafts
    assert [len(d) for d in cut] == [0, 0, 0] and b.last.way == "gain" and b.last.width == 1
    # before proposing, a costly proposer is asked for nothing either
    b = budget(4, Costs(DEAR.verify, lambda longest, total: 0.002 * longest))
    assert b.lengths(rows, [4, 4, 4]).lengths == (0, 0, 0)


def test_free_verification_and_certain_acceptance_verify_every_rows_cap():
    b = budget(4, FLAT)
    b.acceptance = calibrated(rate=1.0)
    rows = [RowEvidence() for _ in range(3)]
    plan = b.lengths(rows, [4, 2, 3])
    assert plan.lengths == (4, 2, 3) and plan.free  # a free proposer is asked for its cap
    cut = b.cut(plan, [draft([5, 6, 7, 8], [1.0] * 4), draft([1, 2], [1.0] * 2), draft([3, 4, 9], [1.0] * 3)], rows).drafts
    assert [len(d) for d in cut] == [4, 2, 3]
    # a costly proposer too, when its calls cost nothing more per token
    b = budget(4, Costs(FLAT.verify, lambda longest, total: 0.001))
    b.acceptance.positions[("*", 0)] = [100.0, 100.0]
    assert b.lengths(rows, [4, 2, 3]).lengths == (4, 2, 3)


def test_the_cut_is_the_width_of_the_best_rate_and_leviathans_optimum_for_one_row():
    """One row, t(W) = 10 ms + 4 ms per extra token, per-token acceptance α = 0.8 (survival
    0.8, 0.64, 0.51, 0.41): E(k)/T(k) = 1/0.010, 1.8/0.014, 2.44/0.018, 2.95/0.022,
    3.36/0.026 -> k = 2 (135.6 tokens/s against 133.9 at k = 3) -- the tuner's formula."""
    costs = Costs(lambda b, w: 0.010 + 0.004 * (w - 1) * b)
    b = budget(4, costs)
    b.acceptance = calibrated(rate=0.8)
    [cut] = b.cut(b.lengths([RowEvidence()], [4]), [draft([1, 2, 3, 4], [0.8, 0.8, 0.8, 0.8])], [RowEvidence()]).drafts
    s = b.last.survival[0]
    rates = [tokens_per_second(1, k, s, costs.seconds(1, k + 1)) for k in range(5)]
    assert len(cut) == max(range(5), key=lambda k: rates[k]) == 2
    assert b.last.tokens == pytest.approx(1 + s[0] + s[1]) and b.last.width == 3
    assert b.last.marginal_seconds == pytest.approx(0.004)
    assert "row 0 2 token(s) from prompt" in b.last.explain(0) and f"next position {s[2]:.2f}" in b.last.explain(0)


def test_a_step_drafts_only_when_it_beats_a_plain_step_by_the_margin():
    """One token at acceptance A costs 20 % more than a plain step: (1 + A) / 1.2 must beat
    1 + MIN_GAIN."""
    costs = Costs(lambda b, w: 0.010 + 0.002 * (w - 1))
    threshold = 1.2 * (1 + MIN_GAIN) - 1
    for a, verified in ((threshold - 0.02, 0), (threshold + 0.02, 1)):
        b = budget(1, costs)
        b.acceptance.bins[("prompt", 9)] = [1e6 * a, 1e6]  # calibrated: confidence 0.95 means a
        plan = b.lengths([RowEvidence()], [1])
        assert len(b.cut(plan, [draft([7], [0.95])], [RowEvidence()]).drafts[0]) == verified, a


def test_rows_of_different_confidence_get_different_lengths_in_the_same_step():
    """Before proposing, a drafter that costs per row and token asks less of a row whose
    record is poor; a sampled drafter's rows stop where their own confidence falls."""
    rows = [RowEvidence(), RowEvidence(evaluated=40, accepted=4, expected=32)]
    b = budget(4, CPU)
    b.curve = Costs(CPU.verify, lambda longest, total: 0.0005 * longest + 0.0008 * total)
    b.acceptance.positions.update({("*", j): [90.0, 100.0] for j in range(4)})
    ks = b.lengths(rows, [4, 4]).lengths
    assert ks[0] > ks[1] and rows[1].adjust(0.9) < 0.25
    q = torch.full((4, 16), 1 / 16)  # drafted from a distribution: the stopping rule decides
    b = budget(4, CPU)
    b.acceptance = calibrated(rate=0.9)
    plan = b.lengths([RowEvidence(), RowEvidence()], [4, 4], sampled=True)
    cut = b.cut(plan, [draft([1, 2, 3, 4], [0.95, 0.9, 0.9, 0.9], "drafter", q),
                 draft([5, 6, 7, 8], [0.9, 0.2, 0.9, 0.9], "drafter", q)], [RowEvidence(), RowEvidence()]).drafts
    assert len(cut[0]) > len(cut[1]) >= 1


def test_the_stopping_rule_at_a_position_reads_nothing_drawn_there_or_after():
    """A sampled draft's length is a stopping time: whether position j is verified depends on
    confidences up to j only (each known before token j was drawn), not on the tokens, and
    the choice of a row's draft ignores a sampled draft's confidences."""
    q = torch.full((4, 16), 1 / 16)
    lengths = {}
    for tail in ([0.9, 0.9], [0.01, 0.01], [0.99, 0.5]):
        for tokens in ([1, 2, 3, 4], [9, 9, 9, 9]):
            b = budget(4, CPU)
            b.acceptance = calibrated(source="drafter")
            plan = b.lengths([RowEvidence()], [4], sampled=True)
            [cut] = b.cut(plan, [draft(tokens, [0.95, 0.05] + tail, "drafter", q)], [RowEvidence()]).drafts
            lengths[(tuple(tail), tuple(tokens))] = len(cut)
    assert set(lengths.values()) == {1}  # it stops at position 2 whatever follows
    b = budget(4, CPU)
    b.acceptance = calibrated(source="drafter")  # its 0.99s are right 0.99 of the time, its drafts 0.5 at a position
    plan = b.lengths([RowEvidence()], [4], sampled=True)
    sampled = draft([1, 2, 3, 4], [0.99] * 4, "drafter", q)
    lookup = draft([1, 2, 3], [0.9, 0.9, 0.9], "prompt")
    cut = b.cut(plan, [draft([1, 2, 3, 4], [0.99] * 4, "drafter", q, alternatives=[lookup])], [RowEvidence()])
    assert cut.picks[0].chosen.source == "prompt"  # valued by position (about 0.5 a token), not by its 0.99s
    cut = b.cut(dataclasses.replace(plan, sampled=False),
                [draft([1, 2, 3, 4], [0.99] * 4, "drafter", None, alternatives=[lookup])], [RowEvidence()])
    assert cut.picks[0].chosen.source == "drafter"  # a greedy draft is valued by its confidence
    assert sampled.confidence is not None


def test_the_draft_with_the_most_expected_accepted_tokens_is_verified():
    """Of a row's candidates (one per source), the one whose calibrated survival sums highest:
    a pool that measured poorly loses to a prompt match, whatever their raw confidences."""
    b = budget(4, FLAT)
    b.acceptance = calibrated("prompt", rate=0.9)
    for i in range(400):
        b.acceptance.observe("pool", 0.95, 0, i % 5 == 0)  # the pool's 0.95 is right 1 time in 5
    row = RowEvidence()
    pool = draft([1, 2, 3, 4], [0.95] * 4, "pool")
    prompt = draft([7, 8, 9], [0.6, 0.6, 0.6], "prompt")
    plan = b.cut(b.lengths([row], [4]), [draft([], source="prompt", alternatives=[pool, prompt])], [row])
    [cut] = plan.drafts
    assert cut.source == "prompt" and cut.tokens.tolist() == [7, 8, 9]
    # what happened is judged for every candidate: the pool's first token was right, the match's wrong
    before = {s: list(b.acceptance.positions[(s, 0)]) for s in ("pool", "prompt")}
    b.observe(plan, [row], [[]], [[1]], 0.0, 0.01)
    assert b.acceptance.positions[("pool", 0)] == [before["pool"][0] + 1, before["pool"][1] + 1]
    assert b.acceptance.positions[("prompt", 0)] == [before["prompt"][0], before["prompt"][1] + 1]
    assert ("pool", 1) not in b.acceptance.positions and row.evaluated == 2 and row.accepted == 1


def test_calibration_and_a_rows_record_move_the_estimates():
    a = Acceptance()
    assert a.estimates("prompt", [0.95], 1) == [pytest.approx(0.95)]  # nothing measured: the confidence itself
    for i in range(100):
        a.observe("prompt", 0.95, 0, i % 4 != 0)
    assert a.estimates("prompt", [0.95], 1)[0] == pytest.approx((75 + CALIBRATION_PRIOR * 0.95) / (100 + CALIBRATION_PRIOR))
    assert a.estimates("pool", [0.95], 1) == [pytest.approx(0.95)]  # per source
    # without confidence: by position, each from the one before
    assert a.estimates("prompt", None, 2)[0] == pytest.approx((75 + 4 * 0.5) / (100 + 4))
    good, bad = RowEvidence(), RowEvidence()
    for _ in range(20):
        good.observe(0.5, True)
        bad.observe(0.5, False)
    assert good.adjust(0.5) > 0.85 and bad.adjust(0.5) < 0.15 and RowEvidence().adjust(0.5) == 0.5
    assert bad.adjust(0.5) == pytest.approx(0.5 * ROW_PRIOR / (10 + ROW_PRIOR))


def test_fixed_verifies_the_primary_draft_whole():
    b = budget(4, DEAR, fixed=True)
    alt = draft([1, 2, 3, 4], [1.0] * 4, "pool")
    plan = b.lengths([RowEvidence()], [4])
    assert plan.lengths == (4,) and plan.fixed
    [cut] = b.cut(plan, [draft([5, 6], [0.1, 0.1], alternatives=[alt])], [RowEvidence()]).drafts
    assert cut.tokens.tolist() == [5, 6] and b.last.way == "fixed"


def test_until_the_costs_are_measured_steps_explore_three_widths():
    b = DraftController(4)
    widths = []
    for _ in range(12):
        plan = b.cut(b.lengths([RowEvidence()], [4]), [draft([1, 2, 3, 4], [0.9] * 4)], [RowEvidence()])
        [cut] = plan.drafts
        widths.append(len(cut))
        b.observe(plan, [RowEvidence()], [[]], [[0]], 0.001, 0.01 + 0.001 * len(cut))
    assert widths[:4] == [0, 1, 0, 2] and widths[4:8] == widths[:4] and b.curve.ready
    assert b.curve.seconds(1, 3) > b.curve.seconds(1, 1)


def test_reset_learning_keeps_the_costs_and_forgets_acceptance():
    b = DraftController(3)
    for w in (1, 2, 3) * 3:
        b.curve.observe(2, w, 0.01 * w)
    b.acceptance.observe("prompt", 0.9, 0, True)
    curve = b.curve
    b.reset_learning()
    assert b.curve is curve and curve.ready and not b.acceptance.bins and not b.acceptance.positions


# ---------------------------------------------------------------------------- in the engine
@pytest.fixture(scope="module")
def oracle():
    target = build("llama", seed=0)
    return target, perturbed_copy(target, 0.0), perturbed_copy(target, 0.4)


def engines(target, drafter, batch, costs):
    for method in ("prompt_lookup", "suffix", "draft_model"):
        spec = SpeculationSettings(method=method, num_assistant_tokens=4, prompt_lookup_num_tokens=4)
        engine = SpeculativeEngine(target, spec, drafter=drafter if method == "draft_model" else None,
                                   max_batch_size=batch, draft_length="auto")
        if costs is not None:
            engine.controller.curve = costs
        yield method, engine


@pytest.mark.parametrize("costs", [None, CPU], ids=["measured", "cpu"])
def test_greedy_equals_plain_with_eos_and_budgets_inside_blocks(oracle, costs):
    """Single row and batched, every row is plain greedy's: some stop at an EOS met inside an
    accepted block, some at a budget that ends mid-draft (budgets 1, 2, 6, 9, 23)."""
    target, _, drafter = oracle
    prompts = [prompt_of(n, seed=n).repeat(1, 2) for n in (4, 9, 1, 30, 12, 6)]
    plain = SpeculativeEngine(target)
    settings, expected = [], []
    for i, p in enumerate(prompts):
        budget_ = (1, 2, 6, 9, 23, 40)[i]
        full = plain.generate(p, GenerationSettings(max_new_tokens=budget_)).token_ids
        if i >= 4:
            eos = full[6 + i]
            settings.append(GenerationSettings(max_new_tokens=budget_, eos_token_id=eos))
            expected.append(full[: full.index(eos) + 1])
        else:
            settings.append(GenerationSettings(max_new_tokens=budget_))
            expected.append(full)
    drafted = 0
    for batch in (1, 3):
        for method, engine in engines(target, drafter, batch, costs):
            results = engine.generate_batch(prompts, settings)
            assert [r.token_ids for r in results] == expected, (method, batch)
            for r in results:
                check_stats(r, 4)
                assert sum(getattr(r.stats, f"accepted_from_{s}") for s in ("prompt", "pool", "drafter")) == \
                    r.stats.accepted_tokens
            drafted += sum(r.stats.draft_tokens for r in results)
    assert drafted > 0


def test_no_draft_is_verified_where_one_more_token_costs_more_than_it_gains(oracle):
    """Every step is a plain step but the probes (every 32 steps, then 64, 128 ...: one token
    more than pays, for one row of a costly proposer), which keep costs and acceptance measured."""
    target, _, drafter = oracle
    prompts = [prompt_of(n, seed=n).repeat(1, 3) for n in (5, 8, 13)]
    want = [r.token_ids for r in SpeculativeEngine(target).generate_batch(prompts, GenerationSettings(max_new_tokens=60))]
    for method, engine in engines(target, drafter, 3, DEAR):
        engine.controller.record = True
        results = engine.generate_batch(prompts, GenerationSettings(max_new_tokens=60))
        assert [r.token_ids for r in results] == want
        cuts = [a for a in engine.controller.history if a.phase == "cut"]
        probes = [a for a in cuts if a.way == "probe"]
        assert all(not any(a.lengths) for a in cuts if a.way != "probe") and len(probes) <= 2, method
        assert sum(r.stats.draft_tokens for r in results) == sum(sum(a.lengths) for a in probes)


def test_free_verification_of_an_oracle_drafts_every_rows_cap(oracle):
    """The drafter is the target, and the controller has measured that its drafts are always
    accepted: with verification free every step drafts each row's cap (k = 4, while the
    budget leaves room)."""
    target, same, _ = oracle
    engine = SpeculativeEngine(target, SpeculationSettings(method="draft_model", num_assistant_tokens=4), drafter=same,
                               max_batch_size=3, draft_length="auto")
    engine.controller.curve = Costs(FLAT.verify, lambda longest, total: 0.0001 * longest)
    engine.controller.acceptance = calibrated("drafter", rate=1.0)
    prompts = [prompt_of(n, seed=n) for n in (5, 8, 13)]
    results = engine.generate_batch(prompts, GenerationSettings(max_new_tokens=21))  # 4 steps of 4 + 1, then 1
    for r in results:
        assert r.stats.drafted_per_position == [4, 4, 4, 4] and r.stats.accepted_tokens == 16
        assert r.stats.accepted_from_drafter == 16 and r.stats.verify_steps == 5


def test_a_trimmed_drafts_cut_tokens_are_judged_against_the_targets(oracle):
    """A greedy draft cut short still tells the controller whether its next token was right:
    the token the step emitted decides it, for free.  Cut to nothing here (every position
    costs more than it gains): each proposal counts once at position 1, accepted exactly when
    its first token is the output's next one, and the row's statistics see no draft."""
    target, _, _ = oracle
    prompt = prompt_of(6, seed=3).repeat(1, 4)
    engine = SpeculativeEngine(target, SpeculationSettings(method="prompt_lookup", prompt_lookup_num_tokens=3),
                               draft_length="auto")
    engine.controller.curve = DEAR
    proposed = []
    propose = engine.proposer.propose

    def recording(requests):
        drafts = propose(requests)
        proposed.extend((r.sequence.shape[1], int(d.tokens[0])) for r, d in zip(requests, drafts) if len(d))
        return drafts

    engine.proposer.propose = recording
    out = engine.generate(prompt, GenerationSettings(max_new_tokens=40))
    text = prompt[0].tolist() + out.token_ids
    hits = sum(text[length] == token for length, token in proposed)
    assert len(proposed) > 10 and 0 < hits and out.stats.draft_steps <= 1  # at most a probe verified
    assert engine.controller.acceptance.positions[("prompt", 0)] == [hits, len(proposed)]


def test_suffix_offers_its_prompt_matches_and_pool_and_counts_tokens_by_source(oracle):
    """Suffix decoding offers a draft per source (the row's tree, prompt lookup's copy, the
    job-wide pool); the controller verifies one per row, and each accepted token is counted
    under its source.  reset_learning empties the pool and keeps the costs."""
    target, _, _ = oracle
    engine = SpeculativeEngine(target, SpeculationSettings(method="suffix", num_assistant_tokens=4),
                               max_batch_size=2, draft_length="auto")
    engine.controller.curve = CPU
    prompts = [prompt_of(20, seed=90 + i).repeat(1, 2) for i in range(4)]
    first = engine.generate_batch(prompts, GenerationSettings(max_new_tokens=30))
    again = engine.generate_batch(prompts, GenerationSettings(max_new_tokens=30))  # the pool holds these outputs
    assert [r.token_ids for r in again] == [r.token_ids for r in first]
    stats = [r.stats for r in first + again]
    assert sum(s.accepted_from_prompt for s in stats) > 0 and sum(s.accepted_from_pool for s in stats) > 0
    assert sum(s.accepted_from_pool for s in (r.stats for r in again)) > sum(s.accepted_from_pool for s in stats[:4])
    assert engine.controller.acceptance.bins and len(engine.proposer.cached) == 8
    engine.reset_learning()
    assert not engine.proposer.cached and not engine.controller.acceptance.bins and engine.controller.curve is CPU


def test_the_controller_records_why_each_row_drafts_what_it_does(oracle):
    target, _, _ = oracle
    engine = SpeculativeEngine(target, SpeculationSettings(method="prompt_lookup", prompt_lookup_num_tokens=4),
                               max_batch_size=2, draft_length="auto")
    engine.controller.curve, engine.controller.record = CPU, True
    engine.generate_batch([prompt_of(9, seed=1).repeat(1, 3), prompt_of(7, seed=2).repeat(1, 3)],
                          GenerationSettings(max_new_tokens=20))
    cuts = [a for a in engine.controller.history if a.phase == "cut"]
    assert cuts and all(a.width == max(a.lengths, default=0) + 1 for a in cuts)
    drafting = [a for a in cuts if any(a.lengths)]
    assert drafting and all(a.tokens > len(a.lengths) and a.seconds > a.plain_seconds for a in drafting)


# ---------------------------------------------------------------------------- proposers' confidence
def test_every_proposer_with_a_confidence_gives_one_per_token_and_a_sampler_only_what_precedes_its_draw():
    """Prompt lookup and suffix: frequencies in [0, 1] of the row's own text (source prompt);
    a drafter and a draft head: the top probability of the distribution each token is drawn
    from (greedy: the drafted token's; sampled: ``max q_j``, known before the draw)."""
    from eagle_models import random_head

    from pipeline.engine.proposers.base import DraftRequest
    from pipeline.engine.sampling import LogitsShaper

    target = build("llama", seed=0)
    prompt = prompt_of(12, seed=4).repeat(1, 3)
    cases = {"prompt_lookup": None, "suffix": None, "draft_model": perturbed_copy(target, 0.4),
             "eagle": random_head(target)}
    for method, drafter in cases.items():
        for sample in (False, True):
            engine = SpeculativeEngine(target, SpeculationSettings(method=method, num_assistant_tokens=4,
                                                                   prompt_lookup_num_tokens=4), drafter=drafter)
            engine.bind(1)
            settings = GenerationSettings(max_new_tokens=8, do_sample=sample, temperature=0.9 if sample else 1.0,
                                          top_k=0, top_p=1.0, seed=3)
            engine.admit([engine.new_row(0, prompt, settings, 0, "cpu")])
            shaper = LogitsShaper(settings, prompt_length=prompt.shape[1])
            gen = torch.Generator().manual_seed(5)
            with torch.no_grad():  # as the engine's step runs it
                [d] = engine.proposer.propose([DraftRequest(0, prompt, 4, shaper, gen, sample)])
            assert len(d) and d.confidence is not None and d.confidence.shape == (len(d),), method
            assert ((0 <= d.confidence) & (d.confidence <= 1)).all(), method
            assert d.source == ("drafter" if drafter is not None else "prompt"), method
            if sample and d.probs is not None:  # the top of q_j, whatever was drawn from it
                assert torch.allclose(d.confidence, d.probs.max(-1).values.double()), method
