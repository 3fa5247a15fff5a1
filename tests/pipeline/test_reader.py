"""One reader of committed output (pipeline/output/reader.py), on outputs the output
package's writer builds (no Ray): a killed run's published part that no entry names is
never read, nor staging; an unfinished output says so; units of two configs are refused by
name; rows stream file by file; ``jobs/report.py`` and ``jobs/train_drafter.py --from``
read the same rows of a killed and then resumed output; ``--previous auto`` finds the
latest earlier finished ``date=`` partition."""

from __future__ import annotations

import importlib.util
import json
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import pipeline.output.writer as writer_mod
from pipeline.config import OutputConfig, load_config
from pipeline.input.units import UNIT_COLUMN, Shard, Split, Unit
from pipeline.output import OutputWriter
from pipeline.output.reader import RUN_COLUMN, CommittedOutput, OutputReadError, previous_partition
from pipeline.report import ReportError, load_run, write_report
from pipeline.schema import OUTPUT_SCHEMA
from pipeline_testkit import REPO

SHARD = Shard(index=0, url="/in/rows.jsonl", format="jsonl", num_rows=6, fingerprint="size=60;mtime=1")
UNITS = [Unit(SHARD, k, Split(2 * k, 2)) for k in range(3)]
#: a config identity whose task is the default config's (train_drafter checks --config against it)
IDENTITY = {"task": {k: v for k, v in load_config(None).resolved()["task"].items() if v is not None}, "method": "plain"}


def _rows(unit: Unit) -> pa.Table:
    start = unit.split.start
    return pa.Table.from_pylist([{"id": f"r{i}", "prompt": f"p{i}", "output_text": f"o{i}", "finish_reason": "length",
                                  "new_tokens": 3, "verify_steps": 3, "method": "plain", "error": None,
                                  "source_file": SHARD.url, "source_row": i} for i in range(start, start + 2)],
                                schema=OUTPUT_SCHEMA)


def _killed(out, monkeypatch, identity=IDENTITY, so=None) -> None:
    """A run that committed unit 0, then was killed inside unit 1's commit: its file
    published (and its publish intent written), its manifest entry never."""
    w = OutputWriter(OutputConfig(uri=str(out), storage_options=so or {}))
    w.prepare(UNITS, identity)
    w.write_part(UNITS[0], _rows(UNITS[0]))
    original = writer_mod.OutputWriter._write_json

    def dies_at_the_entry(self, path, obj, what, staged_as=None):
        if "manifest entry" in what:
            raise KeyboardInterrupt("killed between the files and the entry")
        return original(self, path, obj, what, staged_as)

    monkeypatch.setattr(writer_mod.OutputWriter, "_write_json", dies_at_the_entry)
    with pytest.raises(KeyboardInterrupt):
        w.write_part(UNITS[1], _rows(UNITS[1]))
    monkeypatch.setattr(writer_mod.OutputWriter, "_write_json", original)


def _resume(out, identity=IDENTITY, summary=None, so=None) -> None:
    w = OutputWriter(OutputConfig(uri=str(out), storage_options=so or {}))
    plan = w.prepare(UNITS, identity)
    for unit in plan.todo:
        w.write_part(unit, _rows(unit))
    w.commit(summary or {"rows": 6})


def test_a_killed_output_reads_only_its_committed_unit_and_says_it_is_unfinished(tmp_path, monkeypatch):
    out = tmp_path / "out"
    _killed(out, monkeypatch)
    assert (out / "part-00000-u00001.parquet").exists()  # published, but no entry names it
    (out / "_staging" / "dead").mkdir(parents=True)
    pq.write_table(_rows(UNITS[2]), out / "_staging" / "dead" / "x.parquet")
    read = CommittedOutput.open(str(out))
    assert not read.finished and read.summary is None
    assert read.parts == ["part-00000-u00000.parquet"] and read.rows_committed == 2
    assert read.uncommitted == ["part-00000-u00001.parquet"]
    assert "unfinished (no _SUCCESS" in read.describe() and "not read: part-00000-u00001.parquet" in read.describe()
    table = read.table()
    assert table.column("id").to_pylist() == ["r0", "r1"]
    assert set(table.column(UNIT_COLUMN).to_pylist()) == {"part-00000-u00000.parquet"}
    assert len(set(table.column(RUN_COLUMN).to_pylist())) == 1
    assert pq.read_table(out).num_rows == 4  # what a reader of every part file (the report before) got


def test_a_complete_output_reads_every_unit_in_order_file_by_file(tmp_path, monkeypatch):
    out = tmp_path / "out"
    _killed(out, monkeypatch)
    _resume(out)
    read = CommittedOutput.open(str(out))
    assert read.finished and read.summary == {"rows": 6} and read.uncommitted == []
    assert read.parts == [u.part for u in UNITS] and len(read.runs) == 2  # the killed run's unit, the resume's
    assert [r["id"] for r in read.rows(["id"], provenance=False)] == [f"r{i}" for i in range(6)]
    opened = []
    real_open = read.location.fs.open
    read.location.fs.open = lambda path, *a, **k: opened.append(path) or real_open(path, *a, **k)
    batches = read.batches(["id", "not_a_column"], batch_size=1)
    first = next(batches)
    assert first.num_rows == 1 and len(opened) == 1  # one file open, one batch in memory
    assert first.schema.names == ["id", "not_a_column", UNIT_COLUMN, RUN_COLUMN] and first.column(1).null_count == 1
    assert sum(b.num_rows for b in batches) == 5 and len(opened) == 3


def test_units_of_two_configs_are_refused_by_name(tmp_path, monkeypatch):
    """Unit 0 committed under one config, the rest by a run of another: no reader mixes them
    (the report, train_drafter and the nightly reuse refuse it, naming both)."""
    out = tmp_path / "out"
    _killed(out, monkeypatch)
    entry = out / "_manifest" / "part-00000-u00000.json"
    first = json.loads(entry.read_text())["config_fingerprint"]
    _resume(out)
    forged = json.loads(entry.read_text())
    entry.write_text(json.dumps(dict(forged, config_fingerprint="0" * 16)))
    with pytest.raises(OutputReadError, match=rf"mixes units committed under 2 configs \(0{{16}}: 1 unit\(s\), e\.g\. "
                                              rf"part-00000-u00000\.parquet; {first}: 2 unit\(s\), e\.g\. "
                                              r"part-00000-u00001\.parquet\)"):
        CommittedOutput.open(str(out))
    both = CommittedOutput.open(str(out), mixed_ok=True)
    assert sorted(both.fingerprints, key=str) == sorted([first, "0" * 16])
    with pytest.raises(ReportError, match="mixes units committed under 2 configs"):
        load_run(str(out))
    assert _train_drafter().main(["--from", str(out), "--output", str(tmp_path / "h")]) == 2


def test_what_is_not_a_committed_output_is_named(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "loose").mkdir()
    pq.write_table(_rows(UNITS[0]), tmp_path / "loose" / "part-00000.parquet")
    (tmp_path / "file.parquet").write_bytes(b"x")
    cases = {"missing": "does not exist", "empty": "is an empty folder", "file.parquet": "is a file",
             "loose": r"holds 1 file\(s\) but no committed unit"}
    for name, what in cases.items():
        with pytest.raises(OutputReadError, match=rf"the output '.*{name}' {what}"):
            CommittedOutput.open(str(tmp_path / name))


def test_a_committed_file_that_went_missing_is_named(tmp_path):
    _resume(tmp_path / "out")
    (tmp_path / "out" / "part-00000-u00001.parquet").unlink()
    read = CommittedOutput.open(str(tmp_path / "out"))
    with pytest.raises(OutputReadError, match=r"the manifest's part-00000-u00001\.parquet names "
                                              r"part-00000-u00001\.parquet, which is missing"):
        read.table()


def _train_drafter():
    name = "job_train_drafter"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "jobs" / "train_drafter.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_the_report_and_train_drafter_agree_on_a_killed_then_resumed_output(tmp_path, monkeypatch):
    from train.drafter_from_outputs import read_job_output

    out, config = tmp_path / "out", tmp_path / "job.yaml"
    config.write_text("task: {name: summarize}\n")

    def both() -> tuple[list, list]:
        report = load_run(str(out)).table.select(["id", "output_text"]).to_pylist()
        job = read_job_output(str(out), {}, str(config), None)
        return report, [{"id": r["id"], "output_text": r["output_text"]} for r in job.rows], job

    _killed(out, monkeypatch)
    report, trained, job = both()
    assert report == trained == [{"id": f"r{i}", "output_text": f"o{i}"} for i in range(2)]
    assert job.uncommitted_files == ["part-00000-u00001.parquet"] and not job.finished
    md = (write_report([str(out)], tmp_path / "rep") and (tmp_path / "rep" / "report.md").read_text())
    assert "**Unfinished:** plain: no `_SUCCESS`" in md and "2 row(s)" in md and "not read: part-00000-u00001" in md
    _resume(out, summary={"rows": 6, "config": {"task": {"name": "summarize"}, "models": {}}})
    report, trained, job = both()
    assert report == trained == [{"id": f"r{i}", "output_text": f"o{i}"} for i in range(6)]
    assert job.finished and job.uncommitted_files == [] and load_run(str(out)).finished


# ------------------------------------------------------------------ date partitions, --previous auto
def _night(root, day: str, finished: bool = True) -> None:
    w = OutputWriter(OutputConfig(uri=str(root), partition_by_date=True, run_date=day))
    w.prepare(UNITS[:1], IDENTITY)
    w.write_part(UNITS[0], _rows(UNITS[0]))
    if finished:
        w.commit({"rows": 2, "day": day})


def test_previous_partition_is_the_latest_earlier_finished_night(tmp_path):
    root = tmp_path / "nightly"
    assert previous_partition(str(root), "2026-01-04") is None  # no output yet: a first night
    _night(root, "2026-01-01")
    read = CommittedOutput.open(str(root))  # one partition: read through it
    assert read.url == str(root / "date=2026-01-01") and read.summary["day"] == "2026-01-01"
    _night(root, "2026-01-02", finished=False)
    _night(root, "2026-01-03")
    (root / "date=junk").mkdir()
    (root / "date=junk" / "_SUCCESS").write_text("")
    assert previous_partition(str(root), "2026-01-04") == str(root / "date=2026-01-03")
    assert previous_partition(str(root), "2026-01-03") == str(root / "date=2026-01-01")  # the 2nd never finished
    assert previous_partition(str(root), "2026-01-01") is None
    prev = CommittedOutput.open(previous_partition(str(root), "2026-01-04"))
    assert prev.finished and [r["id"] for r in prev.rows(["id"])] == ["r0", "r1"]
    with pytest.raises(OutputReadError, match=r"holds 3 date partitions \(date=2026-01-01, date=2026-01-02, "
                                              r"date=2026-01-03\), not one job output: pass one of them, e\.g\. "
                                              r".*date=2026-01-03"):
        CommittedOutput.open(str(root))
    with pytest.raises(ValueError):
        previous_partition(str(root), "yesterday")


def test_on_s3_the_reader_reads_the_committed_units_and_finds_the_previous_night(moto_s3, monkeypatch):
    """The same rules on an object store (moto): a killed run's published part is not read,
    the resumed output is read whole, ``previous_partition`` lists the finished nights."""
    moto_s3["client"].create_bucket(Bucket="reader")
    so, out = moto_s3["options"], "s3://reader/out"
    _killed(out, monkeypatch, so=so)
    read = CommittedOutput.open(out, so)
    assert not read.finished and read.uncommitted == ["part-00000-u00001.parquet"]
    assert read.table(["id"]).column("id").to_pylist() == ["r0", "r1"]
    assert load_run(out, so).table.num_rows == 2
    _resume(out, so=so)
    assert [r["id"] for r in CommittedOutput.open(out, so).rows(["id"])] == [f"r{i}" for i in range(6)]
    for day in ("2026-01-01", "2026-01-02"):
        w = OutputWriter(OutputConfig(uri="s3://reader/nightly", partition_by_date=True, run_date=day,
                                      storage_options=so))
        w.prepare(UNITS[:1], IDENTITY)
        w.write_part(UNITS[0], _rows(UNITS[0]))
        w.commit({"rows": 2})
    assert previous_partition("s3://reader/nightly", "2026-01-03", so) == "s3://reader/nightly/date=2026-01-02"
    assert previous_partition("s3://reader/nightly", "2026-01-02", so) == "s3://reader/nightly/date=2026-01-01"
