"""Resumable, idempotent runs: per-shard commit (part + manifest entry), resume after a
failure runs only the missing shards, a rerun after success writes nothing, --overwrite
starts afresh, a changed input is refused, outputs partitioned by run date."""

import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

import pipeline.output.writer
from pipeline_testkit import REPO, TEXTS, committed, job_config, write_jsonl
from pipeline.run import run_job
from pipeline.output import OutputError, is_complete

DATE = "2026-01-02"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Three JSONL shards of 2 rows each."""
    d = tmp_path_factory.mktemp("in")
    for i in range(3):
        write_jsonl(d / f"s{i}.jsonl", [{"id": f"s{i}-{j}", "text": TEXTS[2 * i + j]} for j in range(2)])
    return d


def _cfg(tiny_models, inputs, out, *extra):
    return job_config(tiny_models, str(inputs), str(out), overrides=[
        "output.partition_by_date=true", f"output.run_date={DATE}", "compute.rows_per_batch=2",
        "generation.max_new_tokens=6", *extra])


def _snapshot(root):
    """Every file under ``root`` -> (mtime_ns, bytes)."""
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.read_bytes()) for p in root.rglob("*") if p.is_file()}


def _ids(day):
    return sorted(pq.read_table(day).column("id").to_pylist())


EXPECTED_IDS = sorted(f"s{i}-{j}" for i in range(3) for j in range(2))


@pytest.mark.slow
def test_resume_after_a_failure_runs_only_the_missing_shards(ray_local, tiny_models, inputs, tmp_path, monkeypatch):
    out = tmp_path / "out"
    day = out / f"date={DATE}"

    # Run 1 dies at its third unit commit (after two units are committed: units commit in
    # the order they complete, whichever that is).
    original = pipeline.output.writer.OutputWriter.commit_unit
    calls = []

    def dying(self, unit, fragments):
        calls.append(unit.part)
        if len(calls) == 3:
            raise RuntimeError("driver died")
        return original(self, unit, fragments)

    monkeypatch.setattr(pipeline.output.writer.OutputWriter, "commit_unit", dying)
    with pytest.raises(RuntimeError, match="driver died"):
        run_job(_cfg(tiny_models, inputs, out), progress=False)
    monkeypatch.setattr(pipeline.output.writer.OutputWriter, "commit_unit", original)
    done, missing = sorted(calls[:2]), calls[2]
    assert not is_complete(str(day)) and not (day / "_staging").exists()
    entries = committed(day)
    assert sorted(entries) == done
    first_run = entries[done[0]].run_id
    kept = {n: (day / n).read_bytes() for p in done for n in entries[p].files}

    # Run 2 (same job, same output) resumes: only the missing unit runs; committed parts untouched.
    summary = run_job(_cfg(tiny_models, inputs, out), progress=False)
    assert summary["this_run"]["units_run"] == [missing]
    assert summary["this_run"]["units_skipped"] == done
    assert summary["this_run"]["rows"] == 2
    assert summary["rows"] == 6 and summary["shards"] == 3  # totals over every committed shard
    assert summary["runs"] == sorted({first_run, summary["run_id"]})
    assert {p["part"]: p["run_id"] for p in summary["parts"]} == {**{p: first_run for p in done}, missing: summary["run_id"]}
    for n, data in kept.items():
        assert (day / n).read_bytes() == data
    assert is_complete(str(day))
    assert _ids(day) == EXPECTED_IDS  # every input row exactly once
    t = pq.read_table(day)
    assert summary["new_tokens"] == sum(t.column("new_tokens").to_pylist())
    on_disk = json.loads((day / "_summary.json").read_text())
    assert on_disk["rows"] == 6 and on_disk["run_date"] == DATE

    # Run 3: everything committed, _SUCCESS there -> writes nothing at all.
    before = _snapshot(out)
    again = run_job(_cfg(tiny_models, inputs, out), progress=False)
    assert again["this_run"]["nothing_to_do"] and again["this_run"]["units_run"] == []
    assert again["rows"] == 6
    assert _snapshot(out) == before

    # Run 4: --overwrite starts afresh (every shard rewritten by the new run).
    fresh = run_job(_cfg(tiny_models, inputs, out, "output.overwrite=true"), progress=False)
    assert fresh["this_run"]["units_skipped"] == [] and len(fresh["this_run"]["units_run"]) == 3
    assert fresh["runs"] == [fresh["run_id"]]
    assert _ids(day) == EXPECTED_IDS

    # The whole output read as a dataset: one hive partition per run date.
    assert pq.read_table(out).column("date").unique().to_pylist() == [DATE]


def test_changed_input_is_refused_without_overwrite(tiny_models, inputs, tmp_path):
    """A manifest entry that disagrees with today's input (the file changed) -> OutputError,
    before any model loads; nothing in the output changes."""
    import shutil

    from pipeline.fingerprint import config_identity
    from pipeline.input import resolve_shards
    from pipeline.output import OutputWriter
    import pyarrow as pa
    from pipeline.schema import OUTPUT_SCHEMA

    src = tmp_path / "in"
    shutil.copytree(inputs, src)
    cfg = _cfg(tiny_models, src, tmp_path / "out")
    shards = resolve_shards(cfg.input)
    w = OutputWriter(cfg.output)
    assert w.on_write_start(shards, config_identity(cfg)).done == []
    w.write_part(shards[0], pa.Table.from_pylist([{"id": f"x{i}", "source_row": i} for i in range(shards[0].num_rows)],
                                                schema=OUTPUT_SCHEMA))
    # same input: shard 0 is committed and would be skipped
    assert OutputWriter(cfg.output).on_write_start(resolve_shards(cfg.input)).done == ["part-00000-u00000.parquet"]
    write_jsonl(src / "s0.jsonl", [{"id": "new", "text": TEXTS[0]}] * 3)
    with pytest.raises(OutputError, match="input changed"):
        run_job(_cfg(tiny_models, src, tmp_path / "out"), progress=False)
    (src / "s2.jsonl").unlink()
    (src / "s0.jsonl").unlink()
    with pytest.raises(OutputError, match="s0.jsonl"):
        OutputWriter(cfg.output).on_write_start(resolve_shards(cfg.input))


def test_run_date_flag_partitions_the_output(tmp_path):
    """``--run-date`` turns partitioning on; the configs shipped partition by today's UTC date."""
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    r = subprocess.run([sys.executable, str(REPO / "jobs" / "summarize.py"), "--config", str(REPO / "configs" / "summarize.yaml"),
                        "--run-date", "2026-03-04", "--output", str(tmp_path / "o"), "--print-config"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)["output"]
    assert out["run_date"] == "2026-03-04" and out["partition_by_date"] and out["overwrite"] is False
    r = subprocess.run([sys.executable, str(REPO / "jobs" / "summarize.py"), "--run-date", "2026-13-01", "--print-config"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and "output.run_date must be YYYY-MM-DD" in r.stderr

    from pipeline.config import load_config

    cfg = load_config(REPO / "configs" / "translate.yaml", ["output.run_date=2026-05-06"])
    assert cfg.output.location() == str(REPO / "out" / "translate") + "/date=2026-05-06"  # resolved against configs/
    assert load_config(None, ["output.uri=s3://b/x/", "output.partition_by_date=true",
                              "output.run_date=2026-05-06"]).output.location() == "s3://b/x/date=2026-05-06"
