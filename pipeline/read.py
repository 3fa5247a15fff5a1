"""Stage 1, read: find input shards through fsspec and read them into a fixed schema.

A *shard* is one input file.  :func:`resolve_shards` (in the driver, before any model
loads) expands the input URI, checks that every shard opens, has the id and text
columns, and counts its rows.  :func:`read_shard` (in a Ray task) reads one shard into
:data:`INPUT_SCHEMA`; each row keeps its shard (``source_file``) and position in it
(``source_row``), which the writer uses to write one output part per input shard.

Row-level problems never fail a shard: a line that is not UTF-8, not JSON or not a JSON
object, a text that is not a string or not valid Unicode (a lone surrogate escape such as
``"\ud800"`` is valid JSON but cannot be encoded), an id of another type: each becomes a
row with ``input_error`` set (naming its line or row), and the actor turns it into that
row's ``error``.  A UTF-8 byte-order mark at the start of a JSONL file is skipped.  A
shard is refused as a whole (:class:`InputError`, before any model loads) only when it is
not usable at all: a JSONL file none of whose lines is a JSON object with the text field,
a Parquet file that does not open or lacks the text column.

Formats and listing.  Parquet, and JSON lines (``*.jsonl``, ``*.json``, ``*.ndjson``)
plain or compressed with gzip, bzip2, zstandard or xz (``*.jsonl.gz``, ``.bz2``, ``.zst``,
``.xz``: ``input.compression: infer``, or set for every file).  A compressed shard is a
shard like any other: its fingerprint is the compressed file's size and mtime/ETag.
Hive/Spark partition folders (``lang=de/part-0.parquet``) become string columns of every
row (:func:`hive_partitions`).  Of the files under an input folder (or matched by a glob)
each is read or named, with the reason, in one WARNING line (hidden ``_``/``.`` names,
unknown formats, compressed Parquet, a second spelling of a file already listed); the
job's own output and any folder below the input holding a ``_manifest/`` (a specbatch
output) are left out with an INFO line.  A shard is known by its resolved location
(:func:`resolved_location`: a local file's real path), so locally ``a//b``, ``a/x/../b``,
``./b``, a relative path or a symlink name the same shard, and a rerun spelled another way
resumes.  On an object store a key is a string, read as written: ``s3://b/a//x.jsonl`` and
``s3://b/a/x.jsonl`` are two objects, two shards.

Reads never end early in silence, nor hang: a compressed stream cut before its
end-of-stream marker (every codec, zstandard included) refuses the job naming the file
(:func:`open_stream`); checksums a file carries are verified (Parquet page CRCs, the
codecs' own checks); a local input that is not a regular file (a named pipe, a device, a
socket) is refused by name before the job opens it (:func:`refuse_special_file`).

Ids, one rule for both formats: the id column (``input.id_column``) may hold strings or
integers; an integer becomes its decimal string (so ``7`` and ``"7"`` are the same id).  A
row without an id (field or column missing, or null) gets the derived id
``<shard name>:<row>``, e.g. ``prompts.jsonl:17``: the shard's path relative to the input
location and its 0-based row (``source_row``); the same input gives the same ids on every
run.  Any other id (float, boolean, list, object) makes the row an error row, with the
derived id; a Parquet id column of another type refuses the shard.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import posixpath
import os
import stat
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.config import InputConfig, JobRefused
from pipeline.output.fs import is_local as _is_local, resolved_location, unstrip as _unstrip
from pipeline.output.layout import MANIFEST, STAGING, owned_output_file
from pipeline.retry import StorageError, endpoint_of, open_fs, retrying
from pipeline.schema import INPUT_SCHEMA
from pipeline.units import Shard, Split, Unit, units_of  # noqa: F401 (the input's units; re-exported)


PARQUET_EXT = (".parquet", ".pq")
JSONL_EXT = (".jsonl", ".json", ".ndjson")
#: compressed JSONL: file-name ending -> fsspec compression (``input.compression: infer``)
COMPRESSION_EXT = {".gz": "gzip", ".bz2": "bz2", ".zst": "zstd", ".xz": "xz"}
_KINDS = "*.parquet, *.pq, *.jsonl, *.json or *.ndjson (JSONL optionally .gz, .bz2, .zst or .xz)"


log = logging.getLogger("specbatch")

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


_SPECIAL = {stat.S_IFIFO: "a named pipe (FIFO)", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
            stat.S_IFSOCK: "a socket"}


def refuse_special_file(path: str, what: str, key: str) -> None:
    """Refuse a local ``path`` (following links) that exists but is not a regular file: a
    read of a named pipe, a device (``/dev/zero``) or a socket may never return, so the job
    never opens one.  A missing or unreachable path is left to the caller.

    Raises:
        InputError: ``path`` is a FIFO, a device, a socket or a folder (``what`` and the
            config ``key`` are named in the message).
    """
    try:
        mode = os.stat(path).st_mode
    except OSError:  # missing, or not reachable: left to the caller's own checks
        return
    if stat.S_ISREG(mode):
        return
    kind = "a folder" if stat.S_ISDIR(mode) else _SPECIAL.get(stat.S_IFMT(mode), "not a regular file")
    raise InputError(f"{what} is {kind}, not a regular file: a read of it may never return, so the job does not "
                     f"open it; replace it with a file, or move it out of the input ({key})")


def shard_fingerprint(info: dict[str, Any]) -> str:
    """``size=N;etag=...`` or ``size=N;mtime=...`` from an fsspec ``info()`` record."""
    size = info.get("size")
    for key in ("ETag", "etag", "md5Hash", "crc32c"):
        if info.get(key):
            return f"size={size};etag={str(info[key]).strip(chr(34))}"
    for key in ("mtime", "LastModified", "last_modified", "updated", "created"):
        if info.get(key) is not None:
            return f"size={size};mtime={info[key]}"
    return f"size={size}"


def _base_dir(fs, path: str) -> str:
    """The directory shard names are relative to: the input directory, a glob's fixed
    prefix, or a single file's directory."""
    if any(c in path for c in "*?["):
        fixed = path[: min(path.index(c) for c in "*?[" if c in path)]
        return fixed.rsplit("/", 1)[0] if "/" in fixed else ""
    try:
        if fs.isdir(path):
            return path.rstrip("/")
    except Exception:  # noqa: BLE001 - only names depend on it
        pass
    return posixpath.dirname(path)


def _under(path: str, folder: str) -> bool:
    folder = folder.rstrip("/")
    return path == folder or path.startswith(folder + "/")


def _rel(path: str, base: str) -> str:
    """``path`` relative to ``base``: one separator dropped, so the object ``base//x`` is
    named ``/x``, never the same as ``base/x``."""
    if not base or not _under(path, base):
        return posixpath.basename(path)
    rest = path[len(base.rstrip("/")):]
    return rest[1:] if rest.startswith("/") else rest


def _hidden(name: str) -> bool:
    """Whether a relative name has a part starting with ``_`` or ``.`` (writers' markers,
    dot files); the parts ``.`` and ``..`` of an object-store key are literal strings, not
    hidden names."""
    return any(part.startswith((".", "_")) and part not in (".", "..") for part in name.split("/"))


def hive_partitions(name: str) -> dict[str, str | None]:
    """The Hive partition values in the folders of a relative path:
    ``lang=de/year=2024/part-0.parquet`` -> ``{"lang": "de", "year": "2024"}`` (values as
    strings, percent-decoded; ``__HIVE_DEFAULT_PARTITION__`` is null)."""
    from urllib.parse import unquote

    out: dict[str, str | None] = {}
    for part in name.split("/")[:-1]:
        key, eq, value = part.partition("=")
        if eq and key:
            value = unquote(value)
            out[unquote(key)] = None if value == "__HIVE_DEFAULT_PARTITION__" else value
    return out


class _NotRead:
    """The files of a listing the job does not read, by reason, for one log line."""

    SHOWN = 100  # names per reason in the line; the rest are counted

    def __init__(self) -> None:
        self.by_reason: dict[str, list[str]] = {}

    def add(self, reason: str, name: str) -> None:
        self.by_reason.setdefault(reason, []).append(name)

    def __len__(self) -> int:
        return sum(len(v) for v in self.by_reason.values())

    def line(self) -> str:
        parts = []
        for reason, names in self.by_reason.items():
            shown = ", ".join(names[: self.SHOWN])
            more = f" and {len(names) - self.SHOWN} more" if len(names) > self.SHOWN else ""
            parts.append(f"{shown}{more}: {reason}")
        return "; ".join(parts)


def _output_root(output: Any, retry: Any) -> str | None:
    """The output folder (``output.uri``, every date partition under it) as a resolved URL."""
    if output is None:
        return None
    try:
        ofs, opath = open_fs(output.uri, output.storage_options, retry)
    except Exception:  # noqa: BLE001 - the writer reports a bad output itself
        return None
    return _unstrip(ofs, resolved_location(ofs, opath.rstrip("/") or "/")).rstrip("/")


def resolve_shards(cfg: InputConfig, retry: Any = None, output: Any = None) -> list[Shard]:
    """Expand ``cfg.uri`` into shards, checking each one opens and has the text column.

    A file named by ``input.uri`` is read (or refused).  Of the files found under a folder
    or by a glob, each is read, or named in one WARNING line with the reason (a hidden
    name starting with ``_`` or ``.``, an unknown format, a compressed Parquet file, a
    second spelling of a file already listed); files of the job's output (``output``:
    every file under ``output.uri``) and of any specbatch output below the input location
    (a folder holding ``_manifest/``) are left out with an INFO line.

    Args:
        cfg: the ``input:`` section.
        retry: the ``retry:`` section (or None: defaults).
        output: the ``output:`` section, or None (nothing excluded).

    Returns:
        Shards in sorted path order, ``index`` 0..n-1, each named by its resolved location.

    Raises:
        InputError: nothing matches; no listed file is read; the input lies inside the
            output's ``_manifest/`` or ``_staging/``, or names a file of the output; a shard
            cannot be opened or parsed, or is not usable at all (see the module docstring);
            a Hive partition key clashes with an output column.  Raised in the driver,
            before any model loads.
        StorageError: the storage kept failing with transient errors (retries and
            deadline exhausted): the input may be fine, so this is not a refusal.
    """
    try:
        fs, path = open_fs(cfg.uri, cfg.storage_options, retry)
    except Exception as e:  # bad protocol, missing s3fs, bad storage options
        raise InputError(f"cannot open input {cfg.uri!r}: {type(e).__name__}: {e}") from None
    io = retrying(retry, endpoint_of(fs))
    glob = any(c in path for c in "*?[")
    path = resolved_location(fs, path)
    out_root = _output_root(output, retry)
    if out_root is not None:
        root_url = _unstrip(fs, _base_dir(fs, path) if glob else path)
        inside = root_url[len(out_root):].split("/") if _under(root_url, out_root) else []
        sub = next((d for d in inside if d in (MANIFEST, STAGING)), None)
        if sub:
            raise InputError(f"input {cfg.uri!r} lies inside the output's {sub}/ ({out_root}): the job "
                             "owns and deletes what is there; move the input elsewhere (input.uri)")

    local = _is_local(fs)

    def is_file(p: str) -> bool:  # locally, a FIFO or a device too: refused by name below, never skipped
        return os.path.lexists(p) and not os.path.isdir(p) if local else fs.isfile(p)

    def listing() -> tuple[str, list[str]]:
        if glob:
            return "glob", sorted(p for p in fs.glob(path) if is_file(p))
        if fs.isdir(path):
            return "folder", sorted(p for p in fs.find(path) if not p.endswith("/"))
        if is_file(path):
            return "file", [path]
        return "none", []

    try:
        kind, paths = io(listing, f"list input {cfg.uri!r}")
    except StorageError as e:
        if e.transient:
            raise
        raise InputError(f"cannot list input {cfg.uri!r}: {e}") from None
    if not paths:
        raise InputError(f"input not found: no file matches {cfg.uri!r} (input.uri)")
    base = _base_dir(fs, path)
    picked, not_read, left_out = _pick(fs, kind, paths, base, cfg, out_root)
    for where, n in left_out.items():
        log.info("input %s: leaving out %d file(s) under %s, %s", cfg.uri, n, *where)
    if not_read:
        log.warning("input %s: %d file(s) not read: %s", cfg.uri, len(not_read), not_read.line())
    if not picked:
        why = not_read.line() or "; ".join(f"{n} file(s) under {w[0]} ({w[1]})" for w, n in left_out.items())
        raise InputError(f"input {cfg.uri!r}: none of its {len(paths)} file(s) is read: {why}")
    shards = []
    for i, (p, real, fmt, comp) in enumerate(picked):
        url = _unstrip(fs, real)
        if local:
            link = f" (a link to {real!r})" if os.path.islink(p) else ""
            refuse_special_file(real, f"input shard {_unstrip(fs, p)!r}{link}", "input.uri")
        try:
            (n, splits), fp = io(lambda: (_check_shard(fs, real, fmt, cfg, comp),
                                          shard_fingerprint(fs.info(real))), f"read input shard {url!r}")
        except StorageError as e:
            cause = e.__cause__
            if isinstance(cause, InputError):
                raise cause from None
            if e.transient:
                raise
            how = f"{fmt} ({comp})" if comp else fmt
            raise InputError(f"input shard {url!r} is unreadable as {how}: {type(cause).__name__}: {cause}") from None
        name = _rel(p, base)
        shards.append(Shard(index=i, url=url, format=fmt, num_rows=n, fingerprint=fp, name=name,
                            compression=comp, partitions=hive_partitions(name) or None, splits=tuple(splits)))
    check_partition_keys(shards)
    return shards


def _pick(fs, kind: str, paths: list[str], base: str, cfg: InputConfig, out_root: str | None):
    """Sort a listing into the files read ``(path, resolved path, format, compression)``,
    those not read (:class:`_NotRead`) and those left out (``{(folder, why): count}``)."""

    outputs = {p.rsplit(f"/{MANIFEST}/", 1)[0] for p in paths if f"/{MANIFEST}/" in p}
    outputs = {d for d in outputs if d != base and _under(d, base)}  # below the input location only
    # the input inside (or equal to) the output folder: only the job's own files are left out
    within = out_root is not None and _under(_unstrip(fs, base), out_root)
    picked, seen = [], {}
    not_read, left_out = _NotRead(), {}
    for p in paths:
        real = resolved_location(fs, p)
        url = _unstrip(fs, real)
        if out_root is not None and _under(url, out_root) and (not within or owned_output_file(url[len(out_root):])):
            if kind == "file":
                raise InputError(f"input {cfg.uri!r} is a file of the job's output {out_root}: the job would read "
                                 "its own output; choose another input.uri or output.uri")
            key = (out_root, "the job's output (output.uri)")
            left_out[key] = left_out.get(key, 0) + 1
            continue
        holder = next((d for d in outputs if _under(p, d)), None)
        if holder is not None:
            key = (_unstrip(fs, holder), f"a specbatch output (it holds {MANIFEST}/; name it as input.uri to read it)")
            left_out[key] = left_out.get(key, 0) + 1
            continue
        name = _rel(p, base)
        fmt, comp, why = file_kind(p, cfg)
        if kind == "file":
            if why:
                raise InputError(f"input shard {p!r}: {why}")
        elif _hidden(name):
            not_read.add("hidden (a name starting with '_' or '.', as writers' markers such as _SUCCESS)", name)
            continue
        elif why:
            not_read.add(why, name)
            continue
        if url in seen:
            not_read.add(f"the same file as {seen[url]} (read once)", name)
            continue
        seen[url] = name
        picked.append((p, real, fmt, comp))
    return picked, not_read, left_out


def check_partition_keys(shards: list[Shard]) -> list[str]:
    """The Hive partition keys of the shards (first-seen order), as output columns.

    Raises:
        InputError: a key is also an output column (``id``, ``output_text``...).
    """
    from pipeline.schema import OUTPUT_SCHEMA

    keys = partition_keys(shards)
    clash = [k for k in keys if k in OUTPUT_SCHEMA.names]
    if clash:
        where = next(s.name for s in shards if s.partitions and clash[0] in s.partitions)
        raise InputError(f"input shard {where!r}: partition folder {clash[0]}=... names an output column; "
                         "rename the folder")
    return keys


def partition_keys(shards: list[Shard | dict]) -> list[str]:
    """The Hive partition keys over all shards, in first-seen order."""
    keys: dict[str, None] = {}
    for s in shards:
        parts = s.get("partitions") if isinstance(s, dict) else s.partitions
        keys.update(dict.fromkeys(parts or {}))
    return list(keys)


def _read_every_page(fs, path: str, columns: list[str], max_bytes: int) -> None:
    """Read every data page of ``columns`` of the Parquet file ``path`` (one row group at a
    time) when the file is at most ``max_bytes`` (``input.preflight_read_max_bytes``), so
    that a damaged page (the footer intact) refuses the job before any work rather than
    failing it midway.  A larger file is only opened; a damaged page there fails the run
    when its shard is read, naming the file and the cause.

    Raises:
        InputError: a page cannot be read or decoded (naming the file and the cause).
        Transient storage errors are raised as they are (the caller's retry loop).
    """
    from pipeline.retry import is_transient

    size = fs.size(path)
    if size is not None and size > max_bytes:
        log.info("input shard %s is %d bytes, more than input.preflight_read_max_bytes=%d: its pages are read "
                 "only when its shard runs", path, size, max_bytes)
        return
    try:
        with fs.open(path, "rb") as f:
            pf = _parquet_file(f)
            for i in range(pf.num_row_groups):
                pf.read_row_group(i, columns=columns)
    except Exception as e:  # noqa: BLE001 - decoding errors of every kind
        if is_transient(e):
            raise
        cause = (str(e).strip().splitlines() or [""])[0]
        raise InputError(f"input shard {path!r} is damaged: its footer reads, but a data page of its "
                         f"{' and '.join(repr(c) for c in columns)} column{'s' if len(columns) > 1 else ''} does not "
                         f"({type(e).__name__}: {cause}); replace the file, or move it out of the input") from None


def _parquet_file(f) -> pq.ParquetFile:
    """An input Parquet file opened with its page checksums verified
    (``page_checksum_verification``): a page whose CRC-32 does not match, when the writer
    stored one (``write_page_checksum``), fails to read like a page that does not decode."""
    return pq.ParquetFile(f, page_checksum_verification=True)


_ID_TYPES = (pa.types.is_string, pa.types.is_large_string, pa.types.is_integer, pa.types.is_null)


def _check_shard(fs, path: str, fmt: str, cfg: InputConfig,
                 compression: str | None = None) -> tuple[int, list[dict[str, Any]]]:
    """Open one shard, check it is usable; return its row count and its splits
    (:class:`Split` records of at most ``input.split_rows`` rows: Parquet row groups merged
    up to that, or JSONL line ranges)."""
    if fmt == "parquet":
        with fs.open(path, "rb") as f:
            pf = _parquet_file(f)
            schema = pf.schema_arrow
            n = pf.metadata.num_rows
            group_rows = [pf.metadata.row_group(i).num_rows for i in range(pf.num_row_groups)]
        if cfg.text_column not in schema.names:
            raise InputError(
                f"input shard {path!r} has no column {cfg.text_column!r} (input.text_column); "
                f"its columns are {schema.names}"
            )
        if cfg.id_column in schema.names:
            t = schema.field(cfg.id_column).type
            if pa.types.is_dictionary(t):
                t = t.value_type
            if not any(check(t) for check in _ID_TYPES):
                raise InputError(
                    f"input shard {path!r}: column {cfg.id_column!r} (input.id_column) is {t}; "
                    "ids must be strings or integers"
                )
        else:
            log.warning("input shard %s has no column %r (input.id_column): its rows get derived ids "
                        "<shard name>:<row>", path, cfg.id_column)
        _read_every_page(fs, path, [c for c in (cfg.id_column, cfg.text_column) if c in schema.names],
                         cfg.preflight_read_max_bytes)
        return n, parquet_splits(group_rows, cfg.split_rows)
    n = 0
    usable = False  # a line that is a JSON object with the text field
    objects = 0
    first_problem = None
    splits: list[dict[str, Any]] = []
    with open_stream(fs, path, compression) as f:
        for lineno, offset, raw in _jsonl_scan(f):
            if n % cfg.split_rows == 0:
                splits.append({"start": n, "rows": 0, "offset": offset, "line": lineno - 1})
            splits[-1]["rows"] += 1
            n += 1
            if usable:
                continue
            obj, problem = _parse_line(raw)
            if problem is not None:
                first_problem = first_problem or f"line {lineno} is {problem}"
                continue
            objects += 1
            usable = cfg.text_column in obj
    if n and not usable:
        if not objects:
            raise InputError(f"input shard {path!r} is not JSONL: none of its {n} lines is a JSON object "
                             f"({first_problem})")
        raise InputError(f"input shard {path!r} has no field {cfg.text_column!r} (input.text_column) "
                         f"on any of its {n} lines")
    return n, splits or [{"start": 0, "rows": 0, "offset": 0, "line": 0}]


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
        raise InputError(f"input shard {_unstrip(fs, path)!r} is truncated: its {compression or 'input'} stream ends before "
                         f"its end-of-stream marker ({e}); the rows after the cut would be lost: replace the "
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


def _jsonl_lines(f) -> Iterator[tuple[int, bytes]]:
    """``(line number from 1, bytes)`` of every non-blank line of a binary file; a UTF-8
    byte-order mark at the start is dropped."""
    for lineno, _, raw in _jsonl_scan(f):
        yield lineno, raw


def _jsonl_scan(f, first_line: int = 1, offset: int = 0) -> Iterator[tuple[int, int, bytes]]:
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


def _skip_bytes(f, n: int, compression: str | None) -> None:
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


def _parse_line(raw: bytes) -> tuple[dict | None, str | None]:
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


def _encodable(s: str) -> str | None:
    """None when ``s`` encodes as UTF-8, else why not (a lone surrogate)."""
    try:
        s.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        return f"{e.reason} at character {e.start}"


def _row(shard: Shard, i: int, where: str, id_: Any, text: Any, error: str | None = None) -> dict[str, Any]:
    """One INPUT_SCHEMA row; ``where`` (``line 3`` / ``row 2``) prefixes its input error."""
    problems = [error] if error else []
    if id_ is None:
        out_id = shard.derived_id(i)
    elif isinstance(id_, str):
        bad = _encodable(id_)
        out_id = id_ if bad is None else shard.derived_id(i)
        if bad:
            problems.append(f"id is not valid Unicode ({bad})")
    elif isinstance(id_, int) and not isinstance(id_, bool):
        out_id = str(id_)
    else:
        out_id = shard.derived_id(i)
        problems.append(f"id must be a string or an integer, got {type(id_).__name__} {_short(id_)}")
    if not error and text is not None:
        if not isinstance(text, str):
            problems.append(f"prompt is a {type(text).__name__}, not a string")
            text = None
        else:
            bad = _encodable(text)
            if bad:
                problems.append(f"text is not valid Unicode ({bad})")
                text = None
    return {
        "source_file": shard.url,
        "source_row": i,
        "id": out_id,
        "text": text if isinstance(text, str) and not problems else None,
        "input_error": f"{where}: {'; '.join(problems)}" if problems else None,
    }


def _short(v: Any) -> str:
    r = ascii(v)
    return r if len(r) <= 40 else r[:37] + "..."


def read_shard(shard: Shard | dict, cfg: InputConfig, retry: Any = None,
               partition_keys: list[str] | None = None) -> pa.Table:
    """One shard's rows, all its units in row order (see :func:`read_unit`)."""
    s = Shard(**shard) if isinstance(shard, dict) else shard
    tables = [read_unit(u, cfg, retry, partition_keys) for u in s.units()]
    return pa.concat_tables(tables) if len(tables) > 1 else tables[0]


def read_unit(unit: Unit | dict, cfg: InputConfig, retry: Any = None,
              partition_keys: list[str] | None = None) -> pa.Table:
    """One unit's rows: :data:`INPUT_SCHEMA` (``source_row`` the row's place in its file,
    so ids derived from it are the same whatever the split), then one string column per
    Hive partition key (``partition_keys``, default the shard's own; null where the shard
    has no such folder).  Transient storage errors are retried (see pipeline.retry).

    Raises:
        InputError: the file changed since the job started (its fingerprint differs: the
            unit's offsets no longer hold).
        OSError / pyarrow errors when the file vanished or broke since :func:`resolve_shards`.
    """
    u = Unit.from_dict(unit) if isinstance(unit, dict) else unit
    s = u.shard
    fs, path = open_fs(s.url, cfg.storage_options, retry)
    table = retrying(retry, endpoint_of(fs))(lambda: _read_unit(u, cfg, fs, path), f"read input shard {s.url!r}")
    parts = s.partitions or {}
    for key in (list(parts) if partition_keys is None else partition_keys):
        table = table.append_column(pa.field(key, pa.string()), pa.array([parts.get(key)] * table.num_rows, pa.string()))
    return table


def _read_unit(unit: Unit, cfg: InputConfig, fs, path: str) -> pa.Table:
    """Read one unit into :data:`INPUT_SCHEMA` (one row per input row, in file order).

    Raises:
        InputError: the file changed since the preflight counted it (its fingerprint
            differs), or the read gave other than the unit's rows (any reader that stops
            early), naming the file and both counts.
    """
    shard, sp = unit.shard, unit.split
    if shard.fingerprint is not None:
        now = shard_fingerprint(fs.info(path))
        if now != shard.fingerprint:
            raise InputError(f"input shard {shard.url!r} changed while the job ran ({shard.fingerprint} -> {now}): "
                             "rerun the job (the units committed from the old file are refused then)")
    rows: list[dict[str, Any]] = []
    if shard.format == "parquet":
        with fs.open(path, "rb") as f:
            pf = _parquet_file(f)
            names = pf.schema_arrow.names
            cols = [c for c in dict.fromkeys([cfg.id_column, cfg.text_column]) if c in names]
            if sp.row_groups is None:
                table = pf.read(columns=cols)
            else:
                table = pf.read_row_groups(list(sp.row_groups), columns=cols)
        ids, id_errors = _values(table, cfg.id_column)
        texts, text_errors = _values(table, cfg.text_column)
        for k in range(table.num_rows):
            i = sp.start + k
            err = id_errors.get(k) or text_errors.get(k)
            rows.append(_row(shard, i, f"row {i}", ids[k] if not err else None, texts[k], err))
    elif sp.rows:
        i = sp.start
        with open_stream(fs, path, shard.compression) as f:
            _skip_bytes(f, sp.offset or 0, shard.compression)
            for lineno, _, raw in _jsonl_scan(f, first_line=sp.line + 1, offset=sp.offset or 0):
                obj, problem = _parse_line(raw)
                if problem is not None:
                    rows.append(_row(shard, i, f"line {lineno}", None, None, problem))
                else:
                    rows.append(_row(shard, i, f"line {lineno}", obj.get(cfg.id_column), obj.get(cfg.text_column)))
                i += 1
                if i == sp.start + sp.rows:
                    break
    if len(rows) != sp.rows:
        raise InputError(f"input shard {shard.url!r} gave {len(rows)} rows for unit {unit.part}, but held {sp.rows} "
                         "there when the job started: it changed or was cut while the job ran; rerun (committed "
                         "units are kept)")
    return pa.Table.from_pylist(rows, schema=INPUT_SCHEMA)


def _values(table: pa.Table, column: str) -> tuple[list[Any], dict[int, str]]:
    """A column as Python values (all None when absent), and per-row errors for values
    that cannot be decoded (a string column holding invalid UTF-8)."""
    if column not in table.column_names:
        return [None] * table.num_rows, {}
    col = table.column(column)
    try:
        values = col.to_pylist()
    except Exception:  # noqa: BLE001 - decode value by value
        values, errors = [], {}
        for i in range(len(col)):
            try:
                values.append(col[i].as_py())
            except Exception as e:  # noqa: BLE001
                values.append(None)
                errors[i] = f"column {column!r} cannot be decoded ({type(e).__name__}: {e})"
        return values, errors
    if pa.types.is_binary(col.type) or pa.types.is_large_binary(col.type):
        values = [v if v is None else bytes(v) for v in values]
    return values, {}


def read_units_batch(batch: pa.Table, cfg: dict, retry: dict | None = None,
                     partition_keys: list[str] | None = None) -> pa.Table:
    """``map_batches`` function: a batch of unit records (``{"unit": json of Unit.to_dict()}``)
    -> their rows (INPUT_SCHEMA plus the ``partition_keys`` columns, see :func:`read_unit`,
    then ``_unit``: each row's part name, which the write stage groups by)."""
    from pipeline.output.sink import UNIT_COLUMN

    icfg = InputConfig.model_validate(cfg)
    keys = list(partition_keys or [])
    tables = []
    for rec in batch.to_pylist():
        unit = Unit.from_dict(json.loads(rec["unit"]))
        t = read_unit(unit, icfg, retry, keys)
        tables.append(t.append_column(pa.field(UNIT_COLUMN, pa.string()), pa.array([unit.part] * t.num_rows, pa.string())))
    if tables:
        return pa.concat_tables(tables)
    return pa.schema(list(INPUT_SCHEMA) + [pa.field(k, pa.string()) for k in keys]
                     + [pa.field(UNIT_COLUMN, pa.string())]).empty_table()
