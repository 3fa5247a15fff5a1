"""Stage 4, write: Parquet parts through fsspec, published only when the run completes.

Layout of an output directory (any fsspec URL: local path, ``s3://bucket/prefix``...)::

    <uri>/part-00000.parquet   one part per input shard (shard index 0 -> part-00000),
    <uri>/part-00001.parquet   rows in the shard's order; OUTPUT_SCHEMA
    <uri>/_summary.json        the run summary (see pipeline.summary)
    <uri>/_SUCCESS             written last: the commit marker
    <uri>/_staging/<run_id>/   parts of a run in progress (removed on commit or failure)

Commit protocol.  Parts are written under ``_staging/<run_id>/`` and moved into place
only after every shard is done; then ``_summary.json``, then ``_SUCCESS``.  On a local
filesystem each move is a rename.  S3 has no atomic rename (a move is copy + delete), so
the **``_SUCCESS`` marker, written last, is the commit point**: an output without it is
incomplete, whatever parts it holds.  A run that fails removes its staging directory and
never writes ``_SUCCESS``; a run with ``output.overwrite`` removes an earlier run's
``_SUCCESS`` before it starts, so a failed rerun does not look complete either.
pyarrow's dataset discovery skips names starting with ``_`` or ``.``, so
``pq.read_table(<uri>)`` reads exactly the published parts.
"""

from __future__ import annotations

import json
import posixpath
import uuid
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.core import url_to_fs

from pipeline.config import OutputConfig

#: One row of output.  ``error`` is null when the row succeeded; statistics are null when
#: it failed.  Counts are tokens of the target tokenizer; times are seconds.
OUTPUT_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("prompt", pa.string()),  # the prompt as the model saw it (template and chat template applied)
        ("output_text", pa.string()),  # generated text, special tokens skipped
        ("finish_reason", pa.string()),  # "stop" | "length"
        ("prompt_tokens", pa.int64()),
        ("new_tokens", pa.int64()),
        ("verify_steps", pa.int64()),
        ("draft_tokens", pa.int64()),
        ("accepted_tokens", pa.int64()),
        ("acceptance_rate", pa.float64()),  # accepted / drafted; null when nothing was drafted
        ("mean_accepted_length", pa.float64()),  # new_tokens / verify_steps
        ("drafted_per_position", pa.list_(pa.int64())),  # [i]: drafts that reached position i+1
        ("accepted_per_position", pa.list_(pa.int64())),  # [i]: drafts accepted at position i+1
        ("draft_time_s", pa.float64()),
        ("verify_time_s", pa.float64()),
        ("wall_time_s", pa.float64()),  # the engine's time for this row (generate() call)
        ("method", pa.string()),
        ("target_model", pa.string()),
        ("draft_model", pa.string()),  # null when the method uses no drafter
        ("error", pa.string()),  # "ExceptionType: message" when the row failed, else null
        ("source_file", pa.string()),  # input shard URL
        ("source_row", pa.int64()),  # row (Parquet) or non-blank line (JSONL) in that shard, 0-based
    ]
)

SUCCESS = "_SUCCESS"
SUMMARY = "_summary.json"
STAGING = "_staging"


class OutputError(ValueError):
    """The output location holds a finished run (and ``overwrite`` is off) or is not writable."""


def part_name(shard_index: int) -> str:
    """Output part of input shard ``shard_index``: ``part-00003.parquet``."""
    return f"part-{shard_index:05d}.parquet"


class OutputWriter:
    """Writes one run's parts to staging and publishes them on :meth:`commit`.

    Use: ``prepare()`` (driver, before models load) -> ``write_part()`` per shard ->
    ``commit(summary)``; on any failure ``abort()``.
    """

    def __init__(self, cfg: OutputConfig, run_id: str | None = None):
        self.cfg = cfg
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self.fs, root = url_to_fs(cfg.uri, **cfg.storage_options)
        self.root = root.rstrip("/") or "/"
        self.staging = posixpath.join(self.root, STAGING, self.run_id)
        self.written: list[str] = []

    def _p(self, *names: str) -> str:
        return posixpath.join(self.root, *names)

    def existing_parts(self) -> list[str]:
        try:
            return sorted(self.fs.glob(self._p("part-*.parquet")))
        except FileNotFoundError:
            return []

    def prepare(self) -> None:
        """Refuse a finished output unless overwriting; check that staging is writable.

        Raises:
            OutputError: ``_SUCCESS`` or parts exist and ``overwrite`` is off, or a probe
                file cannot be written (bad bucket, credentials, permissions).
        """
        has_success = self.fs.exists(self._p(SUCCESS))
        parts = self.existing_parts()
        if (has_success or parts) and not self.cfg.overwrite:
            raise OutputError(
                f"output {self.cfg.uri!r} already holds a run ({'_SUCCESS' if has_success else f'{len(parts)} parts'}); "
                "set output.overwrite: true or choose another output.uri"
            )
        try:
            for name in (SUCCESS, SUMMARY):
                if self.fs.exists(self._p(name)):
                    self.fs.rm(self._p(name))
            self.fs.makedirs(self.staging, exist_ok=True)
            probe = posixpath.join(self.staging, ".probe")
            with self.fs.open(probe, "wb") as f:
                f.write(b"ok")
            self.fs.rm(probe)
        except Exception as e:
            raise OutputError(f"output {self.cfg.uri!r} is not writable: {type(e).__name__}: {e}") from None

    def write_part(self, shard_index: int, table: pa.Table) -> str:
        """Write one shard's rows (OUTPUT_SCHEMA) to staging; returns the staged path."""
        path = posixpath.join(self.staging, part_name(shard_index))
        with self.fs.open(path, "wb") as f:
            pq.write_table(table.cast(OUTPUT_SCHEMA), f)
        self.written.append(path)
        return path

    def commit(self, summary: dict[str, Any]) -> None:
        """Publish: drop an earlier run's parts, move staged parts in, then summary, then ``_SUCCESS``."""
        keep = {part_name_of(p) for p in self.written}
        for old in self.existing_parts():
            if posixpath.basename(old) not in keep:
                self.fs.rm(old)
        for p in self.written:
            self.fs.mv(p, self._p(posixpath.basename(p)))
        with self.fs.open(self._p(SUMMARY), "w") as f:
            json.dump(summary, f, indent=2, default=str)
        self._rm_staging()
        with self.fs.open(self._p(SUCCESS), "w") as f:
            f.write(self.run_id + "\n")

    def abort(self) -> None:
        """Remove this run's staging directory (best effort); never writes a marker."""
        try:
            self._rm_staging()
        except Exception:
            pass

    def _rm_staging(self) -> None:
        if self.fs.exists(self.staging):
            self.fs.rm(self.staging, recursive=True)
        base = self._p(STAGING)
        try:
            if self.fs.exists(base) and not self.fs.ls(base):
                self.fs.rmdir(base)
        except Exception:
            pass

    def url(self, name: str = "") -> str:
        """The output directory (or a file in it) as a full URL; local paths made absolute
        (under ``ray job submit`` a relative path lands in the job's working directory)."""
        from pipeline.read import _unstrip

        base = _unstrip(self.fs, self.root)
        return base + ("/" + name if name else "")


def part_name_of(path: str) -> str:
    return posixpath.basename(path)


def is_complete(uri: str, storage_options: dict | None = None) -> bool:
    """Whether ``uri`` holds a finished run (its ``_SUCCESS`` marker exists)."""
    fs, root = url_to_fs(uri, **(storage_options or {}))
    return fs.exists(posixpath.join(root.rstrip("/"), SUCCESS))
