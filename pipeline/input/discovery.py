"""Finding the input: the listing, the files read and those named, each shard checked and
split into units, in the driver before any model loads (:func:`resolve_shards`).

A *shard* is one input file.  :func:`resolve_shards` expands the input URI, checks that
every shard opens, has the id and text columns, and counts its rows and its splits.  A
shard is refused as a whole (:class:`~pipeline.input.formats.InputError`, before any model
loads) only when it is not usable at all: a JSONL file none of whose lines is a JSON object
with the text field, a Parquet file that does not open or lacks the text column (the
Parquet schema, and every JSONL line, are read here: a dataset with no text column at all
is named before work starts, never as "prompt is null" on every row).

Listing.  Of the files under an input folder (or matched by a glob) each is read or named,
with the reason, in one WARNING line (hidden ``_``/``.`` names, unknown formats, compressed
Parquet, a second spelling of a file already listed).  Hive/Spark partition folders
(``lang=de/part-0.parquet``) become string columns of every row (:func:`hive_partitions`).

The job's own output is asked one question, :meth:`OutputLocation.contains(url)
<pipeline.output.location.OutputLocation.contains>`: its own files are left out of the
input (an INFO line), and so is everything under its folder when that folder lies below
the input; an input inside its ``_manifest/`` or ``_staging/``, or naming one of its data
files, is refused.  Any other specbatch output below the input location (a folder holding
``_manifest/``) is left out too, with an INFO line.

A shard is known by its resolved location (:func:`pipeline.storage.resolved_location`: a
local file's real path), so locally ``a//b``, ``a/x/../b``, ``./b``, a relative path or a
symlink name the same shard, and a rerun spelled another way resumes.  On an object store a
key is a string, read as written: ``s3://b/a//x.jsonl`` and ``s3://b/a/x.jsonl`` are two
objects, two shards.  A local input that is not a regular file (a named pipe, a device, a
socket) is refused by name before the job opens it (:func:`pipeline.storage.refuse_special`).
"""

from __future__ import annotations

import logging
import os
import posixpath
from typing import Any

import pyarrow as pa

from pipeline.config import InputConfig
from pipeline.input.formats import (InputError, file_kind, jsonl_scan, line_hash, open_stream, parquet_file,
                                    parquet_splits, parse_line)
from pipeline.units import Shard
from pipeline.retry import StorageError, endpoint_of, open_fs, retrying
from pipeline.storage import file_version, is_local, raise_refusal, refuse_special, resolved_location, under, unstrip

log = logging.getLogger("specbatch")


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


def _rel(path: str, base: str) -> str:
    """``path`` relative to ``base``: one separator dropped, so the object ``base//x`` is
    named ``/x``, never the same as ``base/x``."""
    if not base or not under(path, base):
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


class _Output:
    """The job's output as the listing sees it: :meth:`contains` of its location over the
    whole ``output.uri`` (every ``date=`` partition), and whether the input lies in it."""

    def __init__(self, location: Any, input_root: str):
        self.location = location
        self.url = location.url()
        #: the input location itself is in the output folder: then only the job's own files
        #: there are left out (the rest is the user's input beside the output)
        self.within = location.contains(input_root) is not None

    def leaves_out(self, url: str) -> bool:
        held = self.location.contains(url)
        return held == "own" or (held == "other" and not self.within)


def resolve_shards(cfg: InputConfig, retry: Any = None, output: Any = None, columns: list[str] | None = None,
                   list_columns: bool = False) -> list[Shard]:
    """Expand ``cfg.uri`` into shards, checking each one opens and has the columns the
    prompt is made of (default: the text column).

    A file named by ``input.uri`` is read (or refused).  Of the files found under a folder
    or by a glob, each is read, or named in one WARNING line with the reason (see the module
    docstring); files of the job's output and of any specbatch output below the input
    location (a folder holding ``_manifest/``) are left out with an INFO line.

    Args:
        cfg: the ``input:`` section.
        retry: the ``retry:`` section (or None: defaults).
        output: the job's output as the listing asks it: anything with ``contains(url)`` and
            ``url()`` (:func:`pipeline.output.location.listing_view` of the ``output:`` section),
            or None (nothing excluded).  The input side never opens the output itself.
        columns: the columns every shard must hold (:meth:`pipeline.config.JobConfig.prompt_columns`);
            None: ``[cfg.text_column]``.  A Parquet schema without one, or a JSONL file with
            it on none of its lines, refuses the job naming the column.
        list_columns: record every shard's columns (:attr:`Shard.columns`: a Parquet file's
            schema; a JSONL file's fields over all its lines, in first-seen order), which the
            ``generate`` job keeps on output.

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
    out = _output_of(fs, path, glob, cfg, output, retry)
    kind, paths = _list(fs, path, glob, cfg, io)
    base = _base_dir(fs, path)
    picked, not_read, left_out = _pick(fs, kind, paths, base, cfg, out)
    for where, n in left_out.items():
        log.info("input %s: leaving out %d file(s) under %s, %s", cfg.uri, n, *where)
    if not_read:
        log.warning("input %s: %d file(s) not read: %s", cfg.uri, len(not_read), not_read.line())
    if not picked:
        why = not_read.line() or "; ".join(f"{n} file(s) under {w[0]} ({w[1]})" for w, n in left_out.items())
        raise InputError(f"input {cfg.uri!r}: none of its {len(paths)} file(s) is read: {why}")
    need = list(dict.fromkeys(columns if columns is not None else [cfg.text_column]))
    shards = [_shard(fs, i, p, real, fmt, comp, base, cfg, io, need, list_columns)
              for i, (p, real, fmt, comp) in enumerate(picked)]
    check_partition_keys(shards)
    return shards


def _output_of(fs, path: str, glob: bool, cfg: InputConfig, output: Any, retry: Any) -> _Output | None:
    """The job's output as the listing asks it; refuses an input inside its own files.

    Raises:
        InputError: the input location is one of the output's own files or folders (in its
            ``_manifest/`` or ``_staging/``, or a data file or marker of it).
    """
    location = output
    if location is None:
        return None
    root = unstrip(fs, _base_dir(fs, path) if glob else path)
    if location.contains(root) == "own":
        raise InputError(f"input {cfg.uri!r} lies inside the job's output {location.url()}: it is one of the files, "
                         "or in the _manifest/ or _staging/ folders, that the job writes and deletes there; choose "
                         "another input.uri or output.uri")
    return _Output(location, root)


def _list(fs, path: str, glob: bool, cfg: InputConfig, io) -> tuple[str, list[str]]:
    """``(kind, paths)`` of the input: ``"glob"``, ``"folder"``, ``"file"`` or ``"none"``."""
    local = is_local(fs)

    def is_file(p: str) -> bool:  # locally, a FIFO or a device too: refused by name later, never skipped
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
        raise_refusal(e, InputError, f"cannot list input {cfg.uri!r}")
    if not paths:
        raise InputError(f"input not found: no file matches {cfg.uri!r} (input.uri)")
    return kind, paths


def _shard(fs, i: int, p: str, real: str, fmt: str, comp: str | None, base: str, cfg: InputConfig, io,
           need: list[str], list_columns: bool) -> Shard:
    """Shard ``i``, the file ``p`` (resolved: ``real``), checked, counted and split."""
    url = unstrip(fs, real)
    if is_local(fs):
        link = f" (a link to {real!r})" if os.path.islink(p) else ""
        refuse_special(real, f"input shard {unstrip(fs, p)!r}{link}", InputError,
                       "replace it with a file, or move it out of the input (input.uri)")
    how = f"{fmt} ({comp})" if comp else fmt
    try:
        (n, splits, cols), fp = io(lambda: (_check_shard(fs, real, fmt, cfg, comp, need, list_columns),
                                            file_version(fs.info(real))), f"read input shard {url!r}")
    except StorageError as e:
        raise_refusal(e, InputError, f"input shard {url!r} is unreadable as {how}")
    name = _rel(p, base)
    return Shard(index=i, url=url, format=fmt, num_rows=n, fingerprint=fp, name=name, compression=comp,
                 partitions=hive_partitions(name) or None, splits=tuple(splits),
                 columns=tuple(cols) if list_columns else None)


def _pick(fs, kind: str, paths: list[str], base: str, cfg: InputConfig, out: _Output | None):
    """Sort a listing into the files read ``(path, resolved path, format, compression)``,
    those not read (:class:`_NotRead`) and those left out (``{(folder, why): count}``)."""
    from pipeline.layout import MANIFEST

    outputs = {p.rsplit(f"/{MANIFEST}/", 1)[0] for p in paths if f"/{MANIFEST}/" in p}
    outputs = {d for d in outputs if d != base and under(d, base)}  # below the input location only
    picked, seen = [], {}
    not_read, left_out = _NotRead(), {}
    for p in paths:
        real = resolved_location(fs, p)
        url = unstrip(fs, real)
        if out is not None and out.leaves_out(url):
            key = (out.url, "the job's output (output.uri)")
            left_out[key] = left_out.get(key, 0) + 1
            continue
        holder = next((d for d in outputs if under(p, d)), None)
        if holder is not None:
            key = (unstrip(fs, holder), f"a specbatch output (it holds {MANIFEST}/; name it as input.uri to read it)")
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


def carried_columns(shards: list[Shard], need: list[str], every: bool, id_column: str,
                    text_column: str) -> list[str] | None:
    """The input columns the read stage carries to the actors (in the row's
    :data:`pipeline.schema.CARRIED_COLUMN`) and the output keeps: every column of every shard
    (``every``, the generate job: :attr:`Shard.columns`, first-seen order) or the prompt's own
    ``need``, less the id column; None when the prompt is the text column alone (the read stage's
    ``text``, as before columns).

    Raises:
        InputError: a carried column has the name of an output column or a partition key.
    """
    from pipeline.schema import OUTPUT_SCHEMA

    if not every and list(need) == [text_column]:
        return None
    names: dict[str, None] = {}
    if every:  # the input's order
        for s in shards:
            names.update(dict.fromkeys(s.columns or ()))
    names.update(dict.fromkeys(need))
    names.pop(id_column, None)
    keys = set(partition_keys(shards))
    for c in names:
        if c in OUTPUT_SCHEMA.names or c in keys:
            what = "an output column" if c in OUTPUT_SCHEMA.names else "a partition key"
            raise InputError(f"input column {c!r} has the name of {what}; rename it in the input (the job keeps "
                             "every input column on output)")
    return list(names)


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
    size = fs.size(path)
    if size is not None and size > max_bytes:
        log.info("input shard %s is %d bytes, more than input.preflight_read_max_bytes=%d: its pages are read "
                 "only when its shard runs", path, size, max_bytes)
        return
    try:
        with fs.open(path, "rb") as f:
            pf = parquet_file(f)
            for i in range(pf.num_row_groups):
                pf.read_row_group(i, columns=columns)
    except Exception as e:  # noqa: BLE001 - decoding errors of every kind
        cols = f"{' and '.join(repr(c) for c in columns)} column{'s' if len(columns) > 1 else ''}"
        raise_refusal(e, InputError, f"input shard {path!r} is damaged: its footer reads, but a data page of its "
                                     f"{cols} does not", "replace the file, or move it out of the input")


_ID_TYPES = (pa.types.is_string, pa.types.is_large_string, pa.types.is_integer, pa.types.is_null)


def _check_shard(fs, path: str, fmt: str, cfg: InputConfig, compression: str | None = None,
                 need: list[str] | None = None,
                 list_columns: bool = False) -> tuple[int, list[dict[str, Any]], list[str]]:
    """Open one shard, check it is usable (it holds the columns ``need``, default the text
    column); return its row count, its splits (:class:`~pipeline.units.Split` records
    of at most ``input.split_rows`` rows: Parquet row groups merged up to that, or JSONL line
    ranges with their first line's hash) and its columns (a JSONL file's: those seen before
    every needed one was, all of them with ``list_columns``)."""
    need = list(need if need is not None else [cfg.text_column])
    if fmt == "parquet":
        return _check_parquet(fs, path, cfg, need)
    n = 0
    usable = False  # every needed field seen on some line (the text field on one line, by default)
    seen: dict[str, None] = {}
    objects = 0
    first_problem = None
    splits: list[dict[str, Any]] = []
    with open_stream(fs, path, compression) as f:
        for lineno, offset, raw in jsonl_scan(f):
            if n % cfg.split_rows == 0:
                splits.append({"start": n, "rows": 0, "offset": offset, "line": lineno - 1,
                               "first_line": line_hash(raw)})
            splits[-1]["rows"] += 1
            n += 1
            if usable and not list_columns:
                continue
            obj, problem = parse_line(raw)
            if problem is not None:
                first_problem = first_problem or f"line {lineno} is {problem}"
                continue
            objects += 1
            seen.update(dict.fromkeys(obj))
            usable = all(c in seen for c in need)
    if n and not usable:
        if not objects:
            raise InputError(f"input shard {path!r} is not JSONL: none of its {n} lines is a JSON object "
                             f"({first_problem})")
        missing = next(c for c in need if c not in seen)
        raise InputError(f"input shard {path!r} has no field {missing!r} ({_why(missing, cfg)}) "
                         f"on any of its {n} lines")
    return n, splits or [{"start": 0, "rows": 0, "offset": 0, "line": 0}], list(seen)


def _why(column: str, cfg: InputConfig) -> str:
    """Which key names ``column``."""
    keys = [k for k in ("text_column", "messages_column", "params_column") if getattr(cfg, k) == column]
    return ", ".join(f"input.{k}" for k in keys) if keys else "task.prompt_template names it"


def _check_parquet(fs, path: str, cfg: InputConfig, need: list[str]) -> tuple[int, list[dict[str, Any]], list[str]]:
    """The Parquet half of :func:`_check_shard`: the schema has the text column, the id
    column (if any) holds strings or integers, every page of both decodes."""
    with fs.open(path, "rb") as f:
        pf = parquet_file(f)
        schema = pf.schema_arrow
        n = pf.metadata.num_rows
        group_rows = [pf.metadata.row_group(i).num_rows for i in range(pf.num_row_groups)]
    for c in need:
        if c not in schema.names:
            raise InputError(f"input shard {path!r} has no column {c!r} ({_why(c, cfg)}); "
                             f"its columns are {schema.names}")
    if cfg.id_column in schema.names:
        t = schema.field(cfg.id_column).type
        if pa.types.is_dictionary(t):
            t = t.value_type
        if not any(check(t) for check in _ID_TYPES):
            raise InputError(f"input shard {path!r}: column {cfg.id_column!r} (input.id_column) is {t}; "
                             "ids must be strings or integers")
    else:
        log.warning("input shard %s has no column %r (input.id_column): its rows get derived ids "
                    "<shard name>:<row>", path, cfg.id_column)
    _read_every_page(fs, path, [c for c in dict.fromkeys([cfg.id_column, *need]) if c in schema.names],
                     cfg.preflight_read_max_bytes)
    return n, parquet_splits(group_rows, cfg.split_rows), list(schema.names)
