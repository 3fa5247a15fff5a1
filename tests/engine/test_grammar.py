"""Structured output (issue 53): a response_format's grammar masks the target at every
position of a verification pass, drafts are cut at the first forbidden token, the grammar's
forced runs are a draft source, rows stop where the grammar completes.  Float64 tiny models
with a byte-level JSON tokenizer built here (tiny_models.json_tokenizer)."""

from __future__ import annotations

import json
from collections import Counter

import jsonschema
import pytest
import torch
from scipy.stats import chisquare

from pipeline.engine import GenerationSettings, SpeculationSettings, SpeculativeEngine
from pipeline.engine import grammar as grammar_module
from pipeline.engine.grammar import GrammarError, compile_grammar, normalize_response_format
from pipeline.engine.proposers.base import empty_draft

from eagle_models import random_head
from tiny_models import VOCAB, build, json_tokenizer, perturbed_copy

EOS = 0
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "kind": {"enum": ["alpha", "beta"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "tags", "kind", "n"],
    "additionalProperties": False,
}
RF = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA}}
CHOICE = {"type": "choice", "choice": ["red", "green", "blue", "beta"]}
REGEX = {"type": "regex", "regex": "[a-f]{2,5}-[0-9]{1,3}"}
K = 3  # the schema's first forced run, '{"name": "', is longer


@pytest.fixture(scope="module")
def tok():
    return json_tokenizer()


@pytest.fixture(scope="module")
def target():
    return build("llama", seed=0)


def _prompts(tok, n: int) -> list[list[int]]:
    """Prompts that hold JSON like the output's (so prompt lookup and suffix draft from them,
    drafts the grammar sometimes forbids), of different lengths."""
    texts = ['{"name": "ab", "tags": ["red"], "kind": "beta", "n": 5}', 'abc', '"tags": ["blue", "red"]',
             '{"kind": "alpha"} {"kind": "alpha"}', '12, 34, 56', '["green"]']
    return [tok.encode(texts[i % len(texts)] * (1 + i // len(texts))) for i in range(n)]


#: per row: its response_format and budget (2 ends inside the first forced run; 60 lets it close)
ROWS = [(RF, 60), (RF, 2), (CHOICE, 60), (RF, 9), (REGEX, 60), (None, 12)]


def _settings(i: int, **kw) -> GenerationSettings:
    rf, budget = ROWS[i % len(ROWS)]
    return GenerationSettings(max_new_tokens=budget, response_format=rf, eos_token_id=EOS, **kw)


@pytest.fixture(scope="module")
def plain_results(target, tok):
    """Plain constrained greedy decoding, row by row: the reference."""
    engine = SpeculativeEngine(target, tokenizer=tok)
    return [engine.generate(p, _settings(i)) for i, p in enumerate(_prompts(tok, 6))]


def _engine(method: str, target, tok, rows: int, draft_length: str = "fixed"):
    kw = {"prompt_lookup": dict(prompt_lookup_num_tokens=K), "early_exit": dict(assistant_early_exit=1)}.get(method, {})
    drafter = {"draft_model": perturbed_copy(target, 0.3), "eagle": random_head(target)}.get(method)
    return SpeculativeEngine(target, SpeculationSettings(method=method, num_assistant_tokens=K, **kw), drafter=drafter,
                             tokenizer=tok, max_batch_size=rows, draft_length=draft_length)


def _valid(result, rf) -> bool:
    """Whether the text is a sentence of ``rf``'s language (the schema checked by jsonschema)."""
    if rf is RF:
        try:
            jsonschema.validate(json.loads(result.text), SCHEMA)
        except (json.JSONDecodeError, jsonschema.ValidationError):
            return False
        return True
    if rf is CHOICE:
        return result.text in CHOICE["choice"]
    import re
    return re.fullmatch(REGEX["regex"], result.text) is not None


# ---------------------------------------------------------------------------- shapes and compiling
def test_normalize_response_format_accepts_the_openai_and_vllm_shapes():
    assert normalize_response_format(None) is None
    assert normalize_response_format({"type": "text"}) is None
    assert normalize_response_format('{"type": "json_object"}') == {"type": "json_object"}
    a = normalize_response_format({"json_schema": {"schema": SCHEMA, "name": "item"}, "type": "json_schema"})
    assert a == normalize_response_format(json.dumps(RF)) and list(a) == ["json_schema", "type"]
    assert list(a["json_schema"]["schema"]["properties"]) == ["name", "tags", "kind", "n"]  # the generation order kept
    assert normalize_response_format(CHOICE) == CHOICE
    for bad, field in [({"type": "xml"}, "response_format.type"), ({"type": "json_schema"}, "json_schema"),
                       ({"type": "json_schema", "json_schema": {"name": "s", "schema": []}}, "schema 's'"),
                       ({"type": "choice", "choice": ["a", ""]}, "response_format.choice"),
                       ({"type": "regex", "regex": 5}, "response_format.regex"),
                       ({"type": "json_object", "schema": {}}, "unknown field"), ("{not json", "not JSON"), (7, "object")]:
        with pytest.raises(GrammarError, match=field):
            normalize_response_format(bad)
    with pytest.raises(ValueError, match="response_format.type"):
        GenerationSettings(response_format={"type": "yaml"}).validate()
    with pytest.raises(ValueError, match="logprobs"):
        GenerationSettings(logprobs=-1).validate()


def test_compile_is_cached_by_content_and_refusals_name_the_schema(tok):
    a = compile_grammar(RF, tok, VOCAB)
    assert compile_grammar(json.loads(json.dumps(RF)), tok, VOCAB) is a  # equal content: compiled once
    assert compile_grammar(CHOICE, tok, VOCAB) is not a
    with pytest.raises(GrammarError, match=r"json_schema \(schema 'broken'\) is refused.*objekt"):
        compile_grammar({"type": "json_schema", "json_schema": {"name": "broken", "schema": {"type": "objekt"}}},
                        tok, VOCAB)
    with pytest.raises(GrammarError, match="response_format.regex is refused"):
        compile_grammar({"type": "regex", "regex": "(("}, tok, VOCAB)


def test_a_compile_over_its_time_is_refused_and_not_remembered(tok, monkeypatch):
    import threading

    release = threading.Event()
    real = grammar_module._new_matcher
    monkeypatch.setattr(grammar_module, "_new_matcher", lambda *a: (release.wait(5), real(*a))[1])
    fmt = {"type": "regex", "regex": "[0-9]{4}"}
    with pytest.raises(GrammarError, match="did not compile within 0.05 s"):
        compile_grammar(fmt, tok, VOCAB, timeout_s=0.05)
    release.set()
    monkeypatch.setattr(grammar_module, "_new_matcher", real)
    assert compile_grammar(fmt, tok, VOCAB).format == fmt


def test_the_matcher_follows_any_prefix_and_cuts_forbidden_drafts(tok):
    state = compile_grammar(RF, tok, VOCAB).state([EOS])
    text = tok.encode('{"name": "ab", "tags": [], "kind": "beta", "n": 7}')
    assert state.valid_prefix([], text + [EOS]) == len(text) + 1
    assert state.valid_prefix(text[:4], text[4:] + [EOS, 5]) == len(text) - 4 + 1  # nothing after EOS
    assert state.valid_prefix([], tok.encode('{"nome"')) < len(tok.encode('{"nome"'))
    masks = state.masks(text[:3], text[3:], 5)  # after a later prefix ...
    again = state.masks(text[:3], text[3:], 5)  # ... and back: the same masks
    assert torch.equal(masks, again) and all(masks[i, text[3 + i]] for i in range(5))
    assert not state.masks(text, [], 1)[0, 5] and state.masks(text, [], 1)[0, EOS]  # complete: EOS alone
    assert state.complete(text + [EOS]) and not state.complete(text[:-1])
    assert tok.decode(state.forced([], 20)).startswith('{"name')


# ---------------------------------------------------------------------------- greedy = plain constrained greedy
@pytest.mark.parametrize("rows", [1, 3, 6])
@pytest.mark.parametrize("method", ["prompt_lookup", "suffix", "draft_model", "early_exit", "eagle"])
def test_constrained_greedy_equals_plain_constrained_greedy(method, rows, target, tok, plain_results):
    """Every lossless method, 1, 3 and 6 rows in flight, rows with a schema whose forced runs
    are longer than k, a choice, a regex and none, budgets ending inside a forced run."""
    engine = _engine(method, target, tok, rows, draft_length="auto" if rows == 3 else "fixed")
    results = engine.generate_batch(_prompts(tok, 6), [_settings(i) for i in range(6)])
    for i, (got, want) in enumerate(zip(results, plain_results)):
        assert got.error is None
        assert got.token_ids == want.token_ids, (method, i)
        assert (got.finish_reason, got.grammar_complete) == (want.finish_reason, want.grammar_complete)
        assert got.stats.forced_tokens == want.stats.forced_tokens
    assert sum(r.stats.accepted_from_grammar for r in results) > 0


def test_plain_constrained_output_is_valid_and_stops_where_the_grammar_completes(plain_results):
    for (rf, budget), r in zip(ROWS, plain_results):
        if rf is None:
            assert r.grammar_complete is None
            continue
        if r.finish_reason == "stop":
            assert r.grammar_complete and r.token_ids[-1] == EOS and _valid(r, rf)
        else:
            assert r.finish_reason == "length" and r.grammar_complete is False and len(r.token_ids) == budget
    cut = plain_results[1]  # budget 2: inside '{"name": "'
    assert cut.finish_reason == "length" and not cut.grammar_complete and cut.stats.forced_tokens == 2
    assert sum(r.grammar_complete is True for r in plain_results) >= 3


def test_the_grammar_sources_forced_tokens_are_all_accepted(target):
    """With one tokenization per text, a forced run is what the masked target must emit: a
    proposer that drafts nothing leaves the grammar's drafts, and every one is accepted,
    greedy and sampled."""
    chars = json_tokenizer(pieces=())
    for sample in (False, True):
        engine = _engine("prompt_lookup", target, chars, 2)
        engine.proposer.propose = lambda requests: [empty_draft(r.sequence.device) for r in requests]
        settings = GenerationSettings(max_new_tokens=80, response_format=RF, eos_token_id=EOS, do_sample=sample, seed=3)
        for r in engine.generate_batch([chars.encode("abc"), chars.encode('{"n": 1}')], settings):
            s = r.stats
            assert s.draft_tokens > 5 and s.accepted_tokens == s.draft_tokens == s.accepted_from_grammar
            assert s.forced_tokens >= s.accepted_from_grammar


# ---------------------------------------------------------------------------- sampling
def _exact_law(target, tok, prompt: list[int], rf, temperature: float) -> dict[str, float]:
    """P(text) under plain constrained sampling: every path of the masked, renormalised
    target distribution walked to EOS (texts with several tokenizations summed)."""
    state = compile_grammar(rf, tok, VOCAB).state([EOS])
    law: Counter = Counter()

    def walk(path: list[int], p: float) -> None:
        with torch.no_grad():
            logits = target(torch.tensor([prompt + path])).logits[0, -1] / temperature
        allowed = state.masks(path, [], 1)[0]
        probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), -1)
        for t in allowed.nonzero().flatten().tolist():
            if t == EOS:
                law[tok.decode(path)] += p * float(probs[t])
            else:
                walk(path + [t], p * float(probs[t]))

    walk([], 1.0)
    return law


@pytest.mark.slow
@pytest.mark.parametrize("method", ["draft_model", "prompt_lookup"])
def test_sampling_under_a_choice_at_batch_4_follows_the_masked_target(method, tok):
    target = build("llama", seed=11, initializer_range=0.3)
    prompt = tok.encode('["green", "blue", "red", "green"]')
    temperature, runs = 1.3, 800
    law = _exact_law(target, tok, prompt, CHOICE, temperature)
    assert abs(sum(law.values()) - 1) < 1e-9 and len(law) == 4
    engine = SpeculativeEngine(target, SpeculationSettings(method=method, num_assistant_tokens=2,
                                                           prompt_lookup_num_tokens=2),
                               drafter=perturbed_copy(target, 1.0, seed=12) if method == "draft_model" else None,
                               tokenizer=tok, max_batch_size=4)
    settings = [GenerationSettings(max_new_tokens=12, do_sample=True, temperature=temperature, seed=s,
                                   response_format=CHOICE, eos_token_id=EOS) for s in range(runs)]
    results = engine.generate_batch([prompt] * runs, settings)
    assert all(r.grammar_complete for r in results)
    counts = Counter(r.text for r in results)
    texts = sorted(law)
    assert set(counts) <= set(texts)
    p = chisquare([counts[t] for t in texts], [law[t] * runs for t in texts]).pvalue
    assert p > 1e-3, (counts, law)


# ---------------------------------------------------------------------------- per row
def test_rows_with_mixed_settings_get_what_they_get_alone(target, tok):
    """temperature, top_k, top_p, seed, stop strings, budgets and formats differ per row."""
    rows = [GenerationSettings(max_new_tokens=40, response_format=RF, eos_token_id=EOS),
            GenerationSettings(max_new_tokens=10, do_sample=True, temperature=0.7, top_k=5, seed=1, eos_token_id=EOS),
            GenerationSettings(max_new_tokens=30, stop_strings=["e"], eos_token_id=EOS),
            GenerationSettings(max_new_tokens=20, do_sample=True, temperature=1.3, top_p=0.9, seed=2,
                               response_format=CHOICE, eos_token_id=EOS),
            GenerationSettings(max_new_tokens=3, eos_token_id=EOS, logprobs=2),
            GenerationSettings(max_new_tokens=20, do_sample=True, temperature=0.7, top_k=5, seed=4,
                               response_format=REGEX, eos_token_id=EOS)]
    prompts = _prompts(tok, len(rows))
    engine = _engine("prompt_lookup", target, tok, 4)
    together = engine.generate_batch(prompts, rows)
    for p, s, got in zip(prompts, rows, together):
        alone = _engine("prompt_lookup", target, tok, 1).generate(p, s)
        assert got.token_ids == alone.token_ids and got.finish_reason == alone.finish_reason
        assert got.logprobs == alone.logprobs
    assert together[4].logprobs is not None and together[0].logprobs is None


def test_a_format_the_library_refuses_is_a_per_row_error(target, tok):
    engine = _engine("prompt_lookup", target, tok, 2)
    bad = {"type": "json_schema", "json_schema": {"name": "broken", "schema": {"type": "objekt"}}}
    rows = [GenerationSettings(max_new_tokens=8, response_format=f, eos_token_id=EOS) for f in (RF, bad, CHOICE)]
    results = engine.generate_batch(_prompts(tok, 3), rows)
    assert [r.error is None for r in results] == [True, False, True]
    assert "schema 'broken'" in results[1].error and results[1].error.startswith("ValueError")
    no_tokenizer = SpeculativeEngine(target).generate_batch(_prompts(tok, 1), rows[:1])[0]
    assert "tokenizer" in no_tokenizer.error
    no_eos = engine.generate_batch(_prompts(tok, 1), [GenerationSettings(response_format=RF, eos_token_id=[])])[0]
    assert "EOS" in no_eos.error


def test_logprobs_are_the_masked_targets_and_equal_plain_ones(target, tok):
    settings = GenerationSettings(max_new_tokens=40, response_format=RF, eos_token_id=EOS, logprobs=3)
    prompt = _prompts(tok, 1)[0]
    plain = SpeculativeEngine(target, tokenizer=tok).generate(prompt, settings)
    spec = _engine("draft_model", target, tok, 1).generate(prompt, settings)
    assert spec.token_ids == plain.token_ids and len(spec.logprobs) == len(spec.token_ids)
    for a, b, t in zip(spec.logprobs, plain.logprobs, spec.token_ids):
        assert a["token_id"] == b["token_id"] == t and abs(a["logprob"] - b["logprob"]) < 1e-9
        assert [x[0] for x in a["top"]] == [x[0] for x in b["top"]] and a["top"][0][0] == t  # greedy: top is chosen
        assert 1 <= len(a["top"]) <= 3 and all(lp > float("-inf") for _, lp in a["top"])
    forced = [e for e in spec.logprobs if len(e["top"]) == 1]
    assert forced and all(e["logprob"] == 0.0 for e in forced)  # the grammar allowed one token: probability 1
