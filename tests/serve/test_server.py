"""The OpenAI-style server on tiny float64 models (no Ray: the same app under uvicorn, on a
free 127.0.0.1 port, called over real HTTP).

Concurrent requests share the engine's batch and each equals the same request decoded
alone, token for token; streamed chunks are the committed blocks; stop strings are cut as
OpenAI does; a row whose steps keep raising fails (500), alone (tests/serve/test_server_guards.py),
and the next request succeeds; a client that disconnects cancels its row.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from serve_testkit import serving
from pipeline.engine import GenerationSettings, SpeculationSettings, SpeculativeEngine
from pipeline.serve import OpenAIServer, build_app
from tiny_models import bracket_tokenizer, build, perturbed_copy, prompt_of

K = 3


@pytest.fixture(scope="module")
def models():
    target = build("llama", layers=2, seed=0)
    return target, perturbed_copy(target, 0.3), bracket_tokenizer()


@pytest.fixture(scope="module")
def alone(models):
    """The same model pair decoding one row at a time (the reference)."""
    target, drafter, tok = models
    return SpeculativeEngine(target, SpeculationSettings(method="draft_model", num_assistant_tokens=K),
                             drafter=drafter, tokenizer=tok, max_batch_size=1, draft_length="fixed")


@pytest.fixture(scope="module")
def server(models):
    target, drafter, tok = models
    # a fixed draft length, so that sampled rows draw as many random numbers as alone and
    # equal their lone output too (greedy rows are equal with any draft length)
    engine = SpeculativeEngine(target, SpeculationSettings(method="draft_model", num_assistant_tokens=K),
                               drafter=drafter, tokenizer=tok, max_batch_size=8, draft_length="fixed")
    srv = OpenAIServer(engine, "tiny", GenerationSettings(max_new_tokens=12, do_sample=False))
    with serving(build_app(srv)) as url:
        yield srv, url
    srv.close()


def _requests(n: int) -> list[dict]:
    """Prompts of 1 .. 90 tokens; budgets 1 .. 30; every fourth sampled with a seed."""
    out = []
    for i in range(n):
        body = {"prompt": prompt_of([1, 7, 30, 90, 13, 2, 55, 21][i % 8], seed=i).view(-1).tolist(),
                "max_tokens": [1, 5, 30, 12][i % 4], "return_token_ids": True}
        if i % 4 == 3:
            body.update(temperature=0.9, seed=100 + i)
        else:
            body.update(temperature=0)
        out.append(body)
    return out


def _settings(body: dict) -> GenerationSettings:
    sampled = body.get("temperature", 0) > 0
    return GenerationSettings(max_new_tokens=body["max_tokens"], do_sample=sampled,
                              temperature=body["temperature"] if sampled else None, seed=body.get("seed"))


async def _post_all(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        return await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))


def test_32_concurrent_requests_share_the_batch_and_each_equals_it_alone(server, alone):
    srv, url = server
    bodies = _requests(32)
    responses = asyncio.run(_post_all(url, bodies))
    assert [r.status_code for r in responses] == [200] * 32
    for body, r in zip(bodies, responses):
        out = r.json()
        expected = alone.generate(body["prompt"], _settings(body))
        choice = out["choices"][0]
        assert choice["token_ids"] == expected.token_ids  # exact, float64 (sampled: same seed, same draws)
        assert choice["text"] == expected.text
        assert out["usage"] == {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(expected.token_ids),
                                "total_tokens": len(body["prompt"]) + len(expected.token_ids)}
        assert choice["finish_reason"] == "length"
        spec = out["speculation"]
        assert spec["method"] == "draft_model" and spec == choice["speculation"]
        assert sum(spec["drafted_per_position"]) == spec["draft_tokens"] >= spec["accepted_tokens"]
        assert spec["verify_steps"] >= 1
    health = httpx.get(f"{url}/health").json()
    assert health["status"] == "ok" and health["rows"] == 0
    assert health["peak_rows_in_flight"] > 1  # the requests were decoded together
    assert health["failed_steps"] == 0


def test_stream_sends_each_committed_block(server, alone):
    srv, url = server
    body = {"prompt": prompt_of(20, seed=3).view(-1).tolist(), "max_tokens": 25, "temperature": 0,
            "return_token_ids": True}
    whole = httpx.post(f"{url}/v1/completions", json=body).json()
    events = []
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True,
                                                             "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line:
                assert line.startswith("data: ")
                events.append(line[len("data: "):])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    blocks = [c["choices"][0]["token_ids"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"] is None]
    final = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]][0]["choices"][0]
    assert [t for b in blocks for t in b] == whole["choices"][0]["token_ids"]
    assert all(blocks) and len(blocks) == final["speculation"]["verify_steps"] > 1  # one event per target pass
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == whole["choices"][0]["text"]
    assert final["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]


def test_stop_strings_are_cut_from_the_text_as_openai_does(server, alone):
    srv, url = server
    prompt = prompt_of(9, seed=5).view(-1).tolist()
    free = alone.generate(prompt, GenerationSettings(max_new_tokens=20))
    stop = alone.tokenizer.decode(free.token_ids[4:6])  # two tokens in the middle of the output
    body = {"prompt": prompt, "max_tokens": 20, "temperature": 0, "stop": stop}
    cut = httpx.post(f"{url}/v1/completions", json=body).json()["choices"][0]
    assert cut["finish_reason"] == "stop"
    assert cut["text"] == free.text[:free.text.index(stop)] and stop not in cut["text"]
    kept = httpx.post(f"{url}/v1/completions", json={**body, "include_stop_str_in_output": True}).json()
    assert kept["choices"][0]["text"] == free.text[:free.text.index(stop) + len(stop)]
    streamed = ""
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                streamed += "".join(c["text"] for c in json.loads(line[6:])["choices"])
    assert streamed == cut["text"]


def test_several_prompts_and_n_choices(server, alone):
    srv, url = server
    prompts = [prompt_of(6, seed=1).view(-1).tolist(), prompt_of(11, seed=2).view(-1).tolist()]
    out = httpx.post(f"{url}/v1/completions", json={"prompt": prompts, "max_tokens": 6, "temperature": 0, "n": 2,
                                                    "return_token_ids": True}).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    for c in out["choices"]:
        assert c["token_ids"] == alone.generate(prompts[c["index"] // 2], GenerationSettings(max_new_tokens=6)).token_ids
    assert out["usage"]["completion_tokens"] == 24
    assert out["speculation"]["draft_tokens"] == sum(c["speculation"]["draft_tokens"] for c in out["choices"])


def test_a_row_whose_steps_keep_raising_fails_with_500_and_the_server_goes_on(server, monkeypatch):
    srv, url = server
    body = {"prompt": prompt_of(10, seed=9).view(-1).tolist(), "max_tokens": 8, "temperature": 0,
            "return_token_ids": True}
    good = httpx.post(f"{url}/v1/completions", json=body).json()["choices"][0]["token_ids"]
    engine = srv.engine
    real_step = engine.step
    calls = {"n": 0}

    def broken(rows):  # from its second step on, every step of this row fails (run alone too)
        calls["n"] += 1
        if calls["n"] >= 2:
            raise RuntimeError("simulated CUDA error")
        return real_step(rows)

    monkeypatch.setattr(engine, "step", broken)
    r = httpx.post(f"{url}/v1/completions", json=body)
    assert r.status_code == 500 and "simulated CUDA error" in r.json()["error"]["message"]
    monkeypatch.undo()
    again = httpx.post(f"{url}/v1/completions", json=body)
    assert again.status_code == 200 and again.json()["choices"][0]["token_ids"] == good
    health = httpx.get(f"{url}/health").json()
    assert health["status"] == "ok" and health["failed_steps"] == 1


def test_a_client_that_disconnects_cancels_its_row(server):
    srv, url = server
    body = {"prompt": prompt_of(10, seed=11).view(-1).tolist(), "max_tokens": 200, "temperature": 0,
            "stream": True}

    async def read_one_then_leave():
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            async with client.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        return json.loads(line[6:])

    before = srv.loop.cancelled
    first = asyncio.run(read_one_then_leave())
    assert first["choices"][0]["finish_reason"] is None
    for _ in range(200):
        if srv.loop.rows == 0:
            break
        asyncio.run(asyncio.sleep(0.02))
    assert srv.loop.rows == 0 and srv.loop.scheduler.in_flight == 0
    assert srv.loop.cancelled == before + 1  # the row left without decoding its 200 tokens


def test_jobs_serve_refuses_a_bad_config_before_ray_starts(tmp_path, capsys):
    """``jobs/serve.py``'s command line: a bad model path or key exits 2 naming it, before
    Ray starts; flags land in the ``serve:`` section."""
    from pipeline.serve import main

    assert main(["--target", str(tmp_path / "missing"), "--port", "8123"]) == 2
    assert "models.target" in capsys.readouterr().err
    assert main(["--set", "serve.num_replicas=0"]) == 2
    assert "serve.num_replicas" in capsys.readouterr().err
    assert main(["--port", "8123", "--num-replicas", "2", "--print-config"]) == 0
    serve = json.loads(capsys.readouterr().out)["serve"]
    assert serve["port"] == 8123 and serve["num_replicas"] == 2 and serve["host"] == "127.0.0.1"


def test_replicas_scale_with_the_config_as_the_batch_actors_do():
    from serve_testkit import REPO
    from pipeline.config import load_config
    from pipeline.serve import absolute_paths, deployment_options

    path = REPO / "configs" / "demo-summarize.yaml"
    cfg = load_config(path, ["compute.gpus_per_actor=1", "compute.cpus_per_actor=4"])
    assert deployment_options(cfg) == {"num_replicas": 1, "max_ongoing_requests": 64,
                                       "ray_actor_options": {"num_cpus": 4, "num_gpus": 1},
                                       "graceful_shutdown_wait_loop_s": 0.5, "graceful_shutdown_timeout_s": 5.0}
    cfg = load_config(path, ["serve.num_replicas=3", "serve.gpus_per_replica=0.5", "serve.cpus_per_replica=2",
                             "serve.max_ongoing_requests=16"])
    assert deployment_options(cfg) == {"num_replicas": 3, "max_ongoing_requests": 16,
                                       "ray_actor_options": {"num_cpus": 2, "num_gpus": 0.5},
                                       "graceful_shutdown_wait_loop_s": 0.5, "graceful_shutdown_timeout_s": 5.0}
    # replicas may start in another directory: local paths made absolute, the name kept as written
    resolved = absolute_paths(load_config(path), base=REPO)
    assert Path(resolved.models.target).is_absolute() and Path(resolved.models.target).is_dir()
    assert resolved.serve.model_name == "demo-target"  # the folder's name, not the absolute path
    named = absolute_paths(load_config(path, ["serve.model_name=tiny"]), base=REPO)
    assert named.serve.model_name == "tiny"
    hub = absolute_paths(load_config(path, ["models.target=org/some-model"]), base=REPO)
    assert hub.serve.model_name == "org/some-model"
    assert "{%" in resolved.serve.chat_template  # the template itself travels, not its path


def test_openai_fields_without_an_effect_are_accepted_and_others_refused(server):
    """Clients that always send ``presence_penalty: 0``, ``logprobs: null``, ``echo: false``
    get the same answer; a value that would change the output is a 400 naming the field."""
    srv, url = server
    body = {"prompt": prompt_of(8, seed=4).view(-1).tolist(), "max_tokens": 6, "temperature": 0,
            "return_token_ids": True}
    plain = httpx.post(f"{url}/v1/completions", json=body).json()["choices"][0]["token_ids"]
    noop = {"presence_penalty": 0, "frequency_penalty": 0.0, "logprobs": None, "echo": False, "best_of": 1,
            "logit_bias": {}, "user": "someone"}
    out = httpx.post(f"{url}/v1/completions", json={**body, **noop})
    assert out.status_code == 200 and out.json()["choices"][0]["token_ids"] == plain
    for field, value in (("presence_penalty", 0.3), ("logprobs", 1), ("echo", True), ("best_of", 3),
                         ("logit_bias", {"5": 10})):
        r = httpx.post(f"{url}/v1/completions", json={**body, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field
        assert "not supported" in r.json()["error"]["message"]
