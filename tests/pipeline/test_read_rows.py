"""Reading never lets one row sink its shard: every row that cannot be read or encoded
becomes an error row naming its line (a lone surrogate escape, invalid UTF-8, a line that
is not JSON or not an object, a bad first line), a UTF-8 BOM is accepted, and only a file
with no usable line at all is refused, by name.  Ids follow one rule for JSONL and
Parquet.  Checked on local disk and on moto S3, and end to end through the job."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline_testkit import TEXTS, job_config, write_jsonl
from pipeline.config import InputConfig
from pipeline.input import InputError, read_shard, resolve_shards
from pipeline.run import run_job

GOOD = json.dumps({"id": "g", "text": TEXTS[0]}).encode()

#: (name, line bytes, expected error substring); each is one line of a JSONL file
BAD_LINES = [
    ("surrogate", b'{"id": "s1", "text": "abc \\ud800 def"}', "text is not valid Unicode"),
    ("low surrogate", b'{"id": "s2", "text": "\\udfff"}', "text is not valid Unicode"),
    ("surrogate id", b'{"id": "\\ud83d", "text": "fine"}', "id is not valid Unicode"),
    ("invalid utf-8", b'{"id": "u", "text": "caf\xe9"}', "not valid UTF-8"),
    ("not json", b'{"id": "j", "text": ', "not valid JSON"),
    ("array", b'[1, 2, 3]', "a list, not an object"),
    ("number", b'42', "a int, not an object"),
    ("float id", b'{"id": 1.5, "text": "x"}', "id must be a string or an integer, got float"),
    ("bool id", b'{"id": true, "text": "x"}', "id must be a string or an integer, got bool"),
    ("object id", b'{"id": {"a": 1}, "text": "x"}', "id must be a string or an integer, got dict"),
    ("text not a string", b'{"id": "t", "text": ["a"]}', "prompt is a list, not a string"),
]


def _write(path, lines, bom=False):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + b"\n".join(lines) + b"\n")
    return path


@pytest.mark.parametrize("name, line, message", BAD_LINES, ids=[b[0] for b in BAD_LINES])
@pytest.mark.parametrize("position", ["first", "middle", "last"])
def test_a_bad_line_is_an_error_row_and_the_rest_of_the_shard_is_read(tmp_path, name, line, message, position):
    lines = [GOOD, GOOD, GOOD]
    at = {"first": 0, "middle": 1, "last": 3}[position]
    lines.insert(at, line)
    p = _write(tmp_path / "x.jsonl", lines)
    cfg = InputConfig(uri=str(p))
    (shard,) = resolve_shards(cfg)  # a bad first line no longer refuses the job
    rows = read_shard(shard, cfg).to_pylist()
    assert len(rows) == 4 and [r["source_row"] for r in rows] == [0, 1, 2, 3]
    bad = rows[at]
    assert bad["input_error"].startswith(f"line {at + 1}: ") and message in bad["input_error"], bad
    assert bad["text"] is None and bad["id"]  # an id always: the row's own or a derived one
    assert [r["text"] for i, r in enumerate(rows) if i != at] == [TEXTS[0]] * 3
    assert all(r["input_error"] is None for i, r in enumerate(rows) if i != at)
    pa.Table.from_pylist(rows)  # every value encodes


def test_byte_order_mark_and_blank_lines(tmp_path):
    p = _write(tmp_path / "bom.jsonl", [GOOD, b"", b"   ", json.dumps({"id": 7, "text": TEXTS[1]}).encode()], bom=True)
    cfg = InputConfig(uri=str(p))
    (shard,) = resolve_shards(cfg)
    assert shard.num_rows == 2
    rows = read_shard(shard, cfg).to_pylist()
    assert [(r["id"], r["text"], r["input_error"]) for r in rows] == [("g", TEXTS[0], None), ("7", TEXTS[1], None)]
    # a BOM before a bad first line: still one error row, the next line read
    p2 = _write(tmp_path / "bom2.jsonl", [b"oops", GOOD], bom=True)
    rows = read_shard(resolve_shards(InputConfig(uri=str(p2)))[0], InputConfig(uri=str(p2))).to_pylist()
    assert "line 1: not valid JSON" in rows[0]["input_error"] and rows[1]["text"] == TEXTS[0]


@pytest.mark.parametrize("content, message", [
    (b"hello world\nsecond line\n", "is not JSONL: none of its 2 lines is a JSON object"),
    (b"\xff\xfe\x00h\x00i\x00\n", "not valid UTF-8"),  # UTF-16
    (b"[1]\n[2]\n", "a list, not an object"),
    (b'{"id": 1, "body": "x"}\n{"id": 2}\n', "no field 'text' (input.text_column) on any of its 2 lines"),
])
def test_a_file_with_no_usable_line_is_refused_by_name(tmp_path, content, message):
    (tmp_path / "ok.jsonl").write_bytes(GOOD + b"\n")
    (tmp_path / "bad.jsonl").write_bytes(content)
    with pytest.raises(InputError, match="bad.jsonl") as e:
        resolve_shards(InputConfig(uri=str(tmp_path)))
    assert message in str(e.value)


def test_ids_follow_one_rule_in_jsonl_and_parquet(tmp_path):
    rows = [{"id": "a", "text": "t0"}, {"id": 1, "text": "t1"}, {"text": "t2"}, {"id": None, "text": "t3"},
            {"id": "1", "text": "t4"}]
    write_jsonl(tmp_path / "in" / "sub" / "j.jsonl", rows)
    pq.write_table(pa.table({"id": pa.array(["a", None, "x"]), "text": ["t0", "t1", "t2"]}), tmp_path / "in" / "p.parquet")
    pq.write_table(pa.table({"id": pa.array([1, None], pa.int64()), "text": ["t0", "t1"]}), tmp_path / "in" / "q.parquet")
    pq.write_table(pa.table({"text": ["t0", "t1"]}), tmp_path / "in" / "r.parquet")  # no id column
    cfg = InputConfig(uri=str(tmp_path / "in"))
    shards = resolve_shards(cfg)
    ids = {s.name: read_shard(s, cfg).column("id").to_pylist() for s in shards}
    assert ids == {
        "p.parquet": ["a", "p.parquet:1", "x"],
        "q.parquet": ["1", "q.parquet:1"],
        "r.parquet": ["r.parquet:0", "r.parquet:1"],
        "sub/j.jsonl": ["a", "1", "sub/j.jsonl:2", "sub/j.jsonl:3", "1"],
    }
    # stable: the same input gives the same derived ids (relative to the input location)
    again = {s.name: read_shard(s, cfg).column("id").to_pylist() for s in resolve_shards(InputConfig(uri=str(tmp_path / "in" / "**")))}
    assert again["sub/j.jsonl"] == ids["sub/j.jsonl"]
    # a Parquet id column of another type is refused before any work
    pq.write_table(pa.table({"id": [1.5, 2.5], "text": ["a", "b"]}), tmp_path / "f.parquet")
    with pytest.raises(InputError, match="column 'id' .* is double; ids must be strings or integers"):
        resolve_shards(InputConfig(uri=str(tmp_path / "f.parquet")))


def test_parquet_string_that_is_not_utf8_is_an_error_row(tmp_path):
    texts = pa.array([TEXTS[0].encode(), b"bad \xff\xfe", TEXTS[1].encode()], pa.binary()).view(pa.string())
    pq.write_table(pa.table({"id": ["a", "b", "c"], "text": texts}), tmp_path / "x.parquet")
    cfg = InputConfig(uri=str(tmp_path / "x.parquet"))
    rows = read_shard(resolve_shards(cfg)[0], cfg).to_pylist()
    assert [r["text"] for r in rows] == [TEXTS[0], None, TEXTS[1]]
    assert rows[1]["input_error"].startswith("row 1: column 'text' cannot be decoded")


def _messy_shard_lines():
    return [b'{"id": "s0", "text": "the cat sat on the mat"}', BAD_LINES[0][1], b"not json at all",
            b'{"id": "s3", "text": "a storm hit the coast"}', BAD_LINES[3][1]]


def _check_messy_output(table):
    rows = {r["id"]: r for r in table.to_pylist()}
    assert table.num_rows == 5 and set(rows) == {"s0", "s1", "m.jsonl:2", "s3", "m.jsonl:4"}  # undecodable: derived ids
    assert rows["s0"]["error"] is None and rows["s0"]["new_tokens"] > 0
    assert rows["s3"]["error"] is None and rows["s3"]["new_tokens"] > 0
    assert rows["s1"]["error"].startswith("ValueError: line 2: text is not valid Unicode")
    assert "line 3: not valid JSON" in rows["m.jsonl:2"]["error"]
    assert "line 5: not valid UTF-8" in rows["m.jsonl:4"]["error"]


def test_job_writes_the_good_rows_and_an_error_row_per_bad_line(ray_local, tiny_models, tmp_path):
    _write(tmp_path / "in" / "m.jsonl", _messy_shard_lines(), bom=True)
    summary = run_job(job_config(tiny_models, str(tmp_path / "in"), str(tmp_path / "out"), method="plain",
                                 overrides=["generation.max_new_tokens=4"]), progress=False)
    assert summary["rows"] == 5 and summary["errors"] == 3
    _check_messy_output(pq.read_table(tmp_path / "out"))


def test_job_on_s3_writes_the_good_rows_and_an_error_row_per_bad_line(ray_local, tiny_models, moto_s3):
    import io

    client = moto_s3["client"]
    client.create_bucket(Bucket="rows")
    client.put_object(Bucket="rows", Key="in/m.jsonl", Body=b"\xef\xbb\xbf" + b"\n".join(_messy_shard_lines()) + b"\n")
    opts = moto_s3["options_json"]
    cfg = job_config(tiny_models, "s3://rows/in/", "s3://rows/out", method="plain",
                     overrides=["generation.max_new_tokens=4", f"input.storage_options={opts}",
                                f"output.storage_options={opts}"])
    summary = run_job(cfg, progress=False)
    assert summary["errors"] == 3
    body = client.get_object(Bucket="rows", Key=f"out/part-00000-u00000.{summary['run_id']}.parquet")["Body"].read()
    _check_messy_output(pq.read_table(io.BytesIO(body)))
