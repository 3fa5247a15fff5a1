"""Tree verification (``num_candidates > 1``): several candidate continuations per row in one
target pass, with a tree attention mask and a position per node; the longest verified path
is accepted, and the KV cache keeps only that path.

Float64 tiny random targets (Llama; Gemma 3 with sliding-window layers narrower than some
trees are deep).  Greedy output equals plain greedy token for token for trees of several
shapes, ragged across the rows of a batch, including trees whose first branch is wrong and
whose right continuation is on another branch (accepted from there); after a tree step the
cache equals a fresh pass over the accepted text; EOS inside a block and budgets ending
mid-tree; sampled rows verify linear drafts (documented) and keep the target's law.
"""

from __future__ import annotations

import pytest
import torch

import test_sampling as ts
from pipeline.engine import GenerationSettings, SpeculationSettings, SpeculativeEngine
from pipeline.engine.cache import SlotCache
from pipeline.engine.proposers.base import Draft, NoState, tree_from_branches
from pipeline.engine.proposers.prompt_lookup import lookup, lookup_candidates
from pipeline.engine.runner import ModelRunner, prefill
from pipeline.engine.verify import tree_accept

from test_batch import _gemma3
from tiny_models import VOCAB, build, check_stats, perturbed_copy, prompt_of

# ---------------------------------------------------------------------------- units


def test_tree_accept_follows_the_target_through_any_branch():
    # root -> a(0) -> b(1);  root -> c(2) -> d(3), c -> e(4)
    tokens, parents = [10, 11, 12, 13, 14], [-1, 0, -1, 2, 2]
    # choices: at the root 12 (c), at c 14 (e), at e 7 (bonus)
    choice = [12, 0, 0, 14, 0, 7]
    assert tree_accept(tokens, parents, choice) == ([2, 4], 7)
    assert tree_accept(tokens, parents, [10, 11, 5, 0, 0, 0]) == ([0, 1], 5)
    assert tree_accept(tokens, parents, [42, 0, 0, 0, 0, 0]) == ([], 42)


def test_a_trie_of_candidates_keeps_the_first_branch_first():
    d = tree_from_branches([[1, 2, 3], [1, 5], [4]], "cpu")
    assert d.tokens.tolist() == [1, 2, 3, 5, 4] and d.parents == [-1, 0, 1, 0, -1]
    assert d.first_branch() == [0, 1, 2] and d.depths() == [1, 2, 3, 2, 1] and d.is_tree
    assert d.truncated(3).parents == [-1, 0, 1] and not d.truncated(3).is_tree
    p = d.pruned(1, 9)
    assert p.tokens.tolist() == [1, 4] and p.parents == [-1, -1]
    assert tree_from_branches([[1, 2]], "cpu").parents is None  # one branch: a linear draft


def test_prompt_lookup_candidates_start_with_the_linear_draft():
    seq = torch.tensor([7, 8, 1, 2, 9, 8, 1, 3, 4, 8, 1, 5, 0, 1, 6, 6, 8, 1])
    first = lookup(seq, 3, 2).tolist()
    found = lookup_candidates(seq, 3, 2, 4)
    assert found[0] == first == [2, 9, 8]
    # the other sites of "8 1", latest first, then a site of "1" alone with a new continuation
    assert found[1:] == [[5, 0, 1], [3, 4, 8], [6, 6, 8]]
    assert lookup_candidates(seq, 3, 2, 1) == [first]
    assert lookup_candidates(seq, 3, 2, 9) == found  # no other continuation


# ---------------------------------------------------------------------------- a scripted proposer
class ScriptedTrees(NoState):
    """Drafts trees from the rows' known greedy outputs, in shapes that turn with the row's
    length: the right continuation on the first branch, on the second (the first wrong at
    depth 1), diverging at depth 2 (the first branch wrong there), or a linear draft."""

    def __init__(self, cases: list[tuple[list[int], list[int]]], depth: int = 3):
        self.cases, self.depth, self.shapes = cases, depth, []

    def _truth(self, seq: list[int]) -> list[int]:
        for prompt, out in self.cases:
            if seq[: len(prompt)] == prompt and seq[len(prompt):] == out[: len(seq) - len(prompt)]:
                return out[len(seq) - len(prompt):]
        raise AssertionError("a row the script does not know")

    def propose(self, requests):
        drafts = []
        for r in requests:
            seq = r.sequence[0].tolist()
            right = self._truth(seq)[: min(r.k, self.depth)]
            if not right:
                drafts.append(Draft(torch.empty(0, dtype=torch.long)))
                continue
            wrong = [(t + 1) % VOCAB for t in right]
            shape = len(seq) % 4
            self.shapes.append(shape)
            if shape == 0:
                branches = [right, wrong]
            elif shape == 1:
                branches = [wrong, right]
            elif shape == 2 and len(right) > 1:
                branches = [right[:1] + wrong[1:], right]
            else:
                drafts.append(Draft(torch.tensor(right)))
                continue
            drafts.append(tree_from_branches(branches, r.sequence.device))
        return drafts


def _scripted_engine(target, cases, batch, depth=3):
    engine = SpeculativeEngine(target, SpeculationSettings(method="prompt_lookup", prompt_lookup_num_tokens=depth,
                                                           num_candidates=2),
                               max_batch_size=batch, draft_length="fixed")
    engine.proposer = ScriptedTrees(cases, depth)
    return engine


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def target(request):
    return build("llama", layers=3, seed=0) if request.param == "llama" else _gemma3()


@pytest.fixture(scope="module")
def references(target):
    plain = SpeculativeEngine(target, max_batch_size=1)
    prompts = [prompt_of(n, seed=n + 3) for n in (6, 23, 1, 40, 11)]
    budgets = [24, 7, 13, 24, 2]
    outs = [plain.generate(p, GenerationSettings(max_new_tokens=b)).token_ids for p, b in zip(prompts, budgets)]
    return prompts, budgets, outs


@pytest.mark.parametrize("batch", [1, 3])
def test_the_right_branch_is_accepted_wherever_it_is(target, references, batch):
    """Teeth: the first branch is often wrong; the accepted path comes from the second
    branch (every draft's right continuation is accepted in full), and the output is plain
    greedy's (the accepted path's cache entries moved to their slots, or later steps would
    read the wrong branch's keys)."""
    prompts, budgets, outs = references
    engine = _scripted_engine(target, [(p[0].tolist(), o) for p, o in zip(prompts, outs)], batch)
    results = engine.generate_batch(prompts, [GenerationSettings(max_new_tokens=b) for b in budgets])
    assert [r.token_ids for r in results] == outs
    assert {1, 2} <= set(engine.proposer.shapes)  # wrong first branches were drafted
    assert sum(r.stats.tree_steps for r in results) > len(results)
    for r in results:
        check_stats(r, 3)
        s = r.stats
        assert s.tree_nodes >= 2 * s.tree_steps
        # every draft holds the right continuation somewhere: all accepted (up to the budget)
        assert s.accepted_tokens == s.draft_tokens or r.finish_reason != "length"
        assert s.new_tokens == s.accepted_tokens + s.verify_steps


def test_the_cache_after_a_tree_step_equals_a_fresh_pass(target, references, monkeypatch):
    """After a tree step whose accepted path is its second branch, the row's cached keys and
    values at positions 0 .. L-2 equal those of a fresh prefill of the accepted text; with
    the move to the path's slots switched off they do not."""
    prompts, _, outs = references
    prompt, out = prompts[3], outs[3]

    def one_step(move=True):
        engine = _scripted_engine(target, [(prompt[0].tolist(), out)], 1)
        engine.proposer._truth = lambda seq: out[len(seq) - prompt.shape[1]:]
        engine.bind(1)
        row = engine.new_row(0, prompt, GenerationSettings(max_new_tokens=20), 0, "cpu")
        row.sequence = torch.cat([row.sequence, torch.tensor([out[:1]])], dim=1)  # length % 4 == 1: second branch
        row.generated = list(out[:1])
        assert row.length % 4 == 1
        engine.admit([row])
        engine.step([row])
        assert row.stats.tree_steps == 1 and row.stats.accepted_tokens == 3
        return engine.runner.cache, row

    cache, row = one_step()
    fresh = ModelRunner(target, 1)
    prefill(lambda *a, **kw: fresh.forward(*a, **kw), [0], [row.sequence])
    n = row.length - 1
    for mine, ref in zip(cache.layers, fresh.cache.layers):
        assert torch.allclose(mine.keys[0, :, :n], ref.keys[0, :, :n], atol=1e-10)
        assert torch.allclose(mine.values[0, :, :n], ref.values[0, :, :n], atol=1e-10)

    monkeypatch.setattr(SlotCache, "move", lambda self, slot, a, b: None)
    cache, row = one_step()
    assert not all(torch.allclose(m.keys[0, :, :n], r.keys[0, :, :n], atol=1e-10)
                   for m, r in zip(cache.layers, fresh.cache.layers))


# ---------------------------------------------------------------------------- real proposers
def _tree_engines(target, drafter, batch, **kw):
    for c in (2, 4):
        yield f"suffix c={c}", SpeculativeEngine(
            target, SpeculationSettings(method="suffix", num_assistant_tokens=4, num_candidates=c),
            max_batch_size=batch, **kw)
        yield f"prompt_lookup c={c}", SpeculativeEngine(
            target, SpeculationSettings(method="prompt_lookup", prompt_lookup_num_tokens=4, num_candidates=c),
            max_batch_size=batch, **kw)
        yield f"draft_model c={c}", SpeculativeEngine(
            target, SpeculationSettings(method="draft_model", num_assistant_tokens=3, num_candidates=c),
            drafter=drafter, max_batch_size=batch, **kw)


@pytest.mark.parametrize("batch", [1, 3])
def test_prompt_lookup_suffix_and_draft_model_trees_equal_plain(target, references, batch):
    prompts, budgets, outs = references
    drafter = perturbed_copy(target, 0.3)
    settings = [GenerationSettings(max_new_tokens=b) for b in budgets]
    for name, engine in _tree_engines(target, drafter, batch, draft_length="fixed"):
        results = engine.generate_batch(prompts, settings)
        assert [r.token_ids for r in results] == outs, name
        for r in results:
            check_stats(r, 4)
        assert sum(r.stats.tree_steps for r in results) > 0, name


@pytest.mark.parametrize("costs", ["measured", "cpu", "wide"])
def test_tree_size_by_expected_gain_never_changes_an_output(references, target, costs):
    """With the draft length and the tree's node count from the controller (on the costs it
    measures, on a CPU-like curve, or on one where a wider pass costs next to nothing), every
    row is still plain greedy's."""
    import test_draft_budget as tb

    prompts, budgets, outs = references
    drafter = perturbed_copy(target, 0.3)
    for name, engine in _tree_engines(target, drafter, 3, draft_length="auto"):
        if costs != "measured":
            engine.controller.curve = tb.CPU if costs == "cpu" else tb.Costs(lambda b, w: 0.010 + 0.00003 * b * (w - 1))
        results = engine.generate_batch(prompts * 2, [GenerationSettings(max_new_tokens=b) for b in budgets] * 2)
        assert [r.token_ids for r in results] == outs * 2, name
        if costs == "wide":  # side nodes pay where a wider pass costs next to nothing: trees are verified
            assert sum(r.stats.tree_steps for r in results) > 0, name


def test_eos_inside_a_tree_block_and_a_budget_ending_mid_tree():
    target = build("llama", seed=0)
    oracle = perturbed_copy(target, 0.0)  # the chain is always right: EOS lands inside accepted blocks
    prompts = [prompt_of(n, seed=n) for n in (4, 9, 1, 30)]
    plain = SpeculativeEngine(target)
    settings, expected = [], []
    for i, p in enumerate(prompts):
        full = plain.generate(p, GenerationSettings(max_new_tokens=30)).token_ids
        if i % 2:
            budget = 5 + 2 * i  # not a multiple of the block of 4 + 1
            settings.append(GenerationSettings(max_new_tokens=budget))
            expected.append((full[:budget], "length"))
        else:
            eos = full[6 + i]
            settings.append(GenerationSettings(max_new_tokens=30, eos_token_id=eos))
            expected.append((full[: full.index(eos) + 1], "stop"))
    for method, drafter in (("draft_model", oracle), ("prompt_lookup", None), ("suffix", None)):
        engine = SpeculativeEngine(target, SpeculationSettings(method=method, num_assistant_tokens=4,
                                                               prompt_lookup_num_tokens=4, num_candidates=3),
                                   drafter=drafter, max_batch_size=2, draft_length="fixed")
        results = engine.generate_batch(prompts, settings)
        assert [(r.token_ids, r.finish_reason) for r in results] == expected, method
        for r in results:
            check_stats(r, 4)
        if method == "draft_model":  # its trees branch at every position (these prompts repeat one n-gram site)
            assert all(r.stats.tree_steps == r.stats.draft_steps > 0 for r in results)


def _sampled_tree_engine(target):
    return SpeculativeEngine(target, SpeculationSettings(method="draft_model", num_assistant_tokens=2,
                                                         num_candidates=3), drafter=perturbed_copy(target, 1.0, seed=12))


def test_sampled_rows_verify_linear_drafts_and_say_so(tiny_vocab_pair):
    """Documented: trees are greedy only.  A sampled row of an engine with num_candidates > 1
    is asked for one linear draft per step (rejection sampling, exact), and its statistics
    count those steps in ``tree_off_steps``; a greedy row of the same engine verifies trees."""
    target, _ = tiny_vocab_pair
    engine = _sampled_tree_engine(target)
    sampled = engine.generate(ts.PROMPT, GenerationSettings(max_new_tokens=12, seed=1, **ts.SETTINGS)).stats
    assert sampled.tree_steps == 0 and sampled.tree_off_steps == sampled.draft_steps > 0
    greedy = engine.generate(ts.PROMPT, GenerationSettings(max_new_tokens=12)).stats
    assert greedy.tree_steps == greedy.draft_steps > 0 and greedy.tree_off_steps == 0


@pytest.mark.slow
def test_sampled_rows_of_a_tree_engine_follow_the_target_distribution(tiny_vocab_pair):
    target, _ = tiny_vocab_pair
    samples, drafted, accepted = ts.sample_first_two_tokens(_sampled_tree_engine(target))
    assert 50 < accepted < drafted - 50
    assert ts.chi_square_p_value(samples, ts.exact_two_token_distribution(target)) > 1e-3


@pytest.fixture(scope="module")
def tiny_vocab_pair():
    target = build("llama", vocab=ts.V, hidden=32, seed=11, initializer_range=0.3)
    return target, None


def test_trees_are_refused_where_they_cannot_run():
    target = build("llama", seed=0)
    with pytest.raises(ValueError, match="num_candidates"):
        SpeculationSettings(method="prompt_lookup", num_candidates=0).validate()
    with pytest.raises(ValueError, match="num_candidates=2.*early_exit"):
        SpeculativeEngine(target, SpeculationSettings(method="early_exit", assistant_early_exit=1, num_candidates=2))
