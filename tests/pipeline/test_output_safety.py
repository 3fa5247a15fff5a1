"""The job never touches files that are not its own: a folder holding foreign files is
refused (unless ``output.allow_foreign_files``), foreign files survive ``--overwrite`` and
every commit, files of a run that died mid-publish are cleaned by the next run, stale
``_staging/`` folders go after a successful run, and a shard larger than
``output.max_rows_per_file`` is written as several files under one manifest entry.
On local disk and on moto S3."""

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import pipeline.output.writer
from pipeline.config import OutputConfig
from pipeline.output import OutputError, is_complete
from pipeline.output import OutputWriter
from pipeline.schema import OUTPUT_SCHEMA


def _parquet_bytes(n=2):
    buf = io.BytesIO()
    pq.write_table(pa.table({"id": [f"archived-{i}" for i in range(n)], "x": list(range(n))}), buf)
    return buf.getvalue()


FOREIGN = {"part-archive.parquet": _parquet_bytes(), "notes.txt": b"keep me", "nested/old.parquet": _parquet_bytes(3)}


class Store:
    """One output location on local disk or on moto S3, read and written behind the job's back."""

    def __init__(self, kind, tmp_path, moto, name):
        self.kind = kind
        if kind == "local":
            self.root = tmp_path / name
            self.base = str(self.root)
            self.options = {}
        else:
            self.client, self.bucket, self.prefix = moto["client"], "safety", f"{tmp_path.name}/{name}"
            self.client.create_bucket(Bucket=self.bucket)
            self.base = f"s3://{self.bucket}/{self.prefix}"
            self.options = moto["options"]

    def put(self, rel, data):
        if self.kind == "local":
            p = self.root / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
        else:
            self.client.put_object(Bucket=self.bucket, Key=f"{self.prefix}/{rel}", Body=data)

    def files(self):
        """Relative path -> bytes of every file under the location."""
        if self.kind == "local":
            return {str(p.relative_to(self.root)): p.read_bytes() for p in self.root.rglob("*") if p.is_file()} \
                if self.root.exists() else {}
        out = {}
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix + "/"):
            for o in page.get("Contents", []):
                body = self.client.get_object(Bucket=self.bucket, Key=o["Key"])["Body"].read()
                out[o["Key"][len(self.prefix) + 1:]] = body
        return out

    def cfg(self, **kw):
        return OutputConfig(uri=self.base, storage_options=self.options, **kw)


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    moto = request.getfixturevalue("moto_s3") if request.param == "s3" else None
    return lambda name="out": Store(request.param, tmp_path, moto, name)


def _rows(n, start=0, errors=()):
    return pa.Table.from_pylist([{"id": str(i), "source_row": i, "error": "E: x" if i in errors else None}
                                 for i in range(start, start + n)], schema=OUTPUT_SCHEMA)


def _ours(files):
    return {k: v for k, v in files.items() if k not in FOREIGN}


def test_a_folder_with_foreign_files_is_refused_and_they_are_never_deleted(store):
    s = store()
    for rel, data in FOREIGN.items():
        s.put(rel, data)
    for kw in ({}, {"overwrite": True}):
        with pytest.raises(OutputError, match="3 file\\(s\\) this job did not write: nested/old.parquet, notes.txt, "
                                              "part-archive.parquet.*allow_foreign_files"):
            OutputWriter(s.cfg(**kw)).prepare()
    assert s.files() == FOREIGN  # refused before touching anything

    # allowed: the job writes beside them, and neither commit nor --overwrite touches them
    for run in range(2):
        w = OutputWriter(s.cfg(allow_foreign_files=True, overwrite=run > 0))
        w.prepare()
        w.write_part(0, _rows(3))
        w.commit({"rows": 3})
        files = s.files()
        assert {k: files[k] for k in FOREIGN} == FOREIGN
        assert sorted(_ours(files)) == ["_SUCCESS", "_manifest/part-00000-u00000.json", "_summary.json", "part-00000-u00000.parquet"]
        assert json.loads(files["_manifest/part-00000-u00000.json"])["run_id"] == w.run_id
    assert is_complete(s.base, s.options)


@pytest.mark.parametrize("clash", ["part-00003-u00000.parquet", "part-00000-u00000-00001.parquet", "_summary.json"])
def test_a_foreign_file_with_a_name_the_job_writes_is_always_refused(store, clash):
    s = store()
    s.put(clash, b"not ours")
    for kw in ({}, {"allow_foreign_files": True}, {"allow_foreign_files": True, "overwrite": True}):
        with pytest.raises(OutputError, match=clash.replace(".", "\\.")):
            OutputWriter(s.cfg(**kw)).prepare()
    assert s.files() == {clash: b"not ours"}


def test_an_output_of_another_tool_is_refused(store):
    """Spark-style: parts and a _SUCCESS, no manifest."""
    s = store()
    s.put("_SUCCESS", b"")
    s.put("part-00000-u00000.parquet", _parquet_bytes())
    with pytest.raises(OutputError, match="without a manifest"):
        OutputWriter(s.cfg(overwrite=True, allow_foreign_files=True)).prepare()
    assert sorted(s.files()) == ["_SUCCESS", "part-00000-u00000.parquet"]


def test_a_large_unit_is_written_in_files_of_max_rows_per_file(store):
    s = store()
    w = OutputWriter(s.cfg(max_rows_per_file=10))
    w.prepare()
    # rows given out of order (batches of odd sizes, last first); 3 error rows
    batches, start = [], 0
    for n in (3, 7, 1, 9, 5):
        batches.append(_rows(n, start, errors={4, 12, 24}))
        start += n
    w.write_part(0, pa.concat_tables(batches[::-1]))
    w.write_part(1, _rows(4))
    w.commit({"rows": 29})
    files = s.files()
    names = ["part-00000-u00000-00000.parquet", "part-00000-u00000-00001.parquet", "part-00000-u00000-00002.parquet"]
    assert sorted(k for k in files if k.startswith("part-")) == names + ["part-00001-u00000.parquet"]
    sizes = [pq.read_table(io.BytesIO(files[n])).num_rows for n in names]
    assert sizes == [10, 10, 5]
    ids = [i for n in names for i in pq.read_table(io.BytesIO(files[n])).column("id").to_pylist()]
    assert ids == [str(i) for i in range(25)]  # in row order across the files
    entry = json.loads(files["_manifest/part-00000-u00000.json"])
    assert entry["files"] == names and entry["rows"] == 25 and entry["errors"] == 3
    assert json.loads(files["_manifest/part-00001-u00000.json"])["files"] == ["part-00001-u00000.parquet"]
    assert not any(k.startswith(("_staging", "_manifest/pending")) for k in files)


def test_files_of_a_run_that_died_mid_publish_are_removed_and_foreign_ones_kept(store, monkeypatch):
    """Run 1 publishes shard 0's files and dies before its manifest entry (and leaves its
    staging behind, as a SIGKILL would).  Run 2 rewrites shard 0 (fewer files now) and its
    commit removes the files only the dead run's publish intent names."""
    s = store()
    s.put("notes.txt", b"keep me")
    original = OutputWriter._write_json

    def die_at_manifest_entry(self, path, obj, what, staged_as=None):
        if "manifest entry" in what:
            raise RuntimeError("killed")
        return original(self, path, obj, what, staged_as)

    monkeypatch.setattr(OutputWriter, "_write_json", die_at_manifest_entry)
    w1 = OutputWriter(s.cfg(allow_foreign_files=True, max_rows_per_file=2))
    w1.prepare()
    with pytest.raises(RuntimeError, match="killed"):
        w1.write_part(0, _rows(5))
    monkeypatch.setattr(OutputWriter, "_write_json", original)
    s.put(f"_staging/{w1.run_id}/part-00001/00000.parquet", b"left by a killed run")
    files = s.files()
    assert {"part-00000-u00000-00000.parquet", "part-00000-u00000-00002.parquet",
            f"_manifest/pending/part-00000-u00000.{w1.run_id}.json"} <= set(files)
    assert "_manifest/part-00000-u00000.json" not in files

    w2 = OutputWriter(s.cfg(allow_foreign_files=True))  # not refused: those files are ours
    assert w2.prepare([]).done == [] and w2.location.foreign == ["notes.txt"]
    w2.write_part(0, _rows(5))
    w2.commit({"rows": 5})
    assert sorted(s.files()) == ["_SUCCESS", "_manifest/part-00000-u00000.json", "_summary.json", "notes.txt",
                                 "part-00000-u00000.parquet"]


def test_the_issue_example_part_archive_survives_a_run(ray_local, tiny_models, tmp_path):
    from pipeline_testkit import TEXTS, job_config, write_jsonl
    from pipeline.run import run_job

    write_jsonl(tmp_path / "in" / "a.jsonl", [{"id": i, "text": t} for i, t in enumerate(TEXTS[:3])])
    out = tmp_path / "out"
    out.mkdir()
    (out / "part-archive.parquet").write_bytes(FOREIGN["part-archive.parquet"])
    cfg = lambda *o: job_config(tiny_models, str(tmp_path / "in"), str(out), method="plain",
                                overrides=["generation.max_new_tokens=3", *o])
    with pytest.raises(OutputError, match="part-archive.parquet"):
        run_job(cfg(), progress=False)
    with pytest.raises(OutputError, match="part-archive.parquet"):
        run_job(cfg("output.overwrite=true"), progress=False)
    summary = run_job(cfg("output.overwrite=true", "output.allow_foreign_files=true"), progress=False)
    assert summary["rows"] == 3
    assert (out / "part-archive.parquet").read_bytes() == FOREIGN["part-archive.parquet"]
    assert pq.read_table(out / "part-00000-u00000.parquet").num_rows == 3 and is_complete(str(out))


# ---------------------------------------------------------------------------- names from _manifest/
class Victim:
    """A file outside the output folder (local: beside it; S3: in another bucket) that a
    forged manifest name points at."""

    def __init__(self, s, tmp_path, moto):
        if s.kind == "local":
            self.path = tmp_path / "victim.txt"
            self.path.write_bytes(b"precious")
            self.relative = "../victim.txt"
            self.absolute = str(self.path)
        else:
            self.client = moto["client"]
            self.client.create_bucket(Bucket="victim-bucket")
            self.client.put_object(Bucket="victim-bucket", Key="victim.txt", Body=b"precious")
            self.client.put_object(Bucket=s.bucket, Key=f"{s.prefix.rsplit('/', 1)[0]}/victim.txt", Body=b"precious")
            self.relative = "../victim.txt"
            self.absolute = "/victim-bucket/victim.txt"

    def intact(self):
        if hasattr(self, "client"):
            return self.client.get_object(Bucket="victim-bucket", Key="victim.txt")["Body"].read() == b"precious"
        return self.path.read_bytes() == b"precious"


FORGED_NAMES = ["relative", "absolute", "nested/part-00000-u00000.parquet", "part-00001-u00000.parquet", "part-00000-u00000.parquet\n",
                "part-00000-u00000-00000.parquet"]


@pytest.mark.parametrize("where", ["intent", "entry"])
@pytest.mark.parametrize("forged", FORGED_NAMES)
def test_a_forged_name_in_the_manifest_is_refused_naming_the_file_and_nothing_is_deleted(
        store, tmp_path, request, where, forged):
    s = store()
    victim = Victim(s, tmp_path, request.getfixturevalue("moto_s3") if s.kind == "s3" else None)
    name = getattr(victim, forged, forged)
    w = OutputWriter(s.cfg())
    w.prepare()
    w.write_part(0, _rows(2))  # a real committed shard beside the forged record
    if where == "intent":
        rel = "_manifest/pending/part-00000-u00000.0123456789ab.json"
        s.put(rel, json.dumps({"part": "part-00000-u00000.parquet", "files": [name], "run_id": "0123456789ab"}).encode())
    else:
        rel = "_manifest/part-00000-u00000.json"
        entry = json.loads(s.files()[rel])
        s.put(rel, json.dumps(dict(entry, files=[name])).encode())
    before = s.files()
    for kw in ({}, {"overwrite": True}, {"overwrite": True, "allow_foreign_files": True}):
        with pytest.raises(OutputError, match=f"{rel.replace('.', '[.]')} names the files .*not the names this job "
                                              "gives unit 0 of shard 0 .*does nothing"):
            OutputWriter(s.cfg(**kw)).prepare([])
        assert s.files() == before and victim.intact()
    # and a commit that meets the forged intent (written while the run ran) deletes nothing either
    if where == "intent":
        s.put("_manifest/part-00000-u00000.json", before.get("_manifest/part-00000-u00000.json", b""))
        with pytest.raises(OutputError, match=rel.replace(".", "[.]")):
            w.commit({"rows": 2})
        assert victim.intact() and "part-00000-u00000.parquet" in s.files()


@pytest.mark.parametrize("record", [{"part": "part-00001-u00000.parquet", "files": ["part-00001-u00000.parquet"]},
                                    {"part": "../part-00000-u00000.parquet"}, ["part-00000-u00000.parquet"], {"files": []}])
def test_a_manifest_entry_for_another_shard_or_of_another_shape_is_refused(store, record):
    s = store()
    s.put("_manifest/part-00000-u00000.json", json.dumps(record).encode())
    for kw in ({}, {"overwrite": True}):
        with pytest.raises(OutputError, match="_manifest/part-00000-u00000.json"):
            OutputWriter(s.cfg(**kw)).prepare([])
    assert list(s.files()) == ["_manifest/part-00000-u00000.json"]


@pytest.mark.parametrize("rel", ["_manifest/input.jsonl", "_manifest/pending/notes.txt", "_manifest/part-1.json",
                                 "_staging/data.csv", "_staging/0123456789ab/other.parquet",
                                 # digits that are not ASCII (Arabic-Indic, fullwidth) name no shard of the job
                                 "_manifest/part-\u0660\u0660\u0660\u0660\u0661.json",
                                 "_manifest/pending/part-\uff10\uff10\uff10\uff10\uff11.0123456789ab.json",
                                 "_staging/0123456789ab/part-\u0660\u0660\u0660\u0660\u0661.parquet.json"])
def test_foreign_files_under_manifest_and_staging_are_foreign_and_survive_overwrite_and_commit(store, rel):
    """An input placed under the output's _manifest/, say: never deleted, not even by --overwrite."""
    s = store()
    s.put(rel, b'{"id": "x", "text": "keep me"}\n')
    with pytest.raises(OutputError, match=f"1 file\\(s\\) this job did not write: {rel.replace('.', '[.]')}"):
        OutputWriter(s.cfg(overwrite=True)).prepare()
    for run in range(2):
        w = OutputWriter(s.cfg(overwrite=True, allow_foreign_files=True))
        assert w.prepare().done == [] and w.location.foreign == [rel]
        w.write_part(0, _rows(1))
        w.commit({"rows": 1})
        files = s.files()
        assert files[rel] == b'{"id": "x", "text": "keep me"}\n'
        assert sorted(set(files) - {rel}) == ["_SUCCESS", "_manifest/part-00000-u00000.json", "_summary.json",
                                              "part-00000-u00000.parquet"]


@pytest.mark.parametrize("link", ["_staging", "_manifest", "_manifest/pending", "_staging/0123456789ab",
                                  "_SUCCESS", "_summary.json"])
def test_a_symlink_where_the_job_writes_its_own_files_is_refused(tmp_path, link):
    out = tmp_path / "out"
    (out / link).parent.mkdir(parents=True, exist_ok=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "data.txt").write_text("not the job's")
    (out / link).symlink_to(elsewhere if not link.startswith("_S") and "summary" not in link else elsewhere / "data.txt")
    for kw in ({}, {"overwrite": True, "allow_foreign_files": True}):
        with pytest.raises(OutputError, match=f"{link.replace('.', '[.]')} is a symbolic link .*never through a link"):
            OutputWriter(OutputConfig(uri=str(out), **kw)).prepare()
    assert (elsewhere / "data.txt").read_text() == "not the job's" and sorted(p.name for p in elsewhere.iterdir()) == [
        "data.txt"]
