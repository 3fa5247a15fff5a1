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

Ids, one rule for both formats: the id column (``input.id_column``) may hold strings or
integers; an integer becomes its decimal string (so ``7`` and ``"7"`` are the same id).  A
row without an id (field or column missing, or null) gets the derived id
``<shard name>:<row>``, e.g. ``prompts.jsonl:17``: the shard's path relative to the input
location and its 0-based row (``source_row``); the same input gives the same ids on every
run.  Any other id (float, boolean, list, object) makes the row an error row, with the
derived id; a Parquet id column of another type refuses the shard.
"""

from __future__ import annotations

import json
import logging
import posixpath
from dataclasses import asdict, dataclass
from typing import Any, Iterator

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.config import InputConfig, JobRefused
from pipeline.retry import StorageError, endpoint_of, open_fs, retrying
from pipeline.schema import INPUT_SCHEMA


PARQUET_EXT = (".parquet", ".pq")
JSONL_EXT = (".jsonl", ".json", ".ndjson")


log = logging.getLogger("specbatch")

class InputError(JobRefused):
    """The input is missing, empty, unreadable, or lacks the text column."""


@dataclass(frozen=True)
class Shard:
    """One input file.  ``url`` carries the protocol (``s3://b/k.parquet``, ``/abs/x.jsonl``)."""

    index: int
    url: str
    format: str  # "parquet" | "jsonl"
    num_rows: int
    #: what identifies this version of the file: ``size=...;etag=...`` (S3) or
    #: ``size=...;mtime=...`` (local); compared on resume (see pipeline.output)
    fingerprint: str | None = None
    #: the file's path relative to the input location (``a/b.jsonl``); derived ids use it
    name: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def derived_id(self, row: int) -> str:
        """The id of a row that has none: ``<name>:<row>``."""
        return f"{self.name or posixpath.basename(self.url)}:{row}"


def _format_of(path: str, fmt: str) -> str | None:
    if fmt != "auto":
        return fmt
    low = path.lower()
    if low.endswith(PARQUET_EXT):
        return "parquet"
    if low.endswith(JSONL_EXT):
        return "jsonl"
    return None


def _unstrip(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """A URL that reopens ``path`` anywhere: plain path for local files, else ``proto://path``."""
    protos = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return path if ("file" in protos or "local" in protos) else fs.unstrip_protocol(path)


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


def resolve_shards(cfg: InputConfig, retry: Any = None) -> list[Shard]:
    """Expand ``cfg.uri`` into shards, checking each one opens and has the text column.

    Returns:
        Shards in sorted path order, ``index`` 0..n-1.

    Raises:
        InputError: nothing matches, a shard cannot be opened or parsed, or a shard is not
            usable at all (see the module docstring).  Raised in the driver, before any
            model loads.
        StorageError: the storage kept failing with transient errors (retries and
            deadline exhausted): the input may be fine, so this is not a refusal.
    """
    try:
        fs, path = open_fs(cfg.uri, cfg.storage_options, retry)
    except Exception as e:  # bad protocol, missing s3fs, bad storage options
        raise InputError(f"cannot open input {cfg.uri!r}: {type(e).__name__}: {e}") from None
    io = retrying(retry, endpoint_of(fs))

    def listing() -> list[str]:
        if any(c in path for c in "*?["):
            return sorted(p for p in fs.glob(path) if fs.isfile(p))
        if fs.isdir(path):
            return sorted(p for p in fs.find(path) if _format_of(p, cfg.format) and not _hidden(p, path))
        if fs.isfile(path):
            return [path]
        return []

    try:
        paths = io(listing, f"list input {cfg.uri!r}")
    except StorageError as e:
        if e.transient:
            raise
        raise InputError(f"cannot list input {cfg.uri!r}: {e}") from None
    if not paths:
        raise InputError(f"input not found: no file matches {cfg.uri!r} (input.uri)")
    base = _base_dir(fs, path)
    shards = []
    for i, p in enumerate(paths):
        fmt = _format_of(p, cfg.format)
        if fmt is None:
            raise InputError(f"input shard {p!r}: unknown format; name it *.parquet or *.jsonl, or set input.format")
        url = _unstrip(fs, p)
        try:
            n, fp = io(lambda: (_check_shard(fs, p, fmt, cfg), shard_fingerprint(fs.info(p))), f"read input shard {url!r}")
        except StorageError as e:
            cause = e.__cause__
            if isinstance(cause, InputError):
                raise cause from None
            if e.transient:
                raise
            raise InputError(f"input shard {url!r} is unreadable as {fmt}: {type(cause).__name__}: {cause}") from None
        name = p[len(base):].lstrip("/") if base and p.startswith(base + "/") else posixpath.basename(p)
        shards.append(Shard(index=i, url=url, format=fmt, num_rows=n, fingerprint=fp, name=name))
    return shards


def _hidden(p: str, root: str) -> bool:
    rel = p[len(root):].lstrip("/")
    return any(part.startswith((".", "_")) for part in rel.split("/"))


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
            pf = pq.ParquetFile(f)
            for i in range(pf.num_row_groups):
                pf.read_row_group(i, columns=columns)
    except Exception as e:  # noqa: BLE001 - decoding errors of every kind
        if is_transient(e):
            raise
        cause = (str(e).strip().splitlines() or [""])[0]
        raise InputError(f"input shard {path!r} is damaged: its footer reads, but a data page of its "
                         f"{' and '.join(repr(c) for c in columns)} column{'s' if len(columns) > 1 else ''} does not "
                         f"({type(e).__name__}: {cause}); replace the file, or move it out of the input") from None


_ID_TYPES = (pa.types.is_string, pa.types.is_large_string, pa.types.is_integer, pa.types.is_null)


def _check_shard(fs, path: str, fmt: str, cfg: InputConfig) -> int:
    """Open one shard, check it is usable, return its row count."""
    if fmt == "parquet":
        with fs.open(path, "rb") as f:
            pf = pq.ParquetFile(f)
            schema = pf.schema_arrow
            n = pf.metadata.num_rows
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
        return n
    n = 0
    usable = False  # a line that is a JSON object with the text field
    objects = 0
    first_problem = None
    with fs.open(path, "rb") as f:
        for lineno, raw in _jsonl_lines(f):
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
    return n


def _jsonl_lines(f) -> Iterator[tuple[int, bytes]]:
    """``(line number from 1, bytes)`` of every non-blank line of a binary file; a UTF-8
    byte-order mark at the start is dropped."""
    for lineno, raw in enumerate(f, start=1):
        if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]
        if raw.strip():
            yield lineno, raw


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


def read_shard(shard: Shard | dict, cfg: InputConfig, retry: Any = None) -> pa.Table:
    """:func:`_read_shard` with transient storage errors retried (see pipeline.retry)."""
    s = Shard(**shard) if isinstance(shard, dict) else shard
    fs, path = open_fs(s.url, cfg.storage_options, retry)
    return retrying(retry, endpoint_of(fs))(lambda: _read_shard(s, cfg, fs, path), f"read input shard {s.url!r}")


def _read_shard(shard: Shard, cfg: InputConfig, fs, path: str) -> pa.Table:
    """Read one shard into :data:`INPUT_SCHEMA` (one row per input row, in file order).

    Raises:
        OSError / pyarrow errors when the file vanished or broke since :func:`resolve_shards`.
    """
    rows: list[dict[str, Any]] = []
    if shard.format == "parquet":
        with fs.open(path, "rb") as f:
            pf = pq.ParquetFile(f)
            names = pf.schema_arrow.names
            cols = [c for c in dict.fromkeys([cfg.id_column, cfg.text_column]) if c in names]
            table = pf.read(columns=cols)
        ids, id_errors = _values(table, cfg.id_column)
        texts, text_errors = _values(table, cfg.text_column)
        for i in range(table.num_rows):
            err = id_errors.get(i) or text_errors.get(i)
            rows.append(_row(shard, i, f"row {i}", ids[i] if not err else None, texts[i], err))
    else:
        i = 0
        with fs.open(path, "rb") as f:
            for lineno, raw in _jsonl_lines(f):
                obj, problem = _parse_line(raw)
                if problem is not None:
                    rows.append(_row(shard, i, f"line {lineno}", None, None, problem))
                else:
                    rows.append(_row(shard, i, f"line {lineno}", obj.get(cfg.id_column), obj.get(cfg.text_column)))
                i += 1
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


def read_shards_batch(batch: pa.Table, cfg: dict, retry: dict | None = None) -> pa.Table:
    """``map_batches`` function: a batch of shard records -> their rows (INPUT_SCHEMA)."""
    icfg = InputConfig.model_validate(cfg)
    tables = [read_shard(rec, icfg, retry) for rec in batch.to_pylist()]
    return pa.concat_tables(tables) if tables else INPUT_SCHEMA.empty_table()
