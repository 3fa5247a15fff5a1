"""Nightly reuse trusts nothing it has not checked (issue 56, items 2-4 and the kinds not yet
probed): each committed data file carries its SHA-256, size and rows in its unit's record and
every reader checks them; a damaged previous file is named and its rows are decoded afresh
(counted in ``previous.rejected_rows``), never copied; token ids outside the target's
vocabulary and malformed reuse keys are rejected before any cast; a resume over a damaged
committed file is refused before it writes, with advice that works; ``--previous`` naming the
output itself by any spelling is refused before ``--overwrite`` deletes anything.

The previous outputs are written by an :class:`OutputWriter` in this process (no Ray); one
end-to-end night on a local Ray is marked slow.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import OutputConfig
from pipeline.units import Shard, Split, Unit
from pipeline.output import OutputWriter
from pipeline.output.location import OutputError
from pipeline.output.reader import RUN_COLUMN, CommittedOutput, DamagedFile
from pipeline.processor import check_generation
from pipeline.reuse import ReuseTable, RowReuse, read_previous
from pipeline.run import run_identity
from pipeline.schema import OUTPUT_SCHEMA
from pipeline_testkit import TEXTS, job_config, write_jsonl

SOURCE = "/in/articles.jsonl"
SHARD = Shard(index=0, url=SOURCE, format="jsonl", num_rows=4, fingerprint="size=40;mtime=1")
UNITS = [Unit(SHARD, k, Split(2 * k, 2)) for k in range(2)]


def _rows(unit: Unit, **changed) -> pa.Table:
    return pa.Table.from_pylist([{"id": f"r{i}", "output_text": f"o{i}", "finish_reason": "length", "error": None,
                                  "source_file": SOURCE, "source_row": i, "output_token_ids": [i, 40 + i],
                                  "reuse_key": f"{i:032x}", **changed}
                                 for i in range(unit.split.start, unit.split.start + 2)], schema=OUTPUT_SCHEMA)


def _write(uri, identity=None, storage_options=None, finished=True) -> OutputWriter:
    """Both units committed (and the run finished) into the output ``uri``."""
    w = OutputWriter(OutputConfig(uri=str(uri), storage_options=storage_options or {}))
    w.on_write_start(UNITS, identity)
    for u in UNITS:
        w.write_part(u, _rows(u))
    if finished:
        w.on_write_complete({"rows": 4})
    return w


def _file_of(out: Path, unit: int) -> Path:
    (name,) = [n for n in os.listdir(out) if n.startswith(f"part-00000-u{unit:05d}.")]
    return out / name


# ------------------------------------------------------------------ item 2: every copied byte checked
def test_each_unit_record_carries_each_files_sha256_size_and_rows(tmp_path):
    _write(tmp_path / "out")
    out = CommittedOutput.open(str(tmp_path / "out"))
    for part, e in out.entries.items():
        assert set(e.checksums) == set(e.files)
        for name, c in e.checksums.items():
            data = (tmp_path / "out" / name).read_bytes()
            assert c.to_json() == {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "rows": 2}
    assert out.table().num_rows == 4 and out.unverified == []


def _damage(path: Path, how: str, other: Path) -> None:
    if how == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif how == "replaced by other valid Parquet":  # the same schema, the same size class, other rows
        pq.write_table(_rows(UNITS[1], output_token_ids=[7, 7]), path)
    elif how == "missing":
        path.unlink()
    elif how == "a symlink to another output's file":  # valid Parquet of the job, not this unit's bytes
        pq.write_table(_rows(UNITS[1], output_token_ids=[8, 8]), other)
        path.unlink()
        path.symlink_to(other)
    elif how == "one byte flipped":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 1
        path.write_bytes(bytes(data))


DAMAGES = ["truncated", "replaced by other valid Parquet", "missing", "a symlink to another output's file",
           "one byte flipped"]
SAID = {"truncated": "not the", "replaced by other valid Parquet": "", "missing": "is missing",
        "a symlink to another output's file": "", "one byte flipped": "SHA-256"}


@pytest.mark.parametrize("how", DAMAGES)
def test_a_damaged_previous_file_is_named_its_rows_decoded_afresh_and_never_copied(how, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="specbatch")
    _write(tmp_path / "prev")
    damaged = _file_of(tmp_path / "prev", 1)
    _damage(damaged, how, tmp_path / "elsewhere.parquet")
    table, counts = read_previous(str(tmp_path / "prev"), vocab_size=64)
    assert counts["rows"] == counts["usable"] == 2 and counts["rejected_rows"] == 2
    (reason,) = counts["rejected"]
    assert reason.startswith(damaged.name + ": ") and SAID[how] in reason and counts["rejected"][reason] == 2
    assert [table.find(f"{i:032x}") is not None for i in range(4)] == [True, True, False, False]
    said = [r.getMessage() for r in caplog.records if damaged.name in r.getMessage()]
    assert said and "decoded afresh" in said[0] and "part-00000-u00001" in said[0]
    # the pool is the same table: the rejected rows seed nothing
    docs = RowReuse("fp", table, pool=100).pool_documents()
    assert sorted(docs) == [[0, 40], [1, 41]]
    # reports and training read through the same reader: refused, naming the file (exit 2 there)
    with pytest.raises(DamagedFile, match=damaged.name):
        CommittedOutput.open(str(tmp_path / "prev")).table()


def test_ids_outside_the_vocabulary_and_malformed_keys_are_rejected_before_any_cast():
    good = [{"reuse_key": f"{i:032x}", "id": f"g{i}", "output_token_ids": [i, 4095], "finish_reason": "length",
             "error": None, RUN_COLUMN: "a"} for i in range(3)]
    bad = [dict(good[0], reuse_key=f"{10:032x}", id="far", output_token_ids=[1, 999999]),     # past the vocabulary
           dict(good[0], reuse_key=f"{11:032x}", id="neg", output_token_ids=[-1]),            # negative
           dict(good[0], reuse_key=f"{12:032x}", id="huge", output_token_ids=[2**40 + 5]),     # wraps in int32
           dict(good[0], reuse_key="zz" * 16, id="nothex"),                                    # not hex
           dict(good[0], reuse_key="ab" * 8, id="short"),                                      # 16 digits
           dict(good[0], reuse_key=f"{13:032X}".replace("0", "A"), id="upper")]                 # upper case
    t = pa.Table.from_pylist(good + bad, schema=pa.schema([
        ("reuse_key", pa.string()), ("id", pa.string()), ("output_token_ids", pa.list_(pa.int64())),
        ("finish_reason", pa.string()), ("error", pa.string()), (RUN_COLUMN, pa.string())]))
    table, counts = ReuseTable.from_batches(t.to_batches(max_chunksize=4), lambda r: f"prev#{r}", vocab_size=4096)
    assert counts["usable"] == 3 and counts["rejected_rows"] == 6
    assert counts["rejected"] == {"output token ids outside the target's vocabulary (size 4096)": 3,
                                  "a malformed reuse key (not 32 lower-case hex digits)": 3}
    assert sorted(table.output(r).token_ids for r in range(len(table))) == [[0, 4095], [1, 4095], [2, 4095]]
    assert table.find(f"{12:032x}") is None and table.reference_for("huge") is None
    # without a vocabulary size the ids must still fit int32: nothing wraps
    _, counts = ReuseTable.from_batches(t.to_batches(), lambda r: r)
    assert counts["rejected"]["output token ids outside the target's vocabulary (size 2147483648)"] == 2


def test_a_previous_output_with_duplicate_ids_copies_by_key_and_references_one(tmp_path):
    """Two rows of one id (another prompt each): each copied by its own key; the reference by
    id is one of them (the first in key order), whichever file came first."""
    rows = [{"reuse_key": f"{k:032x}", "id": "same", "output_token_ids": [k], "finish_reason": "stop",
             "error": None, RUN_COLUMN: "a"} for k in (9, 3)]
    t = pa.Table.from_pylist(rows)
    table, counts = ReuseTable.from_batches(t.to_batches(), lambda r: r, vocab_size=64)
    assert counts["usable"] == 2 and counts["rejected_rows"] == 0
    assert table.output(table.find(f"{9:032x}")).token_ids == [9] and table.output(table.find(f"{3:032x}")).token_ids == [3]
    assert table.reference_for("same") == [3]
    table2, _ = ReuseTable.from_batches(t.to_batches()[::-1], lambda r: r, vocab_size=64)
    assert table2.reference_for("same") == [3]


def test_an_output_without_checksums_is_read_unverified_and_counted(tmp_path):
    """An output of a version before checksums: its unit records lack them; its files are
    decoded (a cut one is still rejected), counted in ``unverified_files``."""
    _write(tmp_path / "old")
    for rec in sorted((tmp_path / "old" / "_manifest" / "log").glob("*.json")):
        r = json.loads(rec.read_text())
        if r.pop("checksums", None) is not None:
            rec.write_text(json.dumps(r))
    _, counts = read_previous(str(tmp_path / "old"))
    assert counts["usable"] == 4 and counts["unverified_files"] == 2 and counts["rejected_rows"] == 0
    _damage(_file_of(tmp_path / "old", 0), "truncated", None)
    _, counts = read_previous(str(tmp_path / "old"))
    assert counts["usable"] == 2 and counts["rejected_rows"] == 2 and "does not decode" in next(iter(counts["rejected"]))


def test_malformed_checksums_in_a_record_are_refused_naming_it(tmp_path):
    from pipeline.output.manifest import ManifestDamaged

    _write(tmp_path / "out")
    rec = sorted((tmp_path / "out" / "_manifest" / "log").glob("*.json"))[1]
    r = json.loads(rec.read_text())
    assert r["kind"] == "unit"
    r["checksums"] = {n: {"sha256": "x", "size": 1, "rows": 2} for n in r["files"]}
    rec.write_text(json.dumps(r))
    with pytest.raises((ManifestDamaged, OutputError), match=rec.name):
        CommittedOutput.open(str(tmp_path / "out"))


# ------------------------------------------------------------------ item 3: resume over a damaged file
@pytest.mark.parametrize("how", ["truncated", "missing"])
def test_a_resume_over_a_damaged_committed_file_is_refused_before_it_writes_and_overwrite_works(how, tmp_path):
    _write(tmp_path / "out", finished=False)
    damaged = _file_of(tmp_path / "out", 0)
    _damage(damaged, how, None)
    before = sorted(os.listdir(tmp_path / "out" / "_manifest" / "log"))
    w = OutputWriter(OutputConfig(uri=str(tmp_path / "out")))
    with pytest.raises(OutputError, match=damaged.name) as e:
        w.on_write_start(UNITS, None)
    assert "--overwrite" in str(e.value) and "nothing was written" in str(e.value)
    assert sorted(os.listdir(tmp_path / "out" / "_manifest" / "log")) == before  # no epoch record
    # the advice works: with overwrite the run starts afresh
    w = OutputWriter(OutputConfig(uri=str(tmp_path / "out"), overwrite=True))
    plan = w.on_write_start(UNITS, None)
    assert [u.part for u in plan.todo] == [u.part for u in UNITS] and not damaged.exists()


# ------------------------------------------------------------------ item 4: --previous is the output itself
@pytest.mark.parametrize("spelling", ["dot", "dotdot", "symlink", "trailing slashes"])
def test_previous_naming_the_output_by_any_spelling_is_refused_before_overwrite_deletes(spelling, tiny_models,
                                                                                       tmp_path, capsys):
    from pipeline.cli import main

    out = tmp_path / "out"
    cfg = job_config(tiny_models, str(tmp_path / "in.jsonl"), str(out))
    write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "text": TEXTS[0]}])
    _write(out, run_identity(cfg, check_generation(cfg), []))
    (tmp_path / "link").symlink_to(out)
    previous = {"dot": f"{out}/.", "dotdot": f"{out}/../out", "symlink": str(tmp_path / "link"),
                "trailing slashes": f"{out}//"}[spelling]
    files = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    args = ["--input", str(tmp_path / "in.jsonl"), "--output", str(out), "--target", tiny_models["target"],
            "--drafter", tiny_models["drafter"], "--previous", previous, "--overwrite", "--no-progress",
            "--set", "output.partition_by_date=false"]
    assert main("summarize", args) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "this run's own output folder" in err[0], err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == files  # nothing deleted, nothing written


def test_same_location_decides_by_identity(tmp_path):
    import fsspec

    from pipeline.storage import same_location

    local = fsspec.filesystem("file")
    (tmp_path / "a").mkdir()
    (tmp_path / "l").symlink_to(tmp_path / "a")
    assert same_location(local, str(tmp_path / "a"), local, f"{tmp_path}/l/.")
    assert same_location(local, str(tmp_path / "a"), local, f"{tmp_path}/b/../a/")
    assert not same_location(local, str(tmp_path / "a"), local, str(tmp_path / "b"))


# ------------------------------------------------------------------ the kinds not yet probed
def test_reuse_over_s3_checks_every_file_and_refuses_the_output_itself(moto_s3, tiny_models, tmp_path, caplog):
    """The moto server: a previous night on S3 is read through its checksums (a replaced
    object is rejected by name), and ``--previous`` spelled ``s3://b/out/./`` is the output."""
    from pipeline.config import ConfigError
    from pipeline.reuse import plan_reuse

    s3 = moto_s3["client"]
    s3.create_bucket(Bucket="trust")
    opts = moto_s3["options"]
    cfg = job_config(tiny_models, "unused", "s3://trust/nightly", overrides=[
        "output.run_date=2026-01-02", "output.partition_by_date=true", "output.previous=s3://trust/nightly/date=2026-01-01",
        f"output.storage_options={moto_s3['options_json']}"])
    identity = run_identity(cfg, check_generation(cfg), [])
    _write("s3://trust/nightly/date=2026-01-01", identity, opts)
    plan = plan_reuse(cfg, identity, greedy=True, own_url="s3://trust/nightly/date=2026-01-02")
    assert plan.previous == "s3://trust/nightly/date=2026-01-01"
    table, counts = read_previous(plan.previous, opts, vocab_size=64)
    assert counts["usable"] == 4 and counts["rejected_rows"] == 0 and counts["unverified_files"] == 0
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket="trust", Prefix="nightly/date=2026-01-01/part-00000-u00001")
            ["Contents"]]
    buf = pa.BufferOutputStream()
    pq.write_table(_rows(UNITS[1], output_token_ids=[5, 5]), buf)
    s3.put_object(Bucket="trust", Key=keys[0], Body=buf.getvalue().to_pybytes())
    table, counts = read_previous(plan.previous, opts, vocab_size=64)
    assert counts["usable"] == 2 and counts["rejected_rows"] == 2
    assert next(iter(counts["rejected"])).startswith(keys[0].rsplit("/", 1)[1])
    for own in ("s3://trust/nightly/date=2026-01-01/./", "s3://trust/nightly/x/../date=2026-01-01"):
        with pytest.raises(ConfigError, match="this run's own output folder"):
            plan_reuse(cfg, identity, greedy=True, own_url=own)


def test_a_previous_night_that_did_not_finish_is_read_as_far_as_committed(tiny_models, tmp_path):
    """``--previous`` naming a night whose run never ended: its committed units are copied,
    the summary says unfinished (``auto`` passes such a night over: test_reuse.py)."""
    from pipeline.reuse import plan_reuse

    cfg = job_config(tiny_models, "unused", str(tmp_path / "next"), overrides=[f"output.previous={tmp_path / 'prev'}"])
    identity = run_identity(cfg, check_generation(cfg), [])
    w = OutputWriter(OutputConfig(uri=str(tmp_path / "prev")))
    w.on_write_start(UNITS, identity)
    w.write_part(UNITS[0], _rows(UNITS[0]))  # unit 1 never committed, no final record
    plan = plan_reuse(cfg, identity, greedy=True, own_url=str(tmp_path / "next"))
    assert plan.previous == str(tmp_path / "prev") and plan.finished is False and "unfinished" in plan.note
    table, counts = read_previous(plan.previous, vocab_size=64)
    assert counts["usable"] == 2 and len(table) == 2


def test_foreign_files_inside_a_previous_output_are_never_read(tmp_path):
    """A foreign Parquet file of output rows, and a symlink under a data file's name that no
    unit commits, beside a previous output's committed files: neither is read."""
    _write(tmp_path / "prev")
    pq.write_table(_rows(UNITS[0], reuse_key=f"{99:032x}", output_token_ids=[1]), tmp_path / "prev" / "extra.parquet")
    (tmp_path / "prev" / "part-00000-u00009.parquet").symlink_to(_file_of(tmp_path / "prev", 0))
    out = CommittedOutput.open(str(tmp_path / "prev"))
    assert "part-00000-u00009.parquet" in out.uncommitted
    table, counts = read_previous(str(tmp_path / "prev"), vocab_size=64)
    assert counts["rows"] == 4 and table.find(f"{99:032x}") is None


def test_a_model_folder_the_job_cannot_read_is_refused_before_work_starts(tiny_models, tmp_path, capsys, monkeypatch):
    """A target folder whose weights the job cannot open (a dangling link; a folder in place
    of a file): exit 2, naming it, before Ray starts."""
    import ray

    from pipeline.cli import main

    def no_ray(*a, **kw):
        raise AssertionError("Ray started: the unreadable model was not refused in the preflight")

    monkeypatch.setattr(ray, "init", no_ray)
    write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "text": TEXTS[0]}])
    for how in ("dangling weights", "config is a folder"):
        model = tmp_path / how.replace(" ", "-")
        shutil.copytree(tiny_models["target"], model)
        if how == "dangling weights":
            weights = next(model.glob("*.safetensors"))
            weights.unlink()
            weights.symlink_to(tmp_path / "nowhere.safetensors")
        else:
            (model / "config.json").unlink()
            (model / "config.json").mkdir()
        args = ["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out"), "--target", str(model),
                "--method", "plain", "--no-progress"]
        capsys.readouterr()
        assert main("summarize", args) == 2, how
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
        assert len(err) == 1 and str(model) in err[0], (how, err)
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ end to end (Ray)
@pytest.mark.slow
def test_night_two_over_a_truncated_previous_file_decodes_its_rows_and_ends_cleanly(ray_local, tiny_models, tmp_path,
                                                                                    capsys):
    """Issue 56's probe: a committed file of night 1 cut to half its size.  Night 2 names the
    file, decodes its rows afresh, copies the rest, exits 0 and counts the rejected rows in
    its summary; no Ray "Unhandled error" is printed."""
    from pipeline.cli import main

    out = tmp_path / "nightly"
    write_jsonl(tmp_path / "in" / "a.jsonl", [{"id": f"r{i}", "text": t} for i, t in enumerate(TEXTS[:4])])

    def night(day):
        args = ["--input", str(tmp_path / "in"), "--output", str(out), "--target", tiny_models["target"],
                "--method", "plain", "--max-new-tokens", "6", "--num-actors", "1", "--run-date", day,
                "--previous", "auto", "--no-progress", "--set", "compute.cpus_per_actor=1",
                "--set", "input.split_rows=2", "--audit-fraction", "0"]
        assert main("summarize", args) == 0
        return json.loads((out / f"date={day}" / "_summary.json").read_text()), capsys.readouterr().err

    night("2026-01-01")
    first = out / "date=2026-01-01"
    cut = sorted(first.glob("part-*.parquet"))[1]
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    s2, err = night("2026-01-02")
    assert s2["previous"]["rejected_rows"] == 2 and s2["reused_rows"] == 2 and s2["rows"] == 4
    assert cut.name in next(iter(s2["previous"]["rejected"]))
    assert "2 previous rows rejected and decoded afresh" in err and "Unhandled error" not in err
    rows = CommittedOutput.open(str(out / "date=2026-01-02")).table().to_pylist()
    whole = sorted(pq.read_table(sorted(first.glob("part-*.parquet"))[0], columns=["id"]).column("id").to_pylist())
    assert sorted(r["id"] for r in rows if r["reused_from"] is not None) == whole  # copied from the whole file
    assert sorted(r["id"] for r in rows if r["reused_from"] is None) == sorted({"r0", "r1", "r2", "r3"} - set(whole))
