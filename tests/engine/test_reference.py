"""Reference drafting (pipeline/engine/reference.py): a row drafts from a text the model does
not see, its previous output, and stays lossless: greedy equals plain (single row and
batched; references exact, edited, longer, shorter, empty, of other tokens; EOS inside a
block, a budget ending mid-draft), sampling follows the target's law at batch 4 (chi-square)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from pipeline.engine import GenerationSettings, SpeculationSettings, SpeculativeEngine
from pipeline.engine.reference import REFERENCE_NGRAM, ReferenceIndex, offer_reference
from pipeline.engine.proposers.base import Draft, empty_draft

from test_draft_budget import CPU
from test_sampling import RUNS, SETTINGS, V, chi_square_p_value, exact_two_token_distribution
from tiny_models import build

NEW = 37  # a budget that ends inside a draft of 4


def test_the_index_drafts_what_followed_the_outputs_last_n_gram():
    idx = ReferenceIndex([5, 6, 7, 8, 5, 6, 9, 1], vocab_size=10)
    start = idx.draft([], 3)  # the start marker: the output's first tokens are the reference's
    assert start.source == "reference" and start.tokens.tolist() == [5, 6, 7] and start.probs is None
    assert start.confidence.tolist() == [1.0 / REFERENCE_NGRAM] * 3
    # "5 6" occurs twice, followed by 7 and by 9: the site at or after the previous match wins,
    # and the confidence says the n-gram was followed so half of the time
    idx.last = 4
    d = idx.draft([1, 5, 6], 2)
    assert d.tokens.tolist() == [9, 1]
    assert d.confidence.tolist() == pytest.approx([0.5 * 2 / REFERENCE_NGRAM, 1.0 * 2 / REFERENCE_NGRAM])
    assert idx.draft([2, 3, 4, 5, 6, 7], 4).tokens.tolist() == [8, 5, 6, 9]  # the longest n-gram (6 7)
    assert idx.draft([2, 3, 4, 0], 4) is None  # no n-gram of the output occurs in it
    assert idx.draft([5], 0) is None
    assert ReferenceIndex([], 10).draft([1, 2], 4) is None
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        ReferenceIndex([3, 10], vocab_size=10)
    with pytest.raises(ValueError, match="token ids"):
        ReferenceIndex([1.5])


def test_the_reference_is_offered_beside_the_methods_draft():
    ref = Draft(torch.tensor([1, 2]), confidence=torch.tensor([0.9, 0.9], dtype=torch.float64), source="reference")
    own = Draft(torch.tensor([3]), source="prompt")
    assert offer_reference(own, ref).alternatives == (ref,) and offer_reference(own, None) is own
    alone = offer_reference(Draft(torch.tensor([], dtype=torch.long), alternatives=(own,)), ref)
    assert alone.source == "reference" and alone.tokens.tolist() == [1, 2] and alone.alternatives == (own,)
    tree = Draft(torch.tensor([3, 4]), parents=[-1, -1])
    assert offer_reference(tree, ref) is tree
    assert offer_reference(empty_draft(torch.device("cpu")), ref).source == "reference"


@pytest.fixture(scope="module")
def greedy_rows():
    """Six prompts, their plain greedy outputs, and the outputs under an EOS inside them."""
    target = build("llama", seed=0)
    plain = SpeculativeEngine(target, max_batch_size=1)
    prompts = [torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(i)) for i in range(6)]
    outs = [plain.generate(p, GenerationSettings(max_new_tokens=NEW)).token_ids for p in prompts]
    eos = outs[0][20]  # a token inside row 0's output: it stops there, inside a drafted block
    stopped = [plain.generate(p, GenerationSettings(max_new_tokens=NEW, eos_token_id=eos)).token_ids for p in prompts]
    return target, prompts, outs, eos, stopped


def _references(outs: list[list[int]]) -> list[list[int] | None]:
    """Per row a kind of reference: exact, edited (one token changed), longer, shorter, empty,
    of other tokens (another language)."""
    o = outs
    return [o[0], o[1][:15] + [(o[1][15] + 1) % 64] + o[1][16:], o[2] + o[0], o[3][:12], [],
            [(t * 7 + 3) % 64 for t in o[5][::-1]]]


@pytest.mark.parametrize("method", ["suffix", "prompt_lookup"])
@pytest.mark.parametrize("draft_length", ["auto", "fixed"])
def test_reference_drafts_are_lossless_greedy_and_accepted(greedy_rows, method, draft_length):
    target, prompts, outs, eos, stopped = greedy_rows
    spec = SpeculationSettings(method=method, num_assistant_tokens=4, prompt_lookup_num_tokens=4)
    engine = SpeculativeEngine(target, spec, max_batch_size=3, draft_length=draft_length)
    if engine.controller is not None and not engine.controller.fixed:
        engine.controller.curve = CPU  # the controller's costs fixed: its choices do not follow the machine's load
    refs = _references(outs)
    settings = GenerationSettings(max_new_tokens=NEW)
    without = engine.generate_batch(prompts, settings)
    engine.reset_learning()  # suffix's pool must not hold the outputs it is compared on
    batched = engine.generate_batch(prompts, settings, references=refs)
    engine.reset_learning()
    single = [engine.generate_batch([p], settings, references=[r])[0] for p, r in zip(prompts[:2], refs[:2])]
    engine.reset_learning()
    eos_rows = engine.generate_batch(prompts, GenerationSettings(max_new_tokens=NEW, eos_token_id=eos), references=refs)
    assert [r.token_ids for r in without] == [r.token_ids for r in batched] == outs
    assert [r.token_ids for r in single] == outs[:2]
    assert [r.token_ids for r in eos_rows] == stopped and len(stopped[0]) == 21
    for r in batched + single + eos_rows:
        s = r.stats
        assert s.accepted_tokens == s.accepted_from_prompt + s.accepted_from_pool + s.accepted_from_reference \
            + s.accepted_from_drafter
    assert all(r.stats.accepted_from_reference == 0 for r in without)
    # the exact and the edited references are accepted; the edited row needs fewer steps with it
    assert all(batched[i].stats.accepted_from_reference >= 8 for i in (0, 1))
    assert batched[1].stats.verify_steps < without[1].stats.verify_steps
    assert sum(r.stats.accepted_tokens for r in batched[:2]) > sum(r.stats.accepted_tokens for r in without[:2])
    assert single[0].stats.accepted_from_reference >= 8


def test_plain_decoding_ignores_references_and_bad_ones_are_refused(greedy_rows):
    target, prompts, outs, _, _ = greedy_rows
    plain = SpeculativeEngine(target, max_batch_size=2)
    got = plain.generate_batch(prompts[:2], GenerationSettings(max_new_tokens=NEW), references=outs[:2])
    assert [r.token_ids for r in got] == outs[:2] and got[0].stats.accepted_from_reference == 0
    engine = SpeculativeEngine(target, SpeculationSettings(method="suffix"), max_batch_size=2)
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        engine.generate_batch(prompts[:1], references=[[1, 10_000]])
    with pytest.raises(ValueError, match="references has 1 entries for 2 prompts"):
        engine.generate_batch(prompts[:2], references=[None])


@pytest.mark.slow
def test_reference_drafts_keep_the_targets_law_at_batch_4():
    """``RUNS`` seeded rows, 4 in flight: the first two tokens come from one verification of a
    point-mass reference draft (prompt lookup finds nothing in this prompt, so the reference is
    the draft); both the acceptance and the rejection paths run, and the law is the target's."""
    target = build("llama", vocab=V, hidden=32, seed=11, initializer_range=0.3)
    prompt = torch.tensor([[3, 7, 1, 12, 5, 9, 2]])  # no repeated token: prompt lookup drafts nothing
    exact = exact_two_token_distribution(target, SETTINGS, prompt)
    likeliest = max(exact, key=exact.get)
    engine = SpeculativeEngine(target, SpeculationSettings(method="prompt_lookup", prompt_lookup_num_tokens=2),
                               max_batch_size=4)
    settings = [GenerationSettings(max_new_tokens=3, seed=seed, **SETTINGS) for seed in range(RUNS)]
    results = engine.generate_batch([prompt] * RUNS, settings, references=[list(likeliest) * 2] * RUNS)
    samples = Counter(tuple(r.token_ids[:2]) for r in results)
    accepted = sum(r.stats.accepted_from_reference for r in results)
    drafted = sum(r.stats.draft_tokens for r in results)
    assert 50 < accepted < drafted - 50  # the reference drafted, and was both accepted and rejected
    assert chi_square_p_value(samples, exact) > 1e-3
