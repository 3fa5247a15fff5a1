"""Universal assisted decoding (``method="universal"``): a drafter with another tokenizer.

Two byte-level BPE tokenizers of different sizes trained on tinyshakespeare and random
Llama models of matching vocabularies, all saved with ``save_pretrained`` and loaded with
``AutoTokenizer`` / ``from_pretrained``.  Greedy equals plain decoding and
``generate(assistant_model=..., tokenizer=..., assistant_tokenizer=...)``; the
re-encoding keeps drafts aligned with the committed text; a pair trained on the same text
gets drafts accepted.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import DynamicCache

from pipeline.engine import GenerationSettings, SpeculationSettings, SpeculativeEngine
from pipeline.engine.proposers.base import DraftRequest
from pipeline.engine.sampling import LogitsShaper
from tiny_checkpoints import bpe_tokenizer, llama_for, shakespeare_lines, train_lm
from tiny_models import check_stats

K = 3


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("uad")
    lines = shakespeare_lines(400)
    tok_t = bpe_tokenizer(root / "target", 400, lines, "<bos>", "<eos>")
    tok_d = bpe_tokenizer(root / "drafter", 300, lines, "<s>", "</s>")
    target = llama_for(tok_t, root / "target", seed=0)
    drafter = llama_for(tok_d, root / "drafter", seed=1)
    cfg = drafter.generation_config  # generate() reads the draft settings from the assistant's config
    cfg.num_assistant_tokens, cfg.num_assistant_tokens_schedule, cfg.assistant_confidence_threshold = K, "constant", 0.0
    return target, drafter, tok_t, tok_d


def engine(pair, **kw):
    target, drafter, tok_t, tok_d = pair
    return SpeculativeEngine(target, SpeculationSettings(method="universal", num_assistant_tokens=K, **kw),
                             drafter=drafter, tokenizer=tok_t, drafter_tokenizer=tok_d)


def prompts(tok, n=3, start=1000):
    return [tok(line, return_tensors="pt").input_ids for line in shakespeare_lines(n, start)]


def test_fixture_is_two_real_tokenizers(pair):
    target, drafter, tok_t, tok_d = pair
    assert len(tok_t) != len(tok_d) and target.config.vocab_size == len(tok_t) and drafter.config.vocab_size == len(tok_d)
    text = "First Citizen:\nBefore we proceed any further, hear me speak."
    assert tok_t(text).input_ids != tok_d(text).input_ids
    for tok in (tok_t, tok_d):  # byte level: any text (and any id sequence of whole characters) round-trips
        assert tok.decode(tok(text, add_special_tokens=False).input_ids) == text


@pytest.mark.parametrize("budget", [1, 2, 30])
def test_greedy_matches_plain_and_generate(pair, budget):
    target, drafter, tok_t, tok_d = pair
    eng = engine(pair)
    for prompt in prompts(tok_t):
        plain = SpeculativeEngine(target).generate(prompt, GenerationSettings(max_new_tokens=budget)).token_ids
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = target.generate(prompt, max_new_tokens=budget, do_sample=False, assistant_model=drafter,
                                  tokenizer=tok_t, assistant_tokenizer=tok_d)[0, prompt.shape[1]:].tolist()
        result = eng.generate(prompt, GenerationSettings(max_new_tokens=budget))
        assert result.token_ids == plain == ref
        assert result.text == tok_t.decode(plain, skip_special_tokens=True)
        check_stats(result, K)
        if budget == 30:
            assert result.stats.draft_tokens > 0


def test_sampling_is_seeded_and_drafts(pair):
    eng = engine(pair)
    prompt = prompts(pair[2], 1)[0]
    settings = dict(max_new_tokens=20, do_sample=True, temperature=0.8, top_k=50)
    runs = [eng.generate(prompt, GenerationSettings(seed=s, **settings)) for s in (1, 1, 2)]
    assert runs[0].token_ids == runs[1].token_ids != runs[2].token_ids
    for r in runs:
        check_stats(r, K)
        assert r.stats.draft_tokens > 0


def test_drafts_continue_the_committed_text(pair):
    """Alignment: the target ids of a draft, appended to the committed ids, decode to the
    committed text followed by the drafter's text, also where the committed text ends in
    the middle of a word; and the drafter's cache is re-synchronised to the committed text."""
    target, drafter, tok_t, tok_d = pair
    proposer = engine(pair).proposer
    decode = lambda ids: tok_t.decode(ids, skip_special_tokens=True)
    for head, suffix in [("First Citizen:\nBefore we", " proceed any further"),
                         ("First Citizen:\nBefore we pro", "ceed any further"),
                         ("All:\nSpeak,", " speak.\n\nFirst")]:
        committed = tok_t(head).input_ids
        ids = proposer.to_target(committed, suffix, k=50)
        assert ids and decode(committed + ids) == head + suffix, (head, suffix)
        assert proposer.to_target(committed, suffix, k=2) == ids[:2]
    assert proposer.to_target(tok_t("abc").input_ids, "\ufffd", k=5) == []  # an incomplete character: nothing

    proposer.bind(1, None)
    proposer.admit([0], [None])
    shaper = LogitsShaper(GenerationSettings())

    def cache_matches_ids():
        """The drafter's cache holds exactly the keys of one uncached pass over its ids."""
        reference = DynamicCache(config=drafter.config)
        with torch.no_grad():
            drafter(input_ids=torch.tensor([proposer.ids[0]]), cache=reference, use_cache=True)
        for layer, ref in zip(proposer.runner.cache.layers, reference.layers):
            torch.testing.assert_close(layer.keys[0, :, : len(proposer.ids[0])], ref.keys[0])

    sequence = torch.tensor([tok_t("First Citizen:\nBefore we proceed").input_ids])
    draft = proposer.propose([DraftRequest(0, sequence, K, shaper, None, False)])[0]
    synced = tok_d(decode(sequence[0].tolist())).input_ids
    assert proposer.ids[0][: len(synced)] == synced
    cache_matches_ids()
    if len(draft):
        text = decode(sequence[0].tolist() + draft.tokens.tolist())
        assert text.startswith(decode(sequence[0].tolist()))
    # the target commits something else: the drafter keeps the common prefix only
    other = torch.cat([sequence, torch.tensor([tok_t(" away").input_ids[1:]])], dim=1)
    proposer.propose([DraftRequest(0, other, K, shaper, None, False)])
    synced = tok_d(decode(other[0].tolist())).input_ids
    assert proposer.ids[0][: len(synced)] == synced
    cache_matches_ids()


def test_trained_pair_accepts_drafts(tmp_path):
    """A target and a drafter trained on the same text (a few hundred steps) agree on
    common continuations: drafts cross the tokenizers and are accepted, losslessly."""
    lines = shakespeare_lines(400)
    tok_t = bpe_tokenizer(tmp_path / "t", 400, lines, "<bos>", "<eos>")
    tok_d = bpe_tokenizer(tmp_path / "d", 300, lines, "<s>", "</s>")
    target = train_lm(llama_for(tok_t, tmp_path / "t", seed=0, dtype=torch.float32), tok_t, lines, seed=0).double()
    drafter = train_lm(llama_for(tok_d, tmp_path / "d", seed=1, dtype=torch.float32), tok_d, lines, seed=1).double()
    eng = SpeculativeEngine(target, SpeculationSettings(method="universal", num_assistant_tokens=K), drafter=drafter,
                            tokenizer=tok_t, drafter_tokenizer=tok_d)
    drafted = accepted = 0
    for prompt in prompts(tok_t, 4):
        plain = SpeculativeEngine(target).generate(prompt, GenerationSettings(max_new_tokens=30)).token_ids
        result = eng.generate(prompt, GenerationSettings(max_new_tokens=30))
        assert result.token_ids == plain
        check_stats(result, K)
        drafted += result.stats.draft_tokens
        accepted += result.stats.accepted_tokens
    assert drafted > 0 and 0.05 < accepted / drafted < 1
    # the same rows in flight together: one drafter pass per draft position for all of them
    rows = prompts(tok_t, 4)
    batched = eng.generate_batch(rows, GenerationSettings(max_new_tokens=30), max_batch_size=4)
    for prompt, result in zip(rows, batched):
        assert result.token_ids == SpeculativeEngine(target).generate(prompt, GenerationSettings(max_new_tokens=30)).token_ids
    assert sum(r.stats.accepted_tokens > 0 for r in batched) >= 2


def test_needs_both_tokenizers_and_refuses_ensemble(pair):
    target, drafter, tok_t, tok_d = pair
    with pytest.raises(ValueError, match="tokenizer"):
        SpeculativeEngine(target, SpeculationSettings(method="universal"), drafter=drafter, tokenizer=tok_t)
    with pytest.raises(ValueError, match="drafter"):
        SpeculativeEngine(target, SpeculationSettings(method="universal"), tokenizer=tok_t, drafter_tokenizer=tok_d)
    with pytest.raises(ValueError, match="assistant_ensemble_weight"):
        SpeculativeEngine(target, SpeculationSettings(method="universal", assistant_ensemble_weight=0.7),
                          drafter=drafter, tokenizer=tok_t, drafter_tokenizer=tok_d)


def test_rows_draft_together_in_a_batch(pair):
    """The drafter runs every drafting row in one pass per draft position (one slot of its
    cache per row): a batch of rows in flight, each equal to its plain output, with drafts
    made for several rows (a trained pair's batch: test_trained_pair_accepts_drafts)."""
    target, drafter, tok_t, tok_d = pair
    eng = engine(pair)
    rows = prompts(tok_t)
    results = eng.generate_batch(rows, GenerationSettings(max_new_tokens=20), max_batch_size=8)
    assert eng.runner.cache.max_rows == len(rows) == eng.proposer.runner.cache.max_rows
    assert sum(r.stats.draft_tokens > 0 for r in results) >= 2
    plain = SpeculativeEngine(target)
    for prompt, result in zip(rows, results):
        assert result.token_ids == plain.generate(prompt, GenerationSettings(max_new_tokens=20)).token_ids


def test_a_catch_up_feeds_the_drafter_only_the_latest_window(pair, monkeypatch):
    """A row the drafter has not seen (its first draft, or the first after steps without
    drafts) is caught up on the text's latest ``CATCH_UP_WINDOW`` drafter tokens only (its
    cache restarts there): no drafter pass feeds a row more, and greedy output is plain's,
    one row and batched."""
    import pipeline.engine.proposers.universal as universal
    from pipeline.engine.runner import ModelRunner

    monkeypatch.setattr(universal, "CATCH_UP_WINDOW", 4)
    target, drafter, tok_t, tok_d = pair
    eng = engine(pair)
    fed = []
    original = ModelRunner.forward

    def counted(self, slots, tokens, starts, *a, **kw):
        if self is eng.proposer.runner:
            fed.extend(int(t.shape[0]) for t in tokens)
        return original(self, slots, tokens, starts, *a, **kw)

    monkeypatch.setattr(ModelRunner, "forward", counted)
    rows = prompts(tok_t)
    assert min(r.shape[1] for r in rows) > 4
    plain = [SpeculativeEngine(target).generate(p, GenerationSettings(max_new_tokens=20)).token_ids for p in rows]
    assert [eng.generate(p, GenerationSettings(max_new_tokens=20)).token_ids for p in rows] == plain
    batched = eng.generate_batch(rows, GenerationSettings(max_new_tokens=20), max_batch_size=3)
    assert [r.token_ids for r in batched] == plain
    assert fed and max(fed) <= 4 and 4 in fed
    assert sum(r.stats.draft_tokens for r in batched) > 0
