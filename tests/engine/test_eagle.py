"""Method ``eagle``: a draft head on the target's hidden states (EAGLE), reduced vocabulary.

Tiny float64 Llama targets and tiny heads (eagle_models.py): random heads (drafts mostly
rejected) and heads trained a few steps on the target's own greedy output (drafts mostly
accepted), with one feature layer (EAGLE-1) or several (EAGLE-3), own or tied output
layer, full or reduced draft vocabulary.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

import test_sampling as ts
from pipeline.engine import GenerationSettings, SpeculationSettings, SpeculativeEngine
from pipeline.engine.proposers.base import DraftRequest
from pipeline.engine.draft_head import load_draft_head, save_draft_head
from pipeline.engine.proposers.eagle import EagleProposer
from pipeline.engine.runner import ModelRunner, prefill
from pipeline.engine.sampling import LogitsShaper

from eagle_models import random_head, tiny_target, trained_head, unrolled
from tiny_models import VOCAB, build, check_stats, prompt_of

#: prompts the trained heads learnt the continuations of (long accepted blocks), and others
SEEN = [prompt_of(n, seed=n + 7) for n in (1, 3, 9, 20, 31, 2)]
UNSEEN = [prompt_of(n, seed=n + 500) for n in (5, 1, 17, 40, 2, 64)]
BUDGETS = [30, 1, 2, 7, 13, 30]


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def heads(target):
    """name -> head: random and trained, EAGLE-1 / EAGLE-3 features, own / tied output layer."""
    return {
        "random": random_head(target),
        "trained": trained_head(target, SEEN),
        "trained-eagle3-tied": trained_head(target, SEEN, feature_layers=[1, 2], tie=True, seed=1),
    }


@pytest.fixture(scope="module")
def references(target):
    plain = SpeculativeEngine(target, max_batch_size=1)
    rows = list(zip(SEEN + UNSEEN, BUDGETS + BUDGETS))
    return rows, [plain.generate(p, GenerationSettings(max_new_tokens=b)).token_ids for p, b in rows]


def _engine(target, head, k=3, batch=1, **kw):
    return SpeculativeEngine(target, SpeculationSettings(method="eagle", num_assistant_tokens=k, **kw),
                             drafter=head, max_batch_size=batch, draft_length="fixed")


# ---------------------------------------------------------------------------- greedy = plain
@pytest.mark.parametrize("name", ["random", "trained", "trained-eagle3-tied"])
@pytest.mark.parametrize("k", [1, 4])
def test_single_row_greedy_equals_plain(target, heads, references, name, k):
    rows, expected = references
    engine = _engine(target, heads[name], k)
    accepted = drafted = 0
    for i, ((prompt, budget), ref) in enumerate(zip(rows, expected)):
        r = engine.generate(prompt, GenerationSettings(max_new_tokens=budget))
        assert r.token_ids == ref, (name, k, prompt.shape[1], budget)
        check_stats(r, k)
        if i < len(SEEN):
            accepted += r.stats.accepted_tokens
            drafted += r.stats.draft_tokens
    if name.startswith("trained"):
        assert accepted > 0.8 * drafted  # the high-acceptance case: long accepted blocks
    else:
        assert accepted < 0.5 * drafted


@pytest.mark.parametrize("batch", [3, 8])
def test_batched_rows_equal_plain_and_shuffling_changes_no_row(target, heads, references, batch):
    """All rows draft together (one head pass per draft position over the rows still
    drafting): mixed prompt lengths (1 .. 64), budgets 1 .. 30 (some end mid-draft),
    more rows than slots; shuffled rows give every row the same output."""
    rows, expected = references
    order = list(range(len(rows)))
    random.Random(batch).shuffle(order)
    for name in ("random", "trained", "trained-eagle3-tied"):
        engine = _engine(target, heads[name], 4, batch)
        results = engine.generate_batch([p for p, _ in rows], [GenerationSettings(max_new_tokens=b) for _, b in rows])
        assert [r.token_ids for r in results] == expected, (name, batch)
        for r in results:
            check_stats(r, 4)
        shuffled = engine.generate_batch([rows[i][0] for i in order], [GenerationSettings(max_new_tokens=rows[i][1]) for i in order])
        assert [r.token_ids for r in shuffled] == [expected[i] for i in order], (name, batch)


def test_eos_inside_an_accepted_block(target, heads):
    """Each row stops at its own EOS (a token of its greedy output) inside a block of
    accepted draft tokens, in one row and in a batch."""
    head = heads["trained"]
    plain = SpeculativeEngine(target)
    settings, expected = [], []
    for i, p in enumerate(SEEN):
        full = plain.generate(p, GenerationSettings(max_new_tokens=30)).token_ids
        eos = full[4 + i]
        settings.append(GenerationSettings(max_new_tokens=30, eos_token_id=[eos, VOCAB + 3]))
        expected.append(full[: full.index(eos) + 1])
    for batch in (1, 4):
        results = _engine(target, head, 4, batch).generate_batch(SEEN, settings)
        assert [r.token_ids for r in results] == expected
        assert all(r.finish_reason == "stop" for r in results)
        for r in results:
            check_stats(r, 4)
        # the EOS was an accepted draft token (the block's target token was cut) in some row
        assert any(r.stats.new_tokens == r.stats.accepted_tokens + r.stats.verify_steps - 1 for r in results)


def test_budget_ending_mid_draft(target, heads):
    """Budgets that end inside a draft: the loop caps k at the budget; the head drafts no
    further, the row ends at exactly its budget and equals plain."""
    head = heads["trained"]
    plain = SpeculativeEngine(target)
    prompt = SEEN[3]
    for budget in range(1, 12):
        r = _engine(target, head, 4).generate(prompt, GenerationSettings(max_new_tokens=budget))
        assert r.token_ids == plain.generate(prompt, GenerationSettings(max_new_tokens=budget)).token_ids
        assert r.stats.new_tokens == budget and r.finish_reason == "length"
        assert r.stats.draft_tokens <= budget - r.stats.verify_steps + r.stats.draft_steps  # never past the budget
        check_stats(r, 4)


# ---------------------------------------------------------------------------- reduced vocabulary
def test_reduced_vocabulary_without_the_targets_tokens_is_still_lossless(target, references):
    """A draft vocabulary that leaves out every token the target emits: no draft can be
    accepted, and every output is still plain's."""
    rows, expected = references
    emitted = {t for ref in expected for t in ref}
    outside = [i for i in range(VOCAB) if i not in emitted]
    assert len(outside) >= 8
    for head in (random_head(target, draft_vocab=outside), trained_head(target, SEEN, draft_vocab=outside, steps=20)):
        assert head.lm_head.weight.shape[0] == len(outside)  # the head scores only those ids
        engine = _engine(target, head, 3, 4)
        results = engine.generate_batch([p for p, _ in rows], [GenerationSettings(max_new_tokens=b) for _, b in rows])
        assert [r.token_ids for r in results] == expected
        assert sum(r.stats.accepted_tokens for r in results) == 0 and sum(r.stats.draft_tokens for r in results) > 0


def test_reduced_vocabulary_q_is_zero_outside_and_sums_to_one(target, heads):
    """q (sampling) is the head's softmax over the draft vocabulary, zero elsewhere, after
    the row's logits processors; draft_vocab_size keeps the first N ids."""
    ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))[:40]
    head = random_head(target, draft_vocab=ids)
    engine = _engine(target, head, 3, draft_vocab_size=25)
    proposer = engine.proposer
    assert proposer.head.lm_head.weight.shape[0] == 25 and proposer.vocab_ids.tolist() == ids[:25].tolist()
    runner = engine.bind(1)
    prompt = UNSEEN[3]
    shaper = LogitsShaper(GenerationSettings(do_sample=True, temperature=0.7, top_k=10, max_new_tokens=5))
    with torch.inference_mode():
        proposer.admit([0], [prompt])
        prefill(engine.target_pass, [0], [prompt])
        draft = proposer.propose([DraftRequest(0, prompt, 3, shaper, torch.Generator().manual_seed(0), True)])[0]
    assert draft.probs.shape == (3, VOCAB)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[ids[:25]] = False
    assert float(draft.probs[:, outside].abs().sum()) == 0.0
    torch.testing.assert_close(draft.probs.sum(-1), torch.ones(3, dtype=draft.probs.dtype))
    assert ((draft.probs > 0).sum(-1) <= 10).all()  # top-k shaped q
    assert all(bool(draft.probs[i, t] > 0) for i, t in enumerate(draft.tokens.tolist()))
    assert runner is engine.runner


# ---------------------------------------------------------------------------- sampling
@pytest.fixture(scope="module")
def v16():
    target = build("llama", vocab=ts.V, hidden=32, seed=11, initializer_range=0.3)
    return target, random_head(target, draft_vocab=list(range(3, 15)), seed=4)


def _sample_in_batches_of_4(engine, settings=ts.SETTINGS, prompt=ts.PROMPT, runs=ts.RUNS):
    samples: Counter = Counter()
    drafted = accepted = 0
    for start in range(0, runs, 4):
        seeds = range(start, start + 4)
        results = engine.generate_batch([prompt] * 4, [GenerationSettings(max_new_tokens=3, seed=s, **settings) for s in seeds])
        for r in results:
            samples[tuple(r.token_ids[:2])] += 1
            drafted += r.stats.draft_tokens
            accepted += r.stats.accepted_tokens
    return samples, drafted, accepted


@pytest.mark.slow
def test_sampling_at_batch_4_follows_the_target_distribution(v16):
    """Chi-square of the first two tokens (both from one verification of a two-token draft
    with q zero outside a 12-id draft vocabulary) against the exact target distribution."""
    target, head = v16
    exact = ts.exact_two_token_distribution(target)
    assert len(exact) > 20
    engine = _engine(target, head, 2, 4)
    samples, drafted, accepted = _sample_in_batches_of_4(engine)
    assert 50 < accepted < drafted - 50  # acceptance and rejection paths both ran
    assert ts.chi_square_p_value(samples, exact) > 1e-3


def test_sampling_test_has_teeth(v16, monkeypatch):
    """A proposer that reports a wrong q (uniform over the draft vocabulary) fails it."""
    target, head = v16
    exact = ts.exact_two_token_distribution(target)
    engine = _engine(target, head, 2, 4)
    original = EagleProposer.propose

    def wrong_q(self, requests):
        drafts = original(self, requests)
        for d in drafts:
            if d.probs is not None and len(d):
                d.probs = torch.zeros_like(d.probs)
                d.probs[:, self.vocab_ids] = 1.0 / self.vocab_ids.numel()
        return drafts

    monkeypatch.setattr(EagleProposer, "propose", wrong_q)
    samples, _, _ = _sample_in_batches_of_4(engine, runs=ts.RUNS // 2)
    monkeypatch.setattr(ts, "RUNS", ts.RUNS // 2)  # the expected counts of a half-size sample
    assert ts.chi_square_p_value(samples, exact) < 1e-6


# ---------------------------------------------------------------------------- rollback
@torch.no_grad()
def _fresh_state(target, head, seq):
    """A new proposer that has seen ``seq`` as its prompt (target prefill done)."""
    engine = _engine(target, head, 3)
    engine.bind(1)
    engine.proposer.admit([0], [seq])
    prefill(engine.target_pass, [0], [seq])
    return engine


@pytest.mark.parametrize("name", ["trained", "trained-eagle3-tied"])
def test_rollback_state_equals_a_fresh_run_over_the_committed_prefix(target, heads, name):
    """Three rows draft together through many verify/rollback patterns (every accepted
    count); after each, every row's draft (tokens and q) and its head KV entries equal
    those of a fresh proposer run over its committed sequence."""
    head = heads[name]
    engine = _engine(target, head, 3, 3)
    runner = engine.bind(3)
    proposer = engine.proposer
    rng = random.Random(0)
    seqs = [UNSEEN[0], SEEN[2], UNSEEN[2]]
    slots = [0, 1, 2]
    shaper = LogitsShaper(GenerationSettings())
    with torch.inference_mode():
        proposer.admit(slots, seqs)
        prefill(engine.target_pass, slots, seqs)
        for step in range(10):
            drafts = proposer.propose([DraftRequest(s, seq, 3, shaper, None, True) for s, seq in zip(slots, seqs)])
            for row, (seq, draft) in enumerate(zip(seqs, drafts)):
                fresh = _fresh_state(target, head, seq)
                ref = fresh.proposer.propose([DraftRequest(0, seq, 3, shaper, None, True)])[0]
                assert draft.tokens.tolist() == ref.tokens.tolist(), (step, row)
                torch.testing.assert_close(draft.probs, ref.probs)
                n = seq.shape[1] - 1  # real entries: main positions 0 .. L-2
                assert proposer.length[slots[row]] == n == fresh.proposer.length[0]
                mine, theirs = proposer.runner.cache.layers[0], fresh.proposer.runner.cache.layers[0]
                torch.testing.assert_close(mine.keys[slots[row], :, :n], theirs.keys[0, :, :n])
                torch.testing.assert_close(mine.values[slots[row], :, :n], theirs.values[0, :, :n])
            tokens = [torch.cat([seq[0, -1:], d.tokens]) for seq, d in zip(seqs, drafts)]
            engine.target_pass(slots, tokens, [s.shape[1] - 1 for s in seqs], 4)
            for row, (seq, draft) in enumerate(zip(seqs, drafts)):
                a = [0, 1, 3, 2, 0, 2, 1, 3, 0, 1][(step + row) % 10]
                proposer.rollback(slots[row], seq.shape[1] + a)
                assert proposer.feats[slots[row]].end == seq.shape[1] + a
                bonus = torch.tensor([[rng.randrange(VOCAB)]])
                seqs[row] = torch.cat([seq, draft.tokens[:a].view(1, -1), bonus], dim=1)
    assert runner is engine.runner


def test_noise_in_rejected_positions_changes_no_output(target, heads, references, monkeypatch):
    """After every verification, the head's KV entries past its real length (speculative
    draft positions, rejected or not) are overwritten with noise: no output or acceptance
    changes, greedy or sampled."""
    rows, expected = references
    head = heads["trained"]
    settings = [GenerationSettings(max_new_tokens=b) for _, b in rows]
    sampled = [GenerationSettings(max_new_tokens=b, do_sample=True, temperature=0.8, seed=i) for i, (_, b) in enumerate(rows)]
    clean = [_engine(target, head, 4, 4).generate_batch([p for p, _ in rows], s) for s in (settings, sampled)]
    original = EagleProposer.rollback
    gen = torch.Generator().manual_seed(0)
    touched = []

    def noisy(self, slot, valid_length):
        original(self, slot, valid_length)
        n = self.length[slot]
        for layer in self.runner.cache.layers:
            tail = layer.keys[slot, :, n:]
            touched.append(tail.shape[1])
            tail.copy_(torch.randn(tail.shape, generator=gen, dtype=tail.dtype) * 100)
            layer.values[slot, :, n:].copy_(torch.randn(tail.shape, generator=gen, dtype=tail.dtype) * 100)

    monkeypatch.setattr(EagleProposer, "rollback", noisy)
    for s, ref in zip((settings, sampled), clean):
        results = _engine(target, head, 4, 4).generate_batch([p for p, _ in rows], s)
        assert [r.token_ids for r in results] == [r.token_ids for r in ref]
        assert [r.stats.accepted_per_position for r in results] == [r.stats.accepted_per_position for r in ref]
    assert [r.token_ids for r in clean[0]] == expected
    assert sum(touched) > 0


def test_a_catch_up_reads_only_the_latest_window_and_changes_no_output(target, heads, references, monkeypatch):
    """After a stretch without drafts (here: every prompt longer than a small window, and
    drafts only every fifth step), the head restarts on the row's latest
    ``CATCH_UP_WINDOW`` positions: no head pass feeds a row more than that, the features kept
    per row stay bounded, and greedy output is plain's in one row and in a batch."""
    import dataclasses

    import pipeline.engine.proposers.eagle as eagle

    monkeypatch.setattr(eagle, "CATCH_UP_WINDOW", 6)
    rows, expected = references
    widths, kept = [], []
    original_pass, original_rollback = EagleProposer._pass, EagleProposer.rollback

    def counted_pass(self, slots, feats, ids, starts):
        widths.extend(int(f.shape[0]) for f in feats)
        return original_pass(self, slots, feats, ids, starts)

    def counted_rollback(self, slot, valid_length):
        original_rollback(self, slot, valid_length)
        f = self.feats[slot]
        kept.append(f.end - f.start)

    monkeypatch.setattr(EagleProposer, "_pass", counted_pass)
    monkeypatch.setattr(EagleProposer, "rollback", counted_rollback)
    original_propose = EagleProposer.propose
    calls = [0]

    def sometimes(self, requests):  # a draft every fifth call: the backlog grows past the window
        calls[0] += 1
        if calls[0] % 5:
            requests = [dataclasses.replace(r, k=0) for r in requests]
        return original_propose(self, requests)

    monkeypatch.setattr(EagleProposer, "propose", sometimes)
    for batch in (1, 4):
        engine = _engine(target, heads["trained"], 3, batch)
        results = engine.generate_batch([p for p, _ in rows], [GenerationSettings(max_new_tokens=b) for _, b in rows])
        assert [r.token_ids for r in results] == expected, batch
    assert widths and max(widths) <= 6 and 6 in widths
    assert max(kept) <= 6 + 2 + 4  # the window, its margin and one verified draft


# ---------------------------------------------------------------------------- training = inference
@pytest.mark.parametrize("features", [None, [1, 2]])
@torch.no_grad()
def test_training_time_test_matches_the_proposer(target, features):
    """The unrolled training forward (step s at position j: fed its own step s-1 output,
    attending to real step-1 keys and its own speculative keys) equals what the proposer
    computes at draft position s when the committed prefix ends at j + 3 - s."""
    head = random_head(target, feature_layers=features, seed=5)
    seq = prompt_of(24, seed=3)
    with torch.no_grad():
        out = target(seq, output_hidden_states=True)
        p = head.project(out.hidden_states)[:, :-1]
        e = head.embed(seq[:, 1:])
        steps = unrolled(head, p, e, 3)
    shaper = LogitsShaper(GenerationSettings())
    for L in (5, 11, 20):
        # drafts d_1 .. d_3 of the prefix of length L; feed the sequence's own tokens as the
        # drafts so that positions match the training sequence
        engine = _fresh_state(target, head, seq[:, :L])
        proposer = engine.proposer
        q1 = proposer.propose([DraftRequest(0, seq[:, :L], 1, shaper, None, True)])[0].probs[0]
        g1 = steps[0][0, L - 2]
        torch.testing.assert_close(q1, torch.softmax(head.logits(g1), -1))
        # chained steps with the true next tokens as drafts: the proposer's own pass
        g = proposer._pass([0], [g1.view(1, -1)], [seq[0, L : L + 1]], [L - 1])[:, -1]
        torch.testing.assert_close(g[0], steps[1][0, L - 1])
        g = proposer._pass([0], [g.view(1, -1)], [seq[0, L + 1 : L + 2]], [L])[:, -1]
        torch.testing.assert_close(g[0], steps[2][0, L])


# ---------------------------------------------------------------------------- checkpoint, errors
def test_save_and_load_round_trip(tmp_path, target, heads):
    for name in ("trained", "trained-eagle3-tied"):
        head = heads[name]
        save_draft_head(head, tmp_path / name, dtype=torch.float64)
        loaded = load_draft_head(tmp_path / name, target)
        assert loaded.dtype == torch.float64 and loaded.draft_vocab.tolist() == head.draft_vocab.tolist()
        prompt = UNSEEN[3]
        a = _engine(target, head, 3).generate(prompt, GenerationSettings(max_new_tokens=20))
        b = _engine(target, loaded, 3).generate(prompt, GenerationSettings(max_new_tokens=20))
        assert a.token_ids == b.token_ids and a.stats.accepted_per_position == b.stats.accepted_per_position
    from safetensors import safe_open

    with safe_open(str(tmp_path / "trained-eagle3-tied" / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys() and "draft_vocab" in f.keys()  # tied: the target's rows
    # a folder path is enough for the engine
    engine = SpeculativeEngine(target, SpeculationSettings(method="eagle"), drafter=str(tmp_path / "trained"))
    assert engine.generate(UNSEEN[3], GenerationSettings(max_new_tokens=20)).token_ids == a.token_ids


def test_a_head_for_another_target_is_refused(target, heads, tmp_path):
    other = build("llama", vocab=VOCAB + 8, seed=0)
    with pytest.raises(ValueError, match="vocabulary 104 != the 96"):
        SpeculativeEngine(other, SpeculationSettings(method="eagle"), drafter=random_head(target))
    with pytest.raises(ValueError, match="needs a draft head"):
        SpeculativeEngine(target, SpeculationSettings(method="eagle"))
    with pytest.raises(ValueError, match="drafts with a draft head"):
        SpeculativeEngine(target, SpeculationSettings(method="eagle"), drafter=build("llama", seed=3))
    with pytest.raises(ValueError, match="not a draft head folder"):
        SpeculativeEngine(target, SpeculationSettings(method="eagle"), drafter=str(tmp_path))


@pytest.mark.parametrize("other, problem", [
    (dict(layers=3), "3 layers, the head reads hidden_states [2] of a 2-layer target"),  # the rule the two checks disagreed on
    (dict(layers=1), "1 layers"),
    (dict(vocab=VOCAB + 8), "vocabulary 104 != the 96"),
    (dict(hidden=48), "hidden size 48 != the head's 32"),
])
def test_a_head_that_does_not_fit_is_refused_by_the_driver_and_the_engine_with_one_message(target, tmp_path, other,
                                                                                           problem):
    """One fit check (draft_head.check_fit): the driver's, from the configs
    (eagle.check_drafter, before any weights load), and the engine's when it attaches the head."""
    from pipeline.engine.proposers.eagle import check_drafter

    save_draft_head(random_head(target), tmp_path / "h")
    wrong = tiny_target(**other)
    with pytest.raises(ValueError) as driver:
        check_drafter(str(tmp_path / "h"), wrong.config)
    with pytest.raises(ValueError) as engine:
        SpeculativeEngine(wrong, SpeculationSettings(method="eagle"), drafter=str(tmp_path / "h"))
    assert str(driver.value) == str(engine.value)
    assert str(driver.value).startswith("method 'eagle': the draft head (trained for") and problem in str(driver.value)
    check_drafter(str(tmp_path / "h"), target.config)  # the target it was made for fits


def test_settings():
    SpeculationSettings(method="eagle", draft_vocab_size=100).validate()
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="draft_vocab_size"):
            SpeculationSettings(method="eagle", draft_vocab_size=bad).validate()
    with pytest.raises(ValueError, match="draft_vocab is a setting of method 'draft_model', not of 'eagle'"):
        SpeculationSettings(method="eagle", draft_vocab="x.json").validate()
    with pytest.raises(ValueError, match="draft_vocab must be a path"):
        SpeculationSettings(method="draft_model", draft_vocab=5).validate()
    with pytest.raises(ValueError, match="draft_vocab_size is a setting of method 'draft_model' / 'eagle'"):
        SpeculationSettings(method="prompt_lookup", draft_vocab_size=10).validate()


def test_job_config_needs_a_drafter_for_eagle():
    from pipeline.config import ConfigError, load_config
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "configs"
    with pytest.raises(ConfigError, match="models.drafter is required by method 'eagle'"):
        load_config(root / "summarize.yaml", ["method.name=eagle", "models.drafter=null"])
    cfg = load_config(root / "summarize.yaml", ["method.name=eagle", "method.draft_vocab_size=4096"])
    assert cfg.uses_drafter and cfg.method.speculation_settings().draft_vocab_size == 4096


# ---------------------------------------------------------------------------- draft_model + draft_vocab
def test_draft_model_with_a_reduced_vocabulary(tmp_path, target, references):
    """draft_model computes only the draft-vocabulary rows of its drafter's LM head: the
    logits there equal the full head's, q is zero elsewhere, outputs equal plain."""
    import json

    from pipeline.engine.proposers.draft_model import ReducedHeadLM
    from tiny_models import perturbed_copy

    rows, expected = references
    drafter = perturbed_copy(target, 0.3)
    emitted = [t for t, _ in Counter(t for ref in expected for t in ref).most_common()]
    ids = emitted + [i for i in range(VOCAB) if i not in emitted]
    path = tmp_path / "vocab.json"
    path.write_text(json.dumps(ids))
    reduced = ReducedHeadLM(drafter, torch.tensor(ids[:30]))
    x = prompt_of(7, seed=1)
    torch.testing.assert_close(reduced(logits_to_keep=0, input_ids=x).logits, drafter(x).logits[..., ids[:30]])
    for n in (30, 12):
        engine = SpeculativeEngine(target, SpeculationSettings(method="draft_model", num_assistant_tokens=3,
                                                               draft_vocab=str(path), draft_vocab_size=n),
                                   drafter=drafter, max_batch_size=4)
        results = engine.generate_batch([p for p, _ in rows], [GenerationSettings(max_new_tokens=b) for _, b in rows])
        assert [r.token_ids for r in results] == expected
        assert sum(r.stats.accepted_tokens for r in results) > 0
        assert engine.proposer.reduced.head.weight.shape == (n, target.config.hidden_size)
    with pytest.raises(ValueError, match="draft_vocab_size needs draft_vocab"):
        SpeculativeEngine(target, SpeculationSettings(method="draft_model", draft_vocab_size=12), drafter=drafter)
    engine = SpeculativeEngine(target, SpeculationSettings(method="draft_model", num_assistant_tokens=2,
                                                           draft_vocab=str(path), draft_vocab_size=12), drafter=drafter)
    engine.bind(1)
    p = rows[3][0]
    shaper = LogitsShaper(GenerationSettings(do_sample=True, max_new_tokens=4))
    with torch.inference_mode():
        engine.proposer.admit([0], [p])
        d = engine.proposer.propose([DraftRequest(0, p, 2, shaper, torch.Generator().manual_seed(1), True)])[0]
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[ids[:12]] = False
    assert float(d.probs[:, outside].sum()) == 0.0 and set(d.tokens.tolist()) <= set(ids[:12])


def test_float32_with_the_cpu_kernels_and_a_head_loaded_under_inference_mode(tmp_path, heads):
    """In float32 the head's linear layers run the engine's packed CPU kernels and its
    short-query passes the small-query attention; a head loaded (and cut to a smaller draft
    vocabulary) inside inference mode still has ordinary weights.  Greedy output = plain."""
    target32 = tiny_target().float()
    save_draft_head(heads["trained"], tmp_path / "h", dtype=torch.float32)
    with torch.inference_mode():
        engine = SpeculativeEngine(target32, SpeculationSettings(method="eagle", num_assistant_tokens=3,
                                                                 draft_vocab_size=80),
                                   drafter=str(tmp_path / "h"), max_batch_size=4)
        results = engine.generate_batch(SEEN, GenerationSettings(max_new_tokens=20))
    plain = SpeculativeEngine(target32, max_batch_size=4).generate_batch(SEEN, GenerationSettings(max_new_tokens=20))
    assert [r.token_ids for r in results] == [r.token_ids for r in plain]
    assert sum(r.stats.accepted_tokens for r in results) > 0
    from pipeline.engine.cpu import linear

    plan = engine.cpu_plans["draft head"]
    assert plan.small_query_attention == (plan.why_off is None and plan.options.part_on("small_query_attention"))
    if plan.why_off is None and plan.options.part_on("onednn") and linear.onednn_available():
        assert any(type(m) is linear.PackedLinear for m in engine.proposer.head.modules())
        assert not any(p.is_inference() for p in engine.proposer.head.parameters())


# ---------------------------------------------------------------------------- token trees
def _features_checked(monkeypatch, target):
    """Wraps the proposer's ``propose``: before each step, every row's stored features of its
    committed positions are compared with a fresh target pass over its sequence; returns the
    list of (slot, largest difference) and the list of path moves (slot, src, dst)."""
    seen, moves = [], []
    original_propose, original_move = EagleProposer.propose, EagleProposer.move

    def propose(self, requests):
        for r in requests:
            f, L = self.feats[r.slot], r.sequence.shape[1]
            if f.data is None or f.end < L - 1 or L < 2:
                continue
            with torch.no_grad():
                out = target(r.sequence, output_hidden_states=True)
                fresh = self.head.project(out.hidden_states)[0, f.start : L - 1]
            seen.append((r.slot, float((f.get(f.start, L - 1) - fresh).abs().max())))
        return original_propose(self, requests)

    def move(self, slot, src, dst):
        moves.append((slot, src, dst))
        return original_move(self, slot, src, dst)

    monkeypatch.setattr(EagleProposer, "propose", propose)
    monkeypatch.setattr(EagleProposer, "move", move)
    return seen, moves


@pytest.mark.parametrize("batch", [1, 3])
def test_trees_equal_plain_and_a_path_through_a_leaf_moves_its_features(target, heads, references, batch,
                                                                         monkeypatch):
    """``num_candidates = 4``: the head's chain plus its next likeliest tokens at each
    position as leaves.  Greedy rows equal plain, single-row and batched, budgets ending
    mid-tree; steps whose accepted path took a leaf moved the path's features, and at every
    step each row's features of its committed positions equal a fresh target pass's."""
    rows, expected = references
    seen, moves = _features_checked(monkeypatch, target)
    engine = _engine(target, heads["trained"], 4, batch, num_candidates=4)
    results = engine.generate_batch([p for p, _ in rows], [GenerationSettings(max_new_tokens=b) for _, b in rows])
    assert [r.token_ids for r in results] == expected
    for r in results:
        check_stats(r, 4)
    assert sum(r.stats.tree_steps for r in results) > 0
    assert moves, "no accepted path took a leaf: the test did not reach what it tests"
    assert seen and max(d for _, d in seen) < 1e-9


def test_without_the_move_a_path_through_a_leaf_leaves_wrong_features(target, heads, references, monkeypatch):
    """Teeth for the test above: with the features' move switched off, some row drafts from
    a feature that is not its committed position's (outputs stay plain greedy's: drafts only)."""
    rows, expected = references
    seen, moves = _features_checked(monkeypatch, target)
    monkeypatch.setattr(EagleProposer, "move", lambda self, slot, src, dst: moves.append(src))
    engine = _engine(target, heads["trained"], 4, 1, num_candidates=4)
    results = engine.generate_batch([p for p, _ in rows], [GenerationSettings(max_new_tokens=b) for _, b in rows])
    assert [r.token_ids for r in results] == expected
    assert moves and max(d for _, d in seen) > 1e-6
