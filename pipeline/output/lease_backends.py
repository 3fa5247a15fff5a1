"""Where a lease lives: one :class:`LeaseStore` per kind of storage (:mod:`pipeline.output.lease`).

- :class:`LocalLeaseStore`: local disk (and any POSIX filesystem mounted locally): an
  ``O_EXCL`` create, the heartbeat the file's mtime touched through the holder's own
  descriptor, takeover and release under ``flock`` on the folder; ownership is the file's
  identity (device and inode).
- :class:`S3LeaseStore`: S3 and S3-compatible stores: conditional puts (``If-None-Match: *``
  to create, ``If-Match: <ETag>`` to beat and to take over), a conditional delete to
  release; ownership is the ETag.  A store that ignores the conditions is found right after
  the lease is taken, named in a warning, and the lease falls back to read-then-write with
  a read-back.
- :class:`GenericLeaseStore`: other fsspec filesystems: read, write, read back (best effort).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from pipeline.config import JobRefused
from pipeline.output.exclusive import precondition_failed
from pipeline.layout import LEASE
from pipeline.storage import modified_at, special_kind, timestamp

log = logging.getLogger("specbatch")


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



class LeaseStore:
    """How one kind of storage holds a lease (every method a storage call through the lease's
    retry loop, ``lease.io``)."""

    #: whether the store creates a file only when none is there (else best effort: read back)
    atomic_create = True

    def __init__(self, lease):  # an OutputLease (pipeline.output.lease): its public attributes and methods
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
        """Called once the lease is held (a store's checks of itself)."""

    def beat(self) -> str | None:
        """Refresh the heartbeat; returns why the lease is no longer ours, else None."""
        raise NotImplementedError

    def still_ours(self) -> str | None:
        """None while the lease is this run's, else why not (read from the storage)."""
        raise NotImplementedError

    def release(self) -> None:
        """Remove the lease if it is still this run's."""
        raise NotImplementedError


class LocalLeaseStore(LeaseStore):
    """``O_EXCL`` create, heartbeat = mtime touched through our descriptor, takeover and
    release under ``flock`` on the folder."""

    def __init__(self, lease):
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
                kind = special_kind(st.st_mode, folder_ok=True)  # (a folder: named below, at its read)
                if kind is not None:
                    raise LeaseUnreadable(f"output {self.lease.url!r}: {LEASE} is {kind}, not a regular file, so not "
                                          "a lease of this job: a read of it may never return; move it away")
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
            return Holder(self.lease.parse(raw), age, (st.st_dev, st.st_ino))
        return None

    def take_over(self, stale: Holder, force: bool = False) -> bool:
        with self._folder_lock():
            now = self.read()
            if now is None or now.token != stale.token or (not force and now.age_s <= self.lease.bound(now)):
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


class S3LeaseStore(LeaseStore):
    """Conditional puts (``If-None-Match: *`` to create, ``If-Match: <ETag>`` to beat and
    to take over), a conditional delete to release; ownership is the ETag."""

    def __init__(self, lease):
        super().__init__(lease)
        bucket, key, _ = lease.fs.split_path(lease.path)
        self.bucket, self.key = bucket, key
        self.etag: str | None = None
        self.honours_if_none_match = True
        self.honours_if_match = True

    @property
    def atomic_create(self) -> bool:  # type: ignore[override]
        return self.honours_if_none_match

    def _call(self, method: str, what: str, **kw) -> tuple[dict | None, bool]:
        """``(response, False)``, or ``(None, True)`` on 412 PreconditionFailed (not retried)."""
        def go():
            try:
                return self.lease.fs.call_s3(method, Bucket=self.bucket, Key=self.key, **kw), False
            except Exception as e:  # noqa: BLE001
                if precondition_failed(e):
                    return None, True
                raise

        return self.lease.io(go, f"{what} {self.lease.url}/{LEASE}")

    def _body(self) -> bytes:
        return json.dumps(self.lease.content(), indent=1).encode()

    def create(self) -> bool:
        if self.read() is not None:  # never put over a lease, even on a store that ignores the condition
            return False
        return self._put_and_read_back("create the lease", IfNoneMatch="*")

    def _put_and_read_back(self, what: str, **condition: str) -> bool:
        """Put our lease under ``condition`` (``IfNoneMatch`` / ``IfMatch``), keep its ETag and
        read it back: True when the lease now in the store is the one we wrote (False: the
        condition failed, or a store ignoring it let a concurrent writer replace it)."""
        resp, failed = self._call("put_object", what, Body=self._body(), ContentType="application/json", **condition)
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
        return Holder(self.lease.parse(raw), age, resp["ETag"])

    def take_over(self, stale: Holder, force: bool = False) -> bool:
        if not self.honours_if_match:
            now = self.read()
            if now is None or now.token != stale.token:
                return False
        return self._put_and_read_back("take over the lease", IfMatch=stale.token)

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


class GenericLeaseStore(LeaseStore):
    """Best effort for stores without an atomic create: read, write, read back; ownership
    is the run id in the content."""

    atomic_create = False

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
        content = self.lease.parse(raw)
        mtime = modified_at(info)
        if mtime is None:  # no modification time here: the holder's own heartbeat stamp
            mtime = timestamp(content.get("heartbeat_at"))
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
