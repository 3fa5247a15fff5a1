"""One recipe from a job config to a decoding engine (pipeline.loading): the batch job's
actor, the Serve replica and the tuner build the same engine and generation settings from
the same config, and a row draws from the same seed wherever it is decoded."""

from __future__ import annotations

import dataclasses
import time

import pytest

from actors.generate import GenerateActor
from pipeline_testkit import job_config
from pipeline.engine import GenerationSettings
from pipeline.loading import build_engine, load_engine, load_job_models, resolve_job_generation, row_key, row_settings
from pipeline.tune import measure, tuner


@pytest.mark.parametrize("method", ["draft_model", "prompt_lookup"])
def test_the_actor_the_replica_and_the_tuner_build_the_same_engine(tiny_models, tmp_path, method):
    from pipeline.serve import OpenAIServer

    cfg = job_config(tiny_models, "unused", str(tmp_path / "o"), method=method,
                     overrides=["compute.max_batch_size=4", "serve.max_batch_size=4", "generation.do_sample=true",
                                "generation.temperature=0.7", "generation.seed=7"])
    actor = GenerateActor(cfg.model_dump(), device="cpu")
    server = OpenAIServer.from_config(cfg, device="cpu")
    try:
        models = load_job_models(cfg, "cpu", any_drafter=True)  # as the tuner loads them: the drafter whatever the method
        choice = next(c for c in tuner.allowed_methods(cfg, models, tuner.TuneOptions())[0] if c.method == method)
        k = cfg.method.speculation_settings().k_max
        tuned = tuner._engine(choice, k, 4, models, time.perf_counter)
        engines = {"actor": actor.engine, "replica": server.engine, "tuner": tuned}
        for name, engine in engines.items():
            assert engine.spec.method == method and engine.spec.k_max == k, name
            assert type(engine.proposer) is type(actor.engine.proposer), name
            assert engine.max_batch_size == 4 and engine.tokenizer is not None, name
            assert not engine.controller.fixed, name  # the draft-length controller, on by default everywhere
        # a method that does not draft with a model never gets the drafter, even when it is loaded
        assert models.drafter is not None
        assert (actor.models.drafter is None) == (method == "prompt_lookup")
        settings = resolve_job_generation(cfg, models.target.config)
        assert actor.settings == server.defaults == settings
        assert settings.do_sample and settings.seed == 7 and settings.temperature == 0.7
    finally:
        server.close()


def test_load_engine_follows_the_config(tiny_models, tmp_path):
    cfg = job_config(tiny_models, "unused", str(tmp_path / "o"),
                     overrides=["compute.max_batch_size=3", "compute.draft_length=fixed",
                                "method.num_assistant_tokens=2"])
    loaded = load_engine(cfg, "cpu")
    assert loaded.engine.max_batch_size == 3 and loaded.engine.spec.num_assistant_tokens == 2
    assert loaded.models.device == "cpu" and loaded.load_time_s > 0
    assert load_engine(cfg, "cpu", max_batch_size=5).engine.max_batch_size == 5
    plain = build_engine(loaded.models, None, 2)
    assert plain.spec.method == "plain" and plain.proposer is None and plain.max_batch_size == 2


def test_a_row_is_seeded_from_the_job_seed_and_its_key():
    rows = [{"id": "a"}, {"id": 3}, {"id": None, "source_file": "s.jsonl", "source_row": 4},
            {"source_file": "s.jsonl", "source_row": 5}]
    keys = [row_key(r) for r in rows]
    assert keys[:2] == ["a", 3] and keys[2] == "s.jsonl\x004" and keys[3] == "s.jsonl\x005"
    sampled = GenerationSettings(do_sample=True, temperature=0.9, seed=11)
    seeds = [row_settings(sampled, k).seed for k in keys]
    assert len(set(seeds)) == 4 and all(0 <= s < 2**63 for s in seeds)
    assert seeds == [row_settings(sampled, k).seed for k in keys]  # the same on every run
    assert seeds != [row_settings(dataclasses.replace(sampled, seed=12), k).seed for k in keys]
    assert row_settings(sampled, "a") == dataclasses.replace(sampled, seed=seeds[0])
    # greedy, or sampling without a seed: the job's settings as they are
    for s in (GenerationSettings(), GenerationSettings(do_sample=True)):
        assert all(row_settings(s, k) is s for k in keys)
    # the tuner's pilot seeds its rows as the actor does
    assert [s.seed for s in measure.row_settings(sampled, keys)] == seeds


def test_the_driver_resolves_the_generation_settings_once(tiny_models, tmp_path, monkeypatch):
    """An actor given the driver's resolved generation settings decodes on them as they are:
    nothing resolves them again in the actor's process."""
    import dataclasses

    import pipeline.loading

    cfg = job_config(tiny_models, "unused", str(tmp_path / "o"), method="prompt_lookup")
    resolved = pipeline.loading.resolve_job_generation(cfg, load_job_models(cfg, "cpu").target.config)
    given = dataclasses.replace(resolved, max_new_tokens=3)  # what the driver resolved, marked

    def refuse(*args, **kwargs):
        raise AssertionError("the generation settings were resolved again")

    monkeypatch.setattr(pipeline.loading, "resolve_job_generation", refuse)
    loaded = load_engine(cfg, "cpu", 2, generation=given)
    assert loaded.settings is given
