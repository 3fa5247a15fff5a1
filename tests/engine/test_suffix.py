"""Method ``suffix`` (SuffixDecoding): its trees, and an engine that drafts from them.

The trees: counts of every substring of bounded depth, drafts by frequency that grow with
the match, a job-wide tree whose memory stays within its bound after evictions, and drafts
it makes from earlier rows' outputs.  The engine, in float64 on tiny random targets:
greedy output equal to single-row plain greedy output for batches of 1, 3 and 8 (budgets
ending mid-draft), with EOS ids inside accepted blocks, and whatever order the rows come in
and whatever the job-wide tree holds; sampling at batch 4 keeps the target's law
(chi-square).
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

import test_sampling as ts
from pipeline.engine import GenerationSettings, SpeculationSettings, SpeculativeEngine
from pipeline.engine.proposers.base import DraftRequest
from pipeline.engine.proposers.suffix import SuffixProposer, SuffixTree
from pipeline.engine.sampling import LogitsShaper
from test_batch import rows_of

from tiny_models import build, check_stats, prompt_of

K = 6


def suffix_spec(**kw) -> SpeculationSettings:
    kw.setdefault("num_assistant_tokens", K)
    return SpeculationSettings(method="suffix", **kw)


def dump(tree: SuffixTree) -> dict[tuple[int, ...], tuple[int, int]]:
    """Every node of ``tree``: path -> (count, continued count)."""
    out, stack = {}, [((), tree.root)]
    while stack:
        path, node = stack.pop()
        if path:
            out[path] = (node.count, node.cont)
        stack.extend((path + (t,), c) for t, c in node.children.items())
    return out


def brute_counts(docs: list[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    counts: Counter = Counter()
    for d in docs:
        for s in range(len(d)):
            for e in range(s + 1, min(len(d), s + depth) + 1):
                counts[tuple(d[s:e])] += 1
    return dict(counts)


def request(slot: int, tokens: list[int], k: int) -> DraftRequest:
    settings = GenerationSettings(max_new_tokens=8, do_sample=False)
    return DraftRequest(slot, torch.tensor([tokens]), k, LogitsShaper(settings, prompt_length=1), None, False)


# ---------------------------------------------------------------------------- the trees
def test_tree_counts_every_bounded_substring_incrementally_and_whole():
    rng = random.Random(0)
    doc = [rng.randrange(5) for _ in range(60)]
    whole, grown = SuffixTree(4), SuffixTree(4)
    whole.add(doc)
    active = []
    for i in range(0, 60, 7):  # in pieces, as a row's committed text grows
        active = grown.extend(active, doc[i : i + 7])
    expected = brute_counts([doc], 4)
    assert {p: c for p, (c, _) in dump(whole).items()} == expected
    assert dump(grown) == dump(whole) and grown.nodes == whole.nodes == len(expected)
    # continued = occurrences followed by a token within the depth
    for path, (count, cont) in dump(whole).items():
        if len(path) < 4:
            assert cont == sum(expected.get(path + (t,), 0) for t in range(5))


def test_draft_follows_the_most_frequent_continuation_and_grows_with_the_match():
    tree = SuffixTree(8)
    tree.add([1, 2, 3, 4, 5, 6, 9, 1, 2, 3, 4, 5, 6, 9, 2, 3, 7])
    # after [.., 2, 3] the tree saw 4 twice and 7 once: 4 is drafted, then what followed it
    tokens, score, m, probs = tree.speculate([8, 1, 2, 3], k=10, max_spec_factor=1.0, min_token_prob=0.0)
    assert tokens[:3] == [4, 5, 6] and m == 3 and len(tokens) <= m
    assert probs == [1.0, 1.0, 1.0] and score == 3.0  # [1, 2, 3] was always followed by 4 5 6
    # a factor of 2 lets the same match draft twice as far (depth allowing)
    long, *_ = tree.speculate([8, 1, 2, 3], k=10, max_spec_factor=2.0, min_token_prob=0.0)
    assert len(long) > len(tokens) and long[: len(tokens)] == tokens
    # a minimum probability of 0.7 stops before the 2/3-likely token after [3]
    short, *_ = tree.speculate([8, 3], k=10, max_spec_factor=4.0, min_token_prob=0.7)
    assert short == []
    assert tree.speculate([8, 8], k=5, max_spec_factor=1.0, min_token_prob=0.0) == ([], 0.0, 0, [])
    # a shorter match: after [3] the tree saw 4 twice and 7 once
    assert tree.speculate([8, 3], k=1, max_spec_factor=1.0, min_token_prob=0.0).probs == [pytest.approx(2 / 3)]


def test_branches_are_the_most_frequent_continuations_of_both_trees():
    """What a token tree would verify: the few most frequent first tokens after the text's
    longest continued suffix, each followed greedily, from the row's tree and the job's."""
    proposer = SuffixProposer(max_tree_depth=6)
    proposer.admit([0], [torch.tensor([[5, 6, 7, 9, 9]])])
    proposer.finish(0, [1, 2, 4, 4])  # the job-wide tree: 1 2 -> 4 (always)
    row = [7, 1, 2, 8, 8, 1, 2, 8, 8, 1, 2, 3, 3, 1, 2]  # its own tree: 1 2 -> 8 (twice), 3 (once)
    proposer.admit([1], [torch.tensor([row])])
    branches = proposer.branches(row, 1, width=3, depth=3)
    assert [path[0] for path, _ in branches] == [4, 8, 3]
    assert branches[0] == ([4, 4], 1.0) and branches[1] == ([8, 8, 1], pytest.approx(2 / 3))
    assert all(len(path) <= 3 for path, _ in branches)


def test_job_wide_tree_stays_within_its_bound_and_equals_a_tree_of_what_it_keeps():
    proposer = SuffixProposer(max_tree_depth=5, max_cached_requests=3)
    rng = random.Random(1)
    outputs = []
    for i in range(12):
        prompt = [rng.randrange(20) for _ in range(10)]
        output = [rng.randrange(20) for _ in range(rng.randint(1, 30))]
        proposer.admit([i % 2], [torch.tensor([prompt])])
        proposer.finish(i % 2, output)
        outputs.append(prompt[-4:] + output)
        assert len(proposer.cached) == min(i + 1, 3)
        kept = outputs[-3:]
        assert list(proposer.cached) == kept
        fresh = SuffixTree(5)
        for d in kept:
            fresh.add(d)
        assert dump(proposer.global_tree) == dump(fresh)
        assert proposer.global_tree.nodes == fresh.nodes <= sum(len(d) * 5 for d in kept)
    assert proposer.rows == {}  # finished rows leave nothing behind


def test_job_wide_tree_drafts_what_an_earlier_row_wrote():
    """Teeth: a row whose own text has never continued its latest tokens gets, from the
    job-wide tree, the continuation an earlier row's output had; without it, nothing."""
    earlier_out = [40, 41, 42, 43, 44, 45, 46, 47]
    for cached, expected in ((10, [43, 44, 45, 46, 47]), (0, [])):
        proposer = SuffixProposer(max_tree_depth=8, max_cached_requests=cached, max_spec_factor=2.0)
        proposer.admit([0], [torch.tensor([[1, 2, 3, 4]])])
        proposer.finish(0, earlier_out)
        new = [9, 8, 7, 6, 40, 41, 42]  # ends with the earlier output's start, seen nowhere else in it
        proposer.admit([0], [torch.tensor([new])])
        (draft,) = proposer.propose([request(0, new, 5)])
        assert draft.tokens.tolist() == expected and draft.probs is None
        assert proposer.drafts_from["job"] == (1 if cached else 0)


# ---------------------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def llama():
    target = build("llama", layers=3, seed=0)
    rows = rows_of(7, 12) + [(prompt_of(30, seed=71), 7), (prompt_of(12, seed=72), 5)]  # budgets < K + 1
    plain = SpeculativeEngine(target, max_batch_size=1)
    references = [plain.generate(p, GenerationSettings(max_new_tokens=b)).token_ids for p, b in rows]
    return target, rows, references


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_greedy_equals_plain_single_row_and_batched(llama, batch):
    target, rows, references = llama
    engine = SpeculativeEngine(target, suffix_spec(suffix_decoding_max_spec_factor=2.0), max_batch_size=batch)
    results = engine.generate_batch([p for p, _ in rows], [GenerationSettings(max_new_tokens=b) for _, b in rows])
    for i, (r, ref) in enumerate(zip(results, references)):
        assert r.error is None and r.token_ids == ref, (batch, i)
        assert r.finish_reason == "length"
        check_stats(r, K)
    assert sum(r.stats.accepted_tokens for r in results) > 20  # it drafts, and the target keeps some


def test_rows_shuffled_and_a_warm_job_wide_tree_change_no_output(llama):
    """The job-wide tree's state (empty, or holding every row's output from earlier runs in
    another order) and the rows' order change which tokens are drafted, never an output."""
    target, rows, references = llama
    engine = SpeculativeEngine(target, suffix_spec(suffix_decoding_max_cached_requests=4), max_batch_size=3,
                               draft_length="auto")
    order = list(range(len(rows)))
    for seed in (3, 4, 5):
        random.Random(seed).shuffle(order)
        results = engine.generate_batch([rows[i][0] for i in order],
                                        [GenerationSettings(max_new_tokens=rows[i][1]) for i in order])
        assert [r.token_ids for r in results] == [references[i] for i in order], seed
        assert len(engine.proposer.cached) <= 4
    assert engine.proposer.drafts_from["job"] > 0  # the job-wide tree did draft


def test_job_wide_tree_pays_when_rows_repeat_earlier_rows(llama):
    """A row that continues an earlier row's text (the same prompt, then part of the same
    answer) has the rest of that answer drafted from the job-wide tree: nearly all of it
    is accepted, and more of it than without the tree."""
    target, _, _ = llama
    prompt = prompt_of(20, seed=90)
    first = SpeculativeEngine(target).generate(prompt, GenerationSettings(max_new_tokens=40)).token_ids
    follow = torch.cat([prompt, torch.tensor([first[:6]])], dim=1)
    accepted = {}
    for cached in (10, 0):
        engine = SpeculativeEngine(target, suffix_spec(suffix_decoding_max_cached_requests=cached,
                                                       suffix_decoding_max_spec_factor=4.0))
        engine.generate(prompt, GenerationSettings(max_new_tokens=40))
        r = engine.generate(follow, GenerationSettings(max_new_tokens=30))
        assert r.token_ids == first[6:36]
        accepted[cached] = r.stats.accepted_tokens
    assert accepted[10] >= 20 and accepted[10] > accepted[0]


def test_eos_inside_accepted_blocks(llama):
    """Rows stop at an EOS id their output emits inside an accepted draft block."""
    target, _, _ = llama
    plain = SpeculativeEngine(target)
    prompts = [prompt_of(n, seed=n + 5) for n in (6, 15, 40, 9)]
    settings, expected = [], []
    for i, p in enumerate(prompts):
        full = plain.generate(p, GenerationSettings(max_new_tokens=40)).token_ids
        eos = full[12 + i]
        settings.append(GenerationSettings(max_new_tokens=40, eos_token_id=eos))
        expected.append(full[: full.index(eos) + 1])
    for batch in (1, 4):
        engine = SpeculativeEngine(target, suffix_spec(suffix_decoding_max_spec_factor=4.0), max_batch_size=batch)
        results = engine.generate_batch(prompts, settings)
        assert [r.token_ids for r in results] == expected, batch
        assert all(r.finish_reason == "stop" for r in results)
        assert sum(r.stats.accepted_tokens for r in results) > 0


@pytest.mark.slow
def test_sampling_in_a_batch_of_four_follows_the_target_distribution():
    """test_sampling.py's chi-square test at batch size 4, with the job-wide tree learning
    from every finished row (other prompts' rows among them): the point-mass ``q`` of a
    deterministic draft keeps the target's law."""
    target = build("llama", vocab=ts.V, hidden=32, seed=11, initializer_range=0.3)
    exact = ts.exact_two_token_distribution(target)
    engine = SpeculativeEngine(target, suffix_spec(num_assistant_tokens=2, suffix_decoding_max_spec_factor=2.0,
                                                   suffix_decoding_min_token_prob=0.0), max_batch_size=4)
    others = [torch.randint(0, ts.V, (1, n), generator=torch.Generator().manual_seed(n)) for n in (2, 5, 9)]
    prompts, settings, counted = [], [], []
    for seed in range(ts.RUNS):
        prompts += [ts.PROMPT, others[seed % 3]]
        settings += [GenerationSettings(max_new_tokens=3, seed=seed, **ts.SETTINGS),
                     GenerationSettings(max_new_tokens=1 + seed % 6, seed=10_000 + seed, **ts.SETTINGS)]
        counted += [True, False]
    results = engine.generate_batch(prompts, settings)
    samples = Counter(tuple(r.token_ids[:2]) for r, c in zip(results, counted) if c)
    drafted = sum(r.stats.draft_tokens for r, c in zip(results, counted) if c)
    accepted = sum(r.stats.accepted_tokens for r, c in zip(results, counted) if c)
    assert 50 < accepted < drafted - 50  # acceptance and rejection paths both ran
    assert ts.chi_square_p_value(samples, exact) > 1e-3


@pytest.mark.parametrize("field, bad", [("suffix_decoding_max_tree_depth", 1), ("suffix_decoding_max_cached_requests", -1),
                                        ("suffix_decoding_max_spec_factor", 0.0), ("suffix_decoding_min_token_prob", 1.5)])
def test_bad_options_are_refused_naming_them(field, bad):
    with pytest.raises(ValueError, match=field):
        suffix_spec(**{field: bad}).validate()
    with pytest.raises(ValueError, match=f"{field} is a setting of method 'suffix', not of 'prompt_lookup'"):
        SpeculationSettings(method="prompt_lookup", **{field: 4}).validate()
