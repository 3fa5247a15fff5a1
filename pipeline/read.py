"""Stage 1, read: find input shards through fsspec and read them into a fixed schema.

A *shard* is one input file.  :func:`resolve_shards` (in the driver, before any model
loads) expands the input URI, checks that every shard opens, has the id and text
columns, and counts its rows.  :func:`read_shard` (in a Ray task) reads one shard into
:data:`INPUT_SCHEMA`; each row keeps its shard (``source_file``) and position in it
(``source_row``), which the writer uses to write one output part per input shard.

Row-level problems do not fail a shard: a text that is not a string, or a JSONL line
that is not a JSON object, becomes a row with ``input_error`` set, and the actor turns
it into that row's ``error``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.core import url_to_fs

from pipeline.config import InputConfig
from pipeline.retry import StorageError, retrying

#: One row of input, as the actors receive it.
INPUT_SCHEMA = pa.schema(
    [
        ("source_file", pa.string()),  # the shard's URL
        ("source_row", pa.int64()),  # 0-based row (Parquet) or non-blank line (JSONL) in the shard
        ("id", pa.string()),  # the id column, as a string (null stays null)
        ("text", pa.string()),  # the text column (null when missing or not a string)
        ("input_error", pa.string()),  # why this row cannot be used, else null
    ]
)

PARQUET_EXT = (".parquet", ".pq")
JSONL_EXT = (".jsonl", ".json", ".ndjson")


class InputError(ValueError):
    """The input is missing, empty, unreadable, or lacks the id/text columns."""


@dataclass(frozen=True)
class Shard:
    """One input file.  ``url`` carries the protocol (``s3://b/k.parquet``, ``/abs/x.jsonl``)."""

    index: int
    url: str
    format: str  # "parquet" | "jsonl"
    num_rows: int
    #: what identifies this version of the file: ``size=...;etag=...`` (S3) or
    #: ``size=...;mtime=...`` (local); compared on resume (see pipeline.write)
    fingerprint: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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


def fingerprint(info: dict[str, Any]) -> str:
    """``size=N;etag=...`` or ``size=N;mtime=...`` from an fsspec ``info()`` record."""
    size = info.get("size")
    for key in ("ETag", "etag", "md5Hash", "crc32c"):
        if info.get(key):
            return f"size={size};etag={str(info[key]).strip(chr(34))}"
    for key in ("mtime", "LastModified", "last_modified", "updated", "created"):
        if info.get(key) is not None:
            return f"size={size};mtime={info[key]}"
    return f"size={size}"


def resolve_shards(cfg: InputConfig, retry: Any = None) -> list[Shard]:
    """Expand ``cfg.uri`` into shards, checking each one opens and has the columns.

    Returns:
        Shards in sorted path order, ``index`` 0..n-1.

    Raises:
        InputError: nothing matches, a shard cannot be opened or parsed, or a shard lacks
            ``cfg.id_column`` / ``cfg.text_column``.  Raised in the driver, before any model loads.
    """
    io = retrying(retry)
    try:
        fs, path = url_to_fs(cfg.uri, **cfg.storage_options)
    except Exception as e:  # bad protocol, missing s3fs, bad storage options
        raise InputError(f"cannot open input {cfg.uri!r}: {type(e).__name__}: {e}") from None

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
        raise InputError(f"cannot list input {cfg.uri!r}: {e}") from None
    if not paths:
        raise InputError(f"input not found: no file matches {cfg.uri!r} (input.uri)")
    shards = []
    for i, p in enumerate(paths):
        fmt = _format_of(p, cfg.format)
        if fmt is None:
            raise InputError(f"input shard {p!r}: unknown format; name it *.parquet or *.jsonl, or set input.format")
        url = _unstrip(fs, p)
        try:
            n, fp = io(lambda: (_check_shard(fs, p, fmt, cfg), fingerprint(fs.info(p))), f"read input shard {url!r}")
        except InputError:
            raise
        except StorageError as e:
            cause = e.__cause__
            if isinstance(cause, InputError):
                raise cause from None
            raise InputError(f"input shard {url!r} is unreadable as {fmt}: {type(cause).__name__}: {cause}") from None
        shards.append(Shard(index=i, url=url, format=fmt, num_rows=n, fingerprint=fp))
    return shards


def _hidden(p: str, root: str) -> bool:
    rel = p[len(root):].lstrip("/")
    return any(part.startswith((".", "_")) for part in rel.split("/"))


def _check_shard(fs, path: str, fmt: str, cfg: InputConfig) -> int:
    """Open one shard, check the columns, return its row count."""
    if fmt == "parquet":
        with fs.open(path, "rb") as f:
            pf = pq.ParquetFile(f)
            names = pf.schema_arrow.names
            n = pf.metadata.num_rows
        for col, key in ((cfg.id_column, "id_column"), (cfg.text_column, "text_column")):
            if col not in names:
                raise InputError(
                    f"input shard {path!r} has no column {col!r} (input.{key}); its columns are {names}"
                )
        return n
    n = 0
    first = None
    with fs.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                if first is None:
                    first = line
                n += 1
    if first is not None:
        try:
            obj = json.loads(first)
        except json.JSONDecodeError as e:
            raise InputError(f"input shard {path!r} is not JSONL: first line is not JSON ({e})") from None
        if not isinstance(obj, dict):
            raise InputError(f"input shard {path!r} is not JSONL of objects: first line is {type(obj).__name__}")
        if cfg.text_column not in obj:
            raise InputError(
                f"input shard {path!r} has no field {cfg.text_column!r} (input.text_column) on its first line"
            )
    return n


def _as_id(v: Any) -> str | None:
    if v is None:
        return None
    return v if isinstance(v, str) else json.dumps(v) if isinstance(v, (list, dict)) else str(v)


def _row(shard: Shard, i: int, id_: Any, text: Any, error: str | None = None) -> dict[str, Any]:
    if error is None and text is not None and not isinstance(text, str):
        error = f"prompt is a {type(text).__name__}, not a string"
    return {
        "source_file": shard.url,
        "source_row": i,
        "id": _as_id(id_),
        "text": text if isinstance(text, str) else None,
        "input_error": error,
    }


def read_shard(shard: Shard | dict, cfg: InputConfig, retry: Any = None) -> pa.Table:
    """:func:`_read_shard` with transient storage errors retried (see pipeline.retry)."""
    s = Shard(**shard) if isinstance(shard, dict) else shard
    return retrying(retry)(lambda: _read_shard(s, cfg), f"read input shard {s.url!r}")


def _read_shard(shard: Shard | dict, cfg: InputConfig) -> pa.Table:
    """Read one shard into :data:`INPUT_SCHEMA` (one row per input row, in file order).

    Raises:
        OSError / pyarrow errors when the file vanished or broke since :func:`resolve_shards`.
    """
    if isinstance(shard, dict):
        shard = Shard(**shard)
    fs, path = url_to_fs(shard.url, **cfg.storage_options)
    rows: list[dict[str, Any]] = []
    if shard.format == "parquet":
        with fs.open(path, "rb") as f:
            table = pq.read_table(f, columns=list(dict.fromkeys([cfg.id_column, cfg.text_column])))
        ids = table.column(cfg.id_column).to_pylist()
        text_col = table.column(cfg.text_column)
        texts = text_col.to_pylist()
        if pa.types.is_binary(text_col.type) or pa.types.is_large_binary(text_col.type):
            texts = [t if t is None else bytes(t) for t in texts]
        for i, (id_, text) in enumerate(zip(ids, texts)):
            rows.append(_row(shard, i, id_, text))
    else:
        i = 0
        with fs.open(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    rows.append(_row(shard, i, None, None, f"line {lineno} is not valid JSON: {e}"))
                else:
                    if isinstance(obj, dict):
                        rows.append(_row(shard, i, obj.get(cfg.id_column), obj.get(cfg.text_column)))
                    else:
                        rows.append(_row(shard, i, None, None, f"line {lineno} is a {type(obj).__name__}, not an object"))
                i += 1
    return pa.Table.from_pylist(rows, schema=INPUT_SCHEMA)


def read_shards_batch(batch: pa.Table, cfg: dict, retry: dict | None = None) -> pa.Table:
    """``map_batches`` function: a batch of shard records -> their rows (INPUT_SCHEMA)."""
    icfg = InputConfig.model_validate(cfg)
    tables = [read_shard(rec, icfg, retry) for rec in batch.to_pylist()]
    return pa.concat_tables(tables) if tables else INPUT_SCHEMA.empty_table()
