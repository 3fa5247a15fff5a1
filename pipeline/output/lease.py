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

How each storage makes it exclusive:

- **Local disk** (and any POSIX filesystem mounted locally, NFS included): the lease is
  created with ``O_CREAT | O_EXCL`` (only one creator succeeds); its content is written once
  and the heartbeat is the file's mtime, touched through the open descriptor, so a holder
  only ever touches its own file.  A stale lease is taken over, and a lease released,
  under an exclusive ``flock`` on the output folder, so two takers cannot both succeed.
  Ownership is the file's identity (device and inode) being the one the holder created.
- **S3** (and S3-compatible stores): the lease is created with a conditional put
  (``If-None-Match: *``, honoured by AWS S3 since August 2024, MinIO, moto); each
  heartbeat and a takeover are puts with ``If-Match: <the ETag last seen>``, so a holder
  never overwrites a lease it lost and only one of two takers wins; it is released with a
  conditional delete.  Ownership is the ETag (each beat changes the content, so each ETag
  is new).  Right after creating the lease, the run checks that the store refuses a
  second conditional create and an ``If-Match`` with a wrong ETag; a store that ignores
  either (some older S3-compatible servers) is logged as a warning and the lease falls
  back to read-then-write with a read-back, which two runs starting within the same
  instant could both pass (the later one's first check before publishing then stops the
  one that lost).
- **Other fsspec filesystems** (``gs://``, ``memory://``, ...): the same best-effort
  read-then-write with a read-back, with a warning.

Every storage call goes through the run's retry loop (:mod:`pipeline.retry`).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import getpass
import json
import logging
import math
import os
import posixpath
import socket
import stat
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from pipeline.config import MAX_LEASE_TIMEOUT_S, JobRefused
from pipeline.output.layout import LEASE  # noqa: F401 (the lease file, directly in the output folder)

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


class LeaseUnreadable(JobRefused):
    """The output holds a ``_lease.json`` that is not a lease of this job."""


@dataclass
class Holder:
    """A lease as read back: its content, and the age of its last heartbeat (seconds)."""

    content: dict[str, Any]
    age_s: float
    token: Any  # what identifies this version of the lease (inode, ETag)

    def describe(self) -> str:
        c = self.content
        who = c.get("owner") or "an unknown holder"
        fp = f", config fingerprint {c['config_fingerprint']}" if c.get("config_fingerprint") else ""
        started = f", started {c['acquired_at']}" if c.get("acquired_at") else ""
        beat = f"{self.age_s:.0f} s ago" if self.age_s >= 0 else f"{-self.age_s:.0f} s in the future"
        return f"run {c.get('run_id') or '?'} of {who} (pid {c.get('pid', '?')}{fp}{started}), last heartbeat {beat}"


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
        if "file" in protos or "local" in protos:
            self.backend: _Backend = _Local(self)
        elif any(p in ("s3", "s3a") for p in protos):
            self.backend = _S3(self)
        else:
            self.backend = _Generic(self)
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

    def _parse(self, raw: bytes) -> dict[str, Any]:
        try:
            c = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            c = None
        if not isinstance(c, dict) or c.get("lease") != _MARK:
            raise LeaseUnreadable(
                f"output {self.url!r} holds {LEASE}, which is not a lease of this job ({len(raw)} bytes); the job "
                "never deletes files it did not write: move it away or choose another output.uri")
        return c

    def _bound(self, holder: Holder) -> float:
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
            bound = self._bound(holder)
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
        self.lost = (f"output {self.url!r}: this run lost its lease ({why}); it publishes nothing more, and the "
                     "output now belongs to whichever run holds the lease")
        log.error("%s", self.lost)

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


# ---------------------------------------------------------------------- backends
class _Backend:
    def __init__(self, lease: OutputLease):
        self.lease = lease

    def create(self) -> bool:
        """Create the lease if there is none; True when this run now holds it."""
        raise NotImplementedError

    def read(self) -> Holder | None:
        """The current lease, or None when there is none."""
        raise NotImplementedError

    def take_over(self, stale: Holder, force: bool = False) -> bool:
        """Replace ``stale`` (still the current lease) by ours; False when it changed
        meanwhile (or, unless ``force``, is no longer stale)."""
        raise NotImplementedError

    def after_acquire(self) -> None:
        pass

    def beat(self) -> str | None:
        """Refresh the heartbeat; returns why the lease is no longer ours, else None."""
        raise NotImplementedError

    def still_ours(self) -> str | None:
        raise NotImplementedError

    def release(self) -> None:
        raise NotImplementedError


class _Local(_Backend):
    """``O_EXCL`` create, heartbeat = mtime touched through our descriptor, takeover and
    release under ``flock`` on the folder."""

    def __init__(self, lease: OutputLease):
        super().__init__(lease)
        self.fd: int | None = None
        self.ident: tuple[int, int] | None = None

    @contextlib.contextmanager
    def _folder_lock(self):
        import fcntl

        d = os.open(self.lease.root, os.O_RDONLY)
        try:
            fcntl.flock(d, fcntl.LOCK_EX)
            yield
        finally:
            os.close(d)  # closing drops the lock

    def create(self) -> bool:
        path = self.lease.path

        def make() -> int | None:
            os.makedirs(self.lease.root, exist_ok=True)
            try:
                return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            except FileExistsError:
                return None

        fd = self.lease.io(make, f"create the lease {self.lease.url}/{LEASE}")
        if fd is None:
            return False
        try:
            os.write(fd, json.dumps(self.lease.content(), indent=1).encode())
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        st = os.fstat(fd)
        self.fd, self.ident = fd, (st.st_dev, st.st_ino)
        return True

    def read(self) -> Holder | None:
        path = self.lease.path
        for attempt in range(10):
            try:  # O_NONBLOCK: opening a named pipe planted there returns at once (refused below)
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except FileNotFoundError:
                return None
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise LeaseUnreadable(f"output {self.lease.url!r}: {LEASE} is a symlink; the job writes its "
                                          "lease only as a plain file: remove the link") from None
                raise
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) and not stat.S_ISDIR(st.st_mode):
                    raise LeaseUnreadable(f"output {self.lease.url!r}: {LEASE} is not a regular file (a named pipe, "
                                          "a device or a socket), so not a lease of this job: a read of it may "
                                          "never return; move it away")
                raw = os.read(fd, 1 << 20)
            except IsADirectoryError:
                raise LeaseUnreadable(f"output {self.lease.url!r}: {LEASE} is a folder, not a lease of this job: "
                                      "move it away") from None
            finally:
                os.close(fd)
            age = self.lease.clock() - st.st_mtime
            if not raw.strip() and age < 5 and attempt < 9:  # the creator is writing it
                time.sleep(0.05)
                continue
            if not raw.strip():
                return Holder({"owner": "a run that died while creating it"}, age, (st.st_dev, st.st_ino))
            return Holder(self.lease._parse(raw), age, (st.st_dev, st.st_ino))
        return None

    def take_over(self, stale: Holder, force: bool = False) -> bool:
        with self._folder_lock():
            now = self.read()
            if now is None or now.token != stale.token or (not force and now.age_s <= self.lease._bound(now)):
                return False
            os.unlink(self.lease.path)
            return self.create()

    def _current(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.lease.path, follow_symlinks=False)
        except FileNotFoundError:
            return None
        return st.st_dev, st.st_ino

    def beat(self) -> str | None:
        why = self.still_ours()
        if why:
            return why
        os.utime(self.fd)  # our own file only, even if the path now names another
        return None

    def still_ours(self) -> str | None:
        current = self._current()
        if current == self.ident:
            return None
        if current is None:
            return f"{LEASE} was removed"
        holder = self.read()
        return f"{LEASE} now belongs to {holder.describe() if holder else 'another run'}"

    def release(self) -> None:
        try:
            with self._folder_lock():
                if self._current() == self.ident:
                    os.unlink(self.lease.path)
        finally:
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None


def _precondition_failed(e: BaseException) -> bool:
    """Whether ``e`` (or what it was raised from) is S3's 412 PreconditionFailed."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, FileExistsError):  # s3fs's translation of a failed If-None-Match
            return True
        resp = getattr(e, "response", None)
        if isinstance(resp, dict):
            err = resp.get("Error") or {}
            status = (resp.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            if err.get("Code") == "PreconditionFailed" or status == 412:
                return True
        e = e.__cause__ or e.__context__
    return False


class _S3(_Backend):
    """Conditional puts (``If-None-Match: *`` to create, ``If-Match: <ETag>`` to beat and
    to take over), a conditional delete to release; ownership is the ETag."""

    def __init__(self, lease: OutputLease):
        super().__init__(lease)
        bucket, key, _ = lease.fs.split_path(lease.path)
        self.bucket, self.key = bucket, key
        self.etag: str | None = None
        self.honours_if_none_match = True
        self.honours_if_match = True

    def _call(self, method: str, what: str, **kw) -> tuple[dict | None, bool]:
        """``(response, False)``, or ``(None, True)`` on 412 PreconditionFailed (not retried)."""
        def go():
            try:
                return self.lease.fs.call_s3(method, Bucket=self.bucket, Key=self.key, **kw), False
            except Exception as e:  # noqa: BLE001
                if _precondition_failed(e):
                    return None, True
                raise

        return self.lease.io(go, f"{what} {self.lease.url}/{LEASE}")

    def _body(self) -> bytes:
        return json.dumps(self.lease.content(), indent=1).encode()

    def create(self) -> bool:
        if self.read() is not None:  # never put over a lease, even on a store that ignores the condition
            return False
        resp, failed = self._call("put_object", "create the lease", Body=self._body(), IfNoneMatch="*",
                                  ContentType="application/json")
        if failed:
            return False
        self.etag = resp["ETag"]
        return self._read_back()

    def _read_back(self) -> bool:
        """True when the lease now in the store is the one we wrote (a store ignoring the
        conditions lets a concurrent writer replace it)."""
        holder = self.read()
        return holder is not None and holder.token == self.etag

    def read(self) -> Holder | None:
        from fsspec.asyn import sync

        fs = self.lease.fs

        async def get():  # one GET: the content and the ETag of the same version
            try:
                resp = await fs._call_s3("get_object", Bucket=self.bucket, Key=self.key)
            except FileNotFoundError:
                return None
            async with resp["Body"] as stream:
                return resp, await stream.read()

        got = self.lease.io(lambda: sync(fs.loop, get), f"read the lease {self.lease.url}/{LEASE}")
        if got is None:
            return None
        resp, raw = got
        age = self.lease.clock() - resp["LastModified"].timestamp()
        return Holder(self.lease._parse(raw), age, resp["ETag"])

    def take_over(self, stale: Holder, force: bool = False) -> bool:
        if not self.honours_if_match:
            now = self.read()
            if now is None or now.token != stale.token:
                return False
        resp, failed = self._call("put_object", "take over the lease", Body=self._body(), IfMatch=stale.token,
                                  ContentType="application/json")
        if failed:
            return False
        self.etag = resp["ETag"]
        return self._read_back()

    def after_acquire(self) -> None:
        """Check the store honours both conditions (our own lease is the probe)."""
        resp, failed = self._call("put_object", "check conditional create of", Body=self._body(), IfNoneMatch="*",
                                  ContentType="application/json")
        if not failed:  # the store let us overwrite the lease (with our own content)
            self.honours_if_none_match = False
            self.etag = resp["ETag"]
        resp, failed = self._call("put_object", "check conditional write of", Body=self._body(),
                                  IfMatch='"00000000000000000000000000000000"')
        if not failed:
            self.honours_if_match = False
            self.etag = resp["ETag"]
        if not (self.honours_if_none_match and self.honours_if_match):
            from pipeline.retry import endpoint_of

            ignored = " and ".join(h for h, ok in (("If-None-Match", self.honours_if_none_match),
                                                   ("If-Match", self.honours_if_match)) if not ok)
            log.warning("output %s: the store (%s) ignores conditional writes (%s): the output lease falls back to "
                        "read-then-write with a read-back, which two runs starting at the same instant could both "
                        "pass (the loser stops at its first check before publishing)",
                        self.lease.url, endpoint_of(self.lease.fs), ignored)

    def beat(self) -> str | None:
        if not self.honours_if_match:
            why = self.still_ours()
            if why:
                return why
        resp, failed = self._call("put_object", "renew the lease", Body=self._body(), IfMatch=self.etag,
                                  ContentType="application/json")
        if failed:
            return self._whose()
        self.etag = resp["ETag"]
        return None

    def _whose(self) -> str:
        holder = self.read()
        return f"{LEASE} now belongs to {holder.describe()}" if holder else f"{LEASE} was removed"

    def still_ours(self) -> str | None:
        def head():
            try:
                return self.lease.fs.call_s3("head_object", Bucket=self.bucket, Key=self.key)["ETag"]
            except FileNotFoundError:
                return None

        etag = self.lease.io(head, f"check the lease {self.lease.url}/{LEASE}")
        if etag == self.etag:
            return None
        return self._whose()

    def release(self) -> None:
        if self.honours_if_match:
            _, failed = self._call("delete_object", "release the lease", IfMatch=self.etag)
            if failed:
                log.warning("output %s: the lease was no longer this run's at release; left as it is", self.lease.url)
            return
        if self.still_ours() is None:
            self._call("delete_object", "release the lease")


class _Generic(_Backend):
    """Best effort for stores without an atomic create: read, write, read back; ownership
    is the run id in the content."""

    def after_acquire(self) -> None:
        log.warning("output %s: this storage (%s) offers the job no atomic create, so the output lease is best "
                    "effort (read, write, read back)", self.lease.url, self.lease.fs.protocol)

    def _write(self) -> None:
        def put():
            with self.lease.fs.open(self.lease.path, "wb") as f:
                f.write(json.dumps(self.lease.content(), indent=1).encode())

        self.lease.io(put, f"write the lease {self.lease.url}/{LEASE}")

    def read(self) -> Holder | None:
        fs = self.lease.fs

        def get():
            fs.invalidate_cache(self.lease.path)
            try:
                info = fs.info(self.lease.path)
                with fs.open(self.lease.path, "rb") as f:
                    return info, f.read()
            except FileNotFoundError:
                return None

        got = self.lease.io(get, f"read the lease {self.lease.url}/{LEASE}")
        if got is None:
            return None
        info, raw = got
        content = self.lease._parse(raw)
        mtime = _mtime(info)
        if mtime is None:  # no modification time here: the holder's own heartbeat stamp
            mtime = _parse_iso(content.get("heartbeat_at"))
        age = self.lease.clock() - mtime if mtime is not None else 0.0
        return Holder(content, age, content.get("run_id"))

    def create(self) -> bool:
        if self.read() is not None:
            return False
        self._write()
        return self.still_ours() is None

    def take_over(self, stale: Holder, force: bool = False) -> bool:
        now = self.read()
        if now is None or now.token != stale.token:
            return False
        self._write()
        return self.still_ours() is None

    def beat(self) -> str | None:
        why = self.still_ours()
        if why:
            return why
        self._write()
        return None

    def still_ours(self) -> str | None:
        holder = self.read()
        if holder is None:
            return f"{LEASE} was removed"
        return None if holder.token == self.lease.run_id else f"{LEASE} now belongs to {holder.describe()}"

    def release(self) -> None:
        if self.still_ours() is None:
            self.lease.io(lambda: self.lease.fs.rm(self.lease.path), f"release the lease {self.lease.url}/{LEASE}")


# ---------------------------------------------------------------------- helpers
def _iso(t: float) -> str:
    return _dt.datetime.fromtimestamp(t, _dt.timezone.utc).isoformat(timespec="seconds")


def _parse_iso(s: Any) -> float | None:
    try:
        return _dt.datetime.fromisoformat(str(s)).timestamp()
    except (TypeError, ValueError):
        return None


def _mtime(info: dict[str, Any]) -> float | None:
    for key in ("mtime", "LastModified", "last_modified", "updated", "created"):
        v = info.get(key)
        if isinstance(v, (int, float)):
            return float(v)
        if isinstance(v, _dt.datetime):
            return v.timestamp()
        if isinstance(v, str):
            t = _parse_iso(v.replace("Z", "+00:00"))
            if t is not None:
                return t
    return None


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # noqa: BLE001 - no user name in this environment (a container)
        return f"uid {os.getuid()}"


__all__ = ["LEASE", "OutputLease", "LeaseHeld", "LeaseLost", "LeaseUnreadable", "Holder", "lease_interval"]
