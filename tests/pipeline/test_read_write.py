"""Reading shards (fsspec, Parquet/JSONL, bad rows) and the write/commit protocol."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline_testkit import write_jsonl
from pipeline.config import InputConfig, OutputConfig
from pipeline.input import InputError, read_shard, resolve_shards
from pipeline.output import OutputError, is_complete
from pipeline.output import OutputWriter
from pipeline.schema import OUTPUT_SCHEMA


def test_resolve_dir_glob_and_file(tmp_path):
    write_jsonl(tmp_path / "in" / "b.jsonl", [{"id": 1, "text": "x"}, {"id": 2, "text": "y"}])
    pq.write_table(pa.table({"id": ["a"], "text": ["z"]}), tmp_path / "in" / "a.parquet")
    (tmp_path / "in" / "README.md").write_text("not a shard")
    shards = resolve_shards(InputConfig(uri=str(tmp_path / "in")))
    assert [(s.index, s.format, s.num_rows) for s in shards] == [(0, "parquet", 1), (1, "jsonl", 2)]
    assert [s.url for s in resolve_shards(InputConfig(uri=str(tmp_path / "in" / "*.jsonl")))] == [
        str(tmp_path / "in" / "b.jsonl")
    ]
    assert len(resolve_shards(InputConfig(uri=str(tmp_path / "in" / "a.parquet")))) == 1


def test_missing_input(tmp_path):
    with pytest.raises(InputError, match="input not found"):
        resolve_shards(InputConfig(uri=str(tmp_path / "nope.jsonl")))
    with pytest.raises(InputError, match="input not found"):
        resolve_shards(InputConfig(uri=str(tmp_path / "*.parquet")))


def test_unreadable_shards(tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"this is not parquet at all")
    with pytest.raises(InputError, match="unreadable as parquet"):
        resolve_shards(InputConfig(uri=str(tmp_path / "bad.parquet")))
    (tmp_path / "bad.jsonl").write_bytes(b"\xff\xfe\x00garbage\n")
    with pytest.raises(InputError, match="bad.jsonl"):
        resolve_shards(InputConfig(uri=str(tmp_path / "bad.jsonl")))
    (tmp_path / "notjson.jsonl").write_text("hello world\n")
    with pytest.raises(InputError, match="not JSONL"):
        resolve_shards(InputConfig(uri=str(tmp_path / "notjson.jsonl")))


def test_missing_columns(tmp_path):
    """No text column: refused.  No id column: the rows get derived ids (same rule as JSONL)."""
    pq.write_table(pa.table({"key": ["a"], "body": ["z"]}), tmp_path / "a.parquet")
    with pytest.raises(InputError, match="no column 'text'"):
        resolve_shards(InputConfig(uri=str(tmp_path / "a.parquet")))
    write_jsonl(tmp_path / "b.jsonl", [{"id": 1, "body": "x"}])
    with pytest.raises(InputError, match="text_column"):
        resolve_shards(InputConfig(uri=str(tmp_path / "b.jsonl")))


def test_read_jsonl_keeps_bad_rows_with_an_input_error(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text(
        json.dumps({"id": 1, "text": "good"}) + "\n"
        + json.dumps({"id": "b", "text": 42}) + "\n"
        + "\n"
        + "{broken json\n"
        + json.dumps([1, 2]) + "\n"
        + json.dumps({"id": 5, "text": None}) + "\n"
    )
    (shard,) = resolve_shards(InputConfig(uri=str(p)))
    assert shard.num_rows == 5
    rows = read_shard(shard, InputConfig(uri=str(p))).to_pylist()
    assert [r["source_row"] for r in rows] == [0, 1, 2, 3, 4]
    assert rows[0] == {"source_file": str(p), "source_row": 0, "id": "1", "text": "good", "input_error": None}
    assert rows[1]["text"] is None and "int, not a string" in rows[1]["input_error"]
    assert "not valid JSON" in rows[2]["input_error"]
    assert "list, not an object" in rows[3]["input_error"]
    assert rows[4]["text"] is None and rows[4]["input_error"] is None and rows[4]["id"] == "5"


def test_read_parquet_non_string_column(tmp_path):
    pq.write_table(pa.table({"id": [1, 2], "text": [3, None]}), tmp_path / "a.parquet")
    (shard,) = resolve_shards(InputConfig(uri=str(tmp_path / "a.parquet")))
    rows = read_shard(shard, InputConfig(uri=str(tmp_path / "a.parquet"))).to_pylist()
    assert "int, not a string" in rows[0]["input_error"] and rows[1]["input_error"] is None


def _table(n):
    return pa.Table.from_pylist([{"id": str(i), "error": None, "source_row": i} for i in range(n)], schema=OUTPUT_SCHEMA)


def test_commit_protocol(tmp_path):
    out = tmp_path / "out"
    w = OutputWriter(OutputConfig(uri=str(out)))
    w.on_write_start()
    w.write_part(0, _table(3))
    # a unit is published as soon as it is written: its files (named with the run's id), then its
    # record in the commit log (the run's epoch is record 0)
    part0, part1 = f"part-00000-u00000.{w.run_id}.parquet", f"part-00001-u00000.{w.run_id}.parquet"
    assert (out / part0).exists() and (out / "_manifest" / "log" / "0000000001.json").exists()
    assert not is_complete(str(out))
    w.write_part(1, _table(2))
    w.on_write_complete({"rows": 5})
    assert sorted(p.name for p in out.iterdir()) == ["_SUCCESS", "_manifest", "_summary.json", part0, part1]
    assert pq.read_table(out).num_rows == 5  # pyarrow skips _-prefixed files
    assert json.loads((out / "_summary.json").read_text()) == {"rows": 5}
    records = [json.loads((out / "_manifest" / "log" / f"{i:010d}.json").read_text()) for i in range(4)]
    assert [r["kind"] for r in records] == ["epoch", "unit", "unit", "final"]
    assert records[2]["part"] == "part-00001-u00000.parquet" and records[2]["files"] == [part1]
    assert records[2]["rows"] == 2 and {r["run_id"] for r in records} == {w.run_id}

    # An output written before manifests existed (parts + _SUCCESS only) is refused.
    old = tmp_path / "old"
    old.mkdir()
    (old / "_SUCCESS").write_text("x")
    with pytest.raises(OutputError, match="without a manifest"):
        OutputWriter(OutputConfig(uri=str(old))).on_write_start()

    # An overwriting run that fails: the old run no longer looks complete, no staging left.
    w2 = OutputWriter(OutputConfig(uri=str(out), overwrite=True))
    w2.on_write_start()
    assert not is_complete(str(out)) and not list(out.glob("part-*"))
    assert OutputWriter(OutputConfig(uri=str(out))).location.read_manifest() == {}
    w2.write_part(0, _table(1))
    w2.on_write_failed()
    assert not (out / "_staging").exists() and not is_complete(str(out))

    # An overwriting run that succeeds replaces the parts.
    w3 = OutputWriter(OutputConfig(uri=str(out), overwrite=True))
    w3.on_write_start()
    w3.write_part(0, _table(4))
    w3.on_write_complete({"rows": 4})
    assert pq.read_table(out).num_rows == 4 and is_complete(str(out))
    assert [p.name for p in out.glob("part-*")] == [f"part-00000-u00000.{w3.run_id}.parquet"]


def test_unwritable_output(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OutputError, match="not writable"):
        OutputWriter(OutputConfig(uri=str(blocker / "out"))).on_write_start()
