"""Stage 4, write: Parquet parts through fsspec, committed shard by shard.

Layout of an output directory (``output.uri``, or ``output.uri/date=YYYY-MM-DD`` with
``output.partition_by_date``; any fsspec URL: local path, ``s3://bucket/prefix``...)::

    <dir>/part-00000.parquet          one part per input shard (shard index 0 -> part-00000),
    <dir>/part-00001.parquet          rows in the shard's order; OUTPUT_SCHEMA
    <dir>/_manifest/part-00000.json   the shard's commit record (see below)
    <dir>/_summary.json               the run summary over all committed shards (pipeline.summary)
    <dir>/_SUCCESS                    written last: every shard of the input is committed
    <dir>/_staging/<run_id>/          files of a run in progress, before they are published

Commit protocol, per shard.  When every row of an input shard is back, its part is
written to ``_staging/<run_id>/`` and published under its final name (a rename on a local
filesystem; copy + delete on S3, where a copy is atomic: the object appears whole or not
at all).  Then the shard's **manifest entry** ``_manifest/part-NNNNN.json`` is written:
source URL, fingerprint (size + mtime or ETag), row and error counts, the run id and the
shard's totals.  The manifest entry is the shard's commit point: a part without one is
not committed (a run died between the two writes) and is rewritten by the next run.

Resume (``overwrite: false``, the default): :meth:`OutputWriter.prepare` reads the
manifest and returns the shards already committed *from the same source* (same URL and
fingerprint); the run skips them, so committed rows are never duplicated or rewritten.
A manifest entry that disagrees with today's input (another file at that index, or the
file changed) is refused with :class:`OutputError`: rerun with ``overwrite: true``.
When every shard is already committed and ``_SUCCESS`` exists, the run writes nothing.

Overwrite (``overwrite: true``): parts, manifest, summary and ``_SUCCESS`` are deleted
first and the run starts afresh.

The run ends with :meth:`OutputWriter.commit`: parts without a manifest entry are
removed, then ``_summary.json``, then ``_SUCCESS``.  A reader that wants a complete
output checks ``_SUCCESS``; one that takes what is there reads the parts that have a
manifest entry.  pyarrow's dataset discovery skips names starting with ``_`` or ``.``,
so ``pq.read_table(<dir>)`` reads the published parts.

Every storage call goes through :func:`pipeline.retry.with_retries` (transient errors
retried with exponential backoff; see ``retry:`` in the job config).
"""

from __future__ import annotations

import datetime as _dt
import json
import posixpath
import uuid
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.core import url_to_fs

from pipeline.config import OutputConfig
from pipeline.retry import retrying

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
        ("mean_accepted_length", pa.float64()),  # 1 + accepted / draft_steps; null when nothing was drafted
        ("drafted_per_position", pa.list_(pa.int64())),  # [i]: drafts that reached position i+1
        ("accepted_per_position", pa.list_(pa.int64())),  # [i]: drafts accepted at position i+1
        ("draft_time_s", pa.float64()),  # proposing, a drafter's prompt prefill included
        ("prefill_time_s", pa.float64()),  # the target's prompt forward
        ("verify_time_s", pa.float64()),  # target passes after the prefill
        ("wall_time_s", pa.float64()),  # the engine's time for this row (generate() call)
        ("method", pa.string()),
        ("target_model", pa.string()),
        ("draft_model", pa.string()),  # null when the method uses no drafter
        ("error", pa.string()),  # "ExceptionType: message" when the row failed, else null
        ("source_file", pa.string()),  # input shard URL
        ("source_row", pa.int64()),  # row (Parquet) or non-blank line (JSONL) in that shard, 0-based
        ("audit", pa.bool_()),  # lossless audit: null = not audited, true = plain decoding gave the same ids
        ("draft_steps", pa.int64()),  # verify steps that verified a non-empty draft
        ("tokens_per_step", pa.float64()),  # new_tokens / verify_steps (1.0 for plain decoding)
    ]
)

SUCCESS = "_SUCCESS"
SUMMARY = "_summary.json"
STAGING = "_staging"
MANIFEST = "_manifest"


class OutputError(ValueError):
    """The output location holds a finished run (and ``overwrite`` is off) or is not writable."""


def part_name(shard_index: int) -> str:
    """Output part of input shard ``shard_index``: ``part-00003.parquet``."""
    return f"part-{shard_index:05d}.parquet"


class OutputWriter:
    """Publishes one run's parts shard by shard, with a manifest entry per committed shard.

    Use: ``prepare(shards)`` (driver, before models load; returns the committed shard
    indices to skip) -> ``write_part()`` per shard -> ``commit(summary)``; on failure ``abort()``.

    Args:
        cfg: the output section; the directory is ``cfg.location()``.
        run_id: this run's id (default: random).
        retry: a RetryConfig (or its dict) for storage calls; None = defaults.
    """

    def __init__(self, cfg: OutputConfig, run_id: str | None = None, retry: Any = None):
        self.cfg = cfg
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self.location = cfg.location()
        self.fs, root = url_to_fs(self.location, **cfg.storage_options)
        self.root = root.rstrip("/") or "/"
        self.staging = posixpath.join(self.root, STAGING, self.run_id)
        self.io = retrying(retry)
        self.written: list[str] = []  # final paths of the parts this run published
        self.entries: dict[str, dict[str, Any]] = {}  # part name -> manifest entry (committed)
        self.skipped: list[str] = []  # part names committed by earlier runs, skipped by this one
        self.nothing_to_do = False
        self.skip: set[int] = set()  # set by pipeline.run.preflight from prepare()
        protos = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        self.local = "file" in protos or "local" in protos
        self.object_store = any(p in ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss") for p in protos)

    def _p(self, *names: str) -> str:
        return posixpath.join(self.root, *names)

    def existing_parts(self) -> list[str]:
        def glob() -> list[str]:
            try:
                return sorted(self.fs.glob(self._p("part-*.parquet")))
            except FileNotFoundError:
                return []

        return self.io(glob, f"list {self.url()}")

    def _exists(self, path: str) -> bool:
        return self.io(lambda: self.fs.exists(path), f"check {path}")

    def read_manifest(self) -> dict[str, dict[str, Any]]:
        """Part name -> manifest entry, for every committed shard of this output."""
        def load() -> dict[str, dict[str, Any]]:
            try:
                paths = sorted(self.fs.glob(self._p(MANIFEST, "part-*.json")))
            except FileNotFoundError:
                return {}
            out = {}
            for p in paths:
                with self.fs.open(p, "r") as f:
                    entry = json.load(f)
                out[entry["part"]] = entry
            return out

        return self.io(load, f"read the manifest of {self.url()}")

    def prepare(self, shards: list | None = None) -> set[int]:
        """Check the output against the input; on overwrite, clear it; check staging is writable.

        Args:
            shards: the input shards (:class:`pipeline.read.Shard`); None = no resume check.

        Returns:
            Indices of the shards already committed from the same source (to skip).

        Raises:
            OutputError: the output holds a finished run written without a manifest, or its
                manifest disagrees with the input (and ``overwrite`` is off); or the
                location is not writable (bad bucket, credentials, permissions).
        """
        self.fs.invalidate_cache()
        try:
            if self.cfg.overwrite:
                self._clear()
                skip: set[int] = set()
            else:
                skip = self._resume_check(shards)
        except OutputError:
            raise
        except Exception as e:
            raise OutputError(f"output {self.url()!r} is not usable: {type(e).__name__}: {e}") from None
        if shards is not None and len(skip) == len(shards) and self._exists(self._p(SUCCESS)):
            self.nothing_to_do = True
            return skip
        try:
            for name in (SUCCESS, SUMMARY):
                if self._exists(self._p(name)):
                    self.io(lambda n=name: self.fs.rm(self._p(n)), f"remove {name}")
            probe = posixpath.join(self.staging, ".probe")

            def write_probe() -> None:
                self._makedirs(self.staging)
                with self.fs.open(probe, "wb") as f:
                    f.write(b"ok")
                self.fs.rm(probe)

            self.io(write_probe, f"write to {self.url()}")
        except Exception as e:
            raise OutputError(f"output {self.url()!r} is not writable: {type(e).__name__}: {e}") from None
        return skip

    def _clear(self) -> None:
        """Overwrite: forget every earlier run (markers first, so the output never looks complete)."""
        for name in (SUCCESS, SUMMARY):
            if self._exists(self._p(name)):
                self.io(lambda n=name: self.fs.rm(self._p(n)), f"remove {name}")
        if self._exists(self._p(MANIFEST)):
            self.io(lambda: self.fs.rm(self._p(MANIFEST), recursive=True), "remove the manifest")
        for old in self.existing_parts():
            self.io(lambda o=old: self.fs.rm(o), f"remove {old}")

    def _resume_check(self, shards: list | None) -> set[int]:
        entries = self.read_manifest()
        has_success = self._exists(self._p(SUCCESS))
        if not entries:
            if has_success:
                raise OutputError(
                    f"output {self.url()!r} already holds a run without a manifest (written before resumable "
                    "runs); set output.overwrite: true (--overwrite) or choose another output.uri"
                )
            return set()
        if shards is None:
            raise OutputError(f"output {self.url()!r} already holds committed shards; set output.overwrite: true")
        by_part = {part_name(s.index): s for s in shards}
        skip = set()
        for part, entry in sorted(entries.items()):
            shard = by_part.get(part)
            if shard is None:
                raise OutputError(
                    f"output {self.url()!r}: {part} was committed from {entry.get('source_file')!r}, but the input "
                    f"has only {len(shards)} shards now; set output.overwrite: true (--overwrite) to start afresh"
                )
            if entry.get("source_file") != shard.url or entry.get("fingerprint") != shard.fingerprint:
                raise OutputError(
                    f"output {self.url()!r}: {part} was committed from {entry.get('source_file')!r} "
                    f"({entry.get('fingerprint')}), but input shard {shard.index} is now {shard.url!r} "
                    f"({shard.fingerprint}): the input changed since; set output.overwrite: true (--overwrite) "
                    "to start afresh, or choose another output.uri"
                )
            skip.add(shard.index)
        self.entries = dict(entries)
        self.skipped = sorted(entries)
        return skip

    def write_part(self, shard: Any, table: pa.Table, totals: dict[str, Any] | None = None) -> str:
        """Commit one shard: write its part (OUTPUT_SCHEMA) to staging, publish it under its
        final name, then write its manifest entry (the commit point).  Returns the part's path.

        Args:
            shard: a :class:`pipeline.read.Shard` (or a bare index, for tests: no fingerprint).
            table: the shard's rows.
            totals: the shard's :meth:`pipeline.summary.RunTotals.state` (goes into the manifest).
        """
        index = shard if isinstance(shard, int) else shard.index
        name = part_name(index)
        staged = posixpath.join(self.staging, name)
        final = self._p(name)
        table = table.cast(OUTPUT_SCHEMA)

        def write() -> None:
            self._makedirs(self.staging)
            with self.fs.open(staged, "wb") as f:
                pq.write_table(table, f)

        self.io(write, f"write {name} to staging")
        self._publish(staged, final, name)
        entry = {
            "part": name,
            "source_file": None if isinstance(shard, int) else shard.url,
            "fingerprint": None if isinstance(shard, int) else shard.fingerprint,
            "rows": table.num_rows,
            "errors": table.num_rows - table.column("error").null_count,
            "run_id": self.run_id,
            "committed_at": _dt.datetime.now(_dt.timezone.utc).isoformat(),
            "totals": totals,
        }
        staged_entry = posixpath.join(self.staging, name + ".json")

        def write_entry() -> None:
            with self.fs.open(staged_entry, "w") as f:
                json.dump(entry, f, default=str)

        self.io(write_entry, f"write the manifest entry of {name}")
        self.io(lambda: self._makedirs(self._p(MANIFEST)), "create the manifest")
        self._publish(staged_entry, self._p(MANIFEST, name.replace(".parquet", ".json")), f"manifest entry of {name}")
        self.written.append(final)
        self.entries[name] = entry
        return final

    def _makedirs(self, path: str) -> None:
        """On an object store there is nothing to create, and s3fs's makedirs may try to
        create the *bucket* when a listing fails during an outage (CreateBucket then fails
        for good): skipped there."""
        if not self.object_store:
            self.fs.makedirs(path, exist_ok=True)

    def _publish(self, src: str, dst: str, what: str) -> None:
        if self.local:  # an atomic rename
            self.io(lambda: self.fs.mv(src, dst), f"publish {what}")
            return

        def copy() -> None:  # S3: an atomic server-side copy, then drop the staged object
            self.fs.copy(src, dst)

        def drop() -> None:
            try:
                self.fs.rm(src)
            except FileNotFoundError:
                pass

        self.io(copy, f"publish {what}")
        self.io(drop, f"remove staged {what}")

    def commit(self, summary: dict[str, Any]) -> None:
        """Finish the output: remove parts without a manifest entry, write the summary, then ``_SUCCESS``."""
        self.fs.invalidate_cache()
        for old in self.existing_parts():
            if posixpath.basename(old) not in self.entries:
                self.io(lambda o=old: self.fs.rm(o), f"remove uncommitted {posixpath.basename(old)}")

        def write_summary() -> None:
            with self.fs.open(self._p(SUMMARY), "w") as f:
                json.dump(summary, f, indent=2, default=str)

        self.io(write_summary, f"write {SUMMARY}")
        self.io(self._rm_staging, "remove staging")

        def write_success() -> None:
            with self.fs.open(self._p(SUCCESS), "w") as f:
                f.write(self.run_id + "\n")

        self.io(write_success, f"write {SUCCESS}")

    def read_summary(self) -> dict[str, Any]:
        def load() -> dict[str, Any]:
            with self.fs.open(self._p(SUMMARY), "r") as f:
                return json.load(f)

        return self.io(load, f"read {SUMMARY}")

    def abort(self) -> None:
        """Remove this run's staging directory (best effort, no retries); never writes a marker.
        Shards committed so far stay committed: a rerun resumes after them."""
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
