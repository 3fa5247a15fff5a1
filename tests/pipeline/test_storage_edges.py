"""Storage at its edges (issue 28 items 1-5 and 7): streams cut short, object-store keys that
are not paths, a full disk, reads that would never return, checksums a file carries, and
limits that could lock an output.  Local disk and moto S3; no model and no Ray except the
one end-to-end run on a full disk.
"""

from __future__ import annotations

import bz2
import errno
import gzip
import io
import json
import lzma
import os
import subprocess
import threading
import time
import uuid

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from pipeline.config import ConfigError, InputConfig, OutputConfig, load_config
from pipeline.output.lease import LEASE, LeaseHeld, LeaseUnreadable, OutputLease
from pipeline.output import OutputError, is_complete, listing_view
from pipeline.input import InputError, read_shard, resolve_shards
from pipeline.retry import StorageError, open_fs, retrying
from pipeline.schema import OUTPUT_SCHEMA
from pipeline.output import OutputWriter

N = 3000
BIG = "".join(json.dumps({"id": f"r{i}", "text": f"row {i} " + "lorem ipsum " * 3}) + "\n" for i in range(N)).encode()
SMALL = b"".join(json.dumps({"id": f"g{i}", "text": f"good {i}"}).encode() + b"\n" for i in range(3))
CODECS = {
    "gz": gzip.compress,
    "bz2": bz2.compress,
    "xz": lzma.compress,
    "zst": lambda b: zstandard.ZstdCompressor(write_checksum=True).compress(b),
}


def _ids(table):
    return table.column("id").to_pylist()


# ------------------------------------------------------------------ 1. streams cut short

@pytest.mark.parametrize("cut", [0.5, 0.6, 0.97])
@pytest.mark.parametrize("codec", list(CODECS))
def test_a_truncated_compressed_stream_beside_a_good_file_refuses_the_job_naming_it(tmp_path, codec, cut):
    whole = CODECS[codec](BIG)
    (tmp_path / "good.jsonl").write_bytes(SMALL)
    (tmp_path / f"cut.jsonl.{codec}").write_bytes(whole[: int(len(whole) * cut)])
    with pytest.raises(InputError, match=rf"cut\.jsonl\.{codec}"):
        resolve_shards(InputConfig(uri=str(tmp_path)))


def test_zstd_frames_are_read_to_their_end_and_a_cut_in_a_later_frame_is_named(tmp_path):
    """Several frames (as ``zstd`` of a concatenation, or pzstd, writes them): all read;
    a cut inside the last frame, or a flipped byte under the frame checksum, refuses."""
    c = zstandard.ZstdCompressor(write_checksum=True)
    frames = c.compress(BIG[: len(BIG) // 2]) + c.compress(BIG[len(BIG) // 2:])
    p = tmp_path / "two.jsonl.zst"
    p.write_bytes(frames)
    cfg = InputConfig(uri=str(p))
    (shard,) = resolve_shards(cfg)
    assert shard.num_rows == N and _ids(read_shard(shard, cfg)) == [f"r{i}" for i in range(N)]
    p.write_bytes(frames[:-40])
    with pytest.raises(InputError, match=r"two\.jsonl\.zst' is truncated.*zstd"):
        resolve_shards(cfg)
    flipped = bytearray(frames)
    flipped[len(frames) // 4] ^= 0x20
    p.write_bytes(bytes(flipped))
    with pytest.raises(InputError, match=r"two\.jsonl\.zst"):
        resolve_shards(cfg)


def test_a_stream_cut_after_the_preflight_fails_the_read_naming_the_file(tmp_path):
    """The shard was whole when counted, and is cut before its rows are read: the read
    refuses rather than return the rows before the cut."""
    p = tmp_path / "later.jsonl.zst"
    whole = CODECS["zst"](BIG)
    p.write_bytes(whole)
    cfg = InputConfig(uri=str(p))
    (shard,) = resolve_shards(cfg)
    p.write_bytes(whole[: len(whole) * 6 // 10])
    # the unit's read sees the changed fingerprint first (a store without one: the cut stream)
    with pytest.raises((InputError, StorageError), match=r"later\.jsonl\.zst' (is truncated|changed while the job ran)"):
        read_shard(shard, cfg)


@pytest.mark.parametrize("change", ["cut", "grown"])
def test_a_plain_file_cut_or_grown_after_the_preflight_fails_its_read_naming_both_counts(tmp_path, change):
    """Any reader that can stop early: the rows read must be the rows counted."""
    p = tmp_path / "plain.jsonl"
    p.write_bytes(BIG)
    cfg = InputConfig(uri=str(p))
    (shard,) = resolve_shards(cfg)
    now = BIG[: len(BIG) // 2 + 7] if change == "cut" else BIG + SMALL
    p.write_bytes(now)
    counted = len([line for line in now.split(b"\n") if line.strip()])  # a cut line is an error row of its own
    assert counted != N
    with pytest.raises((InputError, StorageError), match=r"plain\.jsonl' (changed while the job ran|gave \d+ rows for unit \S+, but held)"):
        read_shard(shard, cfg)


def test_a_truncated_stream_on_s3_is_refused_naming_the_object(moto_s3):
    c, opts = moto_s3["client"], moto_s3["options"]
    b = "edges-trunc"
    c.create_bucket(Bucket=b)
    whole = CODECS["zst"](BIG)
    c.put_object(Bucket=b, Key="in/good.jsonl.gz", Body=gzip.compress(SMALL))
    c.put_object(Bucket=b, Key="in/cut.jsonl.zst", Body=whole[: len(whole) // 2])
    with pytest.raises(InputError, match=r"s3://edges-trunc/in/cut\.jsonl\.zst.*truncated"):
        resolve_shards(InputConfig(uri=f"s3://{b}/in/", storage_options=opts))


# ------------------------------------------------------------------ 2. keys are strings

def test_object_store_keys_are_read_as_written_named_or_in_a_folder(moto_s3):
    c, opts = moto_s3["client"], moto_s3["options"]
    b = "edges-keys"
    c.create_bucket(Bucket=b)
    keys = ["dbl/x.jsonl", "dbl//x.jsonl", "dbl/sub/../y.jsonl", "dbl/./z.jsonl", "dbl/sub/y.jsonl"]
    for k in keys:
        c.put_object(Bucket=b, Key=k, Body=json.dumps({"id": k, "text": "t"}).encode() + b"\n")
    for k in keys:  # named: that object, and only it
        cfg = InputConfig(uri=f"s3://{b}/{k}", storage_options=opts)
        (shard,) = resolve_shards(cfg)
        assert shard.url == f"s3://{b}/{k}" and _ids(read_shard(shard, cfg)) == [k], k
    cfg = InputConfig(uri=f"s3://{b}/dbl/", storage_options=opts)
    shards = resolve_shards(cfg)  # as a folder: every object once, none dropped or hidden
    assert sorted(_ids(read_shard(s, cfg))[0] for s in shards) == sorted(keys)
    names = [s.name for s in shards]
    assert len(set(names)) == len(keys) and "/x.jsonl" in names and "x.jsonl" in names
    assert len({s.derived_id(0) for s in shards}) == len(keys)  # derived ids stay apart too


def test_an_output_at_a_literal_double_slash_prefix_is_the_one_left_out(moto_s3):
    c, opts = moto_s3["client"], moto_s3["options"]
    b = "edges-outkey"
    c.create_bucket(Bucket=b)
    c.put_object(Bucket=b, Key="in/a.jsonl", Body=SMALL)
    c.put_object(Bucket=b, Key="in/out/b.jsonl", Body=SMALL)  # input, not the output
    out = OutputConfig(uri=f"s3://{b}/in//out/", storage_options=opts)
    w = OutputWriter(out)
    w.on_write_start()
    w.write_part(0, pa.Table.from_pylist([{"id": "x", "source_row": 0}], schema=OUTPUT_SCHEMA))
    w.on_write_complete({"rows": 1})
    written = {o["Key"] for o in c.list_objects_v2(Bucket=b, Prefix="in//out/")["Contents"]}
    assert f"in//out/part-00000-u00000.{w.run_id}.parquet" in written and "in//out/_SUCCESS" in written
    shards = resolve_shards(InputConfig(uri=f"s3://{b}/in/", storage_options=opts), output=listing_view(out))
    assert [s.name for s in shards] == ["a.jsonl", "out/b.jsonl"]


# ------------------------------------------------------------------ 3. a full disk

@pytest.fixture()
def tiny_disk(tmp_path):
    """A 256 KiB tmpfs (root and ``mount`` needed, else skipped) and a way to fill it."""
    d = tmp_path / "disk"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(d)], capture_output=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")

    def fill():
        fd = os.open(d / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            while True:
                os.write(fd, b"\0" * 4096)
        except OSError as e:
            assert e.errno == errno.ENOSPC
        finally:
            os.close(fd)

    yield d, fill
    subprocess.run(["umount", "-l", str(d)], check=False)


def _rows(n, start=0):
    return pa.Table.from_pylist([{"id": str(i), "source_row": i} for i in range(start, start + n)],
                                schema=OUTPUT_SCHEMA)


def _no_partial_records(out):
    for dirpath, _, files in os.walk(out):
        for n in files:
            p = os.path.join(dirpath, n)
            assert not n.endswith(".tmp"), p
            if n.endswith(".json"):
                json.loads(open(p, "rb").read())  # whole records only


@pytest.mark.parametrize("when", ["unit", "record", "summary"])
def test_a_full_disk_leaves_no_partial_record_and_a_rerun_completes_every_row_once(tiny_disk, when, monkeypatch):
    from pipeline.input import Shard, units_of

    disk, fill = tiny_disk
    out = disk / "out"
    shards = [Shard(index=i, url=f"/in/{i}.jsonl", format="jsonl", num_rows=n, fingerprint="f")
              for i, n in ((0, 5), (1, 3))]
    units = units_of(shards)
    rows = {0: _rows(5), 1: _rows(3, 5)}
    cfg = OutputConfig(uri=str(out), max_rows_per_file=5)
    w = OutputWriter(cfg)
    w.on_write_start(units)
    if when in ("unit", "record"):
        if when == "record":  # the disk fills between the unit's files and its record in the commit log
            from pipeline.output.commit_log import CommitLog

            append = CommitLog.append
            monkeypatch.setattr(CommitLog, "append", lambda self, r: (fill(), append(self, r))[1])
        else:
            fill()
        with pytest.raises((OSError, StorageError), match="No space left"):
            w.write_part(units[0], rows[0])  # its staged file, or its record, cannot be written
        monkeypatch.undo()
    else:
        w.write_part(units[0], rows[0])
        w.write_part(units[1], rows[1])
        fill()
        with pytest.raises((OSError, StorageError), match="No space left"):
            w.on_write_complete({"rows": 8})
    w.on_write_failed()
    _no_partial_records(out)
    assert not is_complete(str(out))
    os.unlink(disk / "filler")  # the space comes back
    w2 = OutputWriter(cfg)
    plan = w2.on_write_start(units)  # not wedged
    assert [u.part for u in plan.todo] == ([u.part for u in units] if when != "summary" else [])
    for u in plan.todo:
        w2.write_part(u, rows[u.shard.index])
    w2.on_write_complete({"rows": 8})
    assert is_complete(str(out))
    assert sorted(pq.read_table(str(out)).column("id").to_pylist(), key=int) == [str(i) for i in range(8)]
    assert not os.path.exists(out / "_manifest" / "pending")


@pytest.fixture(params=["local", "s3"])
def place(request, tmp_path):
    """An output URL, with ``put(rel, bytes)`` and ``files()`` behind the job's back."""
    if request.param == "local":
        root = tmp_path / "out"

        def put(rel, data):
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(data)

        def files():
            return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}

        return str(root), {}, put, files
    moto = request.getfixturevalue("moto_s3")
    c, bucket, prefix = moto["client"], "edges-left", uuid.uuid4().hex[:8]
    c.create_bucket(Bucket=bucket)

    def put(rel, data):
        c.put_object(Bucket=bucket, Key=f"{prefix}/{rel}", Body=data)

    def files():
        got = c.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", [])
        return {o["Key"][len(prefix) + 1:]: c.get_object(Bucket=bucket, Key=o["Key"])["Body"].read() for o in got}

    return f"s3://{bucket}/{prefix}", moto["options"], put, files


def test_records_a_run_began_and_never_finished_are_its_own_and_foreign_ones_are_kept(place):
    """An empty publish intent (a full disk under an older version), an entry cut short and
    a temporary file of the job's naming are the job's own leftovers: cleaned, and the rerun
    completes.  A file of the same names whose content is not the job's is still refused,
    and left as it is."""
    url, opts, put, files = place
    cfg = OutputConfig(uri=url, storage_options=opts)
    put("_manifest/pending/part-00000-u00000.deadrun.json", b"")
    put("_manifest/part-00001-u00000.json", b'{"part": "part-00001-u00000.parquet", "files": ["part-000')
    put("_manifest/part-00002-u00000.json", b'{"pa')  # cut inside its first key
    put(f"._SUCCESS.{uuid.uuid4().hex}.tmp", b"dead")
    w = OutputWriter(cfg)
    assert w.on_write_start([]).done == []
    assert sorted(files()) == ["_manifest/log/0000000000.json"]  # all four removed (they named no published file)
    w.write_part(0, _rows(2))
    w.write_part(1, _rows(2, 2))
    w.on_write_complete({"rows": 4})
    assert sorted(files()) == ["_SUCCESS"] + [f"_manifest/log/{i:010d}.json" for i in range(4)] + [
        "_summary.json", f"part-00000-u00000.{w.run_id}.parquet", f"part-00001-u00000.{w.run_id}.parquet"]
    foreign = b'{"partial": true, "note": "not the job\'s"'
    put("_manifest/pending/part-00002-u00000.other.json", foreign)
    with pytest.raises(OutputError, match=r"part-00002-u00000\.other\.json is not a manifest record of this job"):
        OutputWriter(cfg).on_write_start([])
    assert files()["_manifest/pending/part-00002-u00000.other.json"] == foreign


# ------------------------------------------------------------------ 4. reads that never return

def _bounded(fn, seconds=20):
    """Run ``fn`` in a thread; fail (rather than hang the suite) if it does not return."""
    got = {}

    def go():
        try:
            got["value"] = fn()
        except BaseException as e:  # noqa: BLE001
            got["error"] = e

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{fn} did not return within {seconds} s"
    if "error" in got:
        raise got["error"]
    return got.get("value")


@pytest.mark.parametrize("how", ["folder", "named", "glob", "symlink to /dev/zero"])
def test_a_local_input_that_is_not_a_regular_file_is_refused_by_name_before_it_is_opened(tmp_path, how):
    d = tmp_path / "in"
    d.mkdir()
    (d / "a.jsonl").write_bytes(SMALL)
    special = d / "p.jsonl"
    if how.startswith("symlink"):
        special.symlink_to("/dev/zero")
    else:
        os.mkfifo(special)
    uri = {"folder": str(d), "named": str(special), "glob": str(d / "*.jsonl")}.get(how, str(d))
    kind = r"p\.jsonl' \(a link to '/dev/zero'\) is a character device" if how.startswith("symlink") \
        else r"p\.jsonl' is a named pipe \(FIFO\)"
    with pytest.raises(InputError, match=rf"{kind}, not a regular file"):
        _bounded(lambda: resolve_shards(InputConfig(uri=uri)))


def test_a_fifo_at_the_lease_or_in_the_manifest_is_refused_not_waited_on(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / LEASE)
    fs, root = open_fs(str(out))
    with pytest.raises(LeaseUnreadable, match="not a regular file"):
        _bounded(lambda: OutputLease(fs, root, "r1", url=str(out), io=retrying(None)).acquire())
    os.unlink(out / LEASE)
    (out / "_manifest").mkdir()
    os.mkfifo(out / "_manifest" / "part-00000.json")
    with pytest.raises(OutputError, match=r"_manifest/part-00000\.json is a named pipe"):
        _bounded(lambda: OutputWriter(OutputConfig(uri=str(out))).on_write_start([]))
    assert (out / "_manifest" / "part-00000.json").exists()  # not the job's: left as it is


def test_a_fifo_in_a_model_folder_or_as_the_config_file_is_refused_not_waited_on(tmp_path):
    """The model folder's files are hashed and loaded, the config file is read: a named
    pipe at any of them would block; each is refused by name before it is opened."""
    from pipeline.models import ModelError, check_model_path

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    os.mkfifo(model / "tokenizer.json")
    with pytest.raises(ModelError, match=r"models\.target: .*tokenizer\.json' is a named pipe"):
        _bounded(lambda: check_model_path(str(model), "models.target"))
    (model / "sub").mkdir()
    os.unlink(model / "tokenizer.json")
    os.symlink("/dev/zero", model / "sub" / "model.safetensors")  # a link to a device, one folder down
    with pytest.raises(ModelError, match=r"model\.safetensors' is a character device, not a regular file"):
        _bounded(lambda: check_model_path(str(model), "models.target"))
    os.mkfifo(tmp_path / "job.yaml")
    with pytest.raises(ConfigError, match="config file not a regular file"):
        _bounded(lambda: load_config(str(tmp_path / "job.yaml")))


# ------------------------------------------------------------------ 5. checksums the file carries

def _checksummed_parquet(path, n=200):
    t = pa.table({"id": [f"r{i}" for i in range(n)], "text": [f"text number {i:05d} " * 3 for i in range(n)]})
    pq.write_table(t, path, write_page_checksum=True, compression="none", use_dictionary=False)
    raw = bytearray(path.read_bytes())
    at = raw.find(b"text number 00123")
    raw[at + 12: at + 18] = b"ZZZZZZ"  # still valid UTF-8, the page still decodes
    return bytes(raw)


def test_a_parquet_page_failing_its_checksum_is_refused_naming_the_file(tmp_path):
    p = tmp_path / "in" / "flip.parquet"
    p.parent.mkdir()
    damaged = _checksummed_parquet(p)
    assert pq.read_table(p).num_rows == 200  # intact file: read as before
    p.write_bytes(damaged)
    assert pq.read_table(p).num_rows == 200  # without verification, the flip reads in silence
    with pytest.raises(InputError, match=r"flip\.parquet.*damaged.*CRC"):
        resolve_shards(InputConfig(uri=str(p.parent)))
    # above the preflight's bound, the run's own read refuses it, naming the file
    cfg = InputConfig(uri=str(p.parent), preflight_read_max_bytes=0)
    (shard,) = resolve_shards(cfg)
    with pytest.raises(StorageError, match=r"flip\.parquet.*CRC"):
        read_shard(shard, cfg)


# ------------------------------------------------------------------ 7. limits that could lock an output

@pytest.mark.parametrize("value", [".inf", "1e308", "nan", "86401", "-1"])
def test_a_lease_timeout_that_is_not_a_finite_bound_of_at_most_a_day_is_refused(value):
    with pytest.raises(ConfigError, match="output.lease_timeout_s"):
        load_config(None, [f"output.lease_timeout_s={value}"])
    with pytest.raises(ConfigError, match="retry.deadline_s"):
        load_config(None, ["retry.deadline_s=.inf"])
    assert load_config(None, ["output.lease_timeout_s=86400"]).output.lease_timeout_s == 86400


def _lease_place(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "out"), {}
    moto = request.getfixturevalue("moto_s3")
    moto["client"].create_bucket(Bucket="edges-lease")
    return f"s3://edges-lease/{uuid.uuid4().hex[:8]}", moto["options"]


@pytest.fixture(params=["local", "s3"])
def lease_place(request, tmp_path):
    return _lease_place(request, tmp_path)


def _lease(url, opts, run_id, timeout_s=60.0, clock=time.time):
    fs, root = open_fs(url, opts)
    return OutputLease(fs, root, run_id, url=url, io=retrying(None), timeout_s=timeout_s, clock=clock)


@pytest.mark.parametrize("claim", ["Infinity", "1e308", "NaN", "-5", '"forever"', "true"])
def test_a_lease_claiming_an_unbounded_timeout_counts_at_most_a_day(lease_place, claim):
    url, opts = lease_place
    dead = _lease(url, opts, "dead", timeout_s=60)
    dead.acquire()
    dead.abandon()  # killed: its lease stays, no heartbeat
    fs, root = open_fs(url, opts)
    content = json.loads(fs.cat_file(f"{root}/{LEASE}"))
    content["process"] = "another process"  # not a leftover of this one: the bound decides
    raw = json.dumps(content).replace('"timeout_s": 60.0', f'"timeout_s": {claim}')
    assert claim in raw
    fs.pipe_file(f"{root}/{LEASE}", raw.encode())  # forged by hand
    fs.invalidate_cache()
    # a day and a minute later by this machine's clock, it is stale whatever the file says
    taker = _lease(url, opts, "next", timeout_s=60, clock=lambda: time.time() + 86400 + 60)
    taker.acquire()
    try:
        assert taker.held
    finally:
        taker.release()
    # an hour later, only an unparseable claim falls back to the reader's own 60 s
    again = _lease(url, opts, "dead2", timeout_s=60)
    again.acquire()
    again.abandon()
    content = dict(json.loads(fs.cat_file(f"{root}/{LEASE}")), process="another process")
    fs.pipe_file(f"{root}/{LEASE}", json.dumps(content).replace('"timeout_s": 60.0', f'"timeout_s": {claim}').encode())
    fs.invalidate_cache()
    hour = _lease(url, opts, "hour", timeout_s=60, clock=lambda: time.time() + 3600)
    if claim in ("Infinity", "1e308"):
        with pytest.raises(LeaseHeld, match="output.lease_timeout_s=86400"):
            hour.acquire()
    else:
        hour.acquire()
        hour.release()


def test_a_heartbeat_in_the_future_is_named_as_clock_skew(lease_place):
    url, opts = lease_place
    holder = _lease(url, opts, "skewed", timeout_s=60)
    holder.acquire()
    try:
        behind = _lease(url, opts, "behind", timeout_s=60, clock=lambda: time.time() - 600)
        with pytest.raises(LeaseHeld, match=r"(59\d|60\d) s in the future.*clock skew"):
            behind.acquire()
        slightly = _lease(url, opts, "slightly", timeout_s=60, clock=lambda: time.time() - 3)
        with pytest.raises(LeaseHeld, match="is leased by another run"):  # within the tolerance: held
            slightly.acquire()
    finally:
        holder.release()


@pytest.mark.slow
def test_a_job_whose_output_disk_fills_fails_and_a_rerun_after_space_returns_writes_every_row_once(
        ray_local, tiny_models, tmp_path, tiny_disk):
    """The issue's case through the job's entry: the output on a tmpfs with room for about
    one shard; the run fails on ENOSPC wherever it falls, and once the space is back a plain
    rerun (same config, no overwrite) completes with every row exactly once."""
    from pipeline_testkit import TEXTS, job_config, write_jsonl
    from pipeline.run import run_job

    disk, fill = tiny_disk
    ids = []
    for s in range(4):
        rows = [{"id": f"s{s}-{i}", "text": TEXTS[(s + i) % len(TEXTS)]} for i in range(2)]
        write_jsonl(tmp_path / "in" / f"{s}.jsonl", rows)
        ids += [r["id"] for r in rows]
    out = disk / "out"
    cfg = job_config(tiny_models, str(tmp_path / "in"), str(out), method="plain",
                     overrides=["generation.max_new_tokens=2"])
    (disk / "reserve").write_bytes(b"\0" * 24 * 1024)
    fill()
    os.unlink(disk / "reserve")  # 24 KiB free: the lease and about one shard
    with pytest.raises(Exception, match="No space left"):
        run_job(cfg, progress=False)
    assert not is_complete(str(out))
    _no_partial_records(out)
    os.unlink(disk / "filler")
    run_job(cfg, progress=False)
    assert is_complete(str(out))
    got = pq.read_table(str(out), columns=["id"]).column("id").to_pylist()
    assert sorted(got) == sorted(ids)  # every row, exactly once
