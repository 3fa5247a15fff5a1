"""The commit log of an output folder: the one place a unit is committed, fenced by the storage.

``_manifest/log/NNNNNNNNNN.json`` (:func:`pipeline.layout.log_record`) are numbered
records, each created once with a create-exclusive write (:mod:`pipeline.output.exclusive`:
``link()`` on local disk, ``If-None-Match: *`` on S3) and never overwritten, as Delta
Lake's ``_delta_log``.  A writer always creates the record after the last one it has seen,
and the log has no gaps (record ``n`` is written only by whoever saw record ``n - 1``), so
a writer whose record number was taken learns that someone else wrote since it last
looked: its commit fails (:class:`SlotTaken`).  Three kinds of record:

- ``epoch``: a run begins writing the output (it holds the lease, :mod:`pipeline.output.lease`).
  From this record on, only that run may commit: a run that lost its lease (a paused
  process, a VM freeze longer than ``output.lease_timeout_s``) and resumes finds its next
  record number taken by the epoch of the run that took the output over, so it can write
  no entry, whatever the timing.  This is the lease's fencing token, checked by the
  storage on every commit and not by the writer before it.  ``overwrite: true`` marks a
  run that starts the output afresh: what came before it no longer counts.
- ``unit``: a unit's commit, with its manifest entry (its data files, the source and its
  fingerprint, the rows, the config fingerprint, the totals).
- ``final``: the run's end, written after every unit is committed and every entry was
  found to carry one config fingerprint; ``_SUCCESS`` is then published.

:func:`replay` reads the records in order: a ``unit`` or ``final`` record counts only when
its run wrote the last ``epoch`` before it (a record of a run that had lost its place
never counts), and a unit that already has an entry is never committed again.  The
output is complete when the last record is a ``final`` one (:attr:`LogState.final`).
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass, field
from typing import Callable, Iterable

from pipeline.output import exclusive
from pipeline.layout import LOG, LOG_RECORD, MANIFEST, log_record
from pipeline.output.records import (EpochRecord, FinalRecord, LogRecord, RecordError, UnitRecord,
                                     decode_log_record)


class SlotTaken(RuntimeError):
    """The record number a run meant to write was taken by another run's record (``record``:
    None when it is not one this job writes)."""

    def __init__(self, seq: int, record: LogRecord | None):
        super().__init__(f"record {seq} of the commit log was written by run "
                         f"{record.run_id if record is not None else '?'}")
        self.seq, self.record = seq, record


@dataclass
class LogState:
    """What the log says (:func:`replay`).

    Attributes:
        entries: part name -> the ``unit`` record committing it (its manifest entry).
        runs: run ids of every ``epoch`` record, in order (the runs that wrote this output).
        holder: the run of the last ``epoch`` record (None: an empty log).
        final: the last record when it is a ``final`` one of ``holder`` (the output is complete).
        last_seq: the highest record number (-1: an empty log).
        void: record numbers that do not count (a run that had lost its place wrote them,
            or an ``overwrite`` epoch came after them).
        epochs: record number of every ``epoch`` record.
        overwrite_seq: the number of the last ``overwrite`` epoch (None: none), before
            which nothing counts (the entries of earlier versions included).
    """

    entries: dict[str, UnitRecord] = field(default_factory=dict)
    runs: list[str] = field(default_factory=list)
    holder: str | None = None
    final: FinalRecord | None = None
    last_seq: int = -1
    void: list[int] = field(default_factory=list)
    epochs: list[int] = field(default_factory=list)
    overwrite_seq: int | None = None


def replay(records: Iterable[tuple[int, LogRecord]]) -> LogState:
    """The state of a log from its records ``(number, record)``
    (decoded by :func:`pipeline.output.records.decode_log_record`)."""
    state = LogState()
    counted: dict[str, int] = {}  # part -> record number of its entry
    for seq, rec in sorted(records, key=lambda r: r[0]):
        state.last_seq = max(state.last_seq, seq)
        run = rec.run_id
        if isinstance(rec, EpochRecord):
            state.holder, state.final = run, None
            state.epochs.append(seq)
            if run not in state.runs:
                state.runs.append(run)
            if rec.overwrite:
                state.overwrite_seq = seq
                state.void.extend(counted.values())
                state.entries.clear()
                counted.clear()
            continue
        if run != state.holder:
            state.void.append(seq)  # written by a run that had lost its place
            continue
        if isinstance(rec, UnitRecord):
            part = rec.part
            if part in state.entries:
                state.void.append(seq)
                continue
            state.entries[part], counted[part] = rec, seq
            state.final = None
        else:
            state.final = rec
    return state


class CommitLog:
    """The commit log of one output folder, for one run (``run_id``).

    Args:
        fs, root: the output's filesystem and folder.
        run_id: the run that appends (None: a reader, which never appends).
        io: the run's retry loop (``pipeline.retry.retrying(...)``).
        careful: the store ignores conditional writes (the lease found so): check that a
            record is absent before creating it, and read it back after (best effort).
    """

    def __init__(self, fs, root: str, run_id: str | None, io: Callable, careful: bool = False):
        self.fs, self.root, self.run_id, self.io = fs, root.rstrip("/") or "/", run_id, io
        self.careful = careful
        self.folder = posixpath.join(self.root, MANIFEST, LOG)
        self.next_seq = 0  # where this run appends next: after the last record it has seen

    def path(self, seq: int) -> str:
        return posixpath.join(self.root, log_record(seq))

    def list(self) -> list[tuple[int, str]]:
        """``(number, path)`` of every record, in order (others under the folder are left out)."""
        def find() -> list[str]:
            try:
                return self.fs.find(self.folder, withdirs=False)
            except FileNotFoundError:
                return []

        self.fs.invalidate_cache(self.folder)
        found = []
        for p in self.io(find, f"list the commit log {self.folder}"):
            m = LOG_RECORD.fullmatch(posixpath.basename(p))
            if m and posixpath.dirname(p).rstrip("/") == self.folder:
                found.append((int(m.group(1)), p))
        return sorted(found)

    def read(self, paths: list[str]) -> dict[str, bytes]:
        """The content of the records at ``paths`` (read concurrently where the store can)."""
        if not paths:
            return {}

        def cat() -> dict[str, bytes]:
            got = self.fs.cat(paths, on_error="raise")
            return got if isinstance(got, dict) else {paths[0]: got}

        return self.io(cat, f"read the commit log {self.folder}")

    def seen(self, last_seq: int) -> None:
        """This run has seen the log up to record ``last_seq``: it appends after it."""
        self.next_seq = max(self.next_seq, last_seq + 1)

    def append(self, record: LogRecord) -> LogRecord:
        """Create ``record`` (its ``seq`` and ``run_id`` are set here) as the next record after
        the last one this run has seen.  Returns the record written.

        Raises:
            SlotTaken: another run's record holds that number (it wrote since this run last
                looked: for a ``unit`` or ``final`` record, this run has lost the output).
            StorageError: the storage kept failing.
        """
        seq = self.next_seq
        rec = record.numbered(seq, self.run_id)
        data = rec.encode()
        path = self.path(seq)

        def create() -> bool:
            if self.careful and self.fs.exists(path):
                return False
            return exclusive.create(self.fs, path, data)

        created = self.io(create, f"write record {seq} of the commit log ({record.kind})")
        if not created or self.careful:
            got = self.read([path]).get(path)
            if got != data:  # another run's (a create that lost, or a store that ignores the condition)
                try:
                    other = decode_log_record(seq, json.loads(got))
                except (TypeError, UnicodeDecodeError, json.JSONDecodeError, RecordError):
                    other = None
                raise SlotTaken(seq, other)
        self.next_seq = seq + 1
        return rec


__all__ = ["CommitLog", "LogState", "SlotTaken", "replay"]
