"""The Ray Serve application on the demo models, as ``serve run pipeline.serve:app_builder``
builds it, on a free 127.0.0.1 port, called over HTTP (httpx and the official ``openai``
client).

1. Completions, chat, streaming, ``/v1/models``, ``/health``; greedy outputs equal what
   the batch job's actor writes for the same prompt and settings.
2. 32 concurrent requests are all answered by the one replica (no restart), each equal to
   the same request sent alone (float32 demo models: a row that differs must first differ
   at a near-tie of the target, the batched engine's rule).
3. Every kind of bad request gets a 400 naming the field; a good request then succeeds.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import httpx
import pyarrow as pa
import pytest

from serve_testkit import REPO, free_port

sys.path.insert(0, str(REPO / "bench"))

MAX_TOKENS = 16
MODEL = "demo"
OVERRIDES = {
    "models.target": str(REPO / "models" / "demo-target"),
    "models.drafter": str(REPO / "models" / "demo-drafter"),
    "generation.max_new_tokens": str(MAX_TOKENS),
    "serve.model_name": MODEL,
    "serve.cpus_per_replica": "0.5",
    "serve.max_batch_size": "16",
    "serve.chat_template": str(REPO / "configs" / "chat_templates" / "plain.jinja"),
    # a fixed draft length: the statistics of two requests for the same prompt are then the same
    # (by expected gain, the drafting decisions follow measured times)
    "compute.draft_length": "fixed",
}
TEXTS = [json.loads(line)["text"] for line in (REPO / "data" / "demo_prompts.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def url():
    """The app on an embedded Ray (2 CPUs; reused when the session already has one), shut
    down at the end."""
    import ray
    from ray import serve

    from pipeline.serve import app_builder

    started = not ray.is_initialized()
    if started:
        pp = os.environ.get("PYTHONPATH", "")
        os.environ["PYTHONPATH"] = str(REPO) + (os.pathsep + pp if pp else "")
        ray.init(num_cpus=2, include_dashboard=False, object_store_memory=300 * 2**20,
                 configure_logging=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(app_builder({"config": str(REPO / "configs" / "demo-summarize.yaml"), **OVERRIDES}),
              name="specbatch", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def batch_rows():
    """What the batch job writes for three demo articles (its actor, same config)."""
    from actors.generate import GenerateActor
    from pipeline.config import load_config
    from pipeline.schema import INPUT_SCHEMA

    cfg = load_config(REPO / "configs" / "demo-summarize.yaml", [f"{k}={v}" for k, v in OVERRIDES.items()])
    rows = pa.Table.from_pylist([{"source_file": "demo", "source_row": i, "id": f"r{i}", "text": t, "input_error": None}
                                 for i, t in enumerate(TEXTS[:3])], schema=INPUT_SCHEMA)
    return GenerateActor(cfg.model_dump(), device="cpu")(rows).to_pylist()


@pytest.fixture(scope="module")
def client(url):
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _replica(url: str) -> tuple:
    h = httpx.get(f"{url}/health").json()
    assert h["status"] == "ok"
    return h["replica"], h["pid"]


def test_endpoints_give_what_the_batch_job_writes(url, batch_rows, client):
    health = httpx.get(f"{url}/health")
    assert health.status_code == 200 and health.json()["replica"]
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    for row in batch_rows:
        assert row["error"] is None
        body = {"model": MODEL, "prompt": row["prompt"], "max_tokens": MAX_TOKENS, "temperature": 0}
        out = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
        choice = out["choices"][0]
        assert choice["text"] == row["output_text"]
        assert out["usage"]["completion_tokens"] == row["new_tokens"] > 0
        assert choice["finish_reason"] == {"context": "length"}.get(row["finish_reason"], row["finish_reason"])
        spec = out["speculation"]
        assert spec["method"] == "draft_model" and spec["draft_tokens"] > 0
        assert 0 <= spec["accepted_tokens"] <= spec["draft_tokens"] and spec["verify_steps"] >= 1
        # the job's generation settings are the defaults of a request that sets nothing
        bare = httpx.post(f"{url}/v1/completions", json={"prompt": row["prompt"]}, timeout=120).json()
        assert bare["choices"][0]["text"] == row["output_text"]
        # the official client, plain and streamed
        c = client.completions.create(model=MODEL, prompt=row["prompt"], max_tokens=MAX_TOKENS, temperature=0)
        assert c.choices[0].text == row["output_text"] and c.usage.completion_tokens == row["new_tokens"]
        assert c.model_extra["speculation"]["draft_tokens"] == spec["draft_tokens"]  # as docs/serving.md reads it
        stream = client.completions.create(model=MODEL, prompt=row["prompt"], max_tokens=MAX_TOKENS,
                                           temperature=0, stream=True)
        pieces = [ch.choices[0].text for ch in stream if ch.choices]
        assert len(pieces) > 2 and "".join(pieces) == row["output_text"]


def test_chat_renders_the_template_and_streams(url, client):
    from transformers import AutoTokenizer

    from pipeline.prompts import render_chat

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXTS[4]}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    tok = AutoTokenizer.from_pretrained(OVERRIDES["models.target"])
    rendered = render_chat(tok, messages, (REPO / "configs" / "chat_templates" / "plain.jinja").read_text())
    same = client.completions.create(model=MODEL, prompt=rendered, max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={"add_special_tokens": False})
    assert chat.choices[0].message.content == same.choices[0].text and chat.usage == same.usage
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True)
    deltas = [ch.choices[0].delta for ch in stream if ch.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == chat.choices[0].message.content


def _concurrent_bodies() -> list[dict]:
    prompts = TEXTS + [t[: len(t) // 2] for t in TEXTS[:12]]
    return [{"prompt": p, "max_tokens": (8, 12, 16)[i % 3], "temperature": 0, "return_token_ids": True}
            for i, p in enumerate(prompts)]


def test_32_concurrent_requests_one_replica_each_equal_to_it_alone(url):
    import torch
    from pipeline.engine.exactness import first_difference_is_near_tie
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from ray import serve

    bodies = _concurrent_bodies()
    assert len(bodies) == 32
    replica = _replica(url)

    async def post_all():
        async with httpx.AsyncClient(base_url=url, timeout=300) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json=b) for b in bodies))

    together = asyncio.run(post_all())
    assert [r.status_code for r in together] == [200] * 32
    assert httpx.get(f"{url}/health").json()["peak_rows_in_flight"] > 1  # they shared the batch
    alone = [httpx.post(f"{url}/v1/completions", json=b, timeout=120).json() for b in bodies]
    assert _replica(url) == replica  # no restart
    status = serve.status().applications["specbatch"].deployments["specbatch"]
    assert status.status == "HEALTHY" and status.replica_states == {"RUNNING": 1}

    tok = AutoTokenizer.from_pretrained(OVERRIDES["models.target"])
    target = AutoModelForCausalLM.from_pretrained(OVERRIDES["models.target"], dtype=torch.float32).eval()
    for body, t, a in zip(bodies, together, alone):
        got, ref = t.json()["choices"][0], a["choices"][0]
        if got["token_ids"] != ref["token_ids"]:
            prompt = tok(body["prompt"])["input_ids"]
            assert first_difference_is_near_tie(target, prompt, got["token_ids"], ref["token_ids"]), body["prompt"]
        else:
            assert got["text"] == ref["text"] and got["finish_reason"] == ref["finish_reason"]


BAD = [
    ("completions", {"prompt": "Hello", "frequency": 0.5}, "frequency"),
    ("completions", {"prompt": "Hello", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "Hello", "max_tokens": -3}, "max_tokens"),
    ("completions", {"prompt": "Hello", "max_tokens": 0, "stream": True}, "max_tokens"),
    ("completions", {"prompt": "word " * 2100}, "prompt"),
    ("completions", {"prompt": [5] * 2048}, "prompt"),
    ("completions", {"prompt": [5, 4096]}, "prompt"),
    ("completions", {"prompt": "Hello", "num_assistant_tokens": 0}, "num_assistant_tokens"),
    ("completions", {"prompt": "Hello", "num_assistant_tokens": 6}, "num_assistant_tokens"),
    ("completions", {"prompt": "Hello", "prompt_lookup_num_tokens": 3}, "prompt_lookup_num_tokens"),
    ("completions", {"prompt": "Hello", "temperature": -1}, "temperature"),
    ("completions", {"prompt": "Hello", "top_p": 1.5}, "top_p"),
    ("completions", {"prompt": "Hello", "top_k": -1}, "top_k"),
    ("completions", {"prompt": "Hello", "n": 0}, "n"),
    ("completions", {"prompt": "Hello", "stream": "yes"}, "stream"),
    ("completions", {"max_tokens": 4}, "prompt"),
    ("chat/completions", {"messages": [{"role": "user", "content": "word " * 2100}]}, "messages"),
    ("chat/completions", {"messages": [{"role": "robot", "content": "Hi"}]}, "messages[0].role"),
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi", "mood": "glad"}]}, "messages[0].mood"),
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 0}, "max_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 0},
     "max_completion_tokens"),
    ("completions", {"prompt": "Hello", "logprobs": 2}, "logprobs"),
    ("completions", {"prompt": "Hello", "frequency_penalty": 0.5}, "frequency_penalty"),
]


def test_bad_requests_get_400_naming_the_field_and_the_replica_goes_on(url, client):
    import openai

    replica = _replica(url)
    for endpoint, body, param in BAD:
        r = httpx.post(f"{url}/v1/{endpoint}", json=body, timeout=60)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", (body, error)
        assert param.split("[")[0] in error["message"], (body, error)
    r = httpx.post(f"{url}/v1/completions", content=b"{not json", timeout=60)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    assert httpx.post(f"{url}/v1/completions", json={"model": "other", "prompt": "Hi"}).status_code == 404
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=0)
    assert e.value.status_code == 400 and "max_tokens" in str(e.value)
    good = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    assert good.choices[0].finish_reason in ("length", "stop") and good.usage.completion_tokens >= 1
    assert _replica(url) == replica
