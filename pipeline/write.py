"""Stage 4, write: Parquet files through fsspec, committed shard by shard.

Layout of an output directory (``output.uri``, or ``output.uri/date=YYYY-MM-DD`` with
``output.partition_by_date``; any fsspec URL: local path, ``s3://bucket/prefix``...)::

    <dir>/part-00000.parquet          the rows of input shard 0 (OUTPUT_SCHEMA, in the shard's order)
    <dir>/part-00001-00000.parquet    a shard of more than output.max_rows_per_file rows is
    <dir>/part-00001-00001.parquet    written as several files, in row order
    <dir>/_manifest/part-00000.json   the shard's commit record (see below)
    <dir>/_manifest/pending/...       publish intents (see below)
    <dir>/_summary.json               the run summary over all committed shards (pipeline.summary)
    <dir>/_SUCCESS                    written last: every shard of the input is committed
    <dir>/_staging/<run_id>/          files of a run in progress, before they are published

Files this job owns, and the only ones it ever deletes or overwrites: the data files named
by a manifest entry or a publish intent, everything under ``_manifest/`` and
``_staging/``, and ``_summary.json`` / ``_SUCCESS`` of a directory that has a manifest.
Anything else in the directory is *foreign*: the job refuses such a directory
(:class:`OutputError`) unless ``output.allow_foreign_files: true``, and even then, and with
``overwrite``, never touches those files (a foreign file with a name the job would write,
``part-*.parquet``, ``_SUCCESS``, ``_summary.json``, is always refused).

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

Resume (``overwrite: false``, the default): :meth:`OutputWriter.prepare` reads the
manifest and returns the shards already committed *from the same source under the same
config fingerprint*; the run skips them, so committed rows are never duplicated or
rewritten.  A manifest entry that disagrees with today's input (another file at that
index, or the file changed) or with today's config (another method, generation setting,
prompt template, model file...) is refused with :class:`OutputError`, naming what
changed: rerun with ``overwrite: true``.  When every shard is already committed and
``_SUCCESS`` exists, the run writes nothing.

Overwrite (``overwrite: true``): ``_SUCCESS``, ``_summary.json``, the files the manifest
and intents name, ``_manifest/`` and ``_staging/`` are deleted first and the run starts
afresh.

The run ends with :meth:`OutputWriter.commit`: files of dead publish intents are removed,
then ``_summary.json`` is written, every ``_staging/`` folder (this run's, and any an
interrupted run left) is removed, then ``_SUCCESS`` is written.  A reader that wants a
complete output checks ``_SUCCESS``; pyarrow's dataset discovery skips names starting
with ``_`` or ``.``, so ``pq.read_table(<dir>)`` reads the published files.

Every storage call goes through :func:`pipeline.retry.with_retries` (transient errors
retried with backoff, bounded by timeouts and a deadline; see ``retry:`` in the job config).
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import posixpath
import re
import shutil
import uuid
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.config import JobRefused, OutputConfig
from pipeline.fingerprint import describe_changes, fingerprint
from pipeline.retry import endpoint_of, open_fs, retrying

log = logging.getLogger("specbatch")

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
PENDING = "pending"  # under _manifest/
#: names of data files the job writes; a foreign file with such a name is always refused
DATA_FILE = re.compile(r"^part-\d{5,}(-\d{5,})?\.parquet$")


class OutputError(JobRefused):
    """The output location cannot be used: it holds files this job did not write, a run of
    another config or input (and ``overwrite`` is off), or it is not writable."""


def part_name(shard_index: int) -> str:
    """The name of input shard ``shard_index`` in the output: ``part-00003.parquet`` (also
    its only data file's name when its rows fit in one file)."""
    return f"part-{shard_index:05d}.parquet"


def data_file_names(shard_index: int, n_files: int) -> list[str]:
    """Final names of a shard's data files: ``[part-00003.parquet]`` for one file, else
    ``part-00003-00000.parquet``, ``part-00003-00001.parquet``, ... (row order)."""
    if n_files <= 1:
        return [part_name(shard_index)]
    return [f"part-{shard_index:05d}-{c:05d}.parquet" for c in range(n_files)]


class OutputWriter:
    """Publishes one run's files shard by shard, with a manifest entry per committed shard.

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
        self.location = cfg.location()
        self.fs, root = open_fs(self.location, cfg.storage_options, retry)
        self.root = root.rstrip("/") or "/"
        self.staging = posixpath.join(self.root, STAGING, self.run_id)
        self.io = retrying(retry, endpoint_of(self.fs))
        self.written: list[str] = []  # final paths of the files this run published
        self.entries: dict[str, dict[str, Any]] = {}  # part name -> manifest entry (committed)
        self.intents: dict[str, dict[str, Any]] = {}  # intent path -> publish intent (earlier runs)
        self.foreign: list[str] = []  # files in the directory that this job did not write
        self.skipped: list[str] = []  # part names committed by earlier runs, skipped by this one
        self.nothing_to_do = False
        self.skip: set[int] = set()  # set by pipeline.run.preflight from prepare()
        self.identity: dict[str, Any] | None = None
        self.config_fingerprint: str | None = None
        self._buffers: dict[int, list[pa.Table]] = {}  # shard index -> rows not yet written
        self._buffered: dict[int, int] = {}
        self._staged: dict[int, list[str]] = {}  # shard index -> staged file paths, in order
        self._counts: dict[int, list[int]] = {}  # shard index -> [rows, error rows] staged
        protos = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        self.local = "file" in protos or "local" in protos
        self.object_store = any(p in ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss") for p in protos)

    def _p(self, *names: str) -> str:
        return posixpath.join(self.root, *names)

    def _exists(self, path: str) -> bool:
        return self.io(lambda: self.fs.exists(path), f"check {path}")

    def _listing(self) -> list[str]:
        """Every file under the output directory, as paths relative to it."""
        def find() -> list[str]:
            try:
                return self.fs.find(self.root, withdirs=False)
            except FileNotFoundError:
                return []

        prefix = self.root.rstrip("/") + "/"
        return sorted(p[len(prefix):] for p in self.io(find, f"list {self.url()}")
                      if p.startswith(prefix) and not p.endswith("/"))

    def read_manifest(self) -> dict[str, dict[str, Any]]:
        """Part name -> manifest entry, for every committed shard of this output."""
        return {e["part"]: e for e in self._read_json_files(self._p(MANIFEST, "part-*.json"), "the manifest")}

    def _read_intents(self) -> dict[str, dict[str, Any]]:
        """Intent path -> publish intent, for every intent an unfinished shard left."""
        return {e["_path"]: e for e in self._read_json_files(self._p(MANIFEST, PENDING, "part-*.json"),
                                                              "publish intents", keep_path=True)}

    def _read_json_files(self, pattern: str, what: str, keep_path: bool = False) -> list[dict[str, Any]]:
        def load() -> list[dict[str, Any]]:
            try:
                paths = sorted(self.fs.glob(pattern))
            except FileNotFoundError:
                return []
            out = []
            for p in paths:
                with self.fs.open(p, "r") as f:
                    entry = json.load(f)
                if keep_path:
                    entry["_path"] = p
                out.append(entry)
            return out

        return self.io(load, f"read {what} of {self.url()}")

    def prepare(self, shards: list | None = None, identity: dict[str, Any] | None = None) -> set[int]:
        """Check the output against the input and config; on overwrite, clear this job's
        files; check staging is writable.

        Args:
            shards: the input shards (:class:`pipeline.read.Shard`); None = no resume check.
            identity: :func:`pipeline.fingerprint.config_identity` of this run's config
                (recorded with every shard and compared on resume); None = not checked.

        Returns:
            Indices of the shards already committed from the same source and config (to skip).

        Raises:
            OutputError: the directory holds files this job did not write (see the module
                docstring); or its manifest disagrees with the input or the config (and
                ``overwrite`` is off); or the location is not writable (bad bucket,
                credentials, permissions).
            StorageError: the storage kept failing with transient errors.
        """
        from pipeline.retry import StorageError

        self.identity = identity
        self.config_fingerprint = fingerprint(identity) if identity is not None else None
        self.fs.invalidate_cache()
        try:
            files = self._listing()
            entries = self.read_manifest()
            self.intents = self._read_intents()
            self.foreign = self._foreign(files, entries)
            self._check_foreign(entries)
            if self.cfg.overwrite:
                self._clear(entries)
                skip: set[int] = set()
            else:
                skip = self._resume_check(shards, entries)
        except OutputError:
            raise
        except StorageError as e:
            if e.transient:
                raise
            raise OutputError(f"output {self.url()!r} is not usable: {e}") from None
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
        except StorageError as e:
            if e.transient:
                raise
            raise OutputError(f"output {self.url()!r} is not writable: {e}") from None
        except Exception as e:
            raise OutputError(f"output {self.url()!r} is not writable: {type(e).__name__}: {e}") from None
        return skip

    def _owned_data_files(self, entries: dict[str, dict[str, Any]]) -> set[str]:
        named = set()
        for e in list(entries.values()) + list(self.intents.values()):
            named.update(e.get("files") or [e["part"]])
        return named

    def _foreign(self, files: list[str], entries: dict[str, dict[str, Any]]) -> list[str]:
        """The files (relative paths) this job did not write."""
        named = self._owned_data_files(entries)
        ours_markers = bool(entries or self.intents)
        foreign = []
        for rel in files:
            top = rel.split("/", 1)[0]
            if top in (MANIFEST, STAGING) and "/" in rel:
                continue
            if rel in named or (rel in (SUCCESS, SUMMARY) and ours_markers):
                continue
            foreign.append(rel)
        return foreign

    def _check_foreign(self, entries: dict[str, dict[str, Any]]) -> None:
        if not self.foreign:
            return
        clashing = [f for f in self.foreign if DATA_FILE.match(f) or f in (SUCCESS, SUMMARY)]
        shown = ", ".join(self.foreign[:5]) + (f" and {len(self.foreign) - 5} more" if len(self.foreign) > 5 else "")
        if clashing and not entries and SUCCESS in self.foreign:
            raise OutputError(
                f"output {self.url()!r} already holds a run without a manifest (written before resumable runs, "
                f"or by another tool): {shown}; the job never deletes files it did not write, so move them away "
                "or choose another output.uri"
            )
        if clashing:
            raise OutputError(
                f"output {self.url()!r} holds files this job did not write with names it writes: "
                f"{', '.join(clashing[:5])}; the job never deletes or overwrites files it did not write "
                "(even with --overwrite or output.allow_foreign_files): move them away or choose another output.uri"
            )
        if not self.cfg.allow_foreign_files:
            raise OutputError(
                f"output {self.url()!r} holds {len(self.foreign)} file(s) this job did not write: {shown}; "
                "the job never deletes files it did not write: move them away, choose another output.uri, or set "
                "output.allow_foreign_files: true to write beside them (they are left alone)"
            )
        log.warning("output %s holds %d file(s) this job did not write (left alone): %s",
                    self.url(), len(self.foreign), shown)

    def _clear(self, entries: dict[str, dict[str, Any]]) -> None:
        """Overwrite: delete this job's files (markers first, so the output never looks complete)."""
        for name in (SUCCESS, SUMMARY):
            if self._exists(self._p(name)):
                self.io(lambda n=name: self.fs.rm(self._p(n)), f"remove {name}")
        for name in sorted(self._owned_data_files(entries)):
            self._rm_if_exists(self._p(name), f"remove {name}")
        for d in (MANIFEST, STAGING):
            self.io(lambda d=d: self._rm_tree(self._p(d)), f"remove {d}")
        self.intents = {}

    def _rm_if_exists(self, path: str, what: str) -> None:
        def rm() -> None:
            try:
                self.fs.rm(path)
            except FileNotFoundError:
                pass

        self.io(rm, what)

    def _resume_check(self, shards: list | None, entries: dict[str, dict[str, Any]]) -> set[int]:
        if not entries:
            return set()
        if shards is None:
            raise OutputError(f"output {self.url()!r} already holds committed shards; set output.overwrite: true")
        if self.identity is not None:
            for part, entry in sorted(entries.items()):
                if entry.get("config_fingerprint") != self.config_fingerprint:
                    raise OutputError(
                        f"output {self.url()!r}: {part} was committed under another config "
                        f"({describe_changes(entry.get('config_identity'), self.identity)}); resuming would mix "
                        "outputs of two configs: rerun with --overwrite (output.overwrite: true) to redo the "
                        "output from scratch, or choose another output.uri"
                    )
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
        table = pa.concat_tables(tables) if tables else OUTPUT_SCHEMA.empty_table()
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
        table = table.cast(OUTPUT_SCHEMA)

        def write() -> None:
            self._makedirs(posixpath.dirname(path))
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
        staged = self._staged.pop(index)
        name = part_name(index)
        names = data_file_names(index, len(staged))
        rows, errors = self._counts.pop(index)
        intent_path = self._p(MANIFEST, PENDING, f"part-{index:05d}.{self.run_id}.json")
        intent = {"part": name, "files": names, "run_id": self.run_id}
        self._write_json(intent_path, intent, f"write the publish intent of {name}")
        finals = [self._p(n) for n in names]
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
        self._write_json(self._p(MANIFEST, name.replace(".parquet", ".json")), entry,
                         f"write the manifest entry of {name}", staged_as=posixpath.join(self.staging, name + ".json"))
        self._rm_if_exists(intent_path, f"remove the publish intent of {name}")
        self.written.extend(finals)
        self.entries[name] = entry
        return finals

    def write_part(self, shard: Any, table: pa.Table, totals: dict[str, Any] | None = None) -> str:
        """Commit one shard given all its rows at once (:meth:`add_rows` + :meth:`finish_shard`).
        Returns the path of its first data file."""
        self.add_rows(shard, table)
        return self.finish_shard(shard, totals)[0]

    def _write_json(self, path: str, obj: dict[str, Any], what: str, staged_as: str | None = None) -> None:
        """Write a small JSON file; with ``staged_as``, write it there and publish it to ``path``."""
        target = staged_as or path

        def write() -> None:
            self._makedirs(posixpath.dirname(target))
            with self.fs.open(target, "w") as f:
                json.dump(obj, f, default=str)

        self.io(write, what)
        if staged_as:
            self.io(lambda: self._makedirs(posixpath.dirname(path)), f"create {posixpath.dirname(path)}")
            self._publish(staged_as, path, what.replace("write ", ""))

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

        self.io(copy, f"publish {what}")
        self._rm_if_exists(src, f"remove staged {what}")

    def commit(self, summary: dict[str, Any]) -> None:
        """Finish the output: remove the files of dead publish intents (never named by a
        manifest entry), write the summary, remove every staging folder, then ``_SUCCESS``."""
        self.fs.invalidate_cache()
        intents = self._read_intents()
        committed = {n for e in self.entries.values() for n in e.get("files") or [e["part"]]}
        for path, intent in sorted(intents.items()):
            for n in intent.get("files") or []:
                if n not in committed:
                    self._rm_if_exists(self._p(n), f"remove uncommitted {n}")
            self._rm_if_exists(path, f"remove the publish intent {posixpath.basename(path)}")
        self.io(lambda: self._rm_tree(self._p(MANIFEST, PENDING)), "remove the publish intents folder")

        def write_summary() -> None:
            with self.fs.open(self._p(SUMMARY), "w") as f:
                json.dump(summary, f, indent=2, default=str)

        self.io(write_summary, f"write {SUMMARY}")
        self.io(lambda: self._rm_tree(self._p(STAGING)), "remove staging")

        def write_success() -> None:
            with self.fs.open(self._p(SUCCESS), "w") as f:
                f.write(self.run_id + "\n")

        self.io(write_success, f"write {SUCCESS}")

    def read_summary(self) -> dict[str, Any]:
        def load() -> dict[str, Any]:
            with self.fs.open(self._p(SUMMARY), "r") as f:
                return json.load(f)

        return self.io(load, f"read {SUMMARY}")

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
            self._rm_tree(self.staging)
            base = self._p(STAGING)
            if self.fs.exists(base) and not self.fs.ls(base):
                self.fs.rmdir(base)
        except Exception:  # noqa: BLE001 - best effort
            pass

    def _rm_tree(self, path: str) -> None:
        if self.local:  # fsspec's local rm(recursive) calls os.getcwd(), which fails when the
            # working directory is gone (seen under ray job submit on a worker node)
            if os.path.isdir(path):
                shutil.rmtree(path)
        elif self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    def url(self, name: str = "") -> str:
        """The output directory (or a file in it) as a full URL; local paths made absolute
        (under ``ray job submit`` a relative path lands in the job's working directory)."""
        from pipeline.read import _unstrip

        base = _unstrip(self.fs, self.root)
        return base + ("/" + name if name else "")


def _index(shard: Any) -> int:
    return shard if isinstance(shard, int) else shard.index


def is_complete(uri: str, storage_options: dict | None = None) -> bool:
    """Whether ``uri`` holds a finished run (its ``_SUCCESS`` marker exists)."""
    fs, root = open_fs(uri, storage_options)
    return fs.exists(posixpath.join(root.rstrip("/"), SUCCESS))
