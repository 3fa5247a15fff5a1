"""Logits processors under speculation: lossless, as ``generate()`` applies them.

Every processor the engine accepts (repetition penalty, no-repeat n-gram, bad words, min
new tokens, suppress tokens, and all of them at once) is checked in float64 on two
architectures: greedy output of ``plain``, ``draft_model`` (a noisy drafter, so drafts are
also rejected) and ``prompt_lookup`` equals single-row plain greedy and transformers
``generate()`` with the same setting.  The processor settings are taken from the output
generated without them, so each one changes the output.  An oracle drafter (the target
itself) must have every draft accepted, which holds only if the drafter's logits are
shaped like the target's, each draft position with its own prefix.

Also: bf16 logits go through the processors in float32 (as in ``generate()``); a
temperature so small that softmax underflows gives the greedy limit; checkpoint defaults
(``generation_config``) are honoured unless set explicitly.  The chi-square test with
``min_p`` and ``no_repeat_ngram_size`` is in test_sampling.py.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

import pipeline.engine.settings as settings_module
from pipeline.engine import GenerationSettings, SpeculationSettings, SpeculativeEngine
from pipeline.engine.sampling import LogitsShaper
from pipeline.engine.settings import resolve_generation_settings

from tiny_models import build, check_stats, perturbed_copy, prompt_of

K = 3
BUDGET = 40
METHODS = ("plain", "draft_model", "prompt_lookup")


def processor_cases(free: list[int]) -> dict[str, dict]:
    """Settings of each processor, chosen from ``free`` (the greedy output without any) so
    that each one changes the output."""
    return {
        "repetition_penalty": dict(repetition_penalty=1.4),
        "no_repeat_ngram_size=2": dict(no_repeat_ngram_size=2),
        "no_repeat_ngram_size=3": dict(no_repeat_ngram_size=3),
        # one single-token and two multi-token bad words
        "bad_words_ids": dict(bad_words_ids=[[free[1]], free[4:6], free[8:11]]),
        "suppress_tokens": dict(suppress_tokens=[free[0], free[3]]),
        # the 3rd token is made an EOS id: without min_new_tokens the row would stop there
        "min_new_tokens": dict(min_new_tokens=12, eos_token_id=free[2]),
        "all": dict(repetition_penalty=1.2, no_repeat_ngram_size=3, bad_words_ids=[free[4:6]],
                    suppress_tokens=[free[0]], min_new_tokens=12, eos_token_id=free[2]),
    }


def hf_generate(target, prompt, max_new_tokens=BUDGET, **kw) -> list[int]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = target.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False, **kw)
    return out[0, prompt.shape[1]:].tolist()


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def arch_setup(request):
    target = build(request.param, seed=0)
    drafter = perturbed_copy(target, 0.3, seed=2)
    # generate() takes the assistant's draft settings from its own generation_config
    drafter.generation_config.num_assistant_tokens = K
    drafter.generation_config.num_assistant_tokens_schedule = "constant"
    drafter.generation_config.assistant_confidence_threshold = 0.0
    prompt = prompt_of(17, seed=3)  # repeats: n-grams recur, prompt lookup proposes
    engines = {
        "plain": SpeculativeEngine(target),
        "draft_model": SpeculativeEngine(target, SpeculationSettings(method="draft_model", num_assistant_tokens=K),
                                         drafter=drafter),
        "prompt_lookup": SpeculativeEngine(target, SpeculationSettings(method="prompt_lookup",
                                                                       prompt_lookup_num_tokens=K)),
        "oracle": SpeculativeEngine(target, SpeculationSettings(method="draft_model", num_assistant_tokens=K),
                                    drafter=target),
    }
    return target, drafter, prompt, engines, hf_generate(target, prompt)


@pytest.mark.parametrize("case", list(processor_cases(list(range(20)))))
def test_processor_is_lossless_and_matches_generate(arch_setup, case):
    target, drafter, prompt, engines, free = arch_setup
    kw = processor_cases(free)[case]
    reference = hf_generate(target, prompt, **kw)
    assert reference != free, "the processor must change the output for the test to mean anything"
    # transformers' own assisted decoding agrees (same processors, lossless greedy)
    assert hf_generate(target, prompt, assistant_model=drafter, **kw) == reference
    assert hf_generate(target, prompt, prompt_lookup_num_tokens=K, max_matching_ngram_size=2, **kw) == reference
    settings = GenerationSettings(max_new_tokens=BUDGET, **kw)
    results = {m: e.generate(prompt, settings) for m, e in engines.items()}
    for method, result in results.items():
        assert result.token_ids == reference, (case, method)
        check_stats(result, K)
    assert results["plain"].token_ids == reference  # single-row plain greedy
    # q shaped like p: the oracle drafter's drafts are all accepted (a stop may cut the last one)
    oracle = results["oracle"].stats
    cut = oracle.draft_tokens - oracle.accepted_tokens
    assert cut == 0 or (results["oracle"].finish_reason == "stop" and cut < K)
    assert results["draft_model"].stats.draft_tokens > 0 and results["prompt_lookup"].stats.draft_tokens > 0


def test_partial_acceptance_under_processors(arch_setup):
    """The noisy drafter is rejected at times under the processors, so the rollback path
    (and the residual position's own prefix) is exercised."""
    target, _, prompt, engines, free = arch_setup
    accepted = drafted = 0
    for kw in processor_cases(free).values():
        s = engines["draft_model"].generate(prompt, GenerationSettings(max_new_tokens=BUDGET, **kw)).stats
        accepted += s.accepted_tokens
        drafted += s.draft_tokens
    assert 0 < accepted < drafted


def test_verifying_with_the_committed_prefix_only_is_caught(arch_setup, monkeypatch):
    """The test has teeth: a shaper that gives every verified position the committed
    prefix (not the position's own) breaks the no-repeat n-gram output."""
    target, _, prompt, engines, free = arch_setup
    kw = dict(no_repeat_ngram_size=2)
    reference = hf_generate(target, prompt, **kw)
    original = LogitsShaper.shape

    def committed_prefix_only(self, prefix, logits, extra=None):
        return torch.cat([original(self, prefix, logits[i : i + 1]) for i in range(logits.shape[0])])

    monkeypatch.setattr(LogitsShaper, "shape", committed_prefix_only)
    wrong = engines["oracle"].generate(prompt, GenerationSettings(max_new_tokens=BUDGET, **kw)).token_ids
    assert wrong != reference


def test_min_new_tokens_without_eos_changes_nothing(arch_setup):
    """As in generate(): min_new_tokens only bans EOS ids; a row without any decodes as if unset."""
    target, _, prompt, engines, free = arch_setup
    assert target.generation_config.eos_token_id is None
    out = engines["draft_model"].generate(prompt, GenerationSettings(max_new_tokens=BUDGET, min_new_tokens=30))
    assert out.token_ids == free


def test_bad_word_equal_to_eos_is_ignored(arch_setup):
    """generate() drops a one-token bad word that is an EOS id: the row still stops."""
    target, _, prompt, engines, free = arch_setup
    kw = dict(eos_token_id=free[0], bad_words_ids=[[free[0]]])
    assert hf_generate(target, prompt, **kw) == free[:1]
    for method in METHODS:
        result = engines[method].generate(prompt, GenerationSettings(max_new_tokens=BUDGET, **kw))
        assert result.token_ids == free[:1], method
        assert result.finish_reason == "stop"


# ------------------------------------------------------------------ bf16
def test_bf16_logits_are_processed_in_float32():
    """The issue's example: logits 16.0 and 15.25, token 0 already in the sequence, penalty
    1.05.  In bf16, 16 / 1.05 rounds to 15.25, a tie that keeps token 0; in float32 token 1
    wins."""
    logits = torch.tensor([[16.0, 15.25, 3.0]], dtype=torch.bfloat16)
    prefix = torch.tensor([[0]])
    in_bf16 = RepetitionPenaltyLogitsProcessor(1.05)(prefix, logits)
    assert in_bf16[0, 0] == in_bf16[0, 1]  # the fault: a tie
    for settings in (GenerationSettings(repetition_penalty=1.05),
                     GenerationSettings(repetition_penalty=1.05, do_sample=True, temperature=0.5, top_k=2)):
        shaper = LogitsShaper(settings, prompt_length=1)
        shaped = shaper.shape(prefix, logits)
        assert shaped.dtype == torch.float32
        assert int(shaped.argmax()) == 1
        assert shaper.probs(prefix, logits)[0, 1] > shaper.probs(prefix, logits)[0, 0]
    # no processor: still float32 out (the drafter's q and the verifier's p are float32)
    assert LogitsShaper(GenerationSettings()).shape(prefix, logits).dtype == torch.float32


def test_bf16_greedy_matches_generate():
    """On bf16 models with large logits, greedy decoding with a repetition penalty equals
    generate() (which processes float32 logits).  At least one of these models flips an
    argmax along its output when the penalty is applied in bf16, so the case is sensitive."""
    flips = 0
    for seed in range(3):
        target = build("llama", seed=seed, vocab=256, hidden=64, initializer_range=0.5).to(torch.bfloat16)
        with torch.no_grad():
            target.lm_head.weight.mul_(4)  # logits around 40: bf16 steps of 0.25
        prompt = prompt_of(20, seed=seed, vocab=256)
        for kw in (dict(repetition_penalty=1.05), dict(repetition_penalty=1.05, no_repeat_ngram_size=3)):
            reference = hf_generate(target, prompt, **kw)
            assert SpeculativeEngine(target).generate(prompt, GenerationSettings(max_new_tokens=BUDGET, **kw)).token_ids == reference
        # sensitivity: along the reference, the bf16-processed argmax differs somewhere
        reference = hf_generate(target, prompt, repetition_penalty=1.05)
        seq = torch.cat([prompt, torch.tensor([reference])], dim=1)
        with torch.no_grad():
            logits = target(seq).logits[0, prompt.shape[1] - 1 : -1]
        penalty = RepetitionPenaltyLogitsProcessor(1.05)
        for i in range(len(reference)):
            ids = seq[:, : prompt.shape[1] + i]
            if int(penalty(ids, logits[i : i + 1]).argmax()) != int(penalty(ids, logits[i : i + 1].float()).argmax()):
                flips += 1
    assert flips > 0


# ------------------------------------------------------------------ temperature underflow
@pytest.mark.parametrize("dtype, temperature", [(torch.float32, 1e-40), (torch.float64, 1e-320), (torch.float64, 1e-40)])
def test_tiny_temperature_gives_the_greedy_limit(dtype, temperature):
    """generate() crashes in torch.multinomial here (softmax of inf - inf); the engine
    samples from the limit distribution, the argmax: output equals greedy, every seed."""
    target = build("llama", seed=0).to(dtype)
    drafter = perturbed_copy(target, 0.3, seed=2)
    prompt = prompt_of(17, seed=3)
    greedy = SpeculativeEngine(target).generate(prompt, GenerationSettings(max_new_tokens=30)).token_ids
    for method in METHODS:
        engine = SpeculativeEngine(target, SpeculationSettings(method=method, num_assistant_tokens=K,
                                                               prompt_lookup_num_tokens=K),
                                   drafter=drafter if method == "draft_model" else None)
        for seed in range(3):
            settings = GenerationSettings(max_new_tokens=30, do_sample=True, temperature=temperature, top_p=0.9,
                                          min_p=0.1, seed=seed)
            assert engine.generate(prompt, settings).token_ids == greedy, (method, seed)


def test_overflowing_temperature_shares_ties_uniformly():
    logits = torch.tensor([[2.0, 5.0, 5.0, -1.0], [0.5, -3.0, 0.25, 0.0]], dtype=torch.float32)
    shaper = LogitsShaper(GenerationSettings(do_sample=True, temperature=1e-40))
    probs = shaper.probs(torch.tensor([[0]]), logits)
    assert not probs.isnan().any()
    assert probs.tolist() == [[0.0, 0.5, 0.5, 0.0], [1.0, 0.0, 0.0, 0.0]]
    # all-negative logits overflow to -inf: the limit still holds
    probs = shaper.probs(torch.tensor([[0]]), torch.tensor([[-2.0, -1.0, -3.0]]))
    assert probs.tolist() == [[0.0, 1.0, 0.0]]


# ------------------------------------------------------------------ checkpoint defaults
@pytest.fixture
def fresh_log(monkeypatch):
    """Forget which messages were logged once, so this test sees its own."""
    monkeypatch.setattr(settings_module, "_logged", set())


def test_checkpoint_generation_config_is_honoured(fresh_log, caplog):
    """A checkpoint whose generation_config sets repetition_penalty and no_repeat_ngram_size
    decodes as generate() does; explicit settings override; what was taken is logged once."""
    target = build("llama", seed=4)
    drafter = perturbed_copy(target, 0.3, seed=5)
    drafter.generation_config.num_assistant_tokens = K
    drafter.generation_config.assistant_confidence_threshold = 0.0
    prompt = prompt_of(17, seed=6)
    free = hf_generate(target, prompt)
    target.generation_config.repetition_penalty = 1.3
    target.generation_config.no_repeat_ngram_size = 2
    target.generation_config.max_new_tokens = 25
    with_defaults = hf_generate(target, prompt)
    assert with_defaults != free
    engines = {m: SpeculativeEngine(target, SpeculationSettings(method=m, num_assistant_tokens=K,
                                                                prompt_lookup_num_tokens=K),
                                    drafter=drafter if m == "draft_model" else None) for m in METHODS}
    with caplog.at_level(logging.INFO, logger=settings_module.__name__):
        for method, engine in engines.items():
            assert engine.generate(prompt, GenerationSettings(max_new_tokens=BUDGET)).token_ids == with_defaults, method
            # explicit values win: the processors switched off
            off = GenerationSettings(max_new_tokens=BUDGET, repetition_penalty=1.0, no_repeat_ngram_size=0)
            assert engine.generate(prompt, off).token_ids == free, method
        # the checkpoint's max_new_tokens applies when the caller sets none
        unset = engines["plain"].generate(prompt)
        assert unset.token_ids == with_defaults[:25]
    lines = [r.getMessage() for r in caplog.records if "taken from the target's generation_config" in r.getMessage()]
    assert len(lines) == 2  # once per distinct set of defaults taken, not once per row
    assert "repetition_penalty=1.3" in lines[0] and "no_repeat_ngram_size=2" in lines[0]


def test_resolution_priority_and_unsupported_settings(fresh_log, caplog):
    checkpoint = GenerationConfig(do_sample=True, temperature=0.6, top_p=0.9, top_k=0, min_p=0.05,
                                  repetition_penalty=1.1, bad_words_ids=[[3]], suppress_tokens=[4], eos_token_id=[1, 2],
                                  typical_p=0.5, max_length=4096)
    with caplog.at_level(logging.INFO, logger=settings_module.__name__):
        r = resolve_generation_settings(GenerationSettings(temperature=0.9, suppress_tokens=[]), checkpoint, 96)
    assert (r.do_sample, r.temperature, r.top_p, r.min_p, r.repetition_penalty) == (True, 0.9, 0.9, 0.05, 1.1)
    assert r.top_k is None  # a checkpoint's top_k=0 means "off"
    assert r.suppress_tokens == [] and r.bad_words_ids == [[3]] and r.eos_token_id == [1, 2]
    assert r.max_new_tokens == 128  # the engine's default, not generate()'s max_length
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "typical_p=0.5" in warned and "max_length=4096" in warned
    # nothing set anywhere: the engine's defaults
    plain = resolve_generation_settings(None, GenerationConfig())
    assert (plain.max_new_tokens, plain.do_sample, plain.temperature) == (128, False, 1.0)
    # a bad checkpoint value is refused, naming the setting and where it came from
    with pytest.raises(ValueError, match=r"top_p.*generation_config"):
        resolve_generation_settings(GenerationSettings(), GenerationConfig(do_sample=True, top_p=1.5))


# ------------------------------------------------------------------ the list in docs/engine.md
PAGE = Path(__file__).resolve().parents[2] / "docs" / "engine.md"
#: one value of each processor setting, enough to switch it on
ONE_VALUE = dict(repetition_penalty=1.2, no_repeat_ngram_size=2, bad_words_ids=[[1]], min_new_tokens=2,
                 suppress_tokens=[2], temperature=0.5, top_k=3, top_p=0.9, min_p=0.1)


def _transformers_class(processor) -> str:
    """The processor's class, or the transformers class it refines (temperature)."""
    return next(c.__name__ for c in type(processor).__mro__ if c.__module__.startswith("transformers."))


def accepted_processors() -> list[tuple[str, str, bool]]:
    """``(setting, transformers class, sampling only)`` in the order the shaper runs them,
    read off LogitsShaper itself."""
    rows = []
    for name, value in ONE_VALUE.items():
        def classes(**kw):
            shaper = LogitsShaper(GenerationSettings(**{name: value}, **kw), prompt_length=1, eos_token_ids=[0])
            return [_transformers_class(p) for group in shaper.processors() for p in group]

        (cls,) = classes(do_sample=True)
        rows.append((name, cls, classes(do_sample=False) == []))
    every = LogitsShaper(GenerationSettings(do_sample=True, **ONE_VALUE), prompt_length=1, eos_token_ids=[0])
    order = [_transformers_class(p) for group in every.processors() for p in group]
    assert sorted(order) == sorted(cls for _, cls, _ in rows)
    return sorted(rows, key=lambda r: order.index(r[1]))


def processor_table() -> str:
    """The table of docs/engine.md, generated from the shaper and from what the tests cover."""
    import test_sampling

    differential = {k for kw in processor_cases(list(range(20))).values() for k in kw}
    chi_square = set(test_sampling.SETTINGS) | set(test_sampling.FILTERS)
    lines = ["| setting | transformers processor | applies to | tested by |", "| --- | --- | --- | --- |"]
    for name, cls, sampling_only in accepted_processors():
        tests = [t for t, names in (("differential", differential), ("chi-square", chi_square)) if name in names]
        assert tests, f"{name} is accepted but no test covers it"
        lines.append(f"| `{name}` | `{cls}` | {'sampling' if sampling_only else 'greedy and sampling'} | "
                     f"{', '.join(tests)} |")
    return "\n".join(lines)


def test_the_engine_page_lists_the_accepted_and_tested_processors():
    text = PAGE.read_text()
    start, end = "<!-- processors:start -->\n", "\n<!-- processors:end -->"
    block = text[text.index(start) + len(start): text.index(end)]
    assert block == processor_table(), "update the block in docs/engine.md to:\n" + processor_table()
