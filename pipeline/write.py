"""Stage 4, write: one run's output rows as Parquet files through fsspec, committed shard by
shard into an :class:`~pipeline.output.OutputLocation` (the layout, the files the job owns,
the resume check: :mod:`pipeline.output`).

Commit protocol, per shard.  As a shard's rows come back they are written to
``_staging/<run_id>/`` in files of at most ``max_rows_per_file`` rows, so the driver holds
a bounded number of rows whatever the shard's size.  When the shard is complete: a
*publish intent* ``_manifest/pending/part-NNNNN.<run_id>.json`` names the final file
names; the files are published (a rename on a local filesystem; copy + delete on S3, where
a copy is atomic: the object appears whole or not at all); then the shard's **manifest
entry** ``_manifest/part-NNNNN.json`` is written: its files, the source URL and its
fingerprint (size + mtime or ETag), the config fingerprint (pipeline.fingerprint), row and
error counts, the run id and the shard's totals.  The manifest entry is the shard's commit
point; the intent is then removed.  Files named by an intent but by no entry (a run died
between the two) are not committed: a later run rewrites the shard and removes them.

The run holds the output's lease (:meth:`OutputWriter.acquire_lease`, :mod:`pipeline.lease`)
from before it reads the manifest to its end; every shard's commit and the final commit
first check that the lease is still this run's (:class:`pipeline.lease.LeaseLost`
otherwise), so a run that lost it publishes nothing more.

The run ends with :meth:`OutputWriter.commit`: files of dead publish intents are removed,
then ``_summary.json`` is written, every ``_staging/`` folder's files (this run's, and any
an interrupted run left) are removed, then ``_SUCCESS`` is written.  A reader that wants a
complete output checks ``_SUCCESS``; pyarrow's dataset discovery skips names starting
with ``_`` or ``.``, so ``pq.read_table(<dir>)`` reads the published files.

Every storage call goes through :func:`pipeline.retry.with_retries` (transient errors
retried with backoff, bounded by timeouts and a deadline; see ``retry:`` in the job config).
"""

from __future__ import annotations

import datetime as _dt
import json
import posixpath
import uuid
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.config import OutputConfig
from pipeline.fingerprint import config_fingerprint
from pipeline.lease import OutputLease
from pipeline.output import (MANIFEST, PENDING, STAGING, SUCCESS, SUMMARY, OutputError, OutputLocation,
                             data_file_names, part_name)
from pipeline.schema import OUTPUT_SCHEMA, conform, output_schema


class OutputWriter:
    """Publishes one run's files shard by shard into its :class:`~pipeline.output.OutputLocation`
    (``location``), with a manifest entry per committed shard.

    Use: ``prepare(shards, identity)`` (driver, before models load; returns the committed
    shard indices to skip) -> per shard ``add_rows()`` as rows come back, then
    ``finish_shard()`` (or ``write_part()`` for a whole shard at once) -> ``commit(summary)``;
    on failure ``abort()``.

    Args:
        cfg: the output section; the directory is ``cfg.location()``.
        run_id: this run's id (default: random).
        retry: a RetryConfig (or its dict) for storage calls; None = defaults.
    """

    def __init__(self, cfg: OutputConfig, run_id: str | None = None, retry: Any = None):
        self.cfg = cfg
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self.location = OutputLocation(cfg, retry)
        self.fs, self.io = self.location.fs, self.location.io
        self.staging = self.location.staging_dir(self.run_id)
        self.written: list[str] = []  # final paths of the files this run published
        self.entries: dict[str, dict[str, Any]] = {}  # part name -> manifest entry (committed)
        self.skip: set[int] = set()  # set by pipeline.run.preflight from prepare()
        self.identity: dict[str, Any] | None = None
        self.config_fingerprint: str | None = None
        self._buffers: dict[int, list[pa.Table]] = {}  # shard index -> rows not yet written
        self._buffered: dict[int, int] = {}
        self._staged: dict[int, list[str]] = {}  # shard index -> staged file paths, in order
        self._counts: dict[int, list[int]] = {}  # shard index -> [rows, error rows] staged
        self.lease: OutputLease | None = None
        #: columns written after OUTPUT_SCHEMA's: the input's Hive partition keys (pipeline.run sets them)
        self.extra_columns: list[str] = []

    def acquire_lease(self, config_fingerprint: str | None = None) -> OutputLease:
        """Take the output's lease for this run (``output.lease_timeout_s``; see
        :mod:`pipeline.lease`); from now on every publish first checks it is still ours.
        Release it with :meth:`release_lease`.

        Raises:
            LeaseHeld: another run holds it.
            LeaseUnreadable: ``_lease.json`` is not a lease of this job.
            OutputError: the location is not writable.
            StorageError: the storage kept failing with transient errors.
        """
        from pipeline.retry import StorageError

        loc = self.location
        lease = OutputLease(loc.fs, loc.root, self.run_id, url=loc.url(), io=loc.io,
                            timeout_s=self.cfg.lease_timeout_s, config_fingerprint=config_fingerprint)
        try:
            lease.acquire()
        except StorageError as e:
            if e.transient:
                raise
            raise OutputError(f"output {loc.url()!r} is not writable: {e}") from None
        self.lease = lease
        return lease

    def release_lease(self) -> None:
        """Release the lease (if held; never raises)."""
        if self.lease is not None:
            self.lease.release()

    def abandon_lease(self) -> None:
        """After a storage failure: stop renewing the lease and leave it, touching no
        storage (:meth:`pipeline.lease.OutputLease.abandon`)."""
        if self.lease is not None:
            self.lease.abandon()

    def _check_lease(self) -> None:
        if self.lease is not None:
            self.lease.check()

    def prepare(self, shards: list | None = None, identity: dict[str, Any] | None = None) -> set[int]:
        """Check the location for this run (:meth:`pipeline.output.OutputLocation.prepare`:
        foreign files, resume, overwrite, a writable staging folder) and record the config
        identity every shard this run commits will carry.

        Args:
            shards: the input shards (:class:`pipeline.read.Shard`); None = no resume check.
            identity: :func:`pipeline.fingerprint.config_identity` of this run's config
                (recorded with every shard and compared on resume); None = not checked.

        Returns:
            Indices of the shards already committed from the same source and config (to skip).

        Raises:
            OutputError, StorageError: as :meth:`pipeline.output.OutputLocation.prepare`.
        """
        self.identity = identity
        self.config_fingerprint = config_fingerprint(identity) if identity is not None else None
        skip = self.location.prepare(shards, identity, self.staging)
        self.entries = dict(self.location.entries)
        return skip

    # ------------------------------------------------------------------ writing shards
    def add_rows(self, shard: Any, table: pa.Table) -> None:
        """Rows of a shard, as they come back (any order within the shard; OUTPUT_SCHEMA).
        Whenever ``max_rows_per_file`` rows of a shard are buffered they are written to
        staging, so the buffers hold at most about that many rows per shard in flight
        (and when all buffers together hold more than twice that, the largest is written)."""
        index = _index(shard)
        limit = self.cfg.max_rows_per_file
        self._buffers.setdefault(index, []).append(table)
        self._buffered[index] = self._buffered.get(index, 0) + table.num_rows
        if self._buffered[index] >= limit:
            self._flush(index, final=False)
        while sum(self._buffered.values()) > 2 * limit:  # many shards in flight at once
            self._flush(max(self._buffered, key=self._buffered.get), final=True)

    def _flush(self, index: int, final: bool) -> None:
        """Write the buffered rows of shard ``index`` to staging in files of at most
        ``max_rows_per_file`` rows; unless ``final``, a remainder below that stays buffered
        (``final`` with nothing buffered and nothing staged writes an empty file)."""
        tables = self._buffers.pop(index, [])
        self._buffered.pop(index, None)
        table = pa.concat_tables(tables) if tables else output_schema(self.extra_columns).empty_table()
        del tables
        if table.num_rows:
            table = table.sort_by("source_row")
        limit = self.cfg.max_rows_per_file
        staged = self._staged.setdefault(index, [])
        start = 0
        while table.num_rows - start >= limit or (final and (start < table.num_rows or not staged)):
            chunk = table.slice(start, limit)
            start += chunk.num_rows
            self._stage(index, len(staged), chunk)
            staged.append(self._staged_path(index, len(staged)))
            if chunk.num_rows == 0:
                break
        if start < table.num_rows:
            self._buffers[index] = [table.slice(start)]
            self._buffered[index] = table.num_rows - start

    def _staged_path(self, index: int, chunk: int) -> str:
        return posixpath.join(self.staging, f"part-{index:05d}", f"{chunk:05d}.parquet")

    def _stage(self, index: int, chunk: int, table: pa.Table) -> None:
        path = self._staged_path(index, chunk)
        table = conform(table, self.extra_columns)

        def write() -> None:
            self.location.makedirs(posixpath.dirname(path))
            with self.fs.open(path, "wb") as f:
                pq.write_table(table, f)

        self.io(write, f"write {part_name(index)} (file {chunk}) to staging")
        counts = self._counts.setdefault(index, [0, 0])
        counts[0] += table.num_rows
        counts[1] += table.num_rows - table.column("error").null_count

    def finish_shard(self, shard: Any, totals: dict[str, Any] | None = None) -> list[str]:
        """Commit one shard whose rows were all given to :meth:`add_rows`: write what is
        buffered, record the publish intent, publish the files under their final names,
        then write the manifest entry (the commit point).  Returns the final paths.

        Args:
            shard: a :class:`pipeline.read.Shard` (or a bare index, for tests: no fingerprint).
            totals: the shard's :meth:`pipeline.summary.RunTotals.state` (goes into the manifest).
        """
        index = _index(shard)
        self._flush(index, final=True)
        self._check_lease()  # a run that lost its lease publishes nothing
        staged = self._staged.pop(index)
        name = part_name(index)
        names = data_file_names(index, len(staged))
        rows, errors = self._counts.pop(index)
        intent_path = self.location.path(MANIFEST, PENDING, f"part-{index:05d}.{self.run_id}.json")
        intent = {"part": name, "files": names, "run_id": self.run_id}
        self._write_json(intent_path, intent, f"write the publish intent of {name}")
        finals = [self.location.path(n) for n in names]
        for src, dst, n in zip(staged, finals, names):
            self._publish(src, dst, n)
        entry = {
            "part": name,
            "files": names,
            "source_file": None if isinstance(shard, int) else shard.url,
            "fingerprint": None if isinstance(shard, int) else shard.fingerprint,
            "config_fingerprint": self.config_fingerprint,
            "config_identity": self.identity,
            "rows": rows,
            "errors": errors,
            "run_id": self.run_id,
            "committed_at": _dt.datetime.now(_dt.timezone.utc).isoformat(),
            "totals": totals,
        }
        self._write_json(self.location.path(MANIFEST, name.replace(".parquet", ".json")), entry,
                         f"write the manifest entry of {name}", staged_as=posixpath.join(self.staging, name + ".json"))
        self.location.remove(intent_path, f"remove the publish intent of {name}")
        self.written.extend(finals)
        self.entries[name] = entry
        return finals

    def write_part(self, shard: Any, table: pa.Table, totals: dict[str, Any] | None = None) -> str:
        """Commit one shard given all its rows at once (:meth:`add_rows` + :meth:`finish_shard`).
        Returns the path of its first data file."""
        self.add_rows(shard, table)
        return self.finish_shard(shard, totals)[0]

    def _write_json(self, path: str, obj: dict[str, Any], what: str, staged_as: str | None = None) -> None:
        """Write a small JSON file whole or not at all (:meth:`OutputLocation.put_atomic`: a
        full disk leaves no empty or partial record); with ``staged_as``, write it there and
        publish it to ``path``."""
        self.location.put_atomic(staged_as or path, json.dumps(obj, default=str).encode(), what)
        if staged_as:
            self.io(lambda: self.location.makedirs(posixpath.dirname(path)), f"create {posixpath.dirname(path)}")
            self._publish(staged_as, path, what.replace("write ", ""))

    def _publish(self, src: str, dst: str, what: str) -> None:
        if self.location.local:  # an atomic rename
            self.io(lambda: self.fs.mv(src, dst), f"publish {what}")
            return

        def copy() -> None:  # S3: an atomic server-side copy, then drop the staged object
            self.fs.copy(src, dst)

        self.io(copy, f"publish {what}")
        self.location.remove(src, f"remove staged {what}")

    def commit(self, summary: dict[str, Any]) -> None:
        """Finish the output: remove the files of dead publish intents (never named by a
        manifest entry), write the summary, remove every staging folder, then ``_SUCCESS``."""
        loc = self.location
        self._check_lease()
        self.fs.invalidate_cache()
        intents = loc.read_intents()  # names checked: each is one of its shard's data files
        committed = {n for e in self.entries.values() for n in e.get("files") or [e["part"]]}
        for path, intent in sorted(intents.items()):
            for n in intent["files"]:
                if n not in committed:
                    loc.remove(loc.path(n), f"remove uncommitted {n}")
            loc.remove(path, f"remove the publish intent {posixpath.basename(path)}")
        loc.remove_owned(posixpath.join(MANIFEST, PENDING))

        loc.put_atomic(loc.path(SUMMARY), json.dumps(summary, indent=2, default=str).encode(), f"write {SUMMARY}")
        loc.remove_owned(STAGING)
        # atomic: a _SUCCESS cut short by a full disk must not say the output is complete
        loc.put_atomic(loc.path(SUCCESS), (self.run_id + "\n").encode(), f"write {SUCCESS}")

    def abort(self, cleanup: bool = True) -> None:
        """Drop this run's buffers and (with ``cleanup``, best effort, no retries) its staging
        folder; never writes a marker.  Shards committed so far stay committed: a rerun
        resumes after them, and a later successful run removes any staging left behind."""
        self._buffers.clear()
        self._buffered.clear()
        self._staged.clear()
        self._counts.clear()
        if not cleanup:
            return
        try:
            self.location.remove_owned(posixpath.join(STAGING, self.run_id), retry=False)
        except Exception:  # noqa: BLE001 - best effort
            pass


def _index(shard: Any) -> int:
    return shard if isinstance(shard, int) else shard.index
