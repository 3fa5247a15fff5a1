"""The output location: one output directory on its filesystem, listing, the manifest
(read and checked: :mod:`pipeline.output.manifest`), the foreign-file check, orphans, and
clearing on ``overwrite``.  (The names and which files are the job's:
:mod:`pipeline.layout`; the commit log: :mod:`pipeline.output.commit_log`; the
resume plan: :mod:`pipeline.output.resume`; committing units: :mod:`pipeline.output.writer`.)

On local disk, ``_manifest``, ``_staging``, ``_SUCCESS`` and ``_summary.json`` (or anything
under the two folders) being a symbolic link is refused: the job would write, and delete,
through it.

Files the job did not write (anything :mod:`pipeline.layout` does not name as the
job's, and data files no committed unit, publish intent or run of the commit log names) are
*foreign*: the job refuses such a directory (:class:`OutputError`) unless
``output.allow_foreign_files: true``, and even then, and with ``overwrite``, never touches
those files (a foreign file with a name the job would write, ``part-*.parquet``,
``_SUCCESS``, ``_summary.json``, is always refused).  A data file of the job's own that no
committed unit names (it carries the id of a run of the commit log: that run died, or lost
its lease, after publishing it) is an *orphan*: named in a log line and removed by the next
run that commits, by a run with nothing to do and by ``overwrite``.

Overwrite (``overwrite: true``): once the run's ``overwrite`` epoch is in the commit log
(:meth:`clear`, called by the writer), ``_SUCCESS``, ``_summary.json``, the data files the
manifest and intents name, the orphans, the manifest's records and ``_staging/`` are
deleted and the run starts afresh.

Every storage call goes through :func:`pipeline.retry.with_retries` (transient errors
retried with backoff, bounded by timeouts and a deadline; see ``retry:`` in the job config).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import posixpath
from typing import Any

from pipeline.config import JobRefused, OutputConfig
from pipeline.output import exclusive
from pipeline.output.commit_log import CommitLog
from pipeline.layout import (DATA_FILE, LEASE, LOG, LOG_RECORD, MANIFEST, STAGING, SUCCESS, SUMMARY,
                                    TEMP_FILE, data_file_run, owned_layout_file, owned_output_path)
from pipeline.output.manifest import Manifest, ManifestDamaged, read_manifest
from pipeline.output.records import Intent, UnitRecord
from pipeline.retry import endpoint_of, open_fs, retrying
from pipeline.storage import (is_local, is_object_store, prune_empty, raise_refusal, refuse_special, resolved_location,
                              under, unstrip)

log = logging.getLogger("specbatch")

class OutputError(JobRefused):
    """The output location cannot be used: it holds files this job did not write, a run of
    another config or input (and ``overwrite`` is off), or it is not writable."""


class OutputLocation:
    """One output directory (``cfg.location()``) on its filesystem: listing, the manifest,
    the foreign-file checks of :meth:`inspect`, and the storage helpers the unit commit
    (:class:`pipeline.output.writer.OutputWriter`) writes through.

    After :meth:`inspect`: ``intents`` (publish intents of earlier versions), ``foreign``
    (files this job did not write) and ``orphans`` (its data files no committed unit names),
    as relative paths.

    Args:
        cfg: the output section.
        retry: a RetryConfig (or its dict) for storage calls; None = defaults.
    """

    def __init__(self, cfg: OutputConfig, retry: Any = None):
        self.cfg = cfg
        self.uri = cfg.location()
        self.fs, root = open_fs(self.uri, cfg.storage_options, retry)
        self.root = root.rstrip("/") or "/"
        self.io = retrying(retry, endpoint_of(self.fs))
        self.intents: dict[str, Intent] = {}
        self.foreign: list[str] = []
        self.orphans: list[str] = []
        self.local = is_local(self.fs)
        self.object_store = is_object_store(self.fs)
        self._resolved: str | None = None  # the folder's resolved URL (contains)

    @classmethod
    def whole(cls, cfg: OutputConfig, retry: Any = None) -> "OutputLocation":
        """The whole output folder ``output.uri``, every ``date=`` partition in it (what the
        input's listing asks :meth:`contains` of)."""
        return cls(cfg.model_copy(update={"partition_by_date": False}), retry)

    def contains(self, url: str) -> str | None:
        """What this output folder holds at ``url`` (a resolved URL, as the input's listing
        names its files and folders; :func:`pipeline.storage.resolved_location`):

        - ``"own"``: a file or folder the job writes there (data files, markers, the lease,
          ``_manifest/``, ``_staging/`` and everything in them; in the folder or a ``date=``
          partition: :func:`~pipeline.layout.owned_output_path`);
        - ``"other"``: the folder itself, or anything else in it (a file beside the output);
        - None: a path outside it.
        """
        if self._resolved is None:
            self._resolved = unstrip(self.fs, resolved_location(self.fs, self.root)).rstrip("/")
        root = self._resolved
        if not under(url, root):
            return None
        rel = url[len(root):].strip("/")
        return "own" if rel and owned_output_path(rel) else "other"

    # ------------------------------------------------------------------ paths and storage
    def path(self, *names: str) -> str:
        """A path under the output directory (filesystem path, no protocol)."""
        return posixpath.join(self.root, *names)

    def staging_dir(self, run_id: str) -> str:
        """Where run ``run_id`` stages its files: ``_staging/<run_id>``."""
        return self.path(STAGING, run_id)

    def exists(self, path: str) -> bool:
        return self.io(lambda: self.fs.exists(path), f"check {path}")

    def makedirs(self, path: str) -> None:
        """Create a folder.  On an object store there is nothing to create, and s3fs's
        makedirs may try to create the *bucket* when a listing fails during an outage
        (CreateBucket then fails for good): skipped there.  Not retried (callers wrap it)."""
        if not self.object_store:
            self.fs.makedirs(path, exist_ok=True)

    def remove(self, path: str, what: str) -> None:
        """Delete one file if it exists (retried)."""
        def rm() -> None:
            try:
                self.fs.rm(path)
            except FileNotFoundError:
                pass

        self.io(rm, what)

    def put_atomic(self, path: str, data: bytes, what: str) -> None:
        """Write the small file ``path`` (a manifest record, a marker) whole or not at all,
        retried: on local disk it is written under a temporary name
        (:func:`pipeline.output.exclusive.write_temp`), flushed to disk, then
        renamed over ``path`` (a failed write, a full disk included, removes the temporary
        file and leaves ``path`` as it was); on an object store it is one PUT, which the
        store makes atomic.

        Raises:
            StorageError: the write kept failing (``ENOSPC`` is not retried).
        """
        def put() -> None:
            self.makedirs(posixpath.dirname(path))
            if not self.local:
                self.fs.pipe_file(path, data)
                return
            tmp = exclusive.write_temp(path, data)
            try:
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise

        self.io(put, what)

    def remove_owned(self, under: str, retry: bool = True) -> None:
        """Delete the files of this job's layout under the subfolder ``under`` (``_staging``,
        a run's staging folder, ``_manifest/pending``), leaving any other file there, then
        the folders left empty (local disk).  ``retry=False``: one attempt, errors raised."""
        call = self.io if retry else (lambda fn, what: fn())
        for rel in call(lambda: self.listing(under) if retry else self._list_once(under), f"list {under}"):
            if owned_layout_file(rel):
                call(lambda r=rel: self._rm_quiet(self.path(r)), f"remove {rel}")
        if self.local:
            prune_empty(self.path(under))
            top = under.split("/", 1)[0]
            if top != under:
                with contextlib.suppress(OSError):
                    os.rmdir(self.path(top))  # only when empty

    def _list_once(self, under: str) -> list[str]:
        prefix = self.root.rstrip("/") + "/"
        try:
            found = self.fs.find(self.path(under), withdirs=False)
        except FileNotFoundError:
            return []
        return [p[len(prefix):] for p in found if p.startswith(prefix)]

    def _rm_quiet(self, path: str) -> None:
        try:
            self.fs.rm(path)
        except FileNotFoundError:
            pass

    def url(self, name: str = "") -> str:
        """The output directory (or a file in it) as a full URL; local paths made absolute
        (under ``ray job submit`` a relative path lands in the job's working directory)."""
        base = unstrip(self.fs, self.root)
        return base + ("/" + name if name else "")

    def listing(self, under: str = "") -> list[str]:
        """Every file under the output directory (or its subfolder ``under``), as paths
        relative to the output directory."""
        def find() -> list[str]:
            try:
                return self.fs.find(self.path(under) if under else self.root, withdirs=False)
            except FileNotFoundError:
                return []

        prefix = self.root.rstrip("/") + "/"
        return sorted(p[len(prefix):] for p in self.io(find, f"list {self.url()}")
                      if p.startswith(prefix) and not p.endswith("/"))

    # ------------------------------------------------------------------ the manifest
    def commit_log(self, run_id: str | None = None, careful: bool = False) -> CommitLog:
        """The output's commit log, for run ``run_id`` to append to (None: to read)."""
        return CommitLog(self.fs, self.root, run_id, self.io, careful=careful)

    def manifest(self, log: CommitLog | None = None) -> Manifest:
        """The output's manifest, read and checked (:func:`pipeline.output.manifest.read_manifest`);
        ``log``: the run's commit log, which learns where to append.

        Raises:
            OutputError: a record is not this job's (the message names it).
            StorageError: the storage kept failing.
        """
        try:
            return read_manifest(self.fs, self.root, self.io, self.url(), log or self.commit_log())
        except ManifestDamaged as e:
            raise OutputError(str(e)) from None

    def read_manifest(self) -> dict[str, UnitRecord]:
        """Part name -> manifest entry, for every committed unit of this output.

        Raises:
            OutputError: a record is not this job's.
        """
        return self.manifest().entries

    def read_summary(self) -> dict[str, Any]:
        """The ``_summary.json`` of the last finished run."""
        def load() -> dict[str, Any]:
            with self.fs.open(self.path(SUMMARY), "r") as f:
                return json.load(f)

        return self.io(load, f"read {SUMMARY}")

    # ------------------------------------------------------------------ the checks
    def inspect(self, log: CommitLog | None = None) -> Manifest:
        """Read and check the output folder: its listing, its manifest (names checked), the
        foreign-file check and the orphans; records an earlier version began and never
        finished are removed.  Nothing else is changed (``overwrite`` clears the output
        later: :meth:`clear`).

        Returns:
            The :class:`~pipeline.output.manifest.Manifest`; ``foreign`` and ``orphans``
            (relative paths) are set on the location.

        Raises:
            OutputError: the directory holds files this job did not write (see the module
                docstring), or a manifest record that is not this job's; or the location
                is not usable (bad bucket, credentials, permissions).
            StorageError: the storage kept failing with transient errors.
        """
        self.fs.invalidate_cache()
        if self.local:
            self._refuse_links()
        try:
            files = self.listing()
            m = self.manifest(log)
            self.intents = m.intents
            self.foreign, self.orphans = self._foreign(files, m)
            self._check_foreign(m.entries)
            self._remove_leftovers(files, m.leftovers)
        except Exception as e:
            self.refused(e, "usable")
        return m

    def complete(self, m: Manifest | None = None) -> bool:
        """Whether the output is complete: ``_SUCCESS`` is there and, with a commit log, names
        the run of its last record, a ``final`` one (a ``_SUCCESS`` a run that had lost its
        lease published late does not count).  ``m``: the manifest, if read already."""
        if not self.exists(self.path(SUCCESS)):
            return False
        m = m or self.manifest()
        if m.log.last_seq < 0:
            return True  # an output of an earlier version: no commit log
        if m.log.final is None:
            return False

        def load() -> bytes:
            with self.fs.open(self.path(SUCCESS), "rb") as f:
                return f.read()

        return self.io(load, f"read {SUCCESS}").strip() == m.log.final.run_id.encode()

    def quarantine(self, run_id: str) -> None:
        """Remove the staging folders of every run but ``run_id`` (runs that died or lost their
        lease), before this run commits anything: a publish from them, by a run that lost its
        lease and resumes, then fails (on local disk each folder is first renamed away at once).

        Raises:
            StorageError: the storage kept failing.
        """
        dead = sorted({rel.split("/", 2)[1] for rel in self.listing(STAGING) if rel.count("/") >= 2} - {run_id})
        for run in dead:
            under = posixpath.join(STAGING, run)
            if self.local and not any(f.startswith(under + "/") for f in self.foreign):
                # one rename takes every file of that run out of its reach at once (a foreign file there stays put)
                away = f"{run_id}-quarantine-{run}"[:64]
                with contextlib.suppress(FileNotFoundError):
                    os.rename(self.path(under), self.path(STAGING, away))
                    under = posixpath.join(STAGING, away)
            log.info("output %s: quarantined the staging of run %s (that run died or lost its lease)", self.url(), run)
            self.remove_owned(under)

    def remove_orphans(self, m: Manifest) -> None:
        """Remove the data files of the job's own that no committed unit names (of runs of the
        commit log, or named by a publish intent of an earlier version), found now, and the
        publish intents of earlier versions.  The caller holds the output's lease.

        Raises:
            StorageError: the storage kept failing.
        """
        files = self.listing()
        _, orphans = self._foreign(files, m)
        if orphans:
            shown = ", ".join(orphans[:5]) + (f" and {len(orphans) - 5} more" if len(orphans) > 5 else "")
            log.info("output %s: removing %d orphan(s), data files of this job that no committed unit names (a run "
                     "died or lost its lease after publishing them): %s", self.url(), len(orphans), shown)
        for rel in orphans:
            self.remove(self.path(rel), f"remove the orphan {rel}")
        for path in sorted(m.intents):
            self.remove(path, f"remove the publish intent {posixpath.basename(path)}")
        if m.intents:
            self.remove_owned(posixpath.join(MANIFEST, "pending"))
        self.intents, self.orphans = {}, []

    def make_ready(self, staging: str) -> None:
        """Before a run writes: remove the markers of the last run (the output no longer
        looks complete) and check that ``staging`` is writable.

        Raises:
            OutputError: the location is not writable.
            StorageError: the storage kept failing with transient errors.
        """
        try:
            for name in (SUCCESS, SUMMARY):
                if self.exists(self.path(name)):
                    self.io(lambda n=name: self.fs.rm(self.path(n)), f"remove {name}")
            probe = posixpath.join(staging, ".probe")

            def write_probe() -> None:
                self.makedirs(staging)
                with self.fs.open(probe, "wb") as f:
                    f.write(b"ok")
                self.fs.rm(probe)

            self.io(write_probe, f"write to {self.url()}")
        except Exception as e:
            self.refused(e, "writable")

    def check_committed_sizes(self, m: Manifest) -> None:
        """Before a resume builds on them: every data file a committed unit names is there,
        of the size its record says (``checksums``; a unit of a version before them: only
        there).  Sizes come from one listing; the SHA-256 is checked where the bytes are
        read (:mod:`pipeline.output.reader`): a resume does not read what it skips.

        Raises:
            OutputError: naming the first file missing or of another size, and what to do.
            StorageError: the storage kept failing with transient errors.
        """
        def sizes() -> dict[str, int]:
            try:
                return {posixpath.basename(i["name"].rstrip("/")): int(i.get("size") or 0)
                        for i in self.fs.ls(self.root, detail=True) if i.get("type") != "directory"}
            except FileNotFoundError:
                return {}

        if not m.entries:
            return
        have = self.io(sizes, f"list {self.url()}")
        for part, e in sorted(m.entries.items()):
            for name in e.files:
                check = e.check_of(name)
                want = check.size if check else None
                got = have.get(name)
                if got is None:
                    problem = "is missing"
                elif want is not None and got != want:
                    problem = f"is {got} bytes, not the {want} its record says (cut short or replaced)"
                else:
                    continue
                raise OutputError(f"output {self.url()!r}: {name}, a data file of the committed unit {part}, "
                                  f"{problem}: a resume would keep it; nothing was written. Restore the file, or "
                                  "rerun with --overwrite (output.overwrite: true) to decode every unit again")

    def refused(self, e: Exception, what: str) -> None:
        """Re-raise ``e`` from a check of the location: an :class:`OutputError` or a
        transient :class:`StorageError` as it is, anything else as an OutputError saying the
        output is not ``what`` (``usable``, ``writable``): :func:`pipeline.storage.raise_refusal`."""
        raise_refusal(e, OutputError, f"output {self.url()!r} is not {what}")

    def _remove_leftovers(self, files: list[str], leftovers: list[str]) -> None:
        """Remove what an earlier run of this job began to write and never finished: the
        temporary files of :meth:`put_atomic` (a run killed between write and rename) and the
        manifest records found empty or cut short (:func:`pipeline.output.manifest.partial_record`:
        written by a version that wrote them in place, on a full disk).  Each names no published file (an
        intent is complete before any file is published, an entry is the last write of its
        shard, whose intent still names the files), so nothing else goes with them.  The run
        holds the output's lease: no other run is writing them."""
        prefix = self.root.rstrip("/") + "/"
        temps = [self.path(rel) for rel in files if TEMP_FILE.fullmatch(posixpath.basename(rel))
                 and owned_layout_file(rel)]
        for path in leftovers + temps:
            rel = path[len(prefix):] if path.startswith(prefix) else path
            log.info("output %s: removing %s, a record an earlier run began to write and never finished",
                     self.url(), rel)
            self.remove(path, f"remove the unfinished {rel}")
        leftovers.clear()

    def _refuse_links(self) -> None:
        """Local disk: refuse a symbolic link where this job writes its own files."""
        def refuse(p: str) -> None:
            rel = p[len(self.root.rstrip("/")) + 1:]
            raise OutputError(
                f"output {self.url()!r}: {rel} is a symbolic link (to {os.readlink(p)!r}); the job writes and "
                "deletes its own files only inside the output folder, never through a link: remove the link")

        for name in (MANIFEST, STAGING, SUCCESS, SUMMARY, LEASE):
            if os.path.islink(self.path(name)):
                refuse(self.path(name))
        for name in (SUCCESS, SUMMARY):
            self._refuse_special(self.path(name), dir_ok=False)
        for d in (MANIFEST, STAGING):
            for dirpath, dirnames, filenames in os.walk(self.path(d)):
                for n in dirnames + filenames:
                    if os.path.islink(os.path.join(dirpath, n)):
                        refuse(os.path.join(dirpath, n))
                for n in filenames:
                    self._refuse_special(os.path.join(dirpath, n), dir_ok=True)

    def _refuse_special(self, p: str, dir_ok: bool) -> None:
        """Local disk: refuse a named pipe, device or socket where the job reads or writes
        its own files (a read of it may never return); a folder too, unless ``dir_ok``
        (:func:`pipeline.storage.refuse_special`: links are refused before this)."""
        rel = p[len(self.root.rstrip("/")) + 1:]
        refuse_special(p, f"output {self.url()!r}: {rel}", OutputError,
                       "it is not a file this job wrote, and the job never deletes what it did not write: move it away",
                       folder_ok=dir_ok)

    def _foreign(self, files: list[str], m: Manifest) -> tuple[list[str], list[str]]:
        """``(foreign, orphans)``: the files (relative paths) this job did not write, and its
        data files that no committed unit names (named by a publish intent, or carrying the
        id of a run of the commit log)."""
        committed, named, runs = m.committed_files(), m.named_files(), set(m.runs)
        ours_markers = bool(m.entries or m.intents or runs)
        foreign, orphans = [], []
        for rel in files:
            if owned_layout_file(rel) or rel in committed or (rel in (SUCCESS, SUMMARY) and ours_markers):
                continue
            if rel in named or ("/" not in rel and DATA_FILE.match(rel) and data_file_run(rel) in runs):
                orphans.append(rel)
                continue
            foreign.append(rel)
        return foreign, orphans

    def _check_foreign(self, entries: dict[str, UnitRecord]) -> None:
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

    def clear(self, m: Manifest, keep_from: int) -> None:
        """Overwrite, once this run's ``overwrite`` epoch is record ``keep_from`` of the commit
        log: delete this job's files (markers first, so the output never looks complete; then
        the data files committed, named by intents or orphaned, then the manifest's records
        before ``keep_from`` but the ``epoch`` ones), nothing else.  Every file deleted belongs to a
        run before this one: a run that took the output over from this one (were it paused here)
        writes names this one never lists as its own.

        Raises:
            StorageError: the storage kept failing.
        """
        for name in (SUCCESS, SUMMARY):
            self.remove(self.path(name), f"remove {name}")
        files = self.listing()
        _, orphans = self._foreign(files, m)
        for name in sorted(m.named_files() | set(orphans)):  # of runs before this one's epoch: never a later run's
            self.remove(self.path(name), f"remove {name}")
        kept = set(m.log.epochs)  # the runs that wrote the output stay known: their late files are orphans
        for rel in files:
            if rel == LEASE or rel.startswith(STAGING + "/") or not owned_layout_file(rel):
                continue  # (the staging of other runs: quarantine())
            record = LOG_RECORD.fullmatch(posixpath.basename(rel)) if rel.startswith(f"{MANIFEST}/{LOG}/") else None
            if record and (int(record.group(1)) >= keep_from or int(record.group(1)) in kept):
                continue
            self.remove(self.path(rel), f"remove {rel}")
        if self.local:
            for d in (MANIFEST, STAGING):
                prune_empty(self.path(d))
        self.intents, self.orphans = {}, []


def listing_view(output: Any, retry: Any = None) -> "OutputLocation | None":
    """The job's output as the input listing asks it (:func:`pipeline.input.resolve_shards`'s
    ``output``: ``contains(url)`` and ``url()``), from an ``output:`` section; ``None`` when there is
    none or it cannot be opened (the writer reports a bad output itself)."""
    if output is None:
        return None
    try:
        return OutputLocation.whole(output, retry)
    except Exception:  # noqa: BLE001 - the writer reports a bad output itself
        return None
