"""Work units smaller than a file (issue 26): a unit is a file plus a split of at most
``input.split_rows`` rows (Parquet row groups merged up to it, JSONL line ranges, gzip and
zstandard streams included); each commits on its own and resumes on its own; an output of
the layout before units (one part per file) is resumed, or refused with what to do; the
driver never receives an output row (the workers write); ``[min, max]`` actor pools.
Storage-facing tests on local disk and on moto S3."""

from __future__ import annotations

import gzip
import io
import json
import os
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline_testkit import REPO, TEXTS, OutStore, committed, job_config, write_jsonl
from pipeline.config import InputConfig, OutputConfig, load_config
from pipeline.fingerprint import config_identity
from pipeline.output import OutputError, OutputWriter
from pipeline.input import read_shard, read_unit, resolve_shards, units_of
from pipeline.schema import OUTPUT_SCHEMA

WORDS = "the cat sat on the mat and looked at the dog".split()


def _jsonl_bytes(n: int) -> bytes:
    """``n`` rows without ids (ids derived from the row), a blank line after row 4, a bad
    line at row 7, and a byte-order mark first."""
    lines = []
    for i in range(n):
        lines.append("{not json" if i == 7 else json.dumps({"text": f"row {i} " + " ".join(WORDS[: 1 + i % 5])}))
        if i == 4:
            lines.append("   ")
    return b"\xef\xbb\xbf" + "\n".join(lines).encode() + b"\n"


def _compress(data: bytes, kind: str) -> bytes:
    if kind == "gz":
        return gzip.compress(data)
    if kind == "zst":
        import zstandard

        return zstandard.ZstdCompressor().compress(data)
    return data


@pytest.fixture(params=["local", "s3"])
def where(request, tmp_path):
    """``(uri of a folder, storage options, put(name, bytes))`` on local disk or moto S3."""
    if request.param == "local":
        def put(name, data):
            (tmp_path / name).write_bytes(data)

        return str(tmp_path), {}, put
    moto = request.getfixturevalue("moto_s3")
    bucket = "units-" + request.node.name.split("[")[1].split("]")[0].replace("-", "").lower()[:30]
    moto["client"].create_bucket(Bucket=bucket)

    def put_s3(name, data):
        moto["client"].put_object(Bucket=bucket, Key=f"in/{name}", Body=data)

    return f"s3://{bucket}/in", moto["options"], put_s3


@pytest.mark.parametrize("kind", ["gz", "zst", "plain"])
def test_jsonl_units_are_line_ranges_and_read_the_same_rows_as_the_whole_file(where, kind):
    """Units of 3 rows in a 10-row file (plain, gzip, zstandard): 4 units; each reads its
    rows (a compressed stream decompressed from the start and skipped); together they are
    the whole file's rows, with the same derived ids, row numbers and line numbers."""
    uri, options, put = where
    name = "big.jsonl" + ("" if kind == "plain" else f".{kind}")
    put(name, _compress(_jsonl_bytes(10), kind))
    cfg = InputConfig(uri=f"{uri}/{name}", storage_options=options, split_rows=3)
    (shard,) = resolve_shards(cfg)
    units = shard.units()
    assert [(u.split.start, u.num_rows) for u in units] == [(0, 3), (3, 3), (6, 3), (9, 1)]
    assert [u.part for u in units] == [f"part-00000-u{k:05d}.parquet" for k in range(4)]
    tables = [read_unit(u, cfg) for u in units]
    assert [t.num_rows for t in tables] == [3, 3, 3, 1]
    rows = pa.concat_tables(tables).to_pylist()
    assert [r["source_row"] for r in rows] == list(range(10))
    assert [r["id"] for r in rows] == [f"{name}:{i}" for i in range(10)]  # derived from the row: stable
    assert rows[0]["text"].startswith("row 0")  # the byte-order mark dropped
    assert rows[9]["text"].startswith("row 9")
    assert rows[7]["input_error"].startswith("line 9:")  # physical line 9: the blank line counted
    whole = pa.Table.from_pylist(rows, schema=tables[0].schema)
    assert read_shard(shard, InputConfig(uri=cfg.uri, storage_options=options)).equals(whole)


def test_parquet_units_are_row_groups_merged_up_to_split_rows(where):
    """Row groups of 4, 4 and 2 rows: split_rows 8 merges the first two; 6 the last two;
    3 is less than a row group (a row group is never cut)."""
    uri, options, put = where
    table = pa.table({"id": [f"r{i}" for i in range(10)], "text": [f"t {i}" for i in range(10)]})
    buf = io.BytesIO()
    pq.write_table(table, buf, row_group_size=4)
    put("p.parquet", buf.getvalue())
    for split_rows, expect in ((8, [(0, 8), (8, 2)]), (6, [(0, 4), (4, 6)]), (3, [(0, 4), (4, 4), (8, 2)])):
        cfg = InputConfig(uri=f"{uri}/p.parquet", storage_options=options, split_rows=split_rows)
        (shard,) = resolve_shards(cfg)
        units = shard.units()
        assert [(u.split.start, u.num_rows) for u in units] == expect
        got = pa.concat_tables([read_unit(u, cfg) for u in units])
        assert got.column("id").to_pylist() == [f"r{i}" for i in range(10)]
        assert got.column("source_row").to_pylist() == list(range(10))


def _rows_of(unit):
    s = unit.split
    return pa.Table.from_pylist([{"id": f"{unit.shard.name}:{i}", "source_row": i} for i in range(s.start, s.start + s.rows)],
                                schema=OUTPUT_SCHEMA)


def _legacy_entry(shard, identity):
    """A manifest entry as the layout before units wrote it: one part per input file."""
    from pipeline.fingerprint import config_fingerprint
    from pipeline.summary import RunTotals

    t = RunTotals()
    t.rows = shard.num_rows
    return {"part": f"part-{shard.index:05d}.parquet", "files": [f"part-{shard.index:05d}.parquet"],
            "source_file": shard.url, "fingerprint": shard.fingerprint,
            "config_fingerprint": config_fingerprint(identity), "config_identity": identity,
            "rows": shard.num_rows, "errors": 0, "run_id": "0123456789ab", "totals": t.state()}


def test_an_output_of_the_layout_before_units_is_resumed_and_units_of_another_size_refused(
        tiny_models, tmp_path, request):
    """Shard 0 was committed whole by the layout before units (``part-00000.parquet``):
    a run over units skips all of shard 0's units and does shard 1's; the output then holds
    every row once.  A rerun with another ``input.split_rows`` is refused naming the size
    to set back."""
    for storage in ("local", "s3"):
        out = OutStore(storage, tmp_path / storage, request.getfixturevalue("moto_s3") if storage == "s3" else None)
        inp = tmp_path / storage / "in"
        write_jsonl(inp / "a.jsonl", [{"text": t} for t in TEXTS[:5]])
        write_jsonl(inp / "b.jsonl", [{"text": t} for t in TEXTS[:7]])
        sets = [] if out.options is None else [f"output.storage_options={out.options}"]
        cfg = job_config(tiny_models, str(inp), out.uri, overrides=["input.split_rows=3", *sets])
        identity = config_identity(cfg)
        shards = resolve_shards(cfg.input)
        old = pa.Table.from_pylist([{"id": f"a.jsonl:{i}", "source_row": i} for i in range(5)], schema=OUTPUT_SCHEMA)
        buf = io.BytesIO()
        pq.write_table(old, buf)
        out.put("part-00000.parquet", buf.getvalue())
        out.put("_manifest/part-00000.json", json.dumps(_legacy_entry(shards[0], identity)).encode())

        w = OutputWriter(cfg.output, retry=cfg.retry, split_rows=3)
        plan = w.on_write_start(units_of(shards), identity)
        assert plan.whole_shard == ["part-00000.parquet"] and plan.done == ["part-00000.parquet"]
        assert [u.part for u in plan.todo] == [f"part-00001-u{k:05d}.parquet" for k in range(3)]  # 7 rows: 3 + 3 + 1
        for u in plan.todo[:2]:  # a run that commits two of shard 1's units, then stops
            w.write_part(u, _rows_of(u))
        w.on_write_failed()

        with pytest.raises(OutputError, match=r"units of 3 \(input.split_rows\).*set input.split_rows: 3 to resume"):
            OutputWriter(cfg.output, retry=cfg.retry).on_write_start(
                units_of(resolve_shards(cfg.input.model_copy(update={"split_rows": 2}))), identity)

        w = OutputWriter(cfg.output, retry=cfg.retry, split_rows=3)
        plan = w.on_write_start(units_of(shards), identity)
        assert [u.part for u in plan.todo] == ["part-00001-u00002.parquet"]
        assert plan.done == ["part-00000.parquet", "part-00001-u00000.parquet", "part-00001-u00001.parquet"]
        w.write_part(plan.todo[0], _rows_of(plan.todo[0]))
        w.on_write_complete({"rows": 12})
        assert out.ids() == sorted([f"a.jsonl:{i}" for i in range(5)] + [f"b.jsonl:{i}" for i in range(7)])


def test_a_shard_committed_both_whole_and_by_units_is_refused(tiny_models, tmp_path):
    inp = tmp_path / "in"
    write_jsonl(inp / "a.jsonl", [{"text": t} for t in TEXTS[:4]])
    cfg = job_config(tiny_models, str(inp), str(tmp_path / "out"), overrides=["input.split_rows=2"])
    identity = config_identity(cfg)
    shards = resolve_shards(cfg.input)
    w = OutputWriter(cfg.output, split_rows=2)
    w.on_write_start(units_of(shards), identity)
    w.write_part(shards[0].units()[0], _rows_of(shards[0].units()[0]))
    (tmp_path / "out" / "_manifest" / "part-00000.json").write_text(json.dumps(_legacy_entry(shards[0], identity)))
    pq.write_table(_rows_of(shards[0].units()[0]), tmp_path / "out" / "part-00000.parquet")
    with pytest.raises(OutputError, match="committed both whole .*and by units"):
        OutputWriter(cfg.output).on_write_start(units_of(shards), identity)


def test_a_unit_whose_rows_do_not_come_back_once_each_is_not_committed(tmp_path):
    """The driver commits a unit only when its fragments hold each of its rows once, in order."""
    from pipeline.output.writer import RunError
    from pipeline.input import Shard, Split, Unit

    w = OutputWriter(OutputConfig(uri=str(tmp_path / "out")))
    unit = Unit(Shard(index=0, url="/x.jsonl", format="jsonl", num_rows=4), 0, Split(0, 4))
    w.on_write_start([unit])
    rec = lambda first, last, rows, ok=True: {"part": unit.part, "path": "/nowhere", "first_row": first,  # noqa: E731
                                              "last_row": last, "rows": rows, "errors": 0, "totals": "{}",
                                              "pid": 1, "host": "h", "consecutive": ok}
    from pipeline.output.sink import FRAGMENT_SCHEMA

    with pytest.raises(RunError, match="do not cover rows 0..3 once each"):
        w.add_fragments(pa.Table.from_pylist([rec(0, 1, 2), rec(1, 2, 2)], schema=FRAGMENT_SCHEMA))
    w = OutputWriter(OutputConfig(uri=str(tmp_path / "out2")))
    w.on_write_start([unit])
    with pytest.raises(RunError, match="more output rows"):
        w.add_fragments(pa.Table.from_pylist([rec(0, 2, 3), rec(3, 4, 2)], schema=FRAGMENT_SCHEMA))
    assert committed(tmp_path / "out2") == {}


# ---------------------------------------------------------------------------- with Ray
def test_the_driver_receives_no_output_row_and_a_min_max_pool_runs_the_job(ray_local, tiny_models, tmp_path,
                                                                        monkeypatch):
    """One 12-row file in units of 4, a ``[1, 2]`` actor pool: the driver never writes
    Parquet (the writer raises in this process) nor counts a row (RunTotals.add raises
    here); every fragment was written by another process; each unit's rows are in order."""
    import pipeline.output.writer as writer_mod
    import pipeline.summary

    write_jsonl(tmp_path / "in" / "big.jsonl", [{"text": TEXTS[i % 8]} for i in range(12)])
    cfg = job_config(tiny_models, str(tmp_path / "in" / "big.jsonl"), str(tmp_path / "out"), method="plain",
                     overrides=["input.split_rows=4", "compute.num_actors=[1, 2]", "generation.max_new_tokens=4"])
    driver = os.getpid()

    def no_rows_here(*a, **k):
        raise AssertionError("the driver wrote Parquet rows")

    monkeypatch.setattr(pq, "write_table", no_rows_here)
    monkeypatch.setattr(pipeline.summary.RunTotals, "add", lambda self, t: no_rows_here())
    writers = []
    original = writer_mod.OutputWriter.commit_unit

    def spy(self, unit, fragments):
        writers.extend(f.pid for f in fragments)
        return original(self, unit, fragments)

    monkeypatch.setattr(writer_mod.OutputWriter, "commit_unit", spy)
    from pipeline.run import run_job

    summary = run_job(cfg, progress=False)
    monkeypatch.undo()
    assert summary["rows"] == 12 and summary["units"] == 3
    assert writers and driver not in writers
    assert sorted(summary["this_run"]["units_run"]) == [f"part-00000-u{k:05d}.parquet" for k in range(3)]
    for k in range(3):
        t = pq.read_table(tmp_path / "out" / f"part-00000-u{k:05d}.{summary['run_id']}.parquet")
        assert t.column("source_row").to_pylist() == list(range(4 * k, 4 * k + 4))
        assert t.column("id").to_pylist() == [f"big.jsonl:{i}" for i in range(4 * k, 4 * k + 4)]


def test_min_max_pools_plan_and_strategy():
    from pipeline.ray_setup import pool_plan

    cfg = lambda *s: load_config(None, list(s))  # noqa: E731
    c = cfg("compute.num_actors=[1, 3]")
    assert (c.compute.min_actors, c.compute.max_actors) == (1, 3)
    strategy = pool_plan(c, embedded=True, cluster_cpus=3).strategy()
    assert (strategy.min_size, strategy.max_size) == (1, 3)
    fixed = pool_plan(cfg("compute.num_actors=2"), embedded=True, cluster_cpus=8).strategy()
    assert fixed.min_size == fixed.max_size == 2
    assert cfg("compute.num_actors=[2, 2]").compute.num_actors == 2
    # a [min, max] pool reserves the real CPUs of an actor: it grows only as they are free (3 at most here) ...
    assert pool_plan(c, embedded=True, cluster_cpus=3).cpus == 1
    assert pool_plan(cfg("compute.num_actors=[1, 6]", "compute.cpus_per_actor=2"), embedded=False, cluster_cpus=2).cpus == 2
    # ... unless its min already holds every CPU of an embedded Ray: then it is a fixed pool of min, one CPU free
    held = pool_plan(cfg("compute.num_actors=[2, 6]"), embedded=True, cluster_cpus=2)
    assert (held.min_size, held.max_size, held.cpus) == (2, 2, 0.5)
    # a fixed pool holding every CPU leaves one free, in Ray's unit (0.0001)
    assert pool_plan(cfg("compute.num_actors=3"), embedded=True, cluster_cpus=3).cpus == pytest.approx(0.6666)
    assert pool_plan(cfg("compute.num_actors=30000"), embedded=True, cluster_cpus=3).cpus == 0.0
    from pipeline.config import ConfigError

    for bad in ("[0, 2]", "[3, 2]", "[1, 2, 3]"):
        with pytest.raises(ConfigError, match="compute.num_actors"):
            cfg(f"compute.num_actors={bad}")


def test_a_min_max_pool_is_checked_at_its_min(ray_local, caplog):
    from pipeline.ray_setup import PlanError, check_resource_plan

    cfg = lambda *s: load_config(None, list(s))  # noqa: E731
    with pytest.raises(PlanError, match=r"compute.num_actors=3 \(the min of \[3, 4\]\)"):
        check_resource_plan(cfg("compute.num_actors=[3, 4]"), embedded=True)
    with caplog.at_level("INFO", logger="specbatch"):
        check_resource_plan(cfg("compute.num_actors=[1, 8]"), embedded=True)  # starts with 1; grows to what fits
    assert any("grows to 8 as resources allow" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
# each signal once and each store once (the signal's path and the store's commit are independent;
# the full cross product cost two more job starts, about 110 s of the suite)
@pytest.mark.parametrize("signame, storage", [("SIGTERM", "local"), ("SIGKILL", "s3")])
def test_an_interrupt_inside_one_large_file_keeps_its_committed_units_and_the_rerun_does_the_rest(
        ray_local, tiny_models, tmp_path, request, capsys, signame, storage):
    """One 40-row file in units of 5: the job is stopped (SIGTERM to the driver; SIGKILL to
    its whole process group, as a lost node) once a unit is committed.  The committed
    units stay as they were; the rerun does only the others; every row is there once."""
    from pipeline.cli import main

    out = OutStore(storage, tmp_path, request.getfixturevalue("moto_s3") if storage == "s3" else None)
    write_jsonl(tmp_path / "in" / "big.jsonl", [{"id": f"r{i}", "text": " ".join(WORDS[(i + k) % 11] for k in range(12))}
                                                for i in range(40)])
    args = ["--input", str(tmp_path / "in" / "big.jsonl"), "--output", out.uri, "--target", tiny_models["target"],
            "--method", "plain", "--max-new-tokens", "24", "--rows-per-batch", "1", "--no-progress",
            "--set", "input.split_rows=5", "--set", "output.partition_by_date=false",
            "--set", "output.lease_timeout_s=4"]
    if out.options:
        args += ["--set", f"output.storage_options={out.options}"]
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    env.pop("PYTHONPATH", None)
    errfile = tmp_path / "stderr.txt"
    with open(errfile, "w") as errf:
        job = subprocess.Popen([sys.executable, str(REPO / "jobs" / "summarize.py"), *args], stdout=subprocess.DEVNULL,
                               stderr=errf, env=env, start_new_session=True)
    try:
        deadline = time.time() + 300
        while not out.committed():
            assert job.poll() is None and time.time() < deadline, errfile.read_text()[-3000:]
            time.sleep(0.1)
        if signame == "SIGTERM":
            os.kill(job.pid, signal.SIGTERM)
        else:
            os.killpg(job.pid, signal.SIGKILL)
        job.wait(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    entries = out.committed()
    committed = sorted(entries)
    assert 1 <= len(committed) < 8, committed  # an interrupt loses at most the units in flight
    kept = {n: out.get(n) for entry in entries.values() for n in entry.files}
    if signame == "SIGKILL":
        time.sleep(5)  # the killed run's lease goes stale
    capsys.readouterr()
    assert main("summarize", args) == 0
    capsys.readouterr()
    summary = json.loads(out.get("_summary.json"))
    assert summary["this_run"]["units_skipped"] == committed
    assert sorted(summary["this_run"]["units_run"]) == sorted(
        set(f"part-00000-u{k:05d}.parquet" for k in range(8)) - set(committed))
    assert all(out.get(n) == data for n, data in kept.items())  # committed files untouched
    assert out.ids() == sorted(f"r{i}" for i in range(40))  # every row exactly once
    assert not any(f.startswith("_staging") for f in out.files())
