"""Batched speculative decoding: many rows in flight, each row exactly what it is alone.

Differential tests in float64 on tiny random models of three architectures (Llama;
GPT-2, learned absolute positions; Gemma 3, sliding-window and global layers mixed).
Prompts of 1 to 200 tokens, budgets of 1, 2 and 40 tokens, EOS ids that occur inside
accepted blocks, stop strings; batch sizes 1, 3 and 8 and more rows than slots
(continuous batching).  Every row equals its own single-row plain greedy output, token
for token, and shuffling the rows changes no row.  Sampling keeps the target's
distribution with other prompts' rows in the batch (chi-square).
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

import test_sampling as ts
from pipeline.engine import GenerationSettings, SpeculationSettings, SpeculativeEngine
from pipeline.engine.cost_model import CostCurve
from pipeline.engine.draft_control import Admission, DraftController

from coverage import BATCH_ARCHS, BATCH_METHODS
from tiny_models import NO_SPECIAL, VOCAB, bracket_tokenizer, build, check_stats, perturbed_copy, prompt_of

K = 3
BATCH_SIZES = [1, 3, 8]


def _gemma3(seed=0):
    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=6,
                              layer_types=["sliding_attention"] * 3 + ["full_attention"],
                              max_position_embeddings=512, **NO_SPECIAL)
    torch.manual_seed(seed)
    return Gemma3ForCausalLM(config).double().eval()


ARCHS = {
    "llama": lambda: build("llama", layers=3, seed=0),
    "gpt2": lambda: build("gpt2", layers=3, seed=0),
    "gemma3": _gemma3,
}


def rows_of(seed: int, n: int) -> list[tuple[torch.Tensor, int]]:
    """``n`` (prompt, budget) pairs: prompt lengths spread over 1 .. 200, budgets 1, 2, 40."""
    rng = random.Random(seed)
    lengths = [1, 2, 200, 17, 3, 64, 120, 9, 33, 5, 150, 1]
    out = []
    for i in range(n):
        length = lengths[i % len(lengths)] if i < len(lengths) else rng.randint(1, 200)
        out.append((prompt_of(length, seed=seed * 100 + i), [1, 2, 40][i % 3]))
    return out


assert sorted(ARCHS) == BATCH_ARCHS


@pytest.fixture(scope="module", params=BATCH_ARCHS)
def arch(request):
    target = ARCHS[request.param]()
    drafter = perturbed_copy(target, 0.3)
    rows = rows_of(7, 12)
    plain = SpeculativeEngine(target, max_batch_size=1)
    references = [plain.generate(p, GenerationSettings(max_new_tokens=b)).token_ids for p, b in rows]
    return request.param, target, drafter, rows, references


def method_engines(name, target, drafter, batch, **kw):
    yield "plain", SpeculativeEngine(target, max_batch_size=batch, **kw)
    yield "draft_model", SpeculativeEngine(target, SpeculationSettings(method="draft_model", num_assistant_tokens=K),
                                           drafter=drafter, max_batch_size=batch, **kw)
    yield "prompt_lookup", SpeculativeEngine(target, SpeculationSettings(method="prompt_lookup",
                                                                         prompt_lookup_num_tokens=K),
                                             max_batch_size=batch, **kw)
    if name != "gpt2":  # GPT-2's learned positions cannot be split (see test_architectures)
        yield "early_exit", SpeculativeEngine(target, SpeculationSettings(method="early_exit", assistant_early_exit=1,
                                                                          num_assistant_tokens=K),
                                              max_batch_size=batch, **kw)


@pytest.mark.parametrize("batch", BATCH_SIZES)
def test_every_row_equals_its_single_row_plain_greedy(arch, batch):
    name, target, drafter, rows, references = arch
    settings = [GenerationSettings(max_new_tokens=b) for _, b in rows]
    methods = [m for m, _ in method_engines(name, target, drafter, batch)]
    assert methods == [m for m in BATCH_METHODS if not (name == "gpt2" and m == "early_exit")]
    for method, engine in method_engines(name, target, drafter, batch):
        results = engine.generate_batch([p for p, _ in rows], settings)
        for i, (result, reference) in enumerate(zip(results, references)):
            assert result.error is None
            assert result.token_ids == reference, (name, method, batch, i)
            assert result.finish_reason == "length"
            assert result.stats.prompt_tokens == rows[i][0].shape[1]
            check_stats(result, K)


def test_shuffled_rows_give_every_row_the_same_output(arch):
    name, target, drafter, rows, references = arch
    order = list(range(len(rows)))
    random.Random(3).shuffle(order)
    for method, engine in method_engines(name, target, drafter, 3):
        results = engine.generate_batch([rows[i][0] for i in order],
                                        [GenerationSettings(max_new_tokens=rows[i][1]) for i in order])
        assert [r.token_ids for r in results] == [references[i] for i in order], (name, method)


def random_lengths(monkeypatch, rng: random.Random, cut: bool = True) -> None:
    """The controller asks each row for a random length (0 .. its cap) and, with ``cut``, cuts
    the step's drafts to a random width, every step; its other bookkeeping runs as always."""
    lengths = DraftController.lengths

    def random_ks(self, rows, caps, sampled=False, fixed=False):
        plan = lengths(self, rows, caps, sampled, fixed)
        return dataclasses.replace(plan, lengths=tuple(rng.randint(0, c) for c in caps))

    monkeypatch.setattr(DraftController, "lengths", random_ks)
    if cut:
        monkeypatch.setattr(CostCurve, "ready", property(lambda self: True))
        monkeypatch.setattr(DraftController, "_width",
                            lambda self, picks, firsts, stops: (rng.randint(0, max(firsts)), Admission("cut", "gain", [])))


def test_any_draft_length_never_changes_an_output(arch, monkeypatch):
    """Whatever draft length each row asks for and however much of its draft is verified
    (here: at random, down to 0, per row and step), every row's output stays the same."""
    name, target, drafter, rows, references = arch
    random_lengths(monkeypatch, random.Random(5))
    for method, engine in method_engines(name, target, drafter, 8, draft_length="auto"):
        if method == "plain":
            continue
        results = engine.generate_batch([p for p, _ in rows], [GenerationSettings(max_new_tokens=b) for _, b in rows])
        assert [r.token_ids for r in results] == references, (name, method)


# ---------------------------------------------------------------------------- stopping
@pytest.fixture(scope="module")
def oracle():
    """A drafter equal to the target (every draft accepted), so EOS and stop strings land
    inside accepted blocks."""
    target = build("llama", seed=0)
    return target, perturbed_copy(target, 0.0)


def test_eos_inside_accepted_blocks_per_row(oracle):
    """Each row stops at its own EOS id (a token its greedy output emits mid-block),
    with the EOS kept; rows with other EOS ids or none run on."""
    target, drafter = oracle
    prompts = [prompt_of(n, seed=n) for n in (4, 9, 1, 30, 12, 6)]
    plain = SpeculativeEngine(target)
    settings, expected = [], []
    for i, p in enumerate(prompts):
        full = plain.generate(p, GenerationSettings(max_new_tokens=30)).token_ids
        if i % 3 == 2:  # no EOS for this row
            settings.append(GenerationSettings(max_new_tokens=30))
            expected.append((full, "length"))
            continue
        eos = full[5 + i]
        cut = full[: full.index(eos) + 1]
        settings.append(GenerationSettings(max_new_tokens=30, eos_token_id=[eos, VOCAB + 7]))
        expected.append((cut, "stop"))
    for batch in BATCH_SIZES:
        engine = SpeculativeEngine(target, SpeculationSettings(method="draft_model", num_assistant_tokens=4),
                                   drafter=drafter, max_batch_size=batch, draft_length="fixed")
        results = engine.generate_batch(prompts, settings)
        for r, (tokens, finish) in zip(results, expected):
            assert (r.token_ids, r.finish_reason) == (tokens, finish), batch
            check_stats(r, 4)
        assert sum(r.stats.accepted_tokens for r in results) > 0


@pytest.mark.parametrize("draft_length", ["fixed", "auto"])
def test_stop_strings_per_row(oracle, draft_length):
    """Each row stops at its own stop string, completed inside a verified block, with every
    row drafting its k and with the controller choosing (on a GPU-like cost curve, so that
    blocks are verified): the output is plain greedy's up to the stop, whatever the lengths."""
    target, drafter = oracle
    tok = bracket_tokenizer()
    prompts = [prompt_of(n, seed=n + 50) for n in (5, 8, 13, 21)]
    plain = SpeculativeEngine(target, tokenizer=tok)
    settings, expected = [], []
    for i, p in enumerate(prompts):
        full = plain.generate(p, GenerationSettings(max_new_tokens=25)).token_ids
        stop = tok.decode(full[6 + i : 8 + i])  # two tokens' text, completed mid-block
        text = tok.decode(full)
        settings.append(GenerationSettings(max_new_tokens=25, stop_strings=[stop]))
        n = next(j for j in range(1, len(full) + 1) if stop in tok.decode(full[:j]))
        expected.append(full[:n])
        assert stop in text
    engine = SpeculativeEngine(target, SpeculationSettings(method="draft_model", num_assistant_tokens=5),
                               drafter=drafter, tokenizer=tok, max_batch_size=3, draft_length=draft_length)
    if draft_length == "auto":
        from test_draft_budget import GPU

        engine.controller.curve = GPU
    results = engine.generate_batch(prompts, settings)
    assert [r.token_ids for r in results] == expected
    assert all(r.finish_reason == "stop" for r in results)
    assert sum(r.stats.accepted_tokens for r in results) > 0  # blocks were verified


# ---------------------------------------------------------------------------- batch API
def test_more_rows_than_slots_reuse_slots_and_memory_stays_flat():
    """Continuous batching: 40 rows through 4 slots; the caches stop growing once the
    longest row fits, whatever the number of rows."""
    target = build("llama", seed=0)
    drafter = perturbed_copy(target, 0.3)
    engine = SpeculativeEngine(target, SpeculationSettings(method="draft_model", num_assistant_tokens=K),
                               drafter=drafter, max_batch_size=4)
    prompts = [prompt_of(10 + (i * 7) % 40, seed=i) for i in range(40)]
    plain = SpeculativeEngine(target)
    first = engine.generate_batch(prompts, GenerationSettings(max_new_tokens=20))
    sizes = (engine.runner.cache.nbytes(), engine.proposer.runner.cache.nbytes())
    again = engine.generate_batch(prompts[::-1] * 2, GenerationSettings(max_new_tokens=20))  # 80 more rows
    assert (engine.runner.cache.nbytes(), engine.proposer.runner.cache.nbytes()) == sizes
    assert [r.token_ids for r in again] == [r.token_ids for r in first[::-1]] * 2
    for p, r in zip(prompts[::7], first[::7]):
        assert r.token_ids == plain.generate(p, GenerationSettings(max_new_tokens=20)).token_ids


def test_rows_that_cannot_run_get_their_own_error():
    target = build("llama", seed=0)
    engine = SpeculativeEngine(target, SpeculationSettings(method="prompt_lookup"), max_batch_size=2)
    context = target.config.max_position_embeddings
    prompts = [prompt_of(5), [], prompt_of(context + 3)[0].tolist(), [1, VOCAB + 5], prompt_of(9)]
    results = engine.generate_batch(prompts, GenerationSettings(max_new_tokens=6))
    assert [r.error is None for r in results] == [True, False, False, False, True]
    assert "empty" in results[1].error and "context" in results[2].error and "vocabulary" in results[3].error
    assert results[4].token_ids == SpeculativeEngine(target).generate(prompt_of(9), GenerationSettings(max_new_tokens=6)).token_ids
    with pytest.raises(ValueError, match="empty"):
        engine.generate([], GenerationSettings(max_new_tokens=6))


def test_per_row_settings_may_differ_in_any_field():
    """Rows differing beyond PER_ROW_FIELDS (temperature) step in separate groups: each gets
    what it gets alone (tests/engine/test_grammar.py mixes more settings)."""
    target = build("llama", seed=0)
    engine = SpeculativeEngine(target, max_batch_size=3)
    prompts = [prompt_of(4, seed=1), prompt_of(6, seed=2)]
    ok = engine.generate_batch(prompts, [GenerationSettings(max_new_tokens=3, seed=1),
                                         GenerationSettings(max_new_tokens=7, seed=2, eos_token_id=5)])
    assert [len(r.token_ids) <= n for r, n in zip(ok, (3, 7))] == [True, True]
    mixed = [GenerationSettings(do_sample=True, temperature=0.5, seed=1, max_new_tokens=6),
             GenerationSettings(do_sample=True, temperature=0.9, seed=2, max_new_tokens=6)]
    together = engine.generate_batch(prompts, mixed)
    assert [r.token_ids for r in together] == [SpeculativeEngine(target).generate(p, s).token_ids
                                               for p, s in zip(prompts, mixed)]
    with pytest.raises(ValueError, match="2 prompts"):
        engine.generate_batch(prompts, [GenerationSettings()])


def test_statistics_are_exact_per_row_in_a_batch():
    """A row's draft and acceptance counts are its own: with the load policy off, they
    equal the single-row run's."""
    target = build("llama", seed=0)
    drafter = perturbed_copy(target, 0.3)
    spec = SpeculationSettings(method="draft_model", num_assistant_tokens=K)
    prompts = [prompt_of(n, seed=n) for n in (3, 11, 27, 8, 60)]
    single = SpeculativeEngine(target, spec, drafter=drafter, max_batch_size=1)
    batched = SpeculativeEngine(target, spec, drafter=drafter, max_batch_size=3, draft_length="fixed")
    alone = [single.generate(p, GenerationSettings(max_new_tokens=30)).stats for p in prompts]
    together = [r.stats for r in batched.generate_batch(prompts, GenerationSettings(max_new_tokens=30))]
    keys = ("new_tokens", "verify_steps", "draft_tokens", "accepted_tokens", "drafted_per_position",
            "accepted_per_position")
    for a, b in zip(alone, together):
        assert {k: getattr(a, k) for k in keys} == {k: getattr(b, k) for k in keys}


# ---------------------------------------------------------------------------- sampling
@pytest.mark.parametrize("method, load", [("draft_model", "fixed"), ("prompt_lookup", "fixed"), ("draft_model", "random"),
                                          ("draft_model", "auto")])
@pytest.mark.slow
def test_sampling_in_a_batch_of_four_follows_the_target_distribution(method, load, monkeypatch):
    """The chi-square test of test_sampling.py with batch size 4: each counted row shares
    its batch with rows of other prompts, and draws only from its own generator.  With
    ``load="random"`` the draft length asked changes at random every step (0, 1 or 2); with
    ``"auto"`` the controller decides on a GPU-like cost curve (the drafter's rows cut by the
    stopping rule on their confidence, test_draft_budget.py): the law stays the target's."""
    target = build("llama", vocab=ts.V, hidden=32, seed=11, initializer_range=0.3)
    drafter = perturbed_copy(target, 1.0, seed=12)
    exact = ts.exact_two_token_distribution(target)
    if load == "random":
        random_lengths(monkeypatch, random.Random(9), cut=False)
    engine = SpeculativeEngine(target, SpeculationSettings(method=method, num_assistant_tokens=2,
                                                           prompt_lookup_num_tokens=2),
                               drafter=drafter if method == "draft_model" else None, max_batch_size=4,
                               draft_length="fixed" if load == "fixed" else "auto")
    if load == "auto":
        from test_draft_budget import GPU

        engine.controller.curve, engine.controller.record = GPU, True
    others = [torch.randint(0, ts.V, (1, n), generator=torch.Generator().manual_seed(n)) for n in (2, 5, 9)]
    prompts, settings, counted = [], [], []
    for seed in range(ts.RUNS):
        prompts.append(ts.PROMPT)
        settings.append(GenerationSettings(max_new_tokens=3, seed=seed, **ts.SETTINGS))
        counted.append(True)
        other = others[seed % 3]
        prompts.append(other)
        settings.append(GenerationSettings(max_new_tokens=1 + seed % 6, seed=10_000 + seed, **ts.SETTINGS))
        counted.append(False)
    results = engine.generate_batch(prompts, settings)
    samples = Counter(tuple(r.token_ids[:2]) for r, c in zip(results, counted) if c)
    drafted = sum(r.stats.draft_tokens for r, c in zip(results, counted) if c)
    accepted = sum(r.stats.accepted_tokens for r, c in zip(results, counted) if c)
    assert 50 < accepted < drafted - 50
    assert ts.chi_square_p_value(samples, exact) > 1e-3
    if load == "auto":  # the controller cut the drafts: some steps verified fewer than asked
        cuts = [a for a in engine.controller.history if a.phase == "cut"]
        assert any(0 < sum(a.lengths) < 2 * len(a.lengths) for a in cuts) and any(a.width == 3 for a in cuts)
    if load != "fixed":
        return
    # a row's draws come from its own generator only: alone it draws the same tokens
    alone = SpeculativeEngine(target, SpeculationSettings(method=method, num_assistant_tokens=2,
                                                          prompt_lookup_num_tokens=2),
                              drafter=drafter if method == "draft_model" else None, draft_length="fixed")
    batched_fixed = SpeculativeEngine(target, alone.spec, drafter=alone.proposer.model if method == "draft_model" else None,
                                      max_batch_size=4, draft_length="fixed")
    again = batched_fixed.generate_batch(prompts[:40], settings[:40])
    for p, s, r in zip(prompts[:40:2], settings[:40:2], again[::2]):
        assert alone.generate(p, s).token_ids == r.token_ids


# ---------------------------------------------------------------------------- online use
def test_scheduler_rows_join_mid_flight_stream_blocks_and_mix_settings():
    """The scheduler an online server uses: rows submitted while others are in flight
    (from another thread), each streaming its committed blocks; rows with other sampling
    settings share the slots but step in their own group.  Every row equals its result
    alone."""
    import threading

    from pipeline.engine.scheduler import Scheduler

    target = build("llama", seed=0)
    drafter = perturbed_copy(target, 0.3)
    spec = SpeculationSettings(method="draft_model", num_assistant_tokens=K)
    engine = SpeculativeEngine(target, spec, drafter=drafter, max_batch_size=3, draft_length="fixed")
    alone = SpeculativeEngine(target, spec, drafter=drafter, max_batch_size=1, draft_length="fixed")
    greedy = GenerationSettings(max_new_tokens=15)
    sampled = GenerationSettings(max_new_tokens=15, do_sample=True, temperature=0.8, seed=4)
    prompts = [prompt_of(n, seed=n) for n in (5, 12, 3, 20, 8, 14)]
    settings = [greedy, sampled, greedy, sampled, greedy, greedy]
    scheduler = Scheduler(engine)
    blocks: dict[int, list[list[int]]] = {}
    finals: dict[int, object] = {}

    def submit(i):
        ticket = scheduler.submit(prompts[i], settings[i], on_tokens=lambda b, i=i: blocks.setdefault(i, []).append(b),
                                  on_done=lambda r, i=i: finals.__setitem__(i, r))
        return ticket

    for i in range(2):
        submit(i)
    scheduler.step()
    late = threading.Thread(target=lambda: [submit(i) for i in range(2, 6)])
    late.start()
    late.join()
    while scheduler.busy:
        scheduler.step()
    assert sorted(finals) == list(range(6))
    for i in range(6):
        expected = alone.generate(prompts[i], settings[i]).token_ids
        assert finals[i].token_ids == expected, i
        assert [t for b in blocks[i] for t in b] == expected  # streamed blocks add up to the output
        assert all(len(b) >= 1 for b in blocks[i]) and len(blocks[i]) == finals[i].stats.verify_steps


def test_scheduler_row_draft_length_and_cancel():
    """A row may draft fewer tokens than the engine (its output unchanged, its drafts no
    longer than its own k); a cancelled row leaves at the next step with the tokens it
    committed, and its slot takes the next row; bad draft lengths are refused."""
    from pipeline.engine.scheduler import Scheduler

    target = build("llama", seed=0)
    drafter = perturbed_copy(target, 0.3)
    spec = SpeculationSettings(method="draft_model", num_assistant_tokens=4)
    engine = SpeculativeEngine(target, spec, drafter=drafter, max_batch_size=2, draft_length="fixed")
    settings = GenerationSettings(max_new_tokens=20)
    prompts = [prompt_of(n, seed=n) for n in (6, 11, 4)]
    expected = [engine.generate(p, settings).token_ids for p in prompts]

    scheduler = Scheduler(engine)
    finals: dict[int, object] = {}
    tickets = [scheduler.submit(p, settings, k=k, on_done=lambda r, i=i: finals.__setitem__(i, r))
               for i, (p, k) in enumerate(zip(prompts, (1, None, 2)))]
    scheduler.step()
    scheduler.cancel(tickets[1])
    while scheduler.busy:
        scheduler.step()
    assert finals[0].token_ids == expected[0] and finals[2].token_ids == expected[2]
    assert len(finals[0].stats.drafted_per_position) == 1 and len(finals[2].stats.drafted_per_position) == 2
    cancelled = finals[1]
    assert cancelled.finish_reason == "cancelled" and 1 <= len(cancelled.token_ids) < len(expected[1])
    assert cancelled.token_ids == expected[1][:len(cancelled.token_ids)]
    # a waiting row cancelled before admission never runs
    ticket = scheduler.submit(prompts[0], settings, on_done=lambda r: finals.__setitem__("w", r))
    scheduler.cancel(ticket)
    scheduler.step()
    assert finals["w"].finish_reason == "cancelled" and finals["w"].token_ids == [] and not scheduler.busy
    for bad in (0, 5, True, 2.0):
        with pytest.raises(ValueError, match=r"k \(a row's cap"):
            scheduler.submit(prompts[0], settings, k=bad)


def test_a_scheduler_works_outside_inference_mode_after_generate_batch():
    """The engine's caches, made inside ``generate_batch`` (inference mode), are reused by a
    Scheduler of the same size that its caller drives outside inference mode: the same
    tokens, no "Inplace update to inference tensor outside InferenceMode"."""
    from pipeline.engine.scheduler import Scheduler

    target = build("llama", seed=0)
    engine = SpeculativeEngine(target, SpeculationSettings(method="draft_model", num_assistant_tokens=3),
                               drafter=perturbed_copy(target, 0.3), max_batch_size=2, draft_length="fixed")
    settings = GenerationSettings(max_new_tokens=10)
    prompts = [prompt_of(n, seed=n) for n in (6, 9)]
    expected = [r.token_ids for r in engine.generate_batch(prompts, settings)]
    assert not torch.is_inference_mode_enabled()
    scheduler = Scheduler(engine)
    tickets = [scheduler.submit(p, settings) for p in prompts]
    results = scheduler.run()
    assert [results[t].token_ids for t in tickets] == expected
