"""The commit protocol's typed records (pipeline.output.records): today's bytes on disk.

``data/output_before_records/`` is an output folder written by the code before typed
records (main at f93c784, by ``OutputWriter.write_part`` with ``max_rows_per_file=1``):
a run that committed units 0 and 1 of three (two files each) and was killed before unit 2.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipeline.config import OutputConfig
from pipeline.output import OutputError, OutputLocation, OutputWriter
from pipeline.output.reader import CommittedOutput
from pipeline.output.records import (FRAGMENT_SCHEMA, EpochRecord, FileCheck, FinalRecord, Fragment, RecordError,
                                     UnitRecord, decode_log_record, fragment_table, fragments_of)
from pipeline.units import Split, Unit
from pipeline_testkit import SHARD, unit_rows

FIXTURE = Path(__file__).parent / "data" / "output_before_records"
UNITS = [Unit(SHARD, k, Split(2 * k, 2)) for k in range(3)]
IDENTITY = {"method": "plain", "fixture": "typed records, issue 55"}  # the fixture's config identity
LOG = Path("_manifest") / "log"



def _copy(tmp_path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(FIXTURE, out)
    return out


def _cfg(out: Path) -> OutputConfig:
    return OutputConfig(uri=str(out), partition_by_date=False)


def test_each_record_written_before_typed_records_decodes_and_encodes_to_its_own_bytes():
    kinds = []
    for path in sorted((FIXTURE / LOG).glob("*.json")):
        raw = path.read_bytes()
        rec = decode_log_record(int(path.stem), json.loads(raw))
        assert rec.encode() == raw
        kinds.append(type(rec))
    assert kinds == [EpochRecord, UnitRecord, UnitRecord]
    # the final record, as the code before wrote it (its keys in that order)
    final = {"kind": "final", "config_fingerprint": "75e317252d6697af", "units": 3, "rows": 6,
             "at": "2026-12-07T02:49:38.000000+00:00", "seq": 3, "run_id": "fixture-run-1"}
    raw = json.dumps(final, default=str).encode()
    assert decode_log_record(3, json.loads(raw)).encode() == raw == FinalRecord(
        config_fingerprint="75e317252d6697af", units=3, rows=6, at=final["at"]).numbered(3, "fixture-run-1").encode()


def test_an_output_written_before_typed_records_is_read_and_resumed(tmp_path):
    out = _copy(tmp_path)
    before = {p.name: p.read_bytes() for p in (out / LOG).iterdir()}
    read = CommittedOutput.open(str(out))
    assert read.parts == ["part-00000-u00000.parquet", "part-00000-u00001.parquet"] and not read.finished
    assert read.table(provenance=False).column("id").to_pylist() == ["r0", "r1", "r2", "r3"]
    assert read.unverified == [] and read.rows_committed == 4  # every file checked against its SHA-256

    w = OutputWriter(_cfg(out))
    plan = w.on_write_start(UNITS, IDENTITY)
    assert plan.done == read.parts and [u.part for u in plan.todo] == ["part-00000-u00002.parquet"]
    w.write_part(plan.todo[0], unit_rows(plan.todo[0]))
    w.on_write_complete({"rows": 6})

    again = CommittedOutput.open(str(out))
    assert again.finished and again.rows_committed == 6 and again.unverified == []
    assert again.table(provenance=False).column("id").to_pylist() == [f"r{i}" for i in range(6)]
    assert {p: r for p, r in again.runs.items()} == {"fixture-run-1": read.parts,
                                                    w.run_id: ["part-00000-u00002.parquet"]}
    after = {p.name: p.read_bytes() for p in (out / LOG).iterdir()}
    assert {n: after[n] for n in before} == before  # the earlier records are kept as they were
    final = decode_log_record(5, json.loads(after["0000000005.json"]))
    assert isinstance(final, FinalRecord) and (final.units, final.rows, final.run_id) == (3, 6, w.run_id)


def _refusal(out: Path) -> str:
    with pytest.raises(OutputError) as e:
        OutputLocation(_cfg(out)).manifest()
    return str(e.value)


def test_a_record_of_an_unknown_kind_is_refused_with_the_message_of_before(tmp_path):
    out = _copy(tmp_path)
    rec = out / LOG / "0000000002.json"
    rec.write_text(json.dumps({**json.loads(rec.read_text()), "kind": "merge"}))
    url, rel = OutputLocation(_cfg(out)).url(), "_manifest/log/0000000002.json"
    # the message the code before typed records gave, word for word
    assert _refusal(out) == (f"output {url!r}: {rel} is of kind 'merge', not one of epoch, unit, final: not a record "
                             f"of this job's commit log; the job deletes only files it wrote, so it does nothing: "
                             f"remove {rel} (this job did not write it), or choose another output.uri")


def test_a_damaged_record_is_refused_with_the_message_of_before(tmp_path):
    out = _copy(tmp_path)
    rec = out / LOG / "0000000001.json"
    rec.write_bytes(rec.read_bytes()[:40])  # cut short
    url, rel = OutputLocation(_cfg(out)).url(), "_manifest/log/0000000001.json"
    got = _refusal(out)
    assert got.startswith(f"output {url!r}: {rel} is not a manifest record of this job (")
    assert got.endswith("); the job never deletes files it did not write: remove it, or choose another output.uri")


@pytest.mark.parametrize("field, value, problem", [
    ("seq", 7, "says it is record 7"),
    ("run_id", "a b", "names the run 'a b'"),
    ("part", "part-x.parquet", "names the part 'part-x.parquet'"),
    ("rows", "two", "has rows 'two', not a whole number >= 0"),
    ("start_row", -1, "has start_row -1, not a whole number >= 0"),
    ("config_fingerprint", 5, "has config_fingerprint 5, not a string"),
    ("totals", [1], "has totals [1], not an object"),
])
def test_a_field_of_a_unit_record_that_is_not_the_job_s_is_named(tmp_path, field, value, problem):
    obj = json.loads((FIXTURE / LOG / "0000000001.json").read_text())
    with pytest.raises(RecordError) as e:
        decode_log_record(1, {**obj, field: value})
    assert (e.value.field, e.value.problem) == (field, problem)
    out = _copy(tmp_path)
    (out / LOG / "0000000001.json").write_text(json.dumps({**obj, field: value}))
    assert f"0000000001.json {problem}" in _refusal(out)  # the refusal names the file and the field


def test_files_and_checksums_are_checked_against_the_part_and_run():
    obj = json.loads((FIXTURE / LOG / "0000000001.json").read_text())
    other = [n.replace("fixture-run-1", "other-run") for n in obj["files"]]
    with pytest.raises(RecordError) as e:
        UnitRecord.from_json({**obj, "files": other})
    assert e.value.field == "files"
    with pytest.raises(RecordError) as e:
        UnitRecord.from_json({**obj, "checksums": {obj["files"][0]: obj["checksums"][obj["files"][0]]}})
    assert e.value.field == "checksums"
    entry = UnitRecord.from_json(obj)
    assert entry.check_of(obj["files"][1]) == FileCheck(**obj["checksums"][obj["files"][1]])
    assert entry.to_json() == obj


def test_an_epoch_record_s_overwrite_must_be_a_boolean():
    obj = json.loads((FIXTURE / LOG / "0000000000.json").read_text())
    assert decode_log_record(0, obj) == EpochRecord(**{k: v for k, v in obj.items() if k != "kind"})
    with pytest.raises(RecordError) as e:
        decode_log_record(0, {**obj, "overwrite": "yes"})
    assert e.value.field == "overwrite"


def test_the_write_stage_s_records_round_trip_through_their_table():
    frag = Fragment(part="part-00000-u00000.parquet", path="/s/x.parquet", first_row=0, last_row=1, rows=2, errors=0,
                    totals="{}", pid=1, host="h", consecutive=True, sha256="0" * 64, size=10)
    table = fragment_table([frag])
    assert table.schema == FRAGMENT_SCHEMA and fragments_of(table) == [frag]
    assert frag.check == FileCheck("0" * 64, 10, 2)
    with pytest.raises(RecordError) as e:
        Fragment.from_json({k: v for k, v in frag.to_json().items() if k != "size"})
    assert e.value.field == "size"
