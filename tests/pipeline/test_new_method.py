"""A method added as one file plus one line of the method table (``fake_method.py``: a
proposer that repeats the last token) runs everywhere a method runs: a batch job on Ray (the
config, the driver's checks, the actors, the output and its statistics), a served request
(with a per-request draft length) and the tuner's candidates.  Nothing else names it."""

from __future__ import annotations

import asyncio
import json
import sys

import pyarrow.parquet as pq
import pytest
from ray import cloudpickle

import fake_method
from actors.generate import GenerateActor
from pipeline_testkit import TEXTS, job_config, write_jsonl


class _ActorWithTheNewMethod(GenerateActor):
    """The job's actor, in a process that has the new method's registry line."""

    def __init__(self, *args, **kwargs):
        fake_method.register()
        super().__init__(*args, **kwargs)


@pytest.fixture
def registered(monkeypatch):
    from pipeline.engine import METHODS

    monkeypatch.setitem(METHODS, fake_method.SPEC.name, fake_method.SPEC)
    return fake_method.SPEC.name


def test_a_new_method_runs_through_a_job(ray_local, tiny_models, tmp_path, registered, monkeypatch):
    import actors.generate

    write_jsonl(tmp_path / "in.jsonl", [{"id": i, "text": t} for i, t in enumerate(TEXTS[:4])])
    monkeypatch.setattr(actors.generate, "GenerateActor", _ActorWithTheNewMethod)
    for module in (sys.modules[__name__], fake_method):  # the actors' processes do not see tests/
        cloudpickle.register_pickle_by_value(module)
    runs = {}
    try:
        _run_both(tmp_path, tiny_models, registered, runs)
    finally:
        for module in (sys.modules[__name__], fake_method):
            cloudpickle.unregister_pickle_by_value(module)
    for rid, row in runs[registered].items():
        assert row["method"] == registered and row["draft_model"] is None
        assert row["output_text"] == runs["plain"][rid]["output_text"]  # lossless
        assert row["draft_tokens"] > 0 and len(row["drafted_per_position"]) <= 3


def _run_both(tmp_path, tiny_models, registered, runs):
    from pipeline.run import run_job

    for method in (registered, "plain"):
        cfg = job_config(tiny_models, str(tmp_path / "in.jsonl"), str(tmp_path / method), method=method,
                         overrides=["method.num_assistant_tokens=3", "compute.draft_length=fixed"])
        assert not cfg.uses_drafter  # the table says it drafts without a model
        summary = run_job(cfg, progress=False)
        assert summary["rows"] == 4 and summary["errors"] == 0
        runs[method] = {r["id"]: r for r in pq.read_table(tmp_path / method).to_pylist()}
        assert (summary["draft_tokens"] > 0) == (method == registered)


def test_a_new_method_serves_requests_and_is_a_tuner_candidate(tiny_models, tmp_path, registered):
    from pipeline.engine import SpeculationSettings
    from pipeline.loading import build_engine, load_job_models
    from pipeline.serve import OpenAIServer
    from pipeline.tune import tuner

    # a fixed draft length: under `auto` the controller may rightly find on a loaded machine that the
    # tiny pair's drafts do not pay, and draft nothing (what this test checks is that the method drafts)
    cfg = job_config(tiny_models, "unused", str(tmp_path / "o"), method=registered,
                     overrides=["method.num_assistant_tokens=3", "generation.max_new_tokens=10",
                                "compute.draft_length=fixed"])
    server = OpenAIServer.from_config(cfg, device="cpu")
    try:
        prompt = server.tokenizer("the cat sat on the mat")["input_ids"]
        body = {"prompt": prompt, "max_tokens": 10, "return_token_ids": True, "num_assistant_tokens": 2}
        out = asyncio.run(server.completions(json.dumps(body).encode()))
        spec = out["choices"][0]["speculation"]
        assert spec["method"] == registered and spec["draft_length"] == 2 and spec["draft_tokens"] > 0
        models = load_job_models(cfg, "cpu")
        plain = build_engine(models, SpeculationSettings(), 1)
        assert out["choices"][0]["token_ids"] == plain.generate(prompt, server.defaults).token_ids
        with pytest.raises(Exception, match="prompt_lookup_num_tokens is not a parameter"):
            asyncio.run(server.completions(json.dumps({**body, "num_assistant_tokens": None,
                                                       "prompt_lookup_num_tokens": 2}).encode()))
    finally:
        server.close()

    choices, _ = tuner.allowed_methods(cfg, models, tuner.TuneOptions())
    mine = next(c for c in choices if c.method == registered)
    assert mine.k_max == 3 and mine.k_param == "num_assistant_tokens" and mine.method_section(2) == {
        "name": registered, "num_assistant_tokens": 2}
    engine = tuner._engine(mine, 2, 2, models, tuner.CLOCKS["wall"])
    assert engine.generate(prompt, server.defaults).token_ids == out["choices"][0]["token_ids"]
    # a job of another method: the new method is left out (the default: tried only when configured)
    other = job_config(tiny_models, "unused", str(tmp_path / "o"), method="prompt_lookup")
    assert registered not in {c.method for c in tuner.allowed_methods(other, models, tuner.TuneOptions())[0]}


def test_a_method_with_a_drafter_of_its_own_format_checks_and_loads_it(tiny_models, tmp_path, monkeypatch):
    """A drafter that is no causal-LM checkpoint (a draft head) is checked by the driver and
    loaded by the method's own functions, from models.drafter, through the job's recipe."""
    from pipeline.engine import METHODS
    from pipeline.loading import load_engine
    from pipeline.models import ModelError, check_models

    monkeypatch.setitem(METHODS, fake_method.HEAD_SPEC.name, fake_method.HEAD_SPEC)
    head = tmp_path / "head"
    head.mkdir()
    (head / "head.json").write_text(json.dumps({"token": 7}))
    cfg = job_config(dict(tiny_models, drafter=str(head)), "unused", str(tmp_path / "o"), method="fixed_token",
                     overrides=["method.num_assistant_tokens=2"])
    assert cfg.uses_drafter
    checked = check_models(cfg.models, cfg.uses_drafter, method=cfg.method.name)
    assert checked["drafter_config"] == {"token": 7} and checked["drafter_tokenizer"] is None
    loaded = load_engine(cfg, "cpu")
    assert loaded.models.drafter == {"token": 7} and loaded.engine.proposer.token == 7
    result = loaded.engine.generate([1, 2, 3], loaded.settings)
    assert result.stats.draft_tokens > 0
    (head / "head.json").write_text(json.dumps({"token": 10 ** 9}))
    with pytest.raises(ModelError, match="models.drafter: the head's token"):
        check_models(cfg.models, cfg.uses_drafter, method=cfg.method.name)
