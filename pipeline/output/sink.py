"""The write stage, on the workers: a unit's output rows -> Parquet files in staging
(:meth:`pipeline.output.writer.OutputWriter.write`, the commit protocol's write phase).

:func:`write_fragments` is a Ray Data ``map_batches`` function (tasks asking for no CPU)
after the actor pool.  Each block it gets holds the rows of one or more units (column
``_unit``: the part name, added by the read stage), a unit's rows in input order (the
pool decodes each unit's block in one task, in order).  For each unit in the block it
writes the rows, sorted by ``source_row``, as *fragments* of at most
``output.max_rows_per_file`` rows to ``_staging/<run_id>/<part stem>/<first row>-<token>.parquet``
and returns one small record per fragment (:class:`~pipeline.output.records.Fragment`,
a row of :data:`~pipeline.output.records.FRAGMENT_SCHEMA`): the part, the staged
path, the first and last ``source_row``, its rows, error rows and totals, the pid and
host that wrote it, whether its rows are consecutive (each once, no gap), and the SHA-256
and size of the bytes written (:func:`parquet_bytes`: the unit's record carries them, and
every reader of committed output checks them, :mod:`pipeline.output.reader`).  Output rows never travel to the driver: it commits a unit from
these records alone (:meth:`pipeline.output.writer.OutputWriter.add_fragments`), which
moves the fragments to their final names (a rename or an object store's server-side copy).

A task that Ray retries (a lost node) writes new fragments under new tokens; the driver
uses only the records it received, and the fragments nobody committed stay in staging,
which the run's end removes.
"""

from __future__ import annotations

import json
import os
import posixpath
import socket
import uuid
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.units import UNIT_COLUMN  # each row's unit, from the read stage
from pipeline.output.records import FRAGMENT_SCHEMA, Fragment, fragment_table  # noqa: F401 (the records own it)


def parquet_bytes(table: pa.Table) -> tuple[bytes, str, int]:
    """``table`` as the bytes of one Parquet file, their SHA-256 (hex) and their size: the
    hash is of exactly what is written (the unit's record carries it)."""
    import hashlib

    buf = pa.BufferOutputStream()
    pq.write_table(table, buf)
    data = buf.getvalue().to_pybytes()
    return data, hashlib.sha256(data).hexdigest(), len(data)


def fragment_path(staging: str, part: str, first_row: int, token: str) -> str:
    """``_staging/<run_id>/part-00003-u00002/0000012000-<token>.parquet`` (``staging`` is
    the run's staging folder)."""
    return posixpath.join(staging, part[: -len(".parquet")], f"{first_row:010d}-{token}.parquet")


def write_fragments(batch: pa.Table, *, output: Any, retry: dict[str, Any] | None, staging: str,
                    extra_columns: list[str]) -> pa.Table:
    """``map_batches`` function: output rows (OUTPUT_SCHEMA, the partition columns and
    ``_unit``) -> :data:`FRAGMENT_SCHEMA` records of the fragments written to ``staging``.

    Args:
        output: the ``output:`` section, the writer's validated
            :class:`~pipeline.config.OutputConfig` (validated once, in the driver; a dict of it is
            validated here): its storage options and ``max_rows_per_file``.
        retry: the ``retry:`` section, for storage calls.
        staging: the run's staging folder (a path on the output's filesystem).
        extra_columns: the partition columns written after OUTPUT_SCHEMA's.

    Raises:
        StorageError: a write failed after its retries (the task fails; Ray Data retries it).
    """
    from pipeline.config import OutputConfig
    from pipeline.storage import is_object_store
    from pipeline.retry import endpoint_of, open_fs, retrying
    from pipeline.schema import conform
    from pipeline.summary import RunTotals

    if batch.num_rows == 0:
        return FRAGMENT_SCHEMA.empty_table()
    cfg = output if isinstance(output, OutputConfig) else OutputConfig.model_validate(output)  # the writer's: validated
    fs, _ = open_fs(cfg.location(), cfg.storage_options, retry)
    io = retrying(retry, endpoint_of(fs))
    if "audit" not in batch.column_names:  # an actor of an older schema
        batch = batch.append_column("audit", pa.nulls(batch.num_rows, pa.bool_()))
    units = batch.column(UNIT_COLUMN)
    names = units.unique().to_pylist()
    records = []
    for part in names:
        rows = batch if len(names) == 1 else batch.filter(pc.equal(units, part))
        rows = rows.sort_by("source_row")
        for start in range(0, rows.num_rows, cfg.max_rows_per_file):
            chunk = rows.slice(start, cfg.max_rows_per_file)
            src = chunk.column("source_row")
            first, last = src[0].as_py(), src[-1].as_py()
            if src.null_count:  # rows without their place (a caller's table): never a covering fragment
                first, last = first or 0, (first or 0) + chunk.num_rows - 1
            # each row once, no gap: the driver checks the fragments of a unit tile its rows
            consecutive = not src.null_count and last - first + 1 == chunk.num_rows and (
                chunk.num_rows < 2 or pc.all(pc.equal(pc.subtract(src.slice(1), src.slice(0, chunk.num_rows - 1)),
                                                      1)).as_py())
            path = fragment_path(staging, part, first, uuid.uuid4().hex[:12])
            data, sha256, size = parquet_bytes(conform(chunk, extra_columns))

            def write(path=path, data=data) -> None:
                if not is_object_store(fs):
                    fs.makedirs(posixpath.dirname(path), exist_ok=True)
                with fs.open(path, "wb") as f:
                    f.write(data)

            io(write, f"write {part} (rows {first}..{last}) to staging")
            totals = RunTotals()
            totals.add(chunk)
            records.append(Fragment(part=part, path=path, first_row=first, last_row=last, rows=chunk.num_rows,
                                    errors=totals.errors, totals=json.dumps(totals.state()), pid=os.getpid(),
                                    host=socket.gethostname(), consecutive=bool(consecutive), sha256=sha256, size=size))
    return fragment_table(records)
