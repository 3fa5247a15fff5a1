"""The output lease: one run at a time writes an output folder.

A run takes the lease ``<output>/_lease.json`` (:data:`LEASE`) before it reads the
output's manifest, keeps it alive with a heartbeat while it runs, checks before every
publish that it still holds it, and releases it on every exit path it lives through.  A
second run on a leased output is refused (:class:`LeaseHeld`, exit 2) naming the holder
and how long ago it last beat; a lease whose last heartbeat is older than the bound
(``output.lease_timeout_s``, or the holder's own bound when that is longer, counted as at
most a day whatever the lease file claims) is *stale*:
its holder is presumed dead (SIGKILL, a lost node) and the next run takes it over with a
warning.  A run that finds its lease gone or taken over publishes nothing more
(:class:`LeaseLost`).  A run that fails because the storage failed leaves its lease
(:meth:`OutputLease.abandon`: releasing it could hang as long again); it goes stale after
the bound, and a later run in the same process (a retry loop, a notebook) takes it over
at once, since it knows that run is over.

The lease records the holder: run id, ``user@host``, pid, config fingerprint, when it was
taken and when it last beat.  The heartbeat time is the lease file's modification time as
the storage reports it (local ``st_mtime``, S3 ``LastModified``), compared with this
machine's clock, so hosts sharing an output need clocks that agree to well within the bound;
a heartbeat more than :data:`CLOCK_SKEW_TOLERANCE_S` in the future is refused as clock skew
(:class:`LeaseHeld`, naming it).  A ``_lease.json`` that is not a regular file (a named pipe)
is refused without being read.

The lease says who may write; the commit log fences (:mod:`pipeline.output.commit_log`):
a run that lost its lease and resumes after a pause can commit nothing, since the run that
took the lease over has appended its ``epoch`` record where the paused run's next record
would go, and the storage refuses a second record there.  How each storage makes the lease
itself exclusive (:mod:`pipeline.output.lease_backends`): on local disk an ``O_EXCL``
create with the heartbeat the file's mtime and takeover under ``flock``; on S3 conditional
puts (``If-None-Match: *`` to create, ``If-Match: <ETag>`` to beat and take over; a store
that ignores them is named in a warning and the lease falls back to read-then-write with a
read-back); on other fsspec filesystems a best-effort read-then-write with a read-back.

Every storage call goes through the run's retry loop (:mod:`pipeline.retry`).
"""

from __future__ import annotations

import datetime as _dt
import getpass
import json
import logging
import math
import os
import posixpath
import socket
import threading
import time
import uuid
from typing import Any, Callable

from pipeline.config import MAX_LEASE_TIMEOUT_S, JobRefused
from pipeline.storage import is_local
from pipeline.layout import LEASE  # noqa: F401 (the lease file, directly in the output folder)
from pipeline.output.lease_backends import (GenericLeaseStore, Holder, LeaseStore, LeaseUnreadable,  # noqa: F401
                                            LocalLeaseStore, S3LeaseStore)

log = logging.getLogger("specbatch")

_MARK = "specbatch output lease"
#: this process, in the leases it takes (a lease of this process whose run is over is a leftover)
_PROCESS = uuid.uuid4().hex
_ACTIVE: set[str] = set()  # run ids whose lease this process holds now
#: a lease heartbeat further in the future than this (seconds) is named as clock skew
CLOCK_SKEW_TOLERANCE_S = 10.0


class LeaseHeld(JobRefused):
    """Another run holds the output's lease (its heartbeat is recent): refused before any work."""


class LeaseLost(RuntimeError):
    """This run no longer holds its output's lease (taken over by another run, removed, or
    its heartbeat failed for too long): it publishes nothing more."""


def lease_interval(timeout_s: float) -> float:
    """Seconds between heartbeats for a stale bound of ``timeout_s``: a sixth of it (at
    most 30 s, at least 0.2 s), so several beats may fail before the lease goes stale."""
    return max(0.2, min(30.0, timeout_s / 6))


class OutputLease:
    """The lease of one output folder for one run.

    Use as a context manager (or :meth:`acquire` / :meth:`release`); :meth:`check` before
    every publish.

    Args:
        fs, root: the output's fsspec filesystem and its folder (as ``open_fs`` returns).
        run_id: this run's id.
        url: the output folder as a URL, for messages.
        io: the run's retry loop (``pipeline.retry.retrying(...)``); None = call once.
        timeout_s: the stale bound (``output.lease_timeout_s``), seconds.
        config_fingerprint: recorded in the lease, for the refusal message of a second run.
        clock: wall-clock seconds since the epoch (tests).
    """

    def __init__(self, fs, root: str, run_id: str, *, url: str, io: Callable | None = None,
                 timeout_s: float = 120.0, config_fingerprint: str | None = None,
                 clock: Callable[[], float] = time.time):
        self.fs, self.root, self.run_id, self.url = fs, root.rstrip("/") or "/", run_id, url
        self.path = posixpath.join(self.root, LEASE)
        self.io = io or (lambda fn, what: fn())
        self.timeout_s = float(timeout_s)
        if not (math.isfinite(self.timeout_s) and 0 < self.timeout_s <= MAX_LEASE_TIMEOUT_S):
            raise ValueError(f"output.lease_timeout_s must be a finite number of seconds in (0, "
                             f"{MAX_LEASE_TIMEOUT_S:g}], got {timeout_s!r}")
        self.interval_s = lease_interval(self.timeout_s)
        self.config_fingerprint = config_fingerprint
        self.clock = clock
        protos = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
        if is_local(fs):
            self.backend: LeaseStore = LocalLeaseStore(self)
        elif any(p in ("s3", "s3a") for p in protos):
            self.backend = S3LeaseStore(self)
        else:
            self.backend = GenericLeaseStore(self)
        self.held = False
        self.lost: str | None = None  # why the lease was lost (set by the heartbeat)
        self.beats = 0
        self.last_confirmed = 0.0  # monotonic time of the last beat that confirmed the lease is ours
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ content
    def content(self) -> dict[str, Any]:
        now = _iso(self.clock())
        user = _user()
        host = socket.gethostname()
        return {"lease": _MARK, "version": 1, "run_id": self.run_id, "owner": f"{user}@{host}", "user": user,
                "host": host, "pid": os.getpid(), "process": _PROCESS, "config_fingerprint": self.config_fingerprint,
                "output": self.url, "timeout_s": self.timeout_s,
                "acquired_at": getattr(self, "_acquired_at", now), "heartbeat_at": now, "beats": self.beats}

    def parse(self, raw: bytes) -> dict[str, Any]:
        """The content of a lease file as read (``raw``).

        Raises:
            LeaseUnreadable: it is not a lease of this job.
        """
        try:
            c = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            c = None
        if not isinstance(c, dict) or c.get("lease") != _MARK:
            raise LeaseUnreadable(
                f"output {self.url!r} holds {LEASE}, which is not a lease of this job ({len(raw)} bytes); the job "
                "never deletes files it did not write: move it away or choose another output.uri")
        return c

    def bound(self, holder: Holder) -> float:
        """The stale bound for ``holder``: ours or the holder's own, whichever is longer; what
        a lease file claims counts as at most :data:`~pipeline.config.MAX_LEASE_TIMEOUT_S`
        (the longest bound a run can hold, so a forged ``"timeout_s": 1e308`` or ``Infinity``
        cannot lock the output for good), and a claim that is no positive number (``NaN``,
        negative, a string) counts as the reader's own bound."""
        theirs = holder.content.get("timeout_s")
        if isinstance(theirs, bool) or not isinstance(theirs, (int, float)) or math.isnan(theirs) or theirs <= 0:
            return self.timeout_s  # no bound at all: the reader's own
        return max(self.timeout_s, min(float(theirs), MAX_LEASE_TIMEOUT_S))

    def _refuse_skew(self, holder: Holder) -> None:
        """Refuse a lease whose last heartbeat lies further in the future than
        :data:`CLOCK_SKEW_TOLERANCE_S`: this machine's clock and the storage's disagree (the
        heartbeat is the storage's modification time), and no age measured across them means
        anything, so the lease is neither taken over nor waited on in silence.

        Raises:
            LeaseHeld: naming the skew, in seconds.
        """
        if holder.age_s >= -CLOCK_SKEW_TOLERANCE_S:
            return
        raise LeaseHeld(
            f"output {self.url!r}: the last heartbeat of its lease ({LEASE}, {holder.describe()}) lies "
            f"{-holder.age_s:.0f} s in the future by this machine's clock: clock skew between this machine and the "
            "storage (or the holder's host); the job cannot tell whether that run is alive, so it does nothing: set "
            "the clocks right (NTP), then rerun; if no run holds the output, remove the lease")

    # ------------------------------------------------------------------ acquire / release
    def acquire(self) -> None:
        """Take the lease, taking over a stale one with a warning, and start the heartbeat.

        Raises:
            LeaseHeld: another run's lease is not stale (message names it and its last beat).
            LeaseUnreadable: ``_lease.json`` is not a lease of this job.
            StorageError: the storage kept failing.
        """
        self._acquired_at = _iso(self.clock())
        _ACTIVE.add(self.run_id)  # before the lease exists: this process's other runs must not retake it
        try:
            self._acquire()
        except BaseException:
            _ACTIVE.discard(self.run_id)
            raise
        self.held = True
        self.last_confirmed = time.monotonic()
        self.backend.after_acquire()
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat_loop, name="specbatch-lease", daemon=True)
        self._thread.start()

    def _acquire(self) -> None:
        for _ in range(5):  # a lease released or taken over between our reads: look again
            if self.backend.create():
                break
            holder = self.backend.read()
            if holder is None:
                continue
            self._refuse_skew(holder)
            bound = self.bound(holder)
            leftover = holder.content.get("process") == _PROCESS and holder.content.get("run_id") not in _ACTIVE
            if leftover and self.backend.take_over(holder, force=True):
                log.info("output %s: took over the lease an earlier run of this process left (run %s, after a "
                         "storage failure)", self.url, holder.content.get("run_id"))
                break
            if holder.age_s <= bound:
                raise LeaseHeld(
                    f"output {self.url!r} is leased by another run: {holder.describe()} ({LEASE}); two runs on one "
                    "output would mix their files, so this one does nothing: wait for that run to end, or, if it "
                    f"died, rerun once its lease is stale (no heartbeat for output.lease_timeout_s={bound:g} s, "
                    f"in about {max(1.0, bound - holder.age_s):.0f} s)")
            if self.backend.take_over(holder):
                log.warning("output %s: took over the stale lease of %s (more than output.lease_timeout_s=%g s): "
                            "that run is presumed dead", self.url, holder.describe(), bound)
                break
        else:
            raise LeaseHeld(f"output {self.url!r}: its lease ({LEASE}) keeps changing hands; another run is "
                            "starting on it: try again later")

    def release(self) -> None:
        """Stop the heartbeat and remove the lease if it is still ours.  Never raises
        (a lease left behind goes stale and the next run takes it over)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval_s + 5)
        self._thread = None
        if not self.held:
            return
        self.held = False
        _ACTIVE.discard(self.run_id)
        try:
            with self._lock:
                self.backend.release()
        except Exception as e:  # noqa: BLE001 - best effort: the lease expires
            log.warning("output %s: could not release the lease (%s: %s); it goes stale after %g s",
                        self.url, type(e).__name__, e, self.timeout_s)

    def abandon(self) -> None:
        """Stop the heartbeat and leave the lease as it is, touching no storage (the storage
        just failed: a release could hang as long again).  It goes stale after the bound;
        a later run of this same process takes it over at once."""
        self._stop.set()
        self._thread = None
        self.held = False
        _ACTIVE.discard(self.run_id)

    def __enter__(self) -> "OutputLease":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    # ------------------------------------------------------------------ holding it
    def check(self) -> None:
        """Before a publish: confirm in the storage that the lease is still this run's.

        Raises:
            LeaseLost: it was taken over or removed, or its heartbeat has not reached the
                storage for half the stale bound (another run may take it over soon).
            StorageError: the storage kept failing.
        """
        if not self.held:
            raise LeaseLost(f"output {self.url!r}: this run holds no lease on it")
        if self.lost:
            raise LeaseLost(self.lost)
        quiet = time.monotonic() - self.last_confirmed
        if quiet > self.timeout_s / 2:
            raise LeaseLost(f"output {self.url!r}: this run's lease heartbeat has not reached the storage for "
                            f"{quiet:.0f} s (output.lease_timeout_s={self.timeout_s:g}): another run may take the "
                            "output over, so this one publishes nothing more; rerun to resume")
        with self._lock:
            why = self.backend.still_ours()
        if why:
            self._lose(why)
            raise LeaseLost(self.lost)

    def _lose(self, why: str) -> None:
        self.lose(f"output {self.url!r}: this run lost its lease ({why}); it publishes nothing more, and the "
                  "output now belongs to whichever run holds the lease")

    def lose(self, message: str) -> None:
        """Mark the lease lost (``message`` says why, logged once): every later :meth:`check`
        raises :class:`LeaseLost`, and the heartbeat stops."""
        if not self.lost:
            self.lost = message
            log.error("%s", message)

    @property
    def atomic_create(self) -> bool:
        """Whether the storage creates a file only when none is there (if not, the lease and
        the commit log read back what they write: best effort)."""
        return self.backend.atomic_create

    def beat(self) -> bool:
        """One heartbeat (the background thread calls it every :attr:`interval_s`).
        Returns False once the lease is lost."""
        if self.lost or not self.held:
            return False
        from pipeline.retry import StorageError

        try:
            with self._lock:
                self.beats += 1
                why = self.backend.beat()
        except StorageError as e:
            log.warning("output %s: lease heartbeat failed (%s); retrying in %.0f s", self.url, e, self.interval_s)
            return True
        if why:
            self._lose(why)
            return False
        self.last_confirmed = time.monotonic()
        return True

    def _beat_loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                if not self.beat():
                    return
            except Exception:  # noqa: BLE001 - the thread must not die silently
                log.exception("output %s: lease heartbeat failed", self.url)


# ---------------------------------------------------------------------- helpers
def _iso(t: float) -> str:
    return _dt.datetime.fromtimestamp(t, _dt.timezone.utc).isoformat(timespec="seconds")


def holder_name() -> str:
    """``user@host`` of this process, as leases and the commit log record it."""
    return f"{_user()}@{socket.gethostname()}"


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # noqa: BLE001 - no user name in this environment (a container)
        return f"uid {os.getuid()}"


__all__ = ["LEASE", "OutputLease", "LeaseHeld", "LeaseLost", "LeaseUnreadable", "Holder", "lease_interval",
           "holder_name"]
