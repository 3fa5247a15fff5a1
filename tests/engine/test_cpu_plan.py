"""The CPU acceleration's seam (pipeline/engine/cpu/): options read once, from the config with the
environment as override, in one module; a model prepared once at load, the plan saying what was
chosen; nothing chosen, measured or compiled in decoding afterwards; every model an engine runs
prepared, each under its role."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from pipeline.engine import GenerationSettings, SpeculationSettings, SpeculativeEngine
from pipeline.engine.cpu import CpuOptions, layer, lean, linear, options, plan_of, prepare, with_environment
from pipeline.engine.runner import ModelRunner

from tiny_models import build, perturbed_copy, prompt_of

ENGINE = Path(__file__).resolve().parents[2] / "pipeline" / "engine"


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith(options.ENV_PREFIX) or name in options.ENV_ALIASES:
            monkeypatch.delenv(name)


def test_the_environment_is_read_in_one_module_of_the_engine():
    readers = sorted(str(p.relative_to(ENGINE)) for p in ENGINE.rglob("*.py")
                     if re.search(r"os\.environ|getenv\(", p.read_text(encoding="utf-8")))
    assert readers == ["cpu/options.py"]


def test_the_environment_overrides_each_option_and_the_older_names(monkeypatch):
    base = CpuOptions(transposed=False)
    assert with_environment(base) == base
    monkeypatch.setenv("SPECBATCH_CPU_LEAN_PASS", "off")
    monkeypatch.setenv("SPECBATCH_CPU_TRANSPOSED", "1")
    monkeypatch.setenv("SPECBATCH_CPU_COMPILE_CACHE", "/tmp/somewhere")
    assert with_environment(base) == CpuOptions(lean_pass=False, compile_cache="/tmp/somewhere")
    monkeypatch.setenv("SPECBATCH_INDUCTOR", "0")  # both inductor parts
    monkeypatch.setenv("SPECBATCH_FUSED", "1")  # the field's own variable wins over the older name
    got = with_environment(base)
    assert (got.rowdot, got.compiled_layer, got.lean_pass) == (False, False, False)
    monkeypatch.setenv("SPECBATCH_CPU_KERNELS", "maybe")
    with pytest.raises(ValueError, match="SPECBATCH_CPU_KERNELS='maybe'"):
        with_environment(base)


@pytest.mark.parametrize("field, bad", [("lean_pass", "yes"), ("kernels", 1), ("compile_cache", "  "), ("compile_cache", 3)])
def test_bad_options_are_refused_naming_the_field(field, bad):
    with pytest.raises(ValueError, match=field):
        CpuOptions(**{field: bad}).validate()


def test_the_config_section_carries_the_options_and_refuses_bad_keys(tmp_path):
    from pipeline.config import ConfigError, load_config

    cfg = load_config(None, ["cpu.lean_pass=false", "cpu.compile_cache=cache"])
    assert cfg.cpu.cpu_options() == CpuOptions(lean_pass=False, compile_cache=cfg.cpu.compile_cache)
    with pytest.raises(ConfigError, match="unknown key cpu.fast"):
        load_config(None, ["cpu.fast=true"])
    (tmp_path / "job.yaml").write_text("cpu:\n  compile_cache: here\n")
    assert load_config(tmp_path / "job.yaml").cpu.compile_cache == str(tmp_path / "here")  # relative to the file


def test_the_compile_cache_is_one_folder_per_node(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert options.compile_cache_dir(CpuOptions()) == str(tmp_path / "xdg" / "specbatch" / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "torch"))  # the user's own choice is kept
    assert options.compile_cache_dir(CpuOptions()) == str(tmp_path / "torch")
    assert options.use_compile_cache(CpuOptions(compile_cache=str(tmp_path / "mine"))) == str(tmp_path / "mine")
    import os

    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine") and (tmp_path / "mine").is_dir()


def test_a_model_is_prepared_once_and_again_only_with_other_options():
    model = build("llama").float()
    plan = prepare(model, CpuOptions(), "target")
    assert plan_of(model) is plan and prepare(model) is plan and prepare(model, CpuOptions()) is plan
    assert plan.lean is not None and plan.small_query_attention and plan.kernels
    assert any(type(m) is linear.PackedLinear for m in model.modules())
    off = prepare(model, CpuOptions(kernels=False))
    assert off is not plan and off.why_off == "cpu.kernels is off" and off.lean is None and not off.kernels
    assert not any(type(m) is linear.PackedLinear for m in model.modules())  # restored to nn.Linear
    d = off.describe()
    assert d["why_off"] == "cpu.kernels is off" and d["options"]["kernels"] is False and d["linear_kernels"] == []
    assert ModelRunner(model, 1).cpu is off


def test_nothing_is_measured_or_compiled_in_decoding(monkeypatch):
    """Everything is chosen when the engine is built; a weight changed in place afterwards is
    fused and packed again with the kernels chosen then."""
    model = build("llama").float()
    engine = SpeculativeEngine(model, SpeculationSettings(method="prompt_lookup"), max_batch_size=2)
    assert engine.cpu_plans["target"] is plan_of(model)
    for owner, name in ((linear, "measure_kernels"), (linear, "compile_graph"), (linear, "best_of"), (lean, "best_of"),
                        (layer, "compile_graph")):
        monkeypatch.setattr(owner, name, lambda *a, _n=name, **k: pytest.fail(f"{_n} in decoding"))
    prompts = [prompt_of(9, seed=1)[0].tolist(), prompt_of(6, seed=2)[0].tolist()]
    first = engine.generate_batch(prompts, GenerationSettings(max_new_tokens=6))
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(1.0)  # a new version: the lean pass fuses again
    again = engine.generate_batch(prompts, GenerationSettings(max_new_tokens=6))
    assert [r.token_ids for r in again] == [r.token_ids for r in first]


def test_the_engine_prepares_every_model_it_runs_under_its_role():
    target, drafter = (m.float() for m in (build("llama", seed=4), perturbed_copy(build("llama", seed=4), 0.3)))
    engine = SpeculativeEngine(target, SpeculationSettings(method="draft_model"), drafter=drafter,
                               cpu=CpuOptions(compiled_layer=False))
    assert set(engine.cpu_plans) == {"target", "drafter"}
    assert engine.cpu_plans["drafter"] is plan_of(drafter) and engine.cpu_plans["drafter"].role == "drafter"
    assert all(p.options == CpuOptions(compiled_layer=False) for p in engine.cpu_plans.values())
    plain = SpeculativeEngine(target, None)  # no options: the model keeps its plan (the job's audit engine)
    assert plain.cpu_plans["target"] is engine.cpu_plans["target"]
    line = engine.cpu_plans["target"].summary()
    assert line.startswith("target: lean pass, small-query attention; linear kernels by rows 1-8: ")


def test_a_model_not_on_the_cpu_or_with_the_kernels_off_is_left_alone(monkeypatch):
    model = build("llama")
    monkeypatch.setenv("SPECBATCH_CPU_KERNELS", "0")
    plan = prepare(model, CpuOptions())
    assert plan.why_off == "cpu.kernels is off" and plan.options.kernels is False and plan.lean is None
    assert plan.summary() == "model: off (cpu.kernels is off)"
