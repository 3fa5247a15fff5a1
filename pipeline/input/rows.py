"""Stage 1 on the workers: one unit's rows into :data:`~pipeline.schema.INPUT_SCHEMA`.

Each row keeps its shard (``source_file``) and its place in it (``source_row``), so the ids
derived from it are the same whatever the split, and the write stage commits it under its
unit's part name (:data:`~pipeline.units.UNIT_COLUMN`).

Row-level problems never fail a unit: a line that is not UTF-8, not JSON or not a JSON
object, a text that is not a string or not valid Unicode (a lone surrogate escape such as
``"\\ud800"`` is valid JSON but cannot be encoded), an id of another type: each becomes a
row with ``input_error`` set (naming its line or row), and the actor turns it into that
row's ``error``.

Ids, one rule for both formats: the id column (``input.id_column``) may hold strings or
integers; an integer becomes its decimal string (so ``7`` and ``"7"`` are the same id).  A
row without an id (field or column missing, or null) gets the derived id
``<shard name>:<row>``, e.g. ``prompts.jsonl:17``: the shard's path relative to the input
location and its 0-based row (``source_row``); the same input gives the same ids on every
run.  Any other id (float, boolean, list, object) makes the row an error row, with the
derived id; a Parquet id column of another type refuses the shard (in the driver).

A file that changed since the driver counted it is refused by name, never read from the
wrong place: its version (:func:`pipeline.storage.file_version`) must be the same, and a
JSONL unit must start at a line boundary (the byte before its offset a newline) whose line
is the one counted (:attr:`~pipeline.units.Split.first_line`): a file replaced by one
of the same size with its mtime restored has the version of the old one, but not its lines.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa

from pipeline.config import InputConfig
from pipeline.input.formats import InputError, jsonl_scan, line_hash, open_stream, parquet_file, parse_line, skip_bytes
from pipeline.units import UNIT_COLUMN, Shard, Unit
from pipeline.retry import StorageError, endpoint_of, open_fs, retrying
from pipeline.schema import CARRIED_COLUMN, INPUT_SCHEMA
from pipeline.storage import file_version


def _encodable(s: str) -> str | None:
    """None when ``s`` encodes as UTF-8, else why not (a lone surrogate)."""
    try:
        s.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        return f"{e.reason} at character {e.start}"


def _short(v: Any) -> str:
    r = ascii(v)
    return r if len(r) <= 40 else r[:37] + "..."


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


def read_shard(shard: Shard | dict, cfg: InputConfig, retry: Any = None,
               partition_keys: list[str] | None = None, carry: list[str] | None = None) -> pa.Table:
    """One shard's rows, all its units in row order (see :func:`read_unit`)."""
    s = Shard(**shard) if isinstance(shard, dict) else shard
    tables = [read_unit(u, cfg, retry, partition_keys, carry) for u in s.units()]
    return pa.concat_tables(tables) if len(tables) > 1 else tables[0]


def read_unit(unit: Unit | dict, cfg: InputConfig, retry: Any = None,
              partition_keys: list[str] | None = None, carry: list[str] | None = None) -> pa.Table:
    """One unit's rows: :data:`INPUT_SCHEMA` (``source_row`` the row's place in its file,
    so ids derived from it are the same whatever the split), then one string column per
    Hive partition key (``partition_keys``, default the shard's own; null where the shard
    has no such folder), then with ``carry`` (:func:`pipeline.input.discovery.carried_columns`)
    :data:`~pipeline.schema.CARRIED_COLUMN`: a JSON object of the row's values of those columns
    (absent ones left out; the row's ``text`` is then null: the prompt comes from them).
    Transient storage errors are retried (see pipeline.retry).

    Raises:
        InputError: the file changed since the job started (its version differs, or a JSONL
            unit's first line is not where, or what, it was: the unit's offsets no longer hold).
        OSError / pyarrow errors when the file vanished or broke since the driver listed it.
    """
    u = Unit.from_dict(unit) if isinstance(unit, dict) else unit
    s = u.shard
    fs, path = open_fs(s.url, cfg.storage_options, retry)
    try:
        table = retrying(retry, endpoint_of(fs))(lambda: _read_unit(u, cfg, fs, path, carry),
                                                 f"read input shard {s.url!r}")
    except StorageError as e:
        if isinstance(e.__cause__, InputError):  # the file changed: named as itself, not as a storage failure
            raise e.__cause__ from None
        raise
    parts = s.partitions or {}
    for key in (list(parts) if partition_keys is None else partition_keys):
        table = table.append_column(pa.field(key, pa.string()), pa.array([parts.get(key)] * table.num_rows, pa.string()))
    if carry is not None:
        carried = table.column(CARRIED_COLUMN)
        table = table.drop_columns([CARRIED_COLUMN]).append_column(pa.field(CARRIED_COLUMN, pa.string()), carried)
    return table


def _read_unit(unit: Unit, cfg: InputConfig, fs, path: str, carry: list[str] | None = None) -> pa.Table:
    """Read one unit into :data:`INPUT_SCHEMA` (one row per input row, in file order).

    Raises:
        InputError: the file changed since the preflight counted it (its version differs,
            or a JSONL unit does not start on its line), or the read gave other than the
            unit's rows (any reader that stops early), naming the file and both counts.
    """
    shard, sp = unit.shard, unit.split
    if shard.fingerprint is not None:
        now = file_version(fs.info(path))
        if now != shard.fingerprint:
            raise InputError(f"input shard {shard.url!r} changed while the job ran ({shard.fingerprint} -> {now}): "
                             "rerun the job (the units committed from the old file are refused then)")
    if shard.format == "parquet":
        rows = _parquet_rows(unit, cfg, fs, path, carry)
    else:
        rows = _jsonl_rows(unit, cfg, fs, path, carry) if sp.rows else []
    if len(rows) != sp.rows:
        raise InputError(f"input shard {shard.url!r} gave {len(rows)} rows for unit {unit.part}, but held {sp.rows} "
                         "there when the job started: it changed or was cut while the job ran; rerun (committed "
                         "units are kept)")
    schema = INPUT_SCHEMA if carry is None else INPUT_SCHEMA.append(pa.field(CARRIED_COLUMN, pa.string()))
    return pa.Table.from_pylist(rows, schema=schema)


def _carried(values: dict[str, Any], carry: list[str] | None) -> str | None:
    """The :data:`~pipeline.schema.CARRIED_COLUMN` value of a row (None without ``carry``)."""
    if carry is None:
        return None
    return json.dumps({c: values[c] for c in carry if c in values}, ensure_ascii=False, default=str)


def _parquet_rows(unit: Unit, cfg: InputConfig, fs, path: str, carry: list[str] | None = None) -> list[dict[str, Any]]:
    shard, sp = unit.shard, unit.split
    with fs.open(path, "rb") as f:
        pf = parquet_file(f)
        names = pf.schema_arrow.names
        cols = [c for c in dict.fromkeys([cfg.id_column, *([cfg.text_column] if carry is None else carry)])
                if c in names]
        if sp.row_groups is None:
            table = pf.read(columns=cols)
        else:
            table = pf.read_row_groups(list(sp.row_groups), columns=cols)
    ids, id_errors = _values(table, cfg.id_column)
    texts, text_errors = _values(table, cfg.text_column) if carry is None else ([None] * table.num_rows, {})
    carried = {c: _values(table, c) for c in carry or () if c in table.column_names}
    rows = []
    for k in range(table.num_rows):
        i = sp.start + k
        err = id_errors.get(k) or text_errors.get(k) or next((e[k] for _, e in carried.values() if k in e), None)
        row = _row(shard, i, f"row {i}", ids[k] if not err else None, texts[k], err)
        if carry is not None:
            row[CARRIED_COLUMN] = _carried({c: v[k] for c, (v, _) in carried.items()}, carry)
        rows.append(row)
    return rows


def _jsonl_rows(unit: Unit, cfg: InputConfig, fs, path: str, carry: list[str] | None = None) -> list[dict[str, Any]]:
    """A JSONL unit's rows, read from its byte offset; its first line is checked first (see
    the module docstring)."""
    shard, sp = unit.shard, unit.split
    offset = sp.offset or 0
    rows: list[dict[str, Any]] = []
    i = sp.start
    with open_stream(fs, path, shard.compression) as f:
        skip_bytes(f, max(0, offset - 1), shard.compression)
        if offset and f.read(1) != b"\n":
            raise _moved(unit, f"byte {offset} of the file, where it starts, is not at the start of a line")
        for lineno, _, raw in jsonl_scan(f, first_line=sp.line + 1, offset=offset):
            if i == sp.start and sp.first_line is not None and line_hash(raw) != sp.first_line:
                raise _moved(unit, f"its first line (line {lineno}) is not the line counted there")
            obj, problem = parse_line(raw)
            if problem is not None:
                rows.append(_row(shard, i, f"line {lineno}", None, None, problem))
            else:
                rows.append(_row(shard, i, f"line {lineno}", obj.get(cfg.id_column),
                                 obj.get(cfg.text_column) if carry is None else None))
            if carry is not None:
                rows[-1][CARRIED_COLUMN] = _carried(obj if problem is None else {}, carry)
            i += 1
            if i == sp.start + sp.rows:
                break
    return rows


def _moved(unit: Unit, what: str) -> InputError:
    return InputError(f"input shard {unit.shard.url!r} changed while the job ran, keeping its size and modification "
                      f"time (a file replaced in place): unit {unit.part}: {what}; its rows would be read from the "
                      "wrong place: rerun the job (the units committed from the old file are refused then)")


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
                     partition_keys: list[str] | None = None, carry: list[str] | None = None) -> pa.Table:
    """``map_batches`` function: a batch of unit records (``{"unit": json of Unit.to_dict()}``)
    -> their rows (INPUT_SCHEMA plus the ``partition_keys`` columns, see :func:`read_unit`,
    then :data:`UNIT_COLUMN`: each row's part name, which the write stage groups by)."""
    icfg = InputConfig.model_validate(cfg)
    keys = list(partition_keys or [])
    tables = []
    for rec in batch.to_pylist():
        unit = Unit.from_dict(json.loads(rec["unit"]))
        t = read_unit(unit, icfg, retry, keys, carry)
        tables.append(t.append_column(pa.field(UNIT_COLUMN, pa.string()), pa.array([unit.part] * t.num_rows, pa.string())))
    if tables:
        return pa.concat_tables(tables)
    return pa.schema(list(INPUT_SCHEMA) + [pa.field(k, pa.string()) for k in keys]
                     + ([pa.field(CARRIED_COLUMN, pa.string())] if carry is not None else [])
                     + [pa.field(UNIT_COLUMN, pa.string())]).empty_table()
