"""pipeline/storage.py, the helpers both sides share: one rule for a file the job never
opens (links followed), one rule for "refusal or passing fault", file versions from every
backend's keys; and what the input side builds on them: a JSONL unit that no longer starts
on its line (a file replaced in place, same size and mtime) is refused by name, and the
output answers the listing's one question (``contains``)."""

from __future__ import annotations

import datetime as dt
import gzip
import json
import os
import socket

import pytest

from pipeline.config import InputConfig, JobRefused, OutputConfig
from pipeline.input import InputError, read_unit, resolve_shards, units_of
from pipeline.output.location import OutputError, OutputLocation
from pipeline.retry import StorageError, with_retries
from pipeline.storage import file_version, modified_at, raise_refusal, refuse_special, special_kind, timestamp


class Refused(JobRefused):
    pass


# ------------------------------------------------------------------ refuse_special: one rule
@pytest.mark.parametrize("make, kind", [
    (lambda p: os.mkfifo(p), "a named pipe (FIFO)"),
    (lambda p: os.symlink("/dev/null", p), "a character device"),  # a link is followed
    (lambda p: socket.socket(socket.AF_UNIX).bind(str(p)), "a socket"),
    (lambda p: p.mkdir(), "a folder"),
])
def test_refuse_special_names_what_the_path_is_with_links_followed(tmp_path, make, kind):
    p = tmp_path / "x"
    make(p)
    with pytest.raises(Refused, match=rf"^thing '.*x' is {kind.replace('(', '[(]').replace(')', '[)]')}, not a "
                                      r"regular file: a read of it may never return, so the job does not open it; "
                                      r"move it$"):
        refuse_special(str(p), f"thing {str(p)!r}", Refused, "move it")


def test_refuse_special_lets_files_folders_when_allowed_and_missing_paths_through(tmp_path):
    (tmp_path / "f").write_text("x")
    (tmp_path / "d").mkdir()
    os.symlink(tmp_path / "f", tmp_path / "to-file")
    os.symlink(tmp_path / "gone", tmp_path / "dangling")
    for name in ("f", "to-file", "dangling", "missing"):
        refuse_special(str(tmp_path / name), name, Refused, "")
    refuse_special(str(tmp_path / "d"), "d", Refused, "", folder_ok=True)
    os.mkfifo(tmp_path / "p")
    os.symlink(tmp_path / "p", tmp_path / "to-fifo")
    with pytest.raises(Refused, match="named pipe"):  # a folder allowed is not a pipe allowed
        refuse_special(str(tmp_path / "to-fifo"), "to-fifo", Refused, "", folder_ok=True)
    fd = os.open(tmp_path / "p", os.O_RDONLY | os.O_NONBLOCK)  # the descriptor form never blocks
    try:
        assert special_kind(os.fstat(fd).st_mode) == "a named pipe (FIFO)"
    finally:
        os.close(fd)
    assert special_kind(os.stat(tmp_path / "d").st_mode) == "a folder"
    assert special_kind(os.stat(tmp_path / "d").st_mode, folder_ok=True) is None


def test_the_output_folder_refuses_a_special_file_by_the_same_rule(tmp_path):
    out = tmp_path / "out"
    (out / "_staging" / "run").mkdir(parents=True)
    os.mkfifo(out / "_staging" / "run" / "00000.parquet")
    with pytest.raises(OutputError, match=r"_staging/run/00000\.parquet is a named pipe \(FIFO\), not a regular "
                                          r"file: .*never deletes what it did not write"):
        OutputLocation(OutputConfig(uri=str(out))).inspect()


# ------------------------------------------------------------------ raise_refusal: one rule
def _failed(exc: BaseException) -> StorageError:
    def fn():
        raise exc

    try:
        with_retries(fn, what="read x", attempts=2, initial_backoff_s=0, sleep=lambda s: None)
    except StorageError as e:
        return e
    raise AssertionError("did not fail")


@pytest.mark.parametrize("exc, raised, message", [
    (ConnectionResetError("reset by peer"), StorageError, r"read x failed after 2 attempts"),  # transient: as it is
    (PermissionError("denied"), Refused, r"^cannot read x: PermissionError: denied$"),  # a refusal
    (Refused("x is bad"), Refused, r"^x is bad$"),  # the refusal raised inside the retried call
    (ValueError("line one\nline two"), Refused, r"^cannot read x: ValueError: line one$"),
])
def test_raise_refusal_re_raises_passing_faults_and_refuses_the_rest(exc, raised, message):
    e = _failed(exc)
    with pytest.raises(raised, match=message) as got:
        try:
            raise e
        except StorageError as caught:
            raise_refusal(caught, Refused, "cannot read x")
    if raised is StorageError:
        assert got.value is e and got.value.transient and isinstance(e.__cause__, ConnectionResetError)


def test_raise_refusal_with_a_hint_and_on_a_bare_exception():
    with pytest.raises(Refused, match=r"^x is damaged \(OSError: bad page\); replace it$"):
        raise_refusal(OSError("bad page"), Refused, "x is damaged", "replace it")
    with pytest.raises(TimeoutError):  # a bare transient error is not a refusal either
        raise_refusal(TimeoutError("timed out"), Refused, "x")


# ------------------------------------------------------------------ versions from every backend's keys
def test_file_version_and_modified_at_read_every_backends_keys():
    when = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)
    assert file_version({"size": 3, "ETag": '"abc"', "LastModified": when}) == "size=3;etag=abc"
    assert file_version({"size": 3, "md5Hash": "m"}) == "size=3;etag=m"
    assert file_version({"size": 3, "mtime": 1.5}) == "size=3;mtime=1.5"
    assert file_version({"size": 3}) == "size=3"
    assert modified_at({"LastModified": when}) == when.timestamp()
    assert modified_at({"updated": "2026-01-02T03:04:05Z"}) == when.timestamp()
    assert modified_at({"mtime": 7}) == 7.0 and modified_at({"size": 1}) is None
    assert modified_at({"mtime": True, "created": 8}) == 8.0  # a boolean is no time
    assert modified_at({"mtime": "yesterday", "updated": when}) == when.timestamp()  # the first key that parses
    # one parser for every time the job reads back (the lease's heartbeat_at stamp too)
    assert timestamp("2026-01-02T03:04:05+00:00") == timestamp("2026-01-02T03:04:05Z") == when.timestamp()
    assert timestamp(None) is None and timestamp("soon") is None and timestamp(False) is None


# ------------------------------------------------------------------ a JSONL file replaced in place
def _rows(n: int, word: str = "row", pad: dict[int, int] | None = None) -> bytes:
    """``n`` JSONL rows; row ``i``'s text is padded with ``pad.get(i, 2)`` spaces."""
    pad = pad or {}
    return b"".join(json.dumps({"id": f"r{i}", "text": f"{word} {i}" + " " * pad.get(i, 2)}).encode() + b"\n"
                    for i in range(n))


def _replace_in_place(path, data: bytes) -> None:
    """Write ``data`` over ``path`` and put its mtime back: the file's version is unchanged."""
    st = os.stat(path)
    assert len(data) == st.st_size
    path.write_bytes(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize("compressed", [False, True])
def test_a_jsonl_unit_off_its_line_boundary_is_refused_by_name(tmp_path, compressed):
    """Same size, mtime restored, row 2 one byte longer and row 3 one shorter: unit 1 (rows
    3-5) now starts on row 2's newline.  Before, one row became an error row and a row was
    lost in silence; now the unit is refused by name (plain and gzip: the check is on the
    decompressed stream)."""
    name = "a.jsonl.gz" if compressed else "a.jsonl"
    path = tmp_path / name
    before, after = _rows(6), _rows(6, pad={2: 3, 3: 1})
    assert len(before) == len(after)
    path.write_bytes(gzip.compress(before, mtime=0) if compressed else before)
    units = units_of(resolve_shards(InputConfig(uri=str(path), split_rows=3)))
    assert [u.split.offset > 0 for u in units] == [False, True]
    if compressed:  # a gzip stream keeps its size only by chance: the file's version is dropped instead
        path.write_bytes(gzip.compress(after, mtime=0))
        shard = units[1].shard.__class__(**{**units[1].shard.to_dict(), "fingerprint": None})
        units = [u.__class__(shard, u.split_index, u.split) for u in units]
    else:
        _replace_in_place(path, after)
    assert read_unit(units[0], InputConfig(uri=str(path))).num_rows == 3  # unit 0 starts at byte 0
    with pytest.raises(InputError, match=rf"{name}' changed while the job ran, keeping its size and modification "
                                         r"time .*unit part-00000-u00001\.parquet: byte \d+ of the file, where it "
                                         r"starts, is not at the start of a line"):
        read_unit(units[1], InputConfig(uri=str(path)))


def test_a_jsonl_unit_whose_first_line_changed_on_its_boundary_is_refused_by_name(tmp_path):
    """Same size, mtime restored, every line as long as before: the boundaries hold, but the
    unit's first line is not the one counted (its hash)."""
    path = tmp_path / "a.jsonl"
    path.write_bytes(_rows(6, "row"))
    units = units_of(resolve_shards(InputConfig(uri=str(path), split_rows=2)))
    _replace_in_place(path, _rows(6, "wor"))
    assert units[2].shard.fingerprint == resolve_shards(InputConfig(uri=str(path)))[0].fingerprint
    with pytest.raises(InputError, match=r"unit part-00000-u00002\.parquet: its first line \(line 5\) is not the "
                                         r"line counted there"):
        read_unit(units[2], InputConfig(uri=str(path)))


def test_a_unit_built_by_hand_without_a_hash_still_reads(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(_rows(4))
    unit = units_of(resolve_shards(InputConfig(uri=str(path), split_rows=2)))[1]
    bare = unit.__class__(unit.shard, 1, unit.split.__class__(**{**unit.split.__dict__, "first_line": None}))
    assert read_unit(bare, InputConfig(uri=str(path))).column("id").to_pylist() == ["r2", "r3"]


# ------------------------------------------------------------------ the output's one answer to the input
def test_the_output_answers_what_it_holds_at_a_url(tmp_path):
    loc = OutputLocation.whole(OutputConfig(uri=str(tmp_path / "out"), partition_by_date=True,
                                            run_date="2026-01-02"), None)
    out = str(tmp_path / "out")
    assert loc.url() == out  # the whole folder, not today's partition
    own = ["_manifest", "_manifest/part-00000-u00000.json", "_staging/r/x", "part-00001-u00000.parquet",
           "date=2026-01-01/part-00000-u00000-00001.parquet", "date=2026-01-01/_SUCCESS", "_lease.json",
           "date=2026-01-01/_manifest/pending/x.json"]
    other = ["", "notes.jsonl", "date=2026-01-01", "sub/part-00000-u00000.parquet", "date=2026-01-01/a.jsonl"]
    assert [loc.contains(f"{out}/{r}".rstrip("/")) for r in own] == ["own"] * len(own)
    assert [loc.contains(f"{out}/{r}".rstrip("/")) for r in other] == ["other"] * len(other)
    assert loc.contains(str(tmp_path / "outside.jsonl")) is None and loc.contains(out + "x/a.jsonl") is None
