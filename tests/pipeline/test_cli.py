"""The job entry points as a user runs them: ``python jobs/summarize.py --config ...`` with an
embedded Ray, a progress bar of rows done; bad configs refused with exit status 2."""

import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import yaml

from pipeline_testkit import REPO, TEXTS, write_jsonl


def _run(args, cwd=REPO, timeout=300):
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    # as a user runs it: not the PYTHONPATH that the ray_local fixture put in this process's
    # environment (it would hide a missing init_ray in the job)
    env.pop("PYTHONPATH", None)
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_local_translate_job_with_embedded_ray(tiny_models, tmp_path):
    write_jsonl(tmp_path / "in.jsonl", [{"id": i, "text": t} for i, t in enumerate(TEXTS[:3])])
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump({
        "input": {"uri": str(tmp_path / "in.jsonl")},
        "task": {"name": "translate", "source_lang": "English", "target_lang": "French"},
        "models": tiny_models,
        "method": {"name": "prompt_lookup", "prompt_lookup_num_tokens": 4},
        "generation": {"max_new_tokens": 6},
        "compute": {"rows_per_batch": 2},
        "output": {"uri": str(tmp_path / "out")},
    }))
    # run from another directory: the entry point finds pipeline/ and actors/ itself
    r = _run([str(REPO / "jobs" / "translate.py"), "--config", str(cfg), "--set", "compute.num_actors=1"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "rows done" in r.stderr and "3/3" in r.stderr  # the progress bar
    headline = json.loads(r.stdout[r.stdout.index("{"):])
    assert headline["rows"] == 3 and headline["errors"] == 0
    t = pq.read_table(tmp_path / "out")
    assert t.num_rows == 3 and set(t.column("method").to_pylist()) == {"prompt_lookup"}
    assert t.column("prompt")[0].as_py().startswith("Translate the following text from English to French")


@pytest.mark.parametrize("args, message", [
    (["--set", "method.name=nope"], "unknown method 'nope'"),
    (["--set", "compute.bogus=1"], "unknown key compute.bogus"),
    (["--input", "/nonexistent/prompts/*.jsonl"], "input not found"),
    (["--target", "/nonexistent/model"], "models.target: model path '/nonexistent/model' does not exist"),
    (["--config", "/nonexistent.yaml"], "config file not found"),
])
def test_bad_job_is_refused_before_any_model_loads(tmp_path, args, message):
    write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "text": "x"}])
    base = ["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out")]
    r = _run([str(REPO / "jobs" / "summarize.py"), *base, *args], timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert message in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "out").exists()


def test_translate_entry_point_refuses_a_summarize_config():
    r = _run([str(REPO / "jobs" / "translate.py"), "--config", str(REPO / "configs" / "summarize.yaml"), "--print-config"])
    assert r.returncode == 2 and "task.name: translate" in r.stderr


def test_unreadable_shard_is_refused_before_any_model_loads(tmp_path):
    (tmp_path / "in").mkdir()
    write_jsonl(tmp_path / "in" / "a.jsonl", [{"id": 1, "text": "x"}])
    (tmp_path / "in" / "b.parquet").write_bytes(b"PAR1 but not really parquet")
    r = _run([str(REPO / "jobs" / "summarize.py"), "--input", str(tmp_path / "in"), "--output", str(tmp_path / "out")],
             timeout=120)
    assert r.returncode == 2 and "b.parquet" in r.stderr and "unreadable as parquet" in r.stderr
