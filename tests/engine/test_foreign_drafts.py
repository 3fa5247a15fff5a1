"""Exactness whatever draft is verified (issue 56, item 0).

The draft-length controller may verify, in place of a proposer's own draft, a row's
reference, one of the proposer's alternatives (prompt matches, the pool) or its own draft
cut short; a token tree's path may leave the drafter's first branch.  Any state a proposer
computed while drafting (early exit's layer-``L`` hidden states and shallow cache entries, a
drafter's cache, an MTP layer's entries fed its own drafts) holds only for the tokens it
drafted.  For every method that keeps such state (early_exit, eagle, mtp, mtp_assistant,
draft_model, universal), on float64 tiny models: greedy equals plain greedy token for token,
single row and 3 rows in flight, with references equal to plain's output, diverging from it
and often wrong, with foreign alternatives of sources ``prompt`` and ``pool``, under
``draft_length`` ``fixed`` and ``auto`` with the controller's cost curve measured, CPU-like,
free (it drafts the longest) and dear (it never drafts but its probes).  Sampled rows: the
sampled verification path with ``top_k=1`` equals greedy, and a chi-square test of the
target's law for early exit with references under ``auto`` (slow).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from pipeline.engine import GenerationSettings, SpeculationSettings, SpeculativeEngine
from pipeline.engine.proposers.base import Draft, DraftedTokens
from pipeline.engine.proposers.prompt_lookup import lookup_with_confidence

from test_draft_budget import CPU, DEAR, FLAT, Costs
from tiny_models import build, perturbed_copy

K = 3
NEW = 26  # a budget that ends inside a draft
METHODS = ["early_exit", "draft_model", "eagle", "mtp", "mtp_assistant", "universal"]
#: the controller's cost curve: ``None`` measured; FREE: verification and drafting cost nothing
#: (every row drafts its longest admitted draft); DEAR: a token of width costs a plain step
FREE = Costs(FLAT.verify, lambda longest, total: 0.0)
MODES = {"fixed": None, "measured": None, "cpu": CPU, "free": FREE, "dear": DEAR}


# ---------------------------------------------------------------------------- the models
def _early_exit(root):
    from tiny_checkpoints import layerskip_llama

    return layerskip_llama(root, layers=4), dict(assistant_early_exit=2), {}


def _draft_model(root):
    target = build("llama", seed=0)
    return target, {}, dict(drafter=perturbed_copy(target, 0.4))


def _eagle(root):
    from eagle_models import random_head, tiny_target

    target = tiny_target(seed=0)
    return target, {}, dict(drafter=random_head(target))


def _mtp(root):
    from mtp_models import load_target, write_mtp_checkpoint
    from pipeline.engine.proposers.mtp import load_mtp

    target = load_target(write_mtp_checkpoint(root, "deepseek_v3", vocab=96, num_mtp=2, initializer_range=0.2))
    return target, {}, dict(drafter=load_mtp(target))


def _mtp_assistant(root):
    from transformers import Gemma4AssistantForCausalLM, Gemma4ForConditionalGeneration

    from test_mtp_assistant import write_gemma4_pair

    target_dir, assistant_dir = write_gemma4_pair(root)
    target = Gemma4ForConditionalGeneration.from_pretrained(target_dir, dtype=torch.float64).eval()
    assistant = Gemma4AssistantForCausalLM.from_pretrained(assistant_dir, dtype=torch.float64).eval()
    return target, {}, dict(drafter=assistant)


def _universal(root):
    from tiny_checkpoints import bpe_tokenizer, llama_for, shakespeare_lines

    lines = shakespeare_lines(400)
    tok_t = bpe_tokenizer(root / "target", 400, lines, "<bos>", "<eos>")
    tok_d = bpe_tokenizer(root / "drafter", 300, lines, "<s>", "</s>")
    target = llama_for(tok_t, root / "target", seed=0)
    return target, {}, dict(drafter=llama_for(tok_d, root / "drafter", seed=1), tokenizer=tok_t, drafter_tokenizer=tok_d)


BUILDERS = {"early_exit": _early_exit, "draft_model": _draft_model, "eagle": _eagle, "mtp": _mtp,
            "mtp_assistant": _mtp_assistant, "universal": _universal}


class Case:
    """One method's target, engine arguments, prompts, plain greedy outputs and references."""

    def __init__(self, method, root):
        self.method = method
        self.target, params, self.kwargs = BUILDERS[method](root)
        self.spec = SpeculationSettings(method=method, num_assistant_tokens=K, **params)
        self.vocab = vocab = self.target.get_output_embeddings().weight.shape[0]
        if method == "universal":
            from tiny_checkpoints import shakespeare_lines

            tok = self.kwargs["tokenizer"]
            self.prompts = [tok(line, return_tensors="pt").input_ids for line in shakespeare_lines(3, 1000)]
        else:  # a one-token prompt: MTP and the assistant have no hidden state at its first step
            self.prompts = [torch.randint(1, vocab, (1, n), generator=torch.Generator().manual_seed(n)) for n in (7, 1, 12)]
        plain = SpeculativeEngine(self.target, max_batch_size=3, draft_length="fixed")
        self.plain = [r.token_ids for r in plain.generate_batch(self.prompts, GenerationSettings(max_new_tokens=NEW))]
        o = self.plain
        self.references = [
            o[0],  # plain's own output
            o[1][:6] + [(o[1][6] + 1) % vocab] + o[1][7:],  # diverging at its 7th token
            [(t + 1) % vocab if i % 4 == 3 else t for i, t in enumerate(o[2])],  # wrong at every 4th token
        ]
        self.sequences = [torch.cat([p[0], torch.tensor(t)]).tolist() for p, t in zip(self.prompts, o)]

    def engine(self, mode: str, batch: int) -> SpeculativeEngine:
        engine = SpeculativeEngine(self.target, self.spec, max_batch_size=batch,
                                   draft_length="fixed" if mode == "fixed" else "auto", **self.kwargs)
        if MODES[mode] is not None:
            engine.controller.curve = MODES[mode]  # the controller's costs fixed: its choices do not follow the load
        return engine

    def alternatives(self, engine: SpeculativeEngine) -> None:
        """Wrap the engine's proposer so that every linear draft carries foreign alternatives:
        the row's prompt matches (source ``prompt``) and plain's continuation with every third
        token wrong (source ``pool``, confident), as suffix's alternatives and a grammar's
        forced tokens come."""
        proposer, own = engine.proposer, engine.proposer.propose

        def propose(requests):
            drafts = own(requests)
            for i, (r, d) in enumerate(zip(requests, drafts)):
                if d.parents is not None:
                    continue
                seq = r.sequence[0].tolist()
                extra = []
                copy, conf = lookup_with_confidence(r.sequence[0], r.k, 2)
                if len(copy):
                    extra.append(Draft(copy, confidence=conf, source="prompt"))
                full = next((s for s in self.sequences if s[:len(seq)] == seq), None)
                if full is not None and len(full) > len(seq):
                    pool = [(t + 1) % self.vocab if (len(seq) + j) % 3 == 0 else t for j, t in enumerate(full[len(seq):len(seq) + r.k])]
                    extra.append(Draft(torch.tensor(pool, device=r.sequence.device), source="pool",
                                       confidence=torch.full((len(pool),), 0.99, dtype=torch.float64)))
                drafts[i] = Draft(d.tokens, d.probs, d.parents, d.confidence, d.source, d.alternatives + tuple(extra))
            return drafts

        proposer.propose = propose


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    made: dict[str, Case] = {}

    def get(method: str) -> Case:
        if method not in made:
            made[method] = Case(method, tmp_path_factory.mktemp(method))
        return made[method]

    return get


def _foreign(results) -> int:
    return sum(r.stats.accepted_from_reference + r.stats.accepted_from_prompt + r.stats.accepted_from_pool
               for r in results)


# ---------------------------------------------------------------------------- the tests
def test_drafted_tokens_agree_only_where_ids_and_positions_match():
    d = DraftedTokens(2)
    assert d.agreed(0, [5, 6], 3) is None  # nothing recorded
    d.record(0, 4, [7, 8])
    d.record(0, 6, torch.tensor([9]))  # contiguous: appended
    assert d.held(0) == (4, [7, 8, 9])
    assert d.agreed(0, [1, 7, 8, 9, 2], 3) == 7  # all three, then the verified tokens go on
    assert d.agreed(0, [1, 7, 5, 9], 3) == 5  # differs at position 5: its state holds before it
    assert d.agreed(0, [1, 7], 3) == 5  # the verified tokens end first
    assert d.agreed(0, [7, 8, 9], 4) == 7 and d.agreed(0, [8, 9], 5) == 7  # recorded positions before start: not compared
    assert d.agreed(0, [1], 1) == 4  # a record after the verified tokens agrees nowhere
    d.record(0, 10, [3])  # not contiguous: in its place
    assert d.held(0) == (10, [3]) and d.held(1) is None
    d.forget(0)
    assert d.held(0) is None


@pytest.mark.parametrize("method", METHODS)
def test_greedy_equals_plain_whatever_draft_is_verified(cases, method):
    """References (plain's own output, diverging, often wrong) under every controller mode,
    3 rows in flight (and one at a time under the CPU-like and free curves): every row is plain greedy's, and references were
    accepted where the controller drafts."""
    case = cases(method)
    settings = GenerationSettings(max_new_tokens=NEW)
    foreign = {}
    for mode in MODES:
        batched = case.engine(mode, 3).generate_batch(case.prompts, settings, references=case.references)
        assert [r.token_ids for r in batched] == case.plain, (method, mode, "batched")
        if mode in ("cpu", "free"):
            single = case.engine(mode, 1)
            for p, ref, want in zip(case.prompts, case.references, case.plain):
                assert single.generate_batch([p], settings, references=[ref])[0].token_ids == want, (method, mode)
        foreign[mode] = _foreign(batched)
    assert foreign["free"] > 0 and foreign["cpu"] > 0, foreign  # the references were verified and accepted


@pytest.mark.parametrize("method", METHODS)
def test_greedy_equals_plain_with_foreign_alternatives(cases, method):
    """The proposer's draft with foreign alternatives (prompt matches, a confident near-oracle
    from the pool) beside it, and references: the controller verifies them in its place."""
    case = cases(method)
    settings = GenerationSettings(max_new_tokens=NEW)
    foreign = 0
    for mode in ("measured", "cpu", "free"):
        for batch in (3, 1):
            engine = case.engine(mode, batch)
            case.alternatives(engine)
            if batch == 3:
                got = engine.generate_batch(case.prompts, settings, references=[None, case.references[1], None])
            else:
                got = [engine.generate_batch([p], settings)[0] for p in case.prompts]
            assert [r.token_ids for r in got] == case.plain, (method, mode, batch)
            foreign += sum(r.stats.accepted_from_pool + r.stats.accepted_from_prompt for r in got)
    assert foreign > 0


@pytest.mark.parametrize("method", ["early_exit", "draft_model", "eagle", "mtp", "mtp_assistant"])
def test_the_sampled_path_with_top_1_equals_greedy(cases, method):
    """``do_sample`` with ``top_k=1``: the drafts carry their ``q`` and verification runs
    rejection sampling on shaped logits (the sampled path), yet the target's law is a point
    mass: every row is plain greedy's, whatever draft is verified.  Same seed, same draws
    under ``fixed``."""
    case = cases(method)
    settings = [GenerationSettings(max_new_tokens=NEW, do_sample=True, top_k=1, seed=s) for s in range(3)]
    for mode in ("fixed", "cpu", "free"):
        engine = case.engine(mode, 3)
        case.alternatives(engine)
        got = engine.generate_batch(case.prompts, settings, references=case.references)
        assert [r.token_ids for r in got] == case.plain, (method, mode)


@pytest.mark.slow
def test_early_exit_with_references_keeps_the_targets_law_under_auto(tmp_path):
    """Seeded sampled rows, 4 in flight, a point-mass reference of the likeliest first two
    tokens and the early exit's own draft beside it, the controller on a free curve (it
    verifies whichever it expects to be accepted most): the first two tokens follow the
    target's law (the bug reused the early exit's hidden states for the reference's tokens)."""
    from test_sampling import RUNS, SETTINGS, V, chi_square_p_value, exact_two_token_distribution
    from tiny_checkpoints import layerskip_llama

    target = layerskip_llama(tmp_path, layers=4, vocab=V, initializer_range=0.3)
    prompt = torch.tensor([[3, 7, 1, 12, 5, 9, 2]])
    exact = exact_two_token_distribution(target, SETTINGS, prompt)
    likeliest = max(exact, key=exact.get)
    engine = SpeculativeEngine(target, SpeculationSettings(method="early_exit", assistant_early_exit=1,
                                                           num_assistant_tokens=K), max_batch_size=4,
                               draft_length="auto")
    engine.controller.curve = FREE
    settings = [GenerationSettings(max_new_tokens=3, seed=seed, **SETTINGS) for seed in range(RUNS)]
    results = engine.generate_batch([prompt] * RUNS, settings, references=[list(likeliest) * 2] * RUNS)
    samples = Counter(tuple(r.token_ids[:2]) for r in results)
    assert sum(r.stats.accepted_from_reference for r in results) > 50
    assert sum(r.stats.accepted_from_drafter for r in results) > 50
    assert chi_square_p_value(samples, exact) > 1e-3
