"""Create-exclusive writes: a small file is created whole, once, and never over another.

The storage itself decides which of two writers of one name wins, so a writer that has
lost its place cannot overwrite what the winner wrote, whatever the timing (a paused
process, a VM freeze).  Both the output lease (:mod:`pipeline.output.lease_backends`)
and the commit log (:mod:`pipeline.output.commit_log`) are built on it:

- **Local disk** (and any POSIX filesystem mounted locally, NFS included): the content is
  written and flushed to a temporary name of the job's beside the target
  (:func:`pipeline.layout.temp_name`), then hard-linked to the target with
  ``link()``, which fails when the target exists; the temporary name is then removed.  So
  the file appears whole or not at all, and only once.
- **S3** (and S3-compatible stores): one PUT with ``If-None-Match: *`` (honoured by AWS S3
  since August 2024, MinIO, moto): 412 PreconditionFailed when the key exists (409
  ConditionalRequestConflict when another conditional write of it is in flight).
- **Other fsspec filesystems**: an existence check then a write (best effort; the callers
  read back what they wrote and warn that the store offers no atomic create).
"""

from __future__ import annotations

import contextlib
import os
import posixpath

from pipeline.storage import is_local, is_object_store
from pipeline.layout import temp_name


def precondition_failed(e: BaseException | None) -> bool:
    """Whether ``e`` (or what it was raised from) is S3's 412 PreconditionFailed or 409
    ConditionalRequestConflict: a conditional write lost to another writer."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, FileExistsError):  # s3fs's translation of a failed If-None-Match
            return True
        resp = getattr(e, "response", None)
        if isinstance(resp, dict):
            err = resp.get("Error") or {}
            status = (resp.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            if err.get("Code") in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
                return True
        e = e.__cause__ or e.__context__
    return False


def s3_call(fs, method: str, path: str, **kw):
    """One S3 call on the object at ``path`` (an s3fs filesystem's ``call_s3``)."""
    bucket, key, _ = fs.split_path(path)
    return fs.call_s3(method, Bucket=bucket, Key=key, **kw)


def write_temp(path: str, data: bytes) -> str:
    """Write ``data`` to a fresh temporary file beside the local file ``path``
    (:func:`~pipeline.layout.temp_name`, created exclusively, never through a link),
    flushed to disk; returns its path, for the caller to link or rename into place.

    Raises:
        OSError: the write failed (``ENOSPC``...); the temporary file is removed.
    """
    tmp = temp_name(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return tmp


def create_local(path: str, data: bytes) -> bool:
    """Create the local file ``path`` holding ``data``, whole and only if it does not exist
    (a flushed temporary file, :func:`write_temp`, hard-linked to it).  Returns False when
    ``path`` exists.

    Raises:
        OSError: the write failed (``ENOSPC``...); nothing is left behind.
    """
    tmp = write_temp(path, data)
    try:
        os.link(tmp, path, follow_symlinks=False)
        return True
    except FileExistsError:
        return False
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def create(fs, path: str, data: bytes) -> bool:
    """Create ``path`` on ``fs`` holding ``data``, only if nothing is there (see the module
    docstring for how each storage makes it exclusive).  Returns False when ``path`` exists
    (or another writer won it).  Not retried: callers wrap it in their retry loop (a retry
    after a create whose answer was lost finds the file there: callers read it back).

    Raises:
        OSError, StorageError-able errors of the storage.
    """
    if is_local(fs):
        os.makedirs(posixpath.dirname(path), exist_ok=True)
        return create_local(path, data)
    if is_object_store(fs) and hasattr(fs, "call_s3"):
        try:
            s3_call(fs, "put_object", path, Body=data, IfNoneMatch="*")
        except Exception as e:  # noqa: BLE001
            if precondition_failed(e):
                return False
            raise
        fs.invalidate_cache(posixpath.dirname(path))
        return True
    if fs.exists(path):  # best effort: no atomic create on this storage
        return False
    with fs.open(path, "wb") as f:
        f.write(data)
    return True
