"""The input's file formats: which files the job reads and how, and streams that never end
early in silence.

Parquet, and JSON lines (``*.jsonl``, ``*.json``, ``*.ndjson``) plain or compressed with
gzip, bzip2, zstandard or xz (``*.jsonl.gz``, ``.bz2``, ``.zst``, ``.xz``:
``input.compression: infer``, or set for every file): :func:`file_kind`.  A compressed
shard is a shard like any other: its version is the compressed file's size and mtime/ETag.

Reads never end early in silence, nor hang: a compressed stream cut before its
end-of-stream marker (every codec, zstandard included) refuses the job naming the file
(:func:`open_stream`); checksums a file carries are verified (Parquet page CRCs,
:func:`parquet_file`; the codecs' own checks).

JSONL is scanned line by line (:func:`jsonl_scan`: line number, byte offset, bytes of every
non-blank line, a UTF-8 byte-order mark at the start dropped); a line that is not UTF-8,
not JSON or not an object is named (:func:`parse_line`), never raised.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
from typing import Any, Iterator

from pipeline.config import InputConfig, JobRefused
from pipeline.storage import parquet_file, unstrip  # noqa: F401 (parquet_file: the input's reader too)

PARQUET_EXT = (".parquet", ".pq")
JSONL_EXT = (".jsonl", ".json", ".ndjson")
#: compressed JSONL: file-name ending -> fsspec compression (``input.compression: infer``)
COMPRESSION_EXT = {".gz": "gzip", ".bz2": "bz2", ".zst": "zstd", ".xz": "xz"}
_KINDS = "*.parquet, *.pq, *.jsonl, *.json or *.ndjson (JSONL optionally .gz, .bz2, .zst or .xz)"


class InputError(JobRefused):
    """The input is missing, empty, unreadable, or lacks the text column."""


def file_kind(path: str, cfg: InputConfig) -> tuple[str | None, str | None, str | None]:
    """How the job reads the file ``path``: ``(format, compression, None)``, or ``(None,
    None, why not)`` for a file it does not read.

    ``input.compression: infer`` takes the compression from the ending (``.gz``, ``.bz2``,
    ``.zst``, ``.xz``), as fsspec's ``compression="infer"``; any other value applies to
    every file.  ``input.format: auto`` takes the format from the name without that ending.
    A compressed Parquet file is not read (Parquet compresses its own pages).
    """
    low = path.lower()
    stem, comp = low, None
    for ext, name in COMPRESSION_EXT.items():
        if low.endswith(ext):
            stem, comp = low[: -len(ext)], name
            break
    if cfg.compression != "infer":
        comp = None if cfg.compression == "none" else cfg.compression
    fmt: str | None = cfg.format
    if fmt == "auto":
        fmt = "parquet" if stem.endswith(PARQUET_EXT) else "jsonl" if stem.endswith(JSONL_EXT) else None
    if fmt is None:
        return None, None, f"unknown format (the job reads {_KINDS}; or set input.format)"
    if fmt == "parquet" and comp:
        return None, None, f"a {comp}-compressed Parquet file (Parquet compresses its own pages: decompress it)"
    return fmt, comp, None


def parquet_splits(group_rows: list[int], split_rows: int) -> list[dict[str, Any]]:
    """Splits of a Parquet file whose row groups have ``group_rows`` rows: consecutive row
    groups merged while together at most ``split_rows`` rows (a larger row group is a split
    of its own: Parquet is read by row groups)."""
    splits: list[dict[str, Any]] = []
    start = 0
    for i, r in enumerate(group_rows):
        if not splits or splits[-1]["rows"] + r > split_rows:
            splits.append({"start": start, "rows": 0, "row_groups": []})
        splits[-1]["rows"] += r
        splits[-1]["row_groups"].append(i)
        start += r
    return splits or [{"start": 0, "rows": 0, "row_groups": []}]


@contextlib.contextmanager
def open_stream(fs, path: str, compression: str | None):
    """A binary, line-iterable stream of the (decompressed) file ``path`` that never ends
    early in silence: a compressed stream that stops before its end-of-stream marker raises
    :class:`InputError` naming the file (gzip, bzip2 and xz raise ``EOFError`` themselves;
    zstandard is read frame by frame through :class:`_ZstdFrames`, which checks that the
    last frame ended).  Checksums the stream carries (gzip's CRC-32, bzip2's CRC, xz's
    check, a zstd frame's content checksum) are verified by each decoder.

    Raises:
        InputError: the stream was cut short (naming the file and the codec).
    """
    try:
        if compression == "zstd":
            with fs.open(path, "rb") as raw:
                yield io.BufferedReader(_ZstdFrames(raw, path), buffer_size=1 << 16)
        else:
            with fs.open(path, "rb", compression=compression) as f:
                yield f
    except EOFError as e:
        raise InputError(f"input shard {unstrip(fs, path)!r} is truncated: its {compression or 'input'} stream ends "
                         f"before its end-of-stream marker ({e}); the rows after the cut would be lost: replace the "
                         "file, or move it out of the input") from None


class _ZstdFrames(io.RawIOBase):
    """Zstandard frames of ``raw`` decompressed one after another (``decompressobj`` per
    frame); at the end of ``raw`` the last frame must be complete, else ``EOFError`` (the
    stream reader of ``zstandard`` returns what it has and stops in silence)."""

    def __init__(self, raw, path: str):
        import zstandard

        self.raw, self.path, self._zstd = raw, path, zstandard
        self._obj = None  # the decompressor of the frame being read; None between frames
        self._out = b""

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while not self._out:
            data = self.raw.read(1 << 16)
            if not data:
                if self._obj is not None:
                    raise EOFError("zstd: the last frame is incomplete (premature end)")
                return 0
            while data:
                if self._obj is None:
                    self._obj = self._zstd.ZstdDecompressor().decompressobj()
                self._out += self._obj.decompress(data)
                if not self._obj.eof:
                    break
                data, self._obj = self._obj.unused_data, None
        n = min(len(b), len(self._out))
        b[:n], self._out = self._out[:n], self._out[n:]
        return n


def jsonl_scan(f, first_line: int = 1, offset: int = 0) -> Iterator[tuple[int, int, bytes]]:
    """``(line number, byte offset of the line, bytes)`` of every non-blank line of a
    binary file read from byte ``offset`` (line ``first_line``); a UTF-8 byte-order mark
    at the start of the file is dropped."""
    for lineno, raw in enumerate(f, start=first_line):
        at = offset
        offset += len(raw)
        if at == 0 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]
        if raw.strip():
            yield lineno, at, raw


def line_hash(raw: bytes) -> str:
    """A short hash of a JSONL line's bytes (as :func:`jsonl_scan` gives them): what a unit
    records of its first line (:attr:`pipeline.units.Split.first_line`)."""
    return hashlib.blake2b(raw, digest_size=8).hexdigest()


def skip_bytes(f, n: int, compression: str | None) -> None:
    """Move ``f`` ``n`` bytes on: a seek on a plain file; a compressed stream is read and
    dropped up to there (it cannot seek: a unit deep in a compressed file decompresses
    everything before it)."""
    if not n:
        return
    if compression is None:
        f.seek(n)
        return
    left = n
    while left:
        got = f.read(min(left, 1 << 20))
        if not got:
            raise EOFError(f"the decompressed stream ended {left} bytes before the unit's first line")
        left -= len(got)


def parse_line(raw: bytes) -> tuple[dict | None, str | None]:
    """A JSONL line -> ``(object, None)`` or ``(None, what it is instead)``, e.g.
    ``"not valid JSON: ..."``, ``"a list, not an object"``."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, f"not valid UTF-8 (byte {e.start}: {e.reason})"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return None, f"not valid JSON: {e}"
    except RecursionError:
        return None, "nested too deeply to parse"
    if not isinstance(obj, dict):
        return None, f"a {type(obj).__name__}, not an object"
    return obj, None
