"""The output location: one output directory on its filesystem, listing, the manifest
(read and checked), the foreign-file check, and clearing on ``overwrite``.  (The names
and which files are the job's: :mod:`pipeline.output.layout`; the resume plan:
:mod:`pipeline.output.resume`; committing units: :mod:`pipeline.output.writer`.)

Names read back from ``_manifest/`` are never trusted: before any is used (to delete a
dead run's files, to clear the output on ``overwrite``, to resume), every manifest entry
and publish intent must name its own part (``part-NNNNN-uNNNNN.parquet`` for the file
``part-NNNNN-uNNNNN.json``; ``part-NNNNN.parquet`` for a whole-shard part of the layout
before units) and exactly that part's data files in this job's naming
(:func:`~pipeline.output.layout.data_file_names`: plain names directly in the folder, no
separator, no ``..``, not absolute); anything else is refused (:class:`OutputError`)
naming the manifest file, and nothing is deleted.  On local disk, ``_manifest``,
``_staging``, ``_SUCCESS`` and ``_summary.json`` (or anything under the two folders)
being a symbolic link is refused too: the job would write, and delete, through it.

Files the job did not write (anything :mod:`pipeline.output.layout` does not name as the
job's, and data files no manifest entry or intent names) are *foreign*: the job refuses
such a directory (:class:`OutputError`) unless ``output.allow_foreign_files: true``, and
even then, and with ``overwrite``, never touches those files (a foreign file with a name
the job would write, ``part-*.parquet``, ``_SUCCESS``, ``_summary.json``, is always refused).

Overwrite (``overwrite: true``): ``_SUCCESS``, ``_summary.json``, the files the manifest
and intents name, ``_manifest/`` and ``_staging/`` are deleted first and the run starts
afresh.

Every storage call goes through :func:`pipeline.retry.with_retries` (transient errors
retried with backoff, bounded by timeouts and a deadline; see ``retry:`` in the job config).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import posixpath
import re
from typing import Any

from pipeline.config import JobRefused, OutputConfig
from pipeline.input.units import part_name
from pipeline.output.layout import (DATA_FILE, ENTRY_FILE, INTENT_FILE, LEASE, MANIFEST, PENDING, STAGING, SUCCESS,
                                    SUMMARY, TEMP_FILE, data_file_names, owned_layout_file, owned_output_path,
                                    temp_name)
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

    After :meth:`inspect`: ``intents`` (publish intents earlier runs left) and ``foreign``
    (files this job did not write, relative paths).

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
        self.intents: dict[str, dict[str, Any]] = {}
        self.foreign: list[str] = []
        #: manifest records (paths) an earlier run began and never finished writing (empty, or
        #: cut short): its own, naming nothing; removed by :meth:`inspect`
        self.leftovers: list[str] = []
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
          partition: :func:`~pipeline.output.layout.owned_output_path`);
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
        retried: on local disk it is written under :func:`temp_name`, flushed to disk, then
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
            tmp = temp_name(path)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
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
    def read_manifest(self) -> dict[str, dict[str, Any]]:
        """Part name -> manifest entry, for every committed shard of this output.

        Raises:
            OutputError: an entry is not this job's (see :meth:`_checked`).
        """
        out = {}
        for path, rel, index, entry in self._read_json_files(self.path(MANIFEST, "part-*.json"), ENTRY_FILE,
                                                            "the manifest"):
            out[self._checked(rel, index, entry)["part"]] = entry
        return out

    def read_intents(self) -> dict[str, dict[str, Any]]:
        """Intent path -> publish intent, for every intent an unfinished shard left.

        Raises:
            OutputError: an intent is not this job's (see :meth:`_checked`).
        """
        out = {}
        for path, rel, index, entry in self._read_json_files(self.path(MANIFEST, PENDING, "part-*.json"),
                                                            INTENT_FILE, "publish intents"):
            entry = dict(self._checked(rel, index, entry), _path=path)
            out[path] = entry
        return out

    def _read_json_files(self, pattern: str, name: re.Pattern, what: str) -> list[tuple[str, str, tuple, Any]]:
        """``(path, relative path, (shard, split or None), parsed JSON)`` of the files matching the glob
        ``pattern`` whose name is ``name`` (others there are foreign: never read)."""
        prefix = self.root.rstrip("/") + "/"

        def load() -> list[tuple[str, str, tuple, Any]]:
            try:
                paths = sorted(self.fs.glob(pattern))
            except FileNotFoundError:
                return []
            out = []
            for p in paths:
                m = name.fullmatch(posixpath.basename(p))
                if not m:
                    continue
                rel = p[len(prefix):] if p.startswith(prefix) else p
                with self.fs.open(p, "rb") as f:
                    raw = f.read()
                unit = (int(m.group(1)), None if m.group(2) is None else int(m.group(2)))
                if _partial_record(raw, unit):
                    if p not in self.leftovers:
                        self.leftovers.append(p)
                    continue
                try:
                    entry = json.loads(raw)
                except (UnicodeDecodeError, json.JSONDecodeError) as e:
                    raise OutputError(f"output {self.url()!r}: {rel} is not a manifest record of this job ({e}); "
                                      "the job never deletes files it did not write: remove it, or choose "
                                      "another output.uri") from None
                out.append((p, rel, unit, entry))
            return out

        return self.io(load, f"read {what} of {self.url()}")

    def _checked(self, rel: str, unit: tuple[int, int | None], entry: Any) -> dict[str, Any]:
        """``entry`` (from the manifest file ``rel`` of the part ``unit`` = ``(shard,
        split)``) if it names its own part and exactly that part's data files in this job's
        naming; else OutputError naming the file (a name from ``_manifest/`` is never used
        before this check)."""
        expect = part_name(*unit)
        problem = None
        if not isinstance(entry, dict):
            problem = f"holds a {type(entry).__name__}, not a record"
        elif entry.get("part") != expect:
            problem = f"names the part {entry.get('part')!r}"
        else:
            files = entry.get("files", [expect])
            if not isinstance(files, list) or not files or files != data_file_names(expect, len(files)):
                problem = f"names the files {_short_list(files)}"
        if problem is None:
            if "files" not in entry:
                entry["files"] = [expect]
            return entry
        stem = expect[: -len(".parquet")]
        who = f"shard {unit[0]}" if unit[1] is None else f"unit {unit[1]} of shard {unit[0]}"
        raise OutputError(
            f"output {self.url()!r}: {rel} {problem}, which are not the names this job gives {who} "
            f"({expect}, or {stem}-NNNNN.parquet, directly in the output folder); the job deletes only "
            f"files it wrote, so it does nothing: remove {rel} (this job did not write it), or choose another "
            "output.uri")

    def read_summary(self) -> dict[str, Any]:
        """The ``_summary.json`` of the last finished run."""
        def load() -> dict[str, Any]:
            with self.fs.open(self.path(SUMMARY), "r") as f:
                return json.load(f)

        return self.io(load, f"read {SUMMARY}")

    # ------------------------------------------------------------------ the checks
    def inspect(self) -> dict[str, dict[str, Any]]:
        """Read and check the output folder: its listing, manifest and publish intents
        (names checked), the foreign-file check; on ``overwrite``, clear this job's files.

        Returns:
            The manifest (part name -> entry) the run starts from: empty after a clear.
            ``intents`` and ``foreign`` are set on the location.

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
            self.leftovers = []
            entries = self.read_manifest()
            self.intents = self.read_intents()
            self.foreign = self._foreign(files, entries)
            self._check_foreign(entries)
            self._remove_leftovers(files)
            if self.cfg.overwrite:
                self._clear(entries, files)
                entries = {}
        except Exception as e:
            self._refused(e, "usable")
        return entries

    def complete(self) -> bool:
        """Whether ``_SUCCESS`` is there (the last run finished)."""
        return self.exists(self.path(SUCCESS))

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
            self._refused(e, "writable")

    def _refused(self, e: Exception, what: str) -> None:
        """Re-raise ``e`` from a check of the location: an :class:`OutputError` or a
        transient :class:`StorageError` as it is, anything else as an OutputError saying the
        output is not ``what`` (``usable``, ``writable``): :func:`pipeline.storage.raise_refusal`."""
        raise_refusal(e, OutputError, f"output {self.url()!r} is not {what}")

    def _remove_leftovers(self, files: list[str]) -> None:
        """Remove what an earlier run of this job began to write and never finished: the
        temporary files of :meth:`put_atomic` (a run killed between write and rename) and the
        manifest records found empty or cut short (:func:`_partial_record`: written by a
        version that wrote them in place, on a full disk).  Each names no published file (an
        intent is complete before any file is published, an entry is the last write of its
        shard, whose intent still names the files), so nothing else goes with them.  The run
        holds the output's lease: no other run is writing them."""
        prefix = self.root.rstrip("/") + "/"
        temps = [self.path(rel) for rel in files if TEMP_FILE.fullmatch(posixpath.basename(rel))
                 and owned_layout_file(rel)]
        for path in self.leftovers + temps:
            rel = path[len(prefix):] if path.startswith(prefix) else path
            log.info("output %s: removing %s, a record an earlier run began to write and never finished",
                     self.url(), rel)
            self.remove(path, f"remove the unfinished {rel}")
        self.leftovers = []

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

    def _owned_data_files(self, entries: dict[str, dict[str, Any]]) -> set[str]:
        """The data files the (checked) manifest entries and intents name."""
        named = set()
        for e in list(entries.values()) + list(self.intents.values()):
            named.update(e["files"])
        return named

    def _foreign(self, files: list[str], entries: dict[str, dict[str, Any]]) -> list[str]:
        """The files (relative paths) this job did not write."""
        named = self._owned_data_files(entries)
        ours_markers = bool(entries or self.intents)
        foreign = []
        for rel in files:
            if owned_layout_file(rel):
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

    def _clear(self, entries: dict[str, dict[str, Any]], files: list[str]) -> None:
        """Overwrite: delete this job's files (markers first, so the output never looks
        complete; then the data files, then the manifest and staging files), nothing else."""
        for name in (SUCCESS, SUMMARY):
            if self.exists(self.path(name)):
                self.io(lambda n=name: self.fs.rm(self.path(n)), f"remove {name}")
        for name in sorted(self._owned_data_files(entries)):
            self.remove(self.path(name), f"remove {name}")
        for rel in files:
            if rel != LEASE and owned_layout_file(rel):
                self.remove(self.path(rel), f"remove {rel}")
        if self.local:
            for d in (MANIFEST, STAGING):
                prune_empty(self.path(d))
        self.intents = {}

def _partial_record(raw: bytes, unit: tuple[int, int | None]) -> bool:
    """Whether ``raw``, read from the manifest record of the part ``unit`` = ``(shard,
    split)``, is one this job began and never finished: empty, or the start of the record
    it writes (``{"part": "part-NNNNN-uNNNNN.parquet"...``, JSON cut short, inside its first
    key too).  Anything else that does not parse is not the job's, and is refused."""
    if not raw:
        return True
    head = ('{"part": "%s"' % part_name(*unit)).encode()
    if not (raw.startswith(head) or head.startswith(raw)):
        return False
    try:
        json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return True
    return False


def _short_list(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 120 else r[:117] + "..."
