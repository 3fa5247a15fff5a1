"""The warm-up and the reset of what an engine learned (``SpeculativeEngine.warm_up``,
``StepEngine.reset_learning``), in float64 on tiny random models.

- a warm-up runs every number of rows in flight from its ``max_rows`` down to 1 through the
  one decode path, drafting, and leaves every output as it was: greedy equal to plain for
  every method (drafter, draft head, lookup, suffix, token trees, the draft length by
  the draft-length controller), and a seeded sampled row draws what a cold engine draws;
- ``reset_learning`` empties suffix's job-wide tree: rows decoded again replay their own
  outputs (acceptance up), and after a reset their acceptance is again the first run's,
  draft for draft; the draft-length controller forgets what it learnt of acceptance and keeps
  its cost curve.
"""

from __future__ import annotations

import pytest

from eagle_models import random_head
from pipeline.engine import GenerationSettings, SpeculationSettings, SpeculativeEngine
from test_batch import rows_of
from tiny_models import build, perturbed_copy, prompt_of

K = 3


@pytest.fixture(scope="module")
def pair():
    target = build("llama", layers=3, seed=0)
    rows = rows_of(5, 7)
    plain = SpeculativeEngine(target, max_batch_size=1)
    references = [plain.generate(p, GenerationSettings(max_new_tokens=b)).token_ids for p, b in rows]
    return target, perturbed_copy(target, 0.5), rows, references


def _engine(target, drafter, variant: str, batch: int = 3) -> SpeculativeEngine:
    """``method[+trees][+auto]``: token trees of 3 candidates; the draft-length controller
    (else every row its k, the engine tests' default)."""
    method, *options = variant.split("+")
    spec = SpeculationSettings(method=method, num_assistant_tokens=K, prompt_lookup_num_tokens=K,
                               num_candidates=3 if "trees" in options else 1)
    extra = {"drafter": drafter if method == "draft_model" else random_head(target) if method == "eagle" else None}
    return SpeculativeEngine(target, spec, max_batch_size=batch, draft_length="auto" if "auto" in options else "fixed",
                             **extra)


def _in_flight(engine: SpeculativeEngine) -> list[int]:
    """Records the rows in flight of every step the engine takes from now on."""
    seen: list[int] = []
    step = engine.step

    def counted(rows):
        seen.append(len(rows))
        return step(rows)

    engine.step = counted
    return seen


@pytest.mark.parametrize("variant", ["plain", "draft_model", "eagle", "prompt_lookup", "suffix", "suffix+trees",
                                     "prompt_lookup+auto", "draft_model+auto"])
def test_warm_up_runs_every_batch_size_drafting_and_changes_no_output(pair, variant):
    target, drafter, rows, references = pair
    engine = _engine(target, drafter, variant, batch=4)
    seen = _in_flight(engine)
    seconds = engine.warm_up(prompt_tokens=60, new_tokens=4)
    assert seconds > 0
    assert set(seen) == {1, 2, 3, 4} and seen[0] == 4  # every number of rows in flight, all of them first
    results = engine.generate_batch([p for p, _ in rows], [GenerationSettings(max_new_tokens=b) for _, b in rows],
                                    max_batch_size=3)
    assert [r.token_ids for r in results] == references
    if variant != "plain":
        assert sum(r.stats.draft_tokens for r in results) > 0


def test_warm_up_drafts_on_its_synthetic_rows(pair):
    """Its prompts repeat a random segment, so lookup finds matches and verifies drafts (the
    passes wider than one token get compiled too): most of its tokens come from drafts."""
    target, _, _, _ = pair
    engine = _engine(target, None, "prompt_lookup", batch=2)
    drafted = []
    propose = engine.proposer.propose
    engine.proposer.propose = lambda requests: drafted.extend(len(d) for d in propose(requests)) or \
        propose(requests)
    engine.warm_up(prompt_tokens=72, new_tokens=8)
    assert max(drafted) == K


def test_warm_up_keeps_a_seeded_sampled_row_and_fits_a_small_context(pair):
    """Sampling through the warm-up (the job's settings choose the verification path), then a
    seeded row draws what it draws on a cold engine; a prompt longer than the context is cut."""
    target, drafter, _, _ = pair
    settings = GenerationSettings(max_new_tokens=24, do_sample=True, top_k=8, seed=11)
    prompt = prompt_of(30, seed=3)
    cold = _engine(target, drafter, "draft_model").generate(prompt, settings).token_ids
    warm = _engine(target, drafter, "draft_model")
    warm.warm_up(prompt_tokens=10_000, new_tokens=4, settings=settings)  # 256 positions: cut to fit
    assert warm.generate(prompt, settings).token_ids == cold


def test_warm_up_refuses_bad_sizes(pair):
    engine = _engine(pair[0], None, "plain")
    for kw in ({"max_rows": 0}, {"prompt_tokens": 0}, {"new_tokens": -1}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            engine.warm_up(**kw)


def test_reset_learning_stops_suffix_replaying_its_own_outputs(pair):
    """The same rows decoded twice by one engine: the second time the job-wide tree holds their
    outputs, and acceptance jumps.  After ``reset_learning`` it is the first run's again."""
    target, _, _, _ = pair
    prompts = [prompt_of(24, seed=200 + i) for i in range(6)]
    settings = GenerationSettings(max_new_tokens=30)
    engine = SpeculativeEngine(target, SpeculationSettings(method="suffix", num_assistant_tokens=4),
                               max_batch_size=2, draft_length="fixed")

    def run():
        results = engine.generate_batch(prompts, settings)
        return [r.token_ids for r in results], [r.stats.accepted_tokens for r in results]

    first_ids, first = run()
    replay_ids, replay = run()
    assert replay_ids == first_ids
    assert sum(replay) > sum(first) + 20  # its own outputs, drafted back
    engine.reset_learning()
    assert not engine.proposer.cached and engine.proposer.global_tree.nodes == 0
    again_ids, again = run()
    assert again_ids == first_ids and again == first


def test_reset_learning_keeps_the_cost_curve_and_forgets_acceptance(pair):
    """The contract of ``reset_learning`` with the draft-length controller on: the cost curve
    t(tokens, rows) is the same object with the same measurements and predictions (so the
    next step admits by it, with no new exploring); the acceptance estimates (calibration bins,
    positions), the tree sizer's side-node gain, the recorded admissions and suffix's job-wide
    pool are gone."""
    target, _, rows, _ = pair
    engine = _engine(target, None, "suffix+auto")
    controller = engine.controller
    controller.record = True
    prompts, settings = [p for p, _ in rows], [GenerationSettings(max_new_tokens=b) for _, b in rows]
    engine.generate_batch(prompts, settings)
    curve = controller.curve
    measured = {shape: list(v) for shape, v in curve.table.items()}
    predicted = (curve.seconds(2, 3), curve.propose_weights())
    assert curve.ready and controller.acceptance.positions and controller.acceptance.bins and controller.history
    controller.trees.observe(6, 2)  # as a step of token trees would have: side nodes that gained 2 tokens
    assert engine.proposer.cached
    engine.reset_learning()
    assert engine.controller is controller and controller.curve is curve
    assert {shape: list(v) for shape, v in curve.table.items()} == measured
    assert (curve.seconds(2, 3), curve.propose_weights()) == predicted
    assert not controller.acceptance.positions and not controller.acceptance.bins and not controller.kept
    assert controller.trees.side_nodes == 0 and controller.history == [] and controller.last is None
    assert not engine.proposer.cached and engine.proposer.global_tree.nodes == 0
    engine.generate_batch(prompts[:1], settings[:1])
    assert controller.history and controller.history[0].way != "explore"  # the kept curve admits at once


def test_warm_up_on_a_suffix_engine_leaves_no_synthetic_output_in_its_tree(pair):
    target, _, _, _ = pair
    engine = _engine(target, None, "suffix")
    engine.warm_up(prompt_tokens=48, new_tokens=4)
    assert not engine.proposer.cached and engine.proposer.drafts_from == {"row": 0, "job": 0}
    assert engine.proposer.global_tree.nodes == 0 and not engine.proposer.global_tree.root.children
