"""Corpus formats and the input listing (issue 23 item 2, issue 22 items 3 and 5).

Compressed JSONL (gzip, zstandard, bzip2, xz) as files and inside folders, ``*.ndjson`` and
``*.json`` lines, Hive-partitioned Parquet, every file of a folder read or named, the job's
own output left out, and one shard however its location is spelled: on local disk and on
moto S3.  No model and no Ray: all of this happens in the driver before work starts.
"""

from __future__ import annotations

import bz2
import gzip
import json
import logging
import lzma
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from pipeline_testkit import TEXTS, write_jsonl
from pipeline.config import InputConfig, OutputConfig
from pipeline.input import InputError, file_kind, read_shard, resolve_shards
from pipeline.output import OutputWriter, listing_view
from pipeline.schema import OUTPUT_SCHEMA

ROWS = [{"id": f"r{i}", "text": t} for i, t in enumerate(TEXTS[:3])]
PLAIN = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
COMPRESS = {
    ".gz": gzip.compress,
    ".bz2": bz2.compress,
    ".zst": lambda b: zstandard.ZstdCompressor().compress(b),
    ".xz": lzma.compress,
}


def _rows(shard, cfg):
    return [(r["id"], r["text"], r["input_error"]) for r in read_shard(shard, cfg).to_pylist()]


EXPECTED = [(r["id"], r["text"], None) for r in ROWS]


@pytest.mark.parametrize("ext", list(COMPRESS))
def test_compressed_jsonl_named_as_a_file(tmp_path, ext):
    p = tmp_path / f"corpus.jsonl{ext}"
    p.write_bytes(COMPRESS[ext](PLAIN))
    cfg = InputConfig(uri=str(p))
    (shard,) = resolve_shards(cfg)
    assert (shard.format, shard.num_rows, shard.name) == ("jsonl", 3, p.name)
    assert shard.compression == {".gz": "gzip", ".bz2": "bz2", ".zst": "zstd", ".xz": "xz"}[ext]
    assert _rows(shard, cfg) == EXPECTED
    # derived ids name the compressed file, as for any shard
    assert shard.derived_id(2) == f"corpus.jsonl{ext}:2"


def test_a_folder_of_compressed_and_plain_jsonl_reads_every_file(tmp_path, caplog):
    d = tmp_path / "in"
    (d / "sub").mkdir(parents=True)
    (d / "a.jsonl").write_bytes(PLAIN)
    (d / "b.jsonl.gz").write_bytes(gzip.compress(PLAIN))
    (d / "c.jsonl.zst").write_bytes(COMPRESS[".zst"](PLAIN))
    (d / "sub" / "d.jsonl.bz2").write_bytes(bz2.compress(PLAIN))
    (d / "e.ndjson").write_bytes(PLAIN)
    (d / "f.json").write_bytes(PLAIN)  # JSON lines named .json
    cfg = InputConfig(uri=str(d))
    with caplog.at_level(logging.INFO, logger="specbatch"):
        shards = resolve_shards(cfg)
    assert [s.name for s in shards] == ["a.jsonl", "b.jsonl.gz", "c.jsonl.zst", "e.ndjson", "f.json", "sub/d.jsonl.bz2"]
    assert all(_rows(s, cfg) == EXPECTED for s in shards)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # nothing left unread


def test_a_folder_holding_only_compressed_files_is_read(tmp_path):
    """It used to be reported as "no file matches"."""
    (tmp_path / "x.jsonl.gz").write_bytes(gzip.compress(PLAIN))
    (tmp_path / "y.jsonl.bz2").write_bytes(bz2.compress(PLAIN))
    shards = resolve_shards(InputConfig(uri=str(tmp_path)))
    assert [(s.name, s.num_rows) for s in shards] == [("x.jsonl.gz", 3), ("y.jsonl.bz2", 3)]


def test_explicit_compression_and_format(tmp_path):
    """Files whose names say nothing: ``input.format`` and ``input.compression`` set."""
    (tmp_path / "dump.0").write_bytes(gzip.compress(PLAIN))
    cfg = InputConfig(uri=str(tmp_path / "dump.0"), format="jsonl", compression="gzip")
    (shard,) = resolve_shards(cfg)
    assert shard.compression == "gzip" and _rows(shard, cfg) == EXPECTED
    # without them the file is refused by name, with what to do
    with pytest.raises(InputError, match=r"dump\.0.*unknown format.*input\.format"):
        resolve_shards(InputConfig(uri=str(tmp_path / "dump.0")))
    # compression: none reads a .gz name as it is (here: not JSONL, refused by name)
    (tmp_path / "odd.jsonl.gz").write_bytes(PLAIN)
    (shard,) = resolve_shards(InputConfig(uri=str(tmp_path / "odd.jsonl.gz"), compression="none"))
    assert shard.compression is None and shard.num_rows == 3
    with pytest.raises(InputError, match=r"odd\.jsonl\.gz.*unreadable as jsonl \(gzip\)"):
        resolve_shards(InputConfig(uri=str(tmp_path / "odd.jsonl.gz")))


def test_a_corrupt_compressed_file_is_refused_by_name(tmp_path):
    (tmp_path / "bad.jsonl.gz").write_bytes(gzip.compress(PLAIN)[:25])  # truncated
    with pytest.raises(InputError, match=r"bad\.jsonl\.gz"):
        resolve_shards(InputConfig(uri=str(tmp_path)))


def test_file_kind():
    cfg = InputConfig()
    assert file_kind("a/B.JSONL.GZ", cfg) == ("jsonl", "gzip", None)
    assert file_kind("x.parquet", cfg) == ("parquet", None, None)
    assert file_kind("x.ndjson.zst", cfg) == ("jsonl", "zstd", None)
    assert file_kind("x.parquet.gz", cfg)[2].startswith("a gzip-compressed Parquet file")
    assert file_kind("x.csv", cfg)[2].startswith("unknown format")


def test_hive_partitioned_parquet_keeps_the_partition_columns(tmp_path):
    """A dataset as Spark / Hive (or ``pq.write_to_dataset``) writes it, markers included."""
    table = pa.table({"id": ["a", "b", "c", "d"], "text": TEXTS[:4], "lang": ["de", "de", "en", "fr/be"]})
    pq.write_to_dataset(table, str(tmp_path / "ds"), partition_cols=["lang"])
    (tmp_path / "ds" / "_SUCCESS").write_text("")
    cfg = InputConfig(uri=str(tmp_path / "ds"))
    shards = resolve_shards(cfg)
    assert [s.partitions for s in shards] == [{"lang": "de"}, {"lang": "en"}, {"lang": "fr/be"}]
    rows = [r for s in shards for r in read_shard(s, cfg).to_pylist()]
    assert [(r["id"], r["lang"]) for r in rows] == [("a", "de"), ("b", "de"), ("c", "en"), ("d", "fr/be")]
    # the writer keeps them after the output columns
    from pipeline.input import partition_keys
    from pipeline.schema import conform, output_schema

    keys = partition_keys(shards)
    assert keys == ["lang"] and output_schema(keys).names[-1] == "lang"
    full = pa.Table.from_pylist([{"id": "a", "lang": "de"}], schema=output_schema(keys))
    out = conform(full.append_column("text", pa.array(["dropped"])), keys)
    assert out.schema == output_schema(keys) and out.column("lang").to_pylist() == ["de"]


def test_a_partition_key_that_names_an_output_column_is_refused(tmp_path):
    (tmp_path / "ds" / "error=x").mkdir(parents=True)
    pq.write_table(pa.table({"text": ["t"]}), tmp_path / "ds" / "error=x" / "p.parquet")
    with pytest.raises(InputError, match=r"error=x/p\.parquet.*names an output column"):
        resolve_shards(InputConfig(uri=str(tmp_path / "ds")))


def test_every_file_of_a_folder_is_read_or_named_in_one_warning(tmp_path, caplog):
    d = tmp_path / "in"
    (d / ".cache").mkdir(parents=True)
    (d / "ok.jsonl").write_bytes(PLAIN)
    (d / "notes.txt").write_text("a README of sorts")
    (d / "table.csv").write_text("id,text\n")
    (d / "p.parquet.gz").write_bytes(b"\0")
    (d / "_SUCCESS").write_text("")
    (d / ".cache" / "x.jsonl").write_bytes(PLAIN)
    os.symlink(d / "ok.jsonl", d / "same.jsonl")  # a second name of a listed file
    with caplog.at_level(logging.WARNING, logger="specbatch"):
        shards = resolve_shards(InputConfig(uri=str(d)))
    assert [s.name for s in shards] == ["ok.jsonl"]
    (line,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "6 file(s) not read" in line  # one line, every file named with its reason
    for name, reason in [("notes.txt", "unknown format"), ("table.csv", "unknown format"),
                         ("p.parquet.gz", "gzip-compressed Parquet"), ("_SUCCESS", "hidden"),
                         (".cache/x.jsonl", "hidden"), ("same.jsonl", "the same file as ok.jsonl")]:
        assert name in line and reason in line, (name, line)
    # a glob is listed the same way
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="specbatch"):
        assert [s.name for s in resolve_shards(InputConfig(uri=str(d / "*")))] == ["ok.jsonl"]
    assert "notes.txt" in caplog.records[-1].getMessage()


def test_a_folder_with_no_readable_file_names_them(tmp_path):
    (tmp_path / "a.txt").write_text("x")
    (tmp_path / "b.csv").write_text("y")
    with pytest.raises(InputError, match=r"none of its 2 file\(s\) is read: a\.txt, b\.csv: unknown format"):
        resolve_shards(InputConfig(uri=str(tmp_path)))


def _commit_one(out_cfg: OutputConfig, shards) -> None:
    w = OutputWriter(out_cfg)
    w.on_write_start(shards)
    for s in shards:
        w.write_part(s, pa.Table.from_pylist([{"id": "x", "source_row": i} for i in range(s.num_rows)], schema=OUTPUT_SCHEMA))
    w.on_write_complete({"rows": 1})


def test_the_output_inside_the_input_is_left_out(tmp_path, caplog):
    """Output folder inside (or equal to) the input folder: its parts are never input."""
    d = tmp_path / "in"
    d.mkdir()
    (d / "a.jsonl").write_bytes(PLAIN)
    out = OutputConfig(uri=str(d / "out"), partition_by_date=True, run_date="2026-01-02")
    _commit_one(out, resolve_shards(InputConfig(uri=str(d)), output=listing_view(out)))
    # another specbatch output below the input (another job's): left out as well
    other = OutputConfig(uri=str(d / "older"))
    _commit_one(other, resolve_shards(InputConfig(uri=str(d / "a.jsonl"))))
    with caplog.at_level(logging.INFO, logger="specbatch"):
        shards = resolve_shards(InputConfig(uri=str(d)), output=listing_view(out))
    assert [s.name for s in shards] == ["a.jsonl"]
    info = " ".join(r.getMessage() for r in caplog.records)
    assert f"under {d / 'out'}, the job's output" in info
    assert f"under {d / 'older'}, a specbatch output" in info
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    # the output equal to the input folder: its own files are left out, the input is read
    same = OutputConfig(uri=str(d), allow_foreign_files=True)
    assert [s.name for s in resolve_shards(InputConfig(uri=str(d)), output=listing_view(same))] == ["a.jsonl"]
    # a specbatch output named as the input itself is read (jobs chain: summarize -> translate)
    chained = resolve_shards(InputConfig(uri=str(d / "older"), text_column="output_text"))
    assert [s.name.split(".")[0] for s in chained] == ["part-00000-u00000"]  # (its data file, tagged with its run)


def test_an_input_inside_the_outputs_manifest_or_staging_is_refused(tmp_path):
    out = OutputConfig(uri=str(tmp_path / "out"))
    for sub in ("_manifest", "_staging/run1", "date=2026-01-01/_manifest"):
        (tmp_path / "out" / sub).mkdir(parents=True, exist_ok=True)
        (tmp_path / "out" / sub / "x.jsonl").write_bytes(PLAIN)
        for uri in (tmp_path / "out" / sub / "x.jsonl", tmp_path / "out" / sub, tmp_path / "out" / sub / "*.jsonl"):
            with pytest.raises(InputError, match=r"lies inside the job's output .*_manifest/ or _staging/"):
                resolve_shards(InputConfig(uri=str(uri)), output=listing_view(out))
    # a data file of the output named as the input: refused too
    (tmp_path / "out" / "part-00000-u00000.parquet").write_bytes(b"")
    with pytest.raises(InputError, match="lies inside the job's output .*one of the files"):
        resolve_shards(InputConfig(uri=str(tmp_path / "out" / "part-00000-u00000.parquet")), output=listing_view(out))


def test_another_spelling_of_the_same_input_resumes(tmp_path, monkeypatch):
    """``//``, ``x/..``, ``./``, a relative path, a symlink: one shard, and a committed
    shard is skipped (not "the input changed")."""
    d = tmp_path / "data"
    (d / "x").mkdir(parents=True)
    (d / "a.jsonl.gz").write_bytes(gzip.compress(PLAIN))
    os.symlink(d, tmp_path / "link")
    out = OutputConfig(uri=str(tmp_path / "out"))
    first = resolve_shards(InputConfig(uri=str(d / "a.jsonl.gz")), output=listing_view(out))
    _commit_one(out, first)
    monkeypatch.chdir(tmp_path)
    spellings = [f"{d}//a.jsonl.gz", f"{d}/x/../a.jsonl.gz", f"{d}/./a.jsonl.gz", "data/a.jsonl.gz",
                 "./data/../data/a.jsonl.gz", str(tmp_path / "link" / "a.jsonl.gz"), f"{d}//", "link/"]
    for uri in spellings:
        shards = resolve_shards(InputConfig(uri=uri), output=listing_view(out))
        assert [(s.url, s.fingerprint) for s in shards] == [(first[0].url, first[0].fingerprint)], uri
        assert OutputWriter(out).on_write_start(shards).done == ["part-00000-u00000.parquet"], uri  # resumes: nothing to redo


# ------------------------------------------------------------------ moto S3

@pytest.fixture()
def s3_bucket(moto_s3, request):
    name = "fmt-" + request.node.name.lower().replace("_", "-")[:40].strip("-")
    moto_s3["client"].create_bucket(Bucket=name)
    return name


def test_s3_compressed_folder_partitions_spellings_and_output_exclusion(moto_s3, s3_bucket, caplog):
    c, b, opts = moto_s3["client"], s3_bucket, moto_s3["options"]
    c.put_object(Bucket=b, Key="in/a.jsonl.gz", Body=gzip.compress(PLAIN))
    c.put_object(Bucket=b, Key="in/lang=de/b.jsonl.zst", Body=COMPRESS[".zst"](PLAIN))
    c.put_object(Bucket=b, Key="in/lang=en/c.jsonl.bz2", Body=bz2.compress(PLAIN))
    c.put_object(Bucket=b, Key="in/notes.txt", Body=b"x")
    out = OutputConfig(uri=f"s3://{b}/in/out/", storage_options=opts)
    cfg = InputConfig(uri=f"s3://{b}/in/", storage_options=opts)
    with caplog.at_level(logging.INFO, logger="specbatch"):
        shards = resolve_shards(cfg, output=listing_view(out))
    assert [(s.name, s.compression, s.partitions) for s in shards] == [
        ("a.jsonl.gz", "gzip", None), ("lang=de/b.jsonl.zst", "zstd", {"lang": "de"}),
        ("lang=en/c.jsonl.bz2", "bz2", {"lang": "en"})]
    assert all(_rows(s, cfg) == EXPECTED for s in shards)
    assert read_shard(shards[1], cfg, partition_keys=["lang"]).column("lang").to_pylist() == ["de"] * 3
    assert any("notes.txt" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    _commit_one(out, shards)
    # rerun: the output under the input prefix is left out, the folder with or without its
    # slash resumes; keys are strings: in/./ and in/x/../ are other (empty) prefixes, not in/
    for uri in (f"s3://{b}/in/", f"s3://{b}/in"):
        again = resolve_shards(InputConfig(uri=uri, storage_options=opts), output=listing_view(out))
        assert [s.url for s in again] == [s.url for s in shards], uri
        assert OutputWriter(out).on_write_start(again).done == ["part-00000-u00000.parquet", "part-00001-u00000.parquet", "part-00002-u00000.parquet"], uri
    for uri in (f"s3://{b}/in/./", f"s3://{b}/in/x/../"):
        with pytest.raises(InputError, match="input not found"):
            resolve_shards(InputConfig(uri=uri, storage_options=opts), output=listing_view(out))
    with pytest.raises(InputError, match=r"lies inside the job's output s3://.*/in/out"):
        resolve_shards(InputConfig(uri=f"s3://{b}/in/out/_manifest/", storage_options=opts), output=listing_view(out))


def test_an_input_with_no_text_column_at_all_is_refused_naming_it(tmp_path):
    """Not "prompt is null" on every row: a Parquet file whose schema lacks the text column,
    a JSONL file none of whose lines has the field, is refused before any work, naming the
    key and what the file has; a JSONL file where some line has it is read (the others are
    the rows' own errors)."""
    pq.write_table(pa.table({"id": ["a"], "article": ["x"]}), tmp_path / "a.parquet")
    with pytest.raises(InputError, match=r"a\.parquet' has no column 'text' \(input.text_column\); its columns are "
                                         r"\['id', 'article'\]"):
        resolve_shards(InputConfig(uri=str(tmp_path / "a.parquet")))
    write_jsonl(tmp_path / "b.jsonl", [{"id": "a", "body": "x"}, {"id": "b", "body": "y"}])
    with pytest.raises(InputError, match=r"b\.jsonl' has no field 'text' \(input.text_column\) on any of its 2 lines"):
        resolve_shards(InputConfig(uri=str(tmp_path / "b.jsonl")))
    (shard,) = resolve_shards(InputConfig(uri=str(tmp_path / "b.jsonl"), text_column="body"))
    assert shard.num_rows == 2
    write_jsonl(tmp_path / "c.jsonl", [{"id": "a", "body": "x"}, {"id": "b", "text": "y"}])
    rows = read_shard(resolve_shards(InputConfig(uri=str(tmp_path / "c.jsonl")))[0], InputConfig(uri="x")).to_pylist()
    assert [r["text"] for r in rows] == [None, "y"]
