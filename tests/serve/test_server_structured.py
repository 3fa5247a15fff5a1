"""``/v1/chat/completions`` with ``messages`` and ``response_format`` (issue 53): structured
output on the same engine as the batch job, equal to the engine's own constrained decoding;
a format of a bad shape, or one the grammar library refuses, is a 400 naming ``response_format``."""

from __future__ import annotations

import json

import httpx
import pytest

from serve_testkit import serving
from pipeline.engine import GenerationSettings, SpeculationSettings, SpeculativeEngine
from pipeline.prompts import encode_chat
from pipeline.serve import OpenAIServer, build_app
from tiny_models import build, json_tokenizer, perturbed_copy

CHAT = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4},
                                           "kind": {"enum": ["alpha", "beta"]}},
          "required": ["name", "kind"], "additionalProperties": False}
RF = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA}}
CHOICE = {"type": "choice", "choice": ["red", "green", "blue"]}


@pytest.fixture(scope="module")
def served():
    target = build("llama", layers=2, seed=0)
    tok = json_tokenizer()
    engine = SpeculativeEngine(target, SpeculationSettings(method="draft_model", num_assistant_tokens=3),
                               drafter=perturbed_copy(target, 0.3), tokenizer=tok, max_batch_size=4,
                               draft_length="fixed")
    plain = SpeculativeEngine(target, tokenizer=tok)
    srv = OpenAIServer(engine, "tiny", GenerationSettings(max_new_tokens=40, do_sample=False, eos_token_id=0),
                       chat_template=CHAT)
    with serving(build_app(srv)) as url:
        yield url, plain, tok
    srv.close()


@pytest.mark.parametrize("rf", [RF, CHOICE], ids=["json_schema", "choice"])
def test_chat_with_a_response_format_equals_plain_constrained_decoding(served, rf):
    url, plain, tok = served
    messages = [{"role": "user", "content": '{"name": "ab", "kind": "beta"}'}]
    r = httpx.post(f"{url}/v1/chat/completions", timeout=120,
                   json={"messages": messages, "response_format": rf, "temperature": 0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    _, ids = encode_chat(tok, messages, CHAT)
    want = plain.generate(ids, GenerationSettings(max_new_tokens=40, response_format=rf, eos_token_id=0))
    assert choice["token_ids"] == want.token_ids and want.grammar_complete
    content = choice["message"]["content"]
    if rf is RF:
        value = json.loads(content)
        assert set(value) == {"name", "kind"} and value["kind"] in ("alpha", "beta")
    else:
        assert content in CHOICE["choice"]
    assert choice["finish_reason"] == "stop"


@pytest.mark.parametrize("rf, words", [
    ({"type": "json_schema"}, "json_schema"),
    ({"type": "xml"}, "type"),
    ({"type": "regex", "regex": "a(b"}, "regex"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
        "a": {"type": "nonsense"}}}}}, "x"),
])
def test_a_bad_response_format_is_a_400_naming_it(served, rf, words):
    url, _, _ = served
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "ab"}], "response_format": rf})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format" and words in err["message"]
