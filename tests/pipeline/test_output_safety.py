"""The job never touches files that are not its own: a folder holding foreign files is
refused (unless ``output.allow_foreign_files``), foreign files survive ``--overwrite`` and
every commit, files of a run that died mid-publish (orphans) are cleaned by the next run, stale
``_staging/`` folders go after a successful run, a shard larger than
``output.max_rows_per_file`` is written as several files under one manifest entry, and names
read back from the manifest (the commit log, and the records of earlier versions) are checked
before any is used.  On local disk and on moto S3."""

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import OutputConfig
from pipeline.output import OutputError, is_complete
from pipeline.output import OutputWriter
from pipeline.output.commit_log import CommitLog
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
    """The job's files but the commit log's records."""
    return {k: v for k, v in files.items() if k not in FOREIGN and not k.startswith("_manifest/log/")}


def _log(files):
    """The commit log's records, in order."""
    return [json.loads(v) for k, v in sorted(files.items()) if k.startswith("_manifest/log/")]


def _committed(s):
    """Part -> manifest entry, as the job reads them back."""
    return OutputWriter(s.cfg()).location.read_manifest()


def test_a_folder_with_foreign_files_is_refused_and_they_are_never_deleted(store):
    s = store()
    for rel, data in FOREIGN.items():
        s.put(rel, data)
    for kw in ({}, {"overwrite": True}):
        with pytest.raises(OutputError, match="3 file\\(s\\) this job did not write: nested/old.parquet, notes.txt, "
                                              "part-archive.parquet.*allow_foreign_files"):
            OutputWriter(s.cfg(**kw)).on_write_start()
    assert s.files() == FOREIGN  # refused before touching anything

    # allowed: the job writes beside them, and neither commit nor --overwrite touches them
    for run in range(2):
        w = OutputWriter(s.cfg(allow_foreign_files=True, overwrite=run > 0))
        w.on_write_start()
        w.write_part(0, _rows(3))
        w.on_write_complete({"rows": 3})
        files = s.files()
        assert {k: files[k] for k in FOREIGN} == FOREIGN
        assert sorted(_ours(files)) == ["_SUCCESS", "_summary.json", f"part-00000-u00000.{w.run_id}.parquet"]
        assert _committed(s)["part-00000-u00000.parquet"].run_id == w.run_id
    assert is_complete(s.base, s.options)


@pytest.mark.parametrize("clash", ["part-00003-u00000.parquet", "part-00000-u00000-00001.parquet", "_summary.json",
                                   # the naming of a run this output's commit log does not know
                                   "part-00000-u00000.0123456789ab.parquet"])
def test_a_foreign_file_with_a_name_the_job_writes_is_always_refused(store, clash):
    s = store()
    s.put(clash, b"not ours")
    for kw in ({}, {"allow_foreign_files": True}, {"allow_foreign_files": True, "overwrite": True}):
        with pytest.raises(OutputError, match=clash.replace(".", "\\.")):
            OutputWriter(s.cfg(**kw)).on_write_start()
    assert s.files() == {clash: b"not ours"}


def test_an_output_of_another_tool_is_refused(store):
    """Spark-style: parts and a _SUCCESS, no manifest."""
    s = store()
    s.put("_SUCCESS", b"")
    s.put("part-00000-u00000.parquet", _parquet_bytes())
    with pytest.raises(OutputError, match="without a manifest"):
        OutputWriter(s.cfg(overwrite=True, allow_foreign_files=True)).on_write_start()
    assert sorted(s.files()) == ["_SUCCESS", "part-00000-u00000.parquet"]


def test_a_large_unit_is_written_in_files_of_max_rows_per_file(store):
    s = store()
    w = OutputWriter(s.cfg(max_rows_per_file=10))
    w.on_write_start()
    # rows given out of order (batches of odd sizes, last first); 3 error rows
    batches, start = [], 0
    for n in (3, 7, 1, 9, 5):
        batches.append(_rows(n, start, errors={4, 12, 24}))
        start += n
    w.write_part(0, pa.concat_tables(batches[::-1]))
    w.write_part(1, _rows(4))
    w.on_write_complete({"rows": 29})
    files = s.files()
    names = [f"part-00000-u00000.{w.run_id}.{i:05d}.parquet" for i in range(3)]
    assert sorted(k for k in files if k.startswith("part-")) == names + [f"part-00001-u00000.{w.run_id}.parquet"]
    sizes = [pq.read_table(io.BytesIO(files[n])).num_rows for n in names]
    assert sizes == [10, 10, 5]
    ids = [i for n in names for i in pq.read_table(io.BytesIO(files[n])).column("id").to_pylist()]
    assert ids == [str(i) for i in range(25)]  # in row order across the files
    entries = _committed(s)
    assert list(entries["part-00000-u00000.parquet"].files) == names
    assert entries["part-00000-u00000.parquet"].rows == 25 and entries["part-00000-u00000.parquet"].errors == 3
    assert list(entries["part-00001-u00000.parquet"].files) == [f"part-00001-u00000.{w.run_id}.parquet"]
    assert [r["kind"] for r in _log(files)] == ["epoch", "unit", "unit", "final"]
    assert not any(k.startswith(("_staging", "_manifest/pending")) for k in files)


def test_files_of_a_run_that_died_mid_publish_are_removed_and_foreign_ones_kept(store, monkeypatch):
    """Run 1 publishes unit 0's files and dies before its record in the commit log (and leaves
    its staging behind, as a SIGKILL would): its files are orphans, the job's own (they carry
    the id of a run of the log), not foreign.  Run 2 rewrites unit 0 (fewer files now) and
    its commit removes them, naming them."""
    s = store()
    s.put("notes.txt", b"keep me")
    original = CommitLog.append

    def die_at_the_unit_record(self, record):
        if record.kind == "unit":
            raise RuntimeError("killed")
        return original(self, record)

    monkeypatch.setattr(CommitLog, "append", die_at_the_unit_record)
    w1 = OutputWriter(s.cfg(allow_foreign_files=True, max_rows_per_file=2))
    w1.on_write_start()
    with pytest.raises(RuntimeError, match="killed"):
        w1.write_part(0, _rows(5))
    monkeypatch.setattr(CommitLog, "append", original)
    s.put(f"_staging/{w1.run_id}/part-00001/00000.parquet", b"left by a killed run")
    dead = [f"part-00000-u00000.{w1.run_id}.{i:05d}.parquet" for i in range(3)]
    assert set(dead) <= set(s.files()) and _committed(s) == {}

    w2 = OutputWriter(s.cfg(allow_foreign_files=True))  # not refused: those files are ours
    assert w2.on_write_start([]).done == [] and w2.location.foreign == ["notes.txt"] and w2.location.orphans == dead
    w2.write_part(0, _rows(5))
    w2.on_write_complete({"rows": 5})
    files = s.files()
    assert sorted(_ours(files)) == ["_SUCCESS", "_summary.json", f"part-00000-u00000.{w2.run_id}.parquet"]
    assert files["notes.txt"] == b"keep me"


def test_an_orphan_is_removed_by_overwrite_and_by_a_run_with_nothing_to_do(store):
    """A data file of the job's own that no committed unit names is never foreign: a rerun with
    nothing to do removes it, and so does --overwrite."""
    from pipeline.units import Shard, Split, Unit

    s = store()
    unit = Unit(Shard(index=0, url=None, format="jsonl", num_rows=2), 0, Split(0, 2))
    w = OutputWriter(s.cfg())
    w.on_write_start([unit])
    w.write_part(unit, _rows(2))
    w.on_write_complete({"rows": 2})
    committed = f"part-00000-u00000.{w.run_id}.parquet"
    for kw in ({}, {"overwrite": True}):
        orphan = f"part-00000-u00000.{w.run_id}.00007.parquet"  # as a run that lost its lease leaves them
        s.put(orphan, s.files()[committed])
        again = OutputWriter(s.cfg(**kw))
        plan = again.on_write_start([unit])
        assert again.location.foreign == [] and orphan not in s.files()
        if kw:
            assert plan.done == [] and committed not in s.files()
        else:
            assert plan.nothing_to_do and plan.done == ["part-00000-u00000.parquet"] and committed in s.files()
            assert is_complete(s.base, s.options)


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
    (part,) = out.glob("part-00000-u00000.*.parquet")
    assert pq.read_table(part).num_rows == 3 and is_complete(str(out))


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


@pytest.mark.parametrize("where", ["intent", "legacy entry", "log record"])
@pytest.mark.parametrize("forged", FORGED_NAMES)
def test_a_forged_name_in_the_manifest_is_refused_naming_the_file_and_nothing_is_deleted(
        store, tmp_path, request, where, forged):
    s = store()
    victim = Victim(s, tmp_path, request.getfixturevalue("moto_s3") if s.kind == "s3" else None)
    name = getattr(victim, forged, forged)
    w = OutputWriter(s.cfg())
    w.on_write_start()
    w.write_part(0, _rows(2))  # a real committed shard beside the forged record
    if where == "intent":  # of an earlier version
        rel = "_manifest/pending/part-00000-u00000.0123456789ab.json"
        s.put(rel, json.dumps({"part": "part-00000-u00000.parquet", "files": [name], "run_id": "0123456789ab"}).encode())
    elif where == "legacy entry":
        rel = "_manifest/part-00000-u00000.json"
        s.put(rel, json.dumps({"part": "part-00000-u00000.parquet", "files": [name]}).encode())
    else:
        rel = "_manifest/log/0000000001.json"
        entry = json.loads(s.files()[rel])
        s.put(rel, json.dumps(dict(entry, files=[name])).encode())
    before = s.files()
    for kw in ({}, {"overwrite": True}, {"overwrite": True, "allow_foreign_files": True}):
        with pytest.raises(OutputError, match=f"{rel.replace('.', '[.]')} names the files .*not the names this job "
                                              "gives unit 0 of shard 0 .*does nothing"):
            OutputWriter(s.cfg(**kw)).on_write_start([])
        assert s.files() == before and victim.intact()
    # and a commit that meets the forged intent (written while the run ran) deletes nothing either
    if where == "intent":
        with pytest.raises(OutputError, match=rel.replace(".", "[.]")):
            w.on_write_complete({"rows": 2})
        assert victim.intact() and f"part-00000-u00000.{w.run_id}.parquet" in s.files()


@pytest.mark.parametrize("record", [{"part": "part-00001-u00000.parquet", "files": ["part-00001-u00000.parquet"]},
                                    {"part": "../part-00000-u00000.parquet"}, ["part-00000-u00000.parquet"], {"files": []}])
def test_a_manifest_entry_for_another_shard_or_of_another_shape_is_refused(store, record):
    s = store()
    s.put("_manifest/part-00000-u00000.json", json.dumps(record).encode())
    for kw in ({}, {"overwrite": True}):
        with pytest.raises(OutputError, match="_manifest/part-00000-u00000.json"):
            OutputWriter(s.cfg(**kw)).on_write_start([])
    assert list(s.files()) == ["_manifest/part-00000-u00000.json"]


@pytest.mark.parametrize("rel", ["_manifest/input.jsonl", "_manifest/pending/notes.txt", "_manifest/part-1.json",
                                 "_manifest/log/notes.txt", "_manifest/log/12.json",
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
        OutputWriter(s.cfg(overwrite=True)).on_write_start()
    for run in range(2):
        w = OutputWriter(s.cfg(overwrite=True, allow_foreign_files=True))
        assert w.on_write_start().done == [] and w.location.foreign == [rel]
        w.write_part(0, _rows(1))
        w.on_write_complete({"rows": 1})
        files = s.files()
        assert files[rel] == b'{"id": "x", "text": "keep me"}\n'
        assert sorted(set(_ours(files)) - {rel}) == ["_SUCCESS", "_summary.json",
                                                     f"part-00000-u00000.{w.run_id}.parquet"]


@pytest.mark.parametrize("link", ["_staging", "_manifest", "_manifest/pending", "_manifest/log", "_staging/0123456789ab",
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
            OutputWriter(OutputConfig(uri=str(out), **kw)).on_write_start()
    assert (elsewhere / "data.txt").read_text() == "not the job's" and sorted(p.name for p in elsewhere.iterdir()) == [
        "data.txt"]


@pytest.mark.parametrize("forge", ["not json", "a list", "another number", "another kind", "no run", "a unit of another part",
                                   "untagged files"])
def test_a_record_of_the_commit_log_that_is_not_the_job_s_is_refused_and_nothing_is_deleted(store, forge):
    s = store()
    w = OutputWriter(s.cfg())
    w.on_write_start([])
    w.write_part(0, _rows(2))
    rel = "_manifest/log/0000000001.json"
    unit = json.loads(s.files()[rel])
    forged = {"not json": b"{unit", "a list": json.dumps([unit]).encode(),
              "another number": json.dumps(dict(unit, seq=7)).encode(),
              "another kind": json.dumps(dict(unit, kind="delete")).encode(),
              "no run": json.dumps(dict(unit, run_id="../x")).encode(),
              "a unit of another part": json.dumps(dict(unit, part="part-00001-u00000.parquet")).encode(),
              "untagged files": json.dumps(dict(unit, files=["part-00000-u00000.parquet"])).encode()}[forge]
    s.put(rel, forged)
    before = s.files()
    for kw in ({}, {"overwrite": True}):
        with pytest.raises(OutputError, match=rel.replace(".", "[.]")):
            OutputWriter(s.cfg(**kw)).on_write_start([])
        assert s.files() == before
