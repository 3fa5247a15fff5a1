"""Relative paths: in a config file they resolve against the file's folder, on the command line
against the current directory (pipeline.paths); the bundled configs follow it; the jobs run
from any directory."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from pipeline.config import load_config
from pipeline.fingerprint import config_fingerprint, config_identity
from pipeline.paths import PATH_KEYS, looks_local, resolve_config_paths, resolve_path
from pipeline_testkit import REPO, TEXTS, write_jsonl

CONFIGS = sorted(p for p in (REPO / "configs").rglob("*.yaml") if p.name != "runtime_env.yaml")


def test_resolve_path_kinds(tmp_path):
    base = tmp_path / "cfg"
    (base / "models").mkdir(parents=True)
    assert resolve_path("data/x.jsonl", "uri", base) == str(base / "data" / "x.jsonl")
    assert resolve_path("../in/*.parquet", "uri", base) == str(tmp_path / "in" / "*.parquet")  # globs kept
    assert resolve_path("out/run/", "uri", base) == str(base / "out" / "run") + "/"  # a trailing / kept
    assert resolve_path("./", "uri", base) == str(base) + "/"
    for url in ("s3://bucket/x/", "file:///abs/x.jsonl", "memory://x", "gs://b/p/*.parquet"):
        assert resolve_path(url, "uri", base) == url
    assert resolve_path("/abs/x", "uri", base) == "/abs/x"
    assert resolve_path("~/x", "uri", base) == os.path.expanduser("~/x")
    # models: an org/name hub id stays one, unless org is a folder beside the config
    assert resolve_path("HuggingFaceTB/SmolLM2-135M", "model", base) == "HuggingFaceTB/SmolLM2-135M"
    assert resolve_path("gpt2", "model", base) == str(base / "gpt2")  # no "/": a local folder name
    assert resolve_path("models/tiny", "model", base) == str(base / "models" / "tiny")
    assert resolve_path("../m/a/b", "model", base) == str(tmp_path / "m" / "a" / "b")
    # serve.chat_template: a file, unless it is an inline Jinja template
    assert resolve_path("t.jinja", "file", base) == str(base / "t.jinja")
    inline = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert resolve_path(inline, "file", base) == inline
    assert resolve_path(None, "uri", base) is None and resolve_path("", "uri", base) == ""


def test_looks_local(tmp_path):
    (tmp_path / "models").mkdir()
    assert looks_local("models/x", tmp_path) and not looks_local("org/x", tmp_path)
    assert looks_local("./x", tmp_path) and looks_local("a/b/c", tmp_path) and looks_local("x", tmp_path)


def test_config_paths_resolve_against_the_file_and_overrides_against_the_cwd(tmp_path, monkeypatch):
    cfg_dir = tmp_path / "jobs" / "nightly"
    cfg_dir.mkdir(parents=True)
    (cfg_dir / "chat.jinja").write_text("{{ messages[0]['content'] }}")
    (cfg_dir / "job.yaml").write_text(yaml.safe_dump({
        "input": {"uri": "../data/*.jsonl"},
        "output": {"uri": "runs/out/"},
        "models": {"target": "../../models/t", "drafter": "org/drafter"},
        "serve": {"chat_template": "chat.jinja"},
    }))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config("../jobs/nightly/job.yaml")  # --config: against the working directory
    assert cfg.input.uri == str(tmp_path / "jobs" / "data" / "*.jsonl")
    assert cfg.output.uri == str(cfg_dir / "runs" / "out") + "/"
    assert cfg.models.target == str(tmp_path / "models" / "t")
    assert cfg.models.drafter == "org/drafter"  # a hub id
    assert cfg.serve.chat_template == str(cfg_dir / "chat.jinja")
    assert cfg.serve.chat_template_text() == "{{ messages[0]['content'] }}"
    # command-line values (--input, --output, --set) stay as given: relative to the working directory
    cfg = load_config(cfg_dir / "job.yaml", ["input.uri=mine.jsonl", "output.uri=o/", "models.target=m/t/x"])
    assert (cfg.input.uri, cfg.output.uri, cfg.models.target) == ("mine.jsonl", "o/", "m/t/x")
    # no config file: the defaults are relative to the working directory, as before
    assert load_config(None).input.uri == "data/demo_prompts.jsonl"


def test_resolve_config_paths_touches_only_path_keys(tmp_path):
    data = {"input": {"uri": "a.jsonl", "text_column": "text/x"}, "task": {"prompt_template": "x/{text}"},
            "models": {"gguf_file": "f.gguf"}, "ray": {"address": "auto"}}
    out = resolve_config_paths(json.loads(json.dumps(data)), tmp_path)
    assert out["input"]["uri"] == str(tmp_path / "a.jsonl")
    data["input"]["uri"] = out["input"]["uri"]
    assert out == data  # gguf_file is a name inside models.target, never a path of its own
    assert {k for k, _ in PATH_KEYS} <= {"input", "output", "models", "serve", "method", "cpu"}
    # cpu.compile_cache (inductor's cache folder) is a local folder
    assert resolve_config_paths({"cpu": {"compile_cache": "c"}}, tmp_path)["cpu"]["compile_cache"] == str(tmp_path / "c")
    # method.draft_vocab (draft_model's reduced vocabulary) is a file path
    assert resolve_config_paths({"method": {"draft_vocab": "v.json"}}, tmp_path)["method"]["draft_vocab"] == str(tmp_path / "v.json")


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(REPO / "configs")))
def test_bundled_configs_point_inside_the_repo(path):
    """Every local path of a bundled config, resolved against its folder, lies in the clone (and
    what is committed exists): the configs work from any working directory."""
    cfg = load_config(path)
    for value in (cfg.input.uri, cfg.output.uri):
        assert Path(value).is_absolute() and REPO in Path(value).parents, value
    for value in (cfg.models.target, cfg.models.drafter):
        if value and Path(value).is_absolute():
            assert REPO in Path(value).parents, value
            if "cache" not in Path(value).parts:  # models/cache is fetched by scripts/fetch_models.py
                assert Path(value).is_dir(), value
        elif value:
            assert value.count("/") == 1 and not looks_local(value, path.parent), value  # hub ids
    if "out" not in Path(cfg.input.uri).relative_to(REPO).parts:  # out/inputs is written by prepare_inputs.py
        assert Path(cfg.input.uri).is_file(), cfg.input.uri


def test_fingerprint_ignores_where_a_local_model_lies(tiny_models, tmp_path):
    """The same checkpoint at another path (or named by another relative path) is the same model
    for resume; other files are not."""
    copy = tmp_path / "moved" / "target"
    shutil.copytree(tiny_models["target"], copy)
    a = load_config(None, [f"models.target={tiny_models['target']}", "method.name=plain"])
    b = load_config(None, [f"models.target={copy}", "method.name=plain"])
    assert config_fingerprint(config_identity(a)) == config_fingerprint(config_identity(b))
    (copy / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3}))
    assert config_fingerprint(config_identity(a)) != config_fingerprint(config_identity(b))
    hub = load_config(None, ["models.target=org/not-cached", "method.name=plain"])
    assert config_identity(hub)["models"]["target"] == "org/not-cached"  # a hub id is named by its id


def _job(args, cwd, timeout=300):
    return subprocess.run([sys.executable, str(REPO / "jobs" / "summarize.py"), "--no-progress", *args],
                          cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_job_runs_from_another_directory_with_a_relative_config(tiny_models, tmp_path):
    """A config in its own folder names its input, output and models relative to that folder; the
    job, started from another directory, reads and writes there and leaves the working directory
    alone."""
    cfg_dir = tmp_path / "project" / "configs"
    write_jsonl(tmp_path / "project" / "data" / "in.jsonl", [{"id": i, "text": t} for i, t in enumerate(TEXTS[:3])])
    (cfg_dir).mkdir(parents=True)
    (cfg_dir / "job.yaml").write_text(yaml.safe_dump({
        "input": {"uri": "../data/in.jsonl"},
        "models": {"target": os.path.relpath(tiny_models["target"], cfg_dir),
                   "drafter": os.path.relpath(tiny_models["drafter"], cfg_dir)},
        "method": {"name": "draft_model", "num_assistant_tokens": 3},
        "generation": {"max_new_tokens": 4},
        "compute": {"num_actors": 1, "rows_per_batch": 3},
        "output": {"uri": "../out/"},
    }))
    cwd = tmp_path / "somewhere" / "else"
    cwd.mkdir(parents=True)
    r = _job(["--config", "../../project/configs/job.yaml"], cwd)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    table = pq.read_table(tmp_path / "project" / "out")
    assert table.num_rows == 3 and table.column("error").null_count == 3
    assert list(cwd.iterdir()) == []


def test_default_job_resolves_from_another_directory(tmp_path):
    """``python /path/to/jobs/summarize.py`` from another directory: the default config
    (configs/summarize.yaml) names its input, models and output relative to configs/; ``--output``
    on the command line is relative to the cwd.  (tests/real/test_drafter_and_default_job.py runs
    the default job from another directory; tests/cluster runs it under ``ray job submit``.)"""
    r = _job(["--output", "rel-out/", "--print-config"], tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    cfg = json.loads(r.stdout)
    assert cfg["input"]["uri"] == str(REPO / "data" / "demo_prompts.jsonl")
    assert cfg["models"]["target"] == str(REPO / "models" / "cache" / "SmolLM2-135M-Instruct")
    assert cfg["models"]["drafter"] == str(REPO / "models" / "smollm2-135m-drafter")
    assert cfg["output"]["uri"] == "rel-out/"  # the job's writer takes it relative to the cwd
    assert list(tmp_path.iterdir()) == []
