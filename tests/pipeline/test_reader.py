"""One reader of committed output (pipeline/output/reader.py), on outputs the output
package's writer builds (no Ray): a killed run's published part that no record of the commit
log names (an orphan) is never read, nor staging; an unfinished output says so, and the
reader's ``finished`` is ``is_complete``'s; units of two configs are refused by name; rows
stream file by file; ``jobs/report.py`` and ``jobs/train_drafter.py --from`` read the same
rows of a killed and then resumed output; ``--previous auto`` finds the latest earlier
complete ``date=`` partition.

A run is killed at the seam ``test_fencing.py`` pauses runs at: the commit log's ``append``
(the unit's data files are published, its record never written)."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from pipeline.config import OutputConfig, load_config
from pipeline.fingerprint import config_fingerprint
from pipeline.units import UNIT_COLUMN, Split, Unit
from pipeline.output import OutputWriter, is_complete
from pipeline.output.reader import RUN_COLUMN, CommittedOutput, OutputReadError, previous_partition
from pipeline.report import ReportError, load_run, write_report
from pipeline_testkit import SHARD, job_module, killed_inside_commit, unit_rows
UNITS = [Unit(SHARD, k, Split(2 * k, 2)) for k in range(3)]
#: a config identity whose task is the default config's (train_drafter checks --config against it)
IDENTITY = {"task": {k: v for k, v in load_config(None).resolved()["task"].items() if v is not None}, "method": "plain"}



def _killed(out, identity=IDENTITY, so=None) -> str:
    """A run that committed unit 0, then was killed inside unit 1's commit: its data file
    published, its ``unit`` record never appended.  Returns the run's id."""
    w = OutputWriter(OutputConfig(uri=str(out), storage_options=so or {}))
    w.on_write_start(UNITS, identity)
    w.write_part(UNITS[0], unit_rows(UNITS[0]))
    killed_inside_commit(w, UNITS[1], unit_rows(UNITS[1]))
    return w.run_id


def _resume(out, identity=IDENTITY, summary=None, so=None) -> str:
    w = OutputWriter(OutputConfig(uri=str(out), storage_options=so or {}))
    plan = w.on_write_start(UNITS, identity)
    for unit in plan.todo:
        w.write_part(unit, unit_rows(unit))
    w.on_write_complete(summary or {"rows": 6})
    return w.run_id


def test_a_killed_output_reads_only_its_committed_unit_and_says_it_is_unfinished(tmp_path):
    out = tmp_path / "out"
    run = _killed(out)
    orphan = f"part-00000-u00001.{run}.parquet"
    assert (out / orphan).exists()  # published, but no record names it
    (out / "_staging" / "dead").mkdir(parents=True)
    pq.write_table(unit_rows(UNITS[2]), out / "_staging" / "dead" / "x.parquet")
    read = CommittedOutput.open(str(out))
    assert not read.finished and not is_complete(str(out)) and read.summary is None
    assert read.parts == ["part-00000-u00000.parquet"] and read.rows_committed == 2
    assert read.record_of("part-00000-u00000.parquet") == "_manifest/log/0000000001.json"  # after the run's epoch
    assert read.uncommitted == [orphan] and read.runs == {run: ["part-00000-u00000.parquet"]}
    assert "unfinished (no _SUCCESS" in read.describe() and f"not read: {orphan}" in read.describe()
    table = read.table()
    assert table.column("id").to_pylist() == ["r0", "r1"]
    assert set(table.column(UNIT_COLUMN).to_pylist()) == {"part-00000-u00000.parquet"}
    assert set(table.column(RUN_COLUMN).to_pylist()) == {run}
    assert pq.read_table(out).num_rows == 4  # what a reader of every part file (the report before) got


def test_a_complete_output_reads_every_unit_in_order_file_by_file(tmp_path):
    out = tmp_path / "out"
    killed = _killed(out)
    resumed = _resume(out)
    read = CommittedOutput.open(str(out))
    assert read.finished and is_complete(str(out)) and read.summary == {"rows": 6}
    assert read.uncommitted == [] and not (out / f"part-00000-u00001.{killed}.parquet").exists()  # the orphan removed
    assert read.parts == [u.part for u in UNITS]
    assert read.runs == {killed: ["part-00000-u00000.parquet"], resumed: [u.part for u in UNITS[1:]]}
    assert [r["id"] for r in read.rows(["id"], provenance=False)] == [f"r{i}" for i in range(6)]
    opened = []
    real_open = read.location.fs.open
    read.location.fs.open = lambda path, *a, **k: opened.append(path) or real_open(path, *a, **k)
    batches = read.batches(["id", "not_a_column"], batch_size=1)
    first = next(batches)
    assert first.num_rows == 1 and len(opened) == 1  # one file open, one batch in memory
    assert first.schema.names == ["id", "not_a_column", UNIT_COLUMN, RUN_COLUMN] and first.column(1).null_count == 1
    assert sum(b.num_rows for b in batches) == 5 and len(opened) == 3


OTHER = dict(IDENTITY, method="draft_model")


def _earlier_version(out) -> None:
    """An output an earlier version left (no commit log: untagged data files, one manifest
    entry per unit, as its writer wrote them): unit 0 committed under ``OTHER``, units 1-2 by
    a run of ``IDENTITY`` that took it over, finished (issue 50's paused run, before fencing)."""
    from pipeline.summary import RunTotals

    (out / "_manifest").mkdir(parents=True)
    for unit in UNITS:
        identity, run = (OTHER, "0123456789ab") if unit.split_index == 0 else (IDENTITY, "ba9876543210")
        pq.write_table(unit_rows(unit), out / unit.part)
        totals = RunTotals()
        totals.rows = 2
        entry = {"part": unit.part, "files": [unit.part], "source_file": SHARD.url, "fingerprint": SHARD.fingerprint,
                 "shard": 0, "split": unit.split_index, "start_row": unit.split.start, "rows": 2, "split_rows": 2,
                 "config_fingerprint": config_fingerprint(identity), "config_identity": identity, "errors": 0,
                 "run_id": run, "committed_at": "2026-01-01T00:00:00+00:00", "totals": totals.state()}
        (out / "_manifest" / unit.part.replace(".parquet", ".json")).write_text(json.dumps(entry))
    (out / "_summary.json").write_text(json.dumps({"rows": 6}))
    (out / "_SUCCESS").write_text("")


def _forged_record(out) -> None:
    """A complete output of this version whose unit 0 record of the commit log was edited by
    hand to carry ``OTHER``'s fingerprint (a valid record: its kind, number, run and names)."""
    _resume(out)
    record = out / CommittedOutput.open(str(out)).record_of(UNITS[0].part)
    rec = json.loads(record.read_text())
    record.write_text(json.dumps(dict(rec, config_fingerprint=config_fingerprint(OTHER), config_identity=OTHER)))


@pytest.mark.parametrize("build", [_earlier_version, _forged_record], ids=["earlier-version", "forged-record"])
def test_units_of_two_configs_are_refused_by_name(tmp_path, build):
    """Unit 0 committed under one config, the rest under another.  This version's writer
    cannot leave that (a run that lost its lease commits nothing, a resume under another
    config is refused), so the output is one an earlier version left, or records edited by
    hand; no reader mixes them (the report, train_drafter and the nightly reuse refuse it,
    naming both)."""
    out = tmp_path / "out"
    build(out)
    other, first = config_fingerprint(OTHER), config_fingerprint(IDENTITY)
    with pytest.raises(OutputReadError, match=rf"mixes units committed under 2 configs \({other}: 1 unit\(s\), e\.g\. "
                                              rf"part-00000-u00000\.parquet; {first}: 2 unit\(s\), e\.g\. "
                                              r"part-00000-u00001\.parquet\)"):
        CommittedOutput.open(str(out))
    both = CommittedOutput.open(str(out), mixed_ok=True)
    assert list(both.fingerprints) == [other, first] and both.finished and both.uncommitted == []
    assert [r["id"] for r in both.rows(["id"])] == [f"r{i}" for i in range(6)]
    with pytest.raises(ReportError, match="mixes units committed under 2 configs"):
        load_run(str(out))
    assert _train_drafter().main(["--from", str(out), "--output", str(tmp_path / "h")]) == 2


def test_what_is_not_a_committed_output_is_named(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "loose").mkdir()
    pq.write_table(unit_rows(UNITS[0]), tmp_path / "loose" / "part-00000.parquet")
    (tmp_path / "file.parquet").write_bytes(b"x")
    cases = {"missing": "does not exist", "empty": "is an empty folder", "file.parquet": "is a file",
             "loose": r"holds 1 file\(s\) but no committed unit"}
    for name, what in cases.items():
        with pytest.raises(OutputReadError, match=rf"the output '.*{name}' {what}"):
            CommittedOutput.open(str(tmp_path / name))


def test_a_committed_file_that_went_missing_is_named_with_its_record(tmp_path):
    """The file, its unit and the record naming it: the commit log's, or an earlier version's entry."""
    run = _resume(tmp_path / "out")
    (tmp_path / "out" / f"part-00000-u00001.{run}.parquet").unlink()
    read = CommittedOutput.open(str(tmp_path / "out"))
    with pytest.raises(OutputReadError, match=rf"part-00000-u00001\.{run}\.parquet, a data file of the committed unit "
                                              r"part-00000-u00001\.parquet \(_manifest/log/0000000002\.json names "
                                              r"it\), is missing"):
        read.table()
    _earlier_version(tmp_path / "old")
    (tmp_path / "old" / "part-00000-u00002.parquet").unlink()
    with pytest.raises(OutputReadError, match=r"part-00000-u00002\.parquet, a data file of the committed unit "
                                              r"part-00000-u00002\.parquet \(_manifest/part-00000-u00002\.json "
                                              r"names it\), is missing"):
        CommittedOutput.open(str(tmp_path / "old"), mixed_ok=True).table()


def _train_drafter():
    return job_module("train_drafter")


def test_the_report_and_train_drafter_agree_on_a_killed_then_resumed_output(tmp_path):
    from train.drafter_from_outputs import read_job_output

    out, config = tmp_path / "out", tmp_path / "job.yaml"
    config.write_text("task: {name: summarize}\n")

    def both() -> tuple[list, list]:
        report = load_run(str(out)).table.select(["id", "output_text"]).to_pylist()
        job = read_job_output(str(out), {}, str(config), None)
        return report, [{"id": r["id"], "output_text": r["output_text"]} for r in job.rows], job

    run = _killed(out)
    report, trained, job = both()
    assert report == trained == [{"id": f"r{i}", "output_text": f"o{i}"} for i in range(2)]
    assert job.uncommitted_files == [f"part-00000-u00001.{run}.parquet"] and not job.finished
    md = (write_report([str(out)], tmp_path / "rep") and (tmp_path / "rep" / "report.md").read_text())
    assert "**Unfinished:** plain: no `_SUCCESS`" in md and "2 row(s)" in md and "not read: part-00000-u00001" in md
    _resume(out, summary={"rows": 6, "config": {"task": {"name": "summarize"}, "models": {}}})
    report, trained, job = both()
    assert report == trained == [{"id": f"r{i}", "output_text": f"o{i}"} for i in range(6)]
    assert job.finished and job.uncommitted_files == [] and load_run(str(out)).finished


# ------------------------------------------------------------------ date partitions, --previous auto
def _night(root, day: str, finished: bool = True, so=None) -> None:
    w = OutputWriter(OutputConfig(uri=str(root), partition_by_date=True, run_date=day, storage_options=so or {}))
    w.on_write_start(UNITS[:1], IDENTITY)
    w.write_part(UNITS[0], unit_rows(UNITS[0]))
    if finished:
        w.on_write_complete({"rows": 2, "day": day})


LATE_SUCCESS = b"0123456789ab\n"  # a _SUCCESS another run published late (it had lost its lease): does not count


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
    (root / "date=2026-01-02" / "_SUCCESS").write_bytes(LATE_SUCCESS)
    second = str(root / "date=2026-01-02")
    assert not CommittedOutput.open(second).finished and not is_complete(second)  # the reader says what the job says
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


def test_on_s3_the_reader_reads_the_committed_units_and_finds_the_previous_night(moto_s3):
    """The same rules on an object store (moto): a killed run's published part is not read
    (named as uncommitted), the resumed output is read whole, ``previous_partition`` lists
    the complete nights (a late ``_SUCCESS`` does not count)."""
    client = moto_s3["client"]
    client.create_bucket(Bucket="reader")
    so, out = moto_s3["options"], "s3://reader/out"
    run = _killed(out, so=so)
    read = CommittedOutput.open(out, so)
    assert not read.finished and not is_complete(out, so) and read.uncommitted == [f"part-00000-u00001.{run}.parquet"]
    assert read.table(["id"]).column("id").to_pylist() == ["r0", "r1"]
    assert load_run(out, so).table.num_rows == 2
    _resume(out, so=so)
    read = CommittedOutput.open(out, so)
    assert read.finished and is_complete(out, so) and read.uncommitted == []
    assert [r["id"] for r in read.rows(["id"])] == [f"r{i}" for i in range(6)]
    for day in ("2026-01-01", "2026-01-02"):
        _night("s3://reader/nightly", day, finished=day == "2026-01-01", so=so)
    client.put_object(Bucket="reader", Key="nightly/date=2026-01-02/_SUCCESS", Body=LATE_SUCCESS)
    assert previous_partition("s3://reader/nightly", "2026-01-03", so) == "s3://reader/nightly/date=2026-01-01"
    assert previous_partition("s3://reader/nightly", "2026-01-01", so) is None
