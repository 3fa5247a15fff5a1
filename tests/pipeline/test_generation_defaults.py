"""The ``generation:`` section: every GenerationSettings field is a key, unset by default,
so the target checkpoint's ``generation_config.json`` applies as in ``generate()``;
explicit keys override it; the driver resolves and logs the defaults before any actor."""

from __future__ import annotations

import json
import logging
import shutil
import warnings

import pyarrow as pa
import pytest
import torch

import pipeline.engine.settings as settings_module
from actors.generate import GenerateActor
from pipeline.config import ConfigError, GenerationConfig, load_config
from pipeline.engine import GenerationSettings
from pipeline.models import check_models
from pipeline.prompts import PromptBuilder
from pipeline.schema import INPUT_SCHEMA
from pipeline.run import resolve_job_generation
from pipeline_testkit import TEXTS, job_config

CHECKPOINT_DEFAULTS = {"repetition_penalty": 1.5, "no_repeat_ngram_size": 2, "max_new_tokens": 10}


@pytest.fixture(scope="module")
def opinionated_target(tiny_models, tmp_path_factory):
    """The tiny target, whose generation_config.json sets decoding defaults."""
    path = tmp_path_factory.mktemp("ckpt") / "target"
    shutil.copytree(tiny_models["target"], path)
    gc_file = path / "generation_config.json"
    gc = json.loads(gc_file.read_text()) if gc_file.exists() else {}
    gc.update(CHECKPOINT_DEFAULTS)
    gc_file.write_text(json.dumps(gc))
    return {"target": str(path), "drafter": tiny_models["drafter"]}


def _rows(texts):
    return pa.Table.from_pylist([{"source_file": "f", "source_row": i, "id": f"r{i}", "text": t, "input_error": None}
                                 for i, t in enumerate(texts)], schema=INPUT_SCHEMA)


def test_every_engine_setting_is_a_key_and_unset_by_default():
    from dataclasses import fields

    assert set(GenerationConfig.model_fields) == {f.name for f in fields(GenerationSettings)}
    assert all(v is None for v in GenerationConfig().model_dump().values())
    cfg = load_config(None, ["generation.min_p=0.05", "generation.bad_words_ids=[[4], [5, 6]]",
                             "generation.suppress_tokens=[7]", "generation.min_new_tokens=3",
                             "generation.no_repeat_ngram_size=3"])
    s = cfg.generation.generation_settings()
    assert (s.min_p, s.bad_words_ids, s.suppress_tokens, s.min_new_tokens, s.no_repeat_ngram_size) == (
        0.05, [[4], [5, 6]], [7], 3, 3)
    assert s.repetition_penalty is None and s.do_sample is None  # unset: the checkpoint decides
    for bad, key in [("generation.bad_words_ids=[4, 5]", "bad_words_ids"), ("generation.min_p=1.5", "min_p"),
                     ("generation.no_repeat_ngram_size=-2", "no_repeat_ngram_size"),
                     ("generation.suppress_token=[1]", "suppress_token")]:
        with pytest.raises(ConfigError, match=key):
            load_config(None, [bad])


def test_checkpoint_defaults_apply_in_the_actor_and_explicit_keys_win(opinionated_target, tmp_path):
    def outputs(overrides):
        cfg = job_config(opinionated_target, "unused", str(tmp_path / "o"), method="draft_model")
        data = cfg.model_dump()
        data["generation"] = dict(GenerationConfig().model_dump(), **overrides)  # no max_new_tokens=12 either
        actor = GenerateActor(data, device="cpu")
        return actor, actor(_rows(TEXTS[:3])).to_pylist()

    actor, rows = outputs({})
    m = actor.models
    builder = PromptBuilder(m.tokenizer, actor.cfg.task)
    for text, row in zip(TEXTS[:3], rows):
        _, ids = builder.build(text)
        prompt = torch.tensor([ids])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = m.target.generate(prompt, do_sample=False)[0, prompt.shape[1]:].tolist()  # honours the checkpoint
        assert row["error"] is None and row["new_tokens"] <= 10
        assert row["output_text"] == m.tokenizer.decode(ref, skip_special_tokens=True)
    # the processors change these outputs, and an explicit key switches them off
    _, plain_rows = outputs({"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "max_new_tokens": 10})
    assert [r["output_text"] for r in plain_rows] != [r["output_text"] for r in rows]
    ref_rows = []
    for text in TEXTS[:3]:
        _, ids = builder.build(text)
        prompt = torch.tensor([ids])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = m.target.generate(prompt, do_sample=False, repetition_penalty=1.0, no_repeat_ngram_size=0)
        ref_rows.append(m.tokenizer.decode(out[0, prompt.shape[1]:], skip_special_tokens=True))
    assert [r["output_text"] for r in plain_rows] == ref_rows


def test_driver_resolves_and_logs_the_defaults(opinionated_target, tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(settings_module, "_logged", set())
    cfg = job_config(opinionated_target, "unused", str(tmp_path / "o"), overrides=["generation.max_new_tokens=null"])
    checked = check_models(cfg.models, cfg.uses_drafter)
    with caplog.at_level(logging.INFO, logger=settings_module.__name__):
        s = resolve_job_generation(cfg, checked["target_config"])
    assert (s.repetition_penalty, s.no_repeat_ngram_size, s.max_new_tokens, s.do_sample) == (1.5, 2, 10, False)
    assert any("repetition_penalty=1.5" in r.getMessage() for r in caplog.records)
    # a checkpoint value the engine refuses fails the job before any actor, naming it
    bad = tmp_path / "bad"
    shutil.copytree(opinionated_target["target"], bad)
    gc = json.loads((bad / "generation_config.json").read_text())
    (bad / "generation_config.json").write_text(json.dumps(dict(gc, do_sample=True, top_p=1.5)))
    cfg = job_config({"target": str(bad), "drafter": opinionated_target["drafter"]}, "unused", str(tmp_path / "o2"))
    with pytest.raises(ConfigError, match=r"generation: top_p"):
        resolve_job_generation(cfg, check_models(cfg.models, cfg.uses_drafter)["target_config"])
    # the job config's out-of-vocabulary token ids are refused there too
    cfg = job_config(opinionated_target, "unused", str(tmp_path / "o3"), overrides=["generation.suppress_tokens=[100000]"])
    with pytest.raises(ConfigError, match="suppress_tokens"):
        resolve_job_generation(cfg, check_models(cfg.models, cfg.uses_drafter)["target_config"])


def test_quieting_ray_data_keeps_other_loggers_records():
    """The console filter of Ray Data's handlers may sit on a handler the root logger
    shares: it must drop only Ray Data's info records, never the job's own."""
    from pipeline.ray_setup import _QuietRayData

    def record(name, level, msg="m"):
        return logging.LogRecord(name, level, __file__, 1, msg, None, None)

    f = _QuietRayData()
    assert f.filter(record(settings_module.__name__, logging.INFO))
    assert f.filter(record("pipeline.run", logging.DEBUG))
    assert not f.filter(record("ray.data", logging.INFO))
    assert not f.filter(record("ray.data._internal.execution", logging.INFO))
    assert f.filter(record("ray.data._internal.execution", logging.WARNING))
