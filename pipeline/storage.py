"""Storage helpers shared by the input side (:mod:`pipeline.input`) and the output side
(:mod:`pipeline.output`), one owner for each.

fsspec hides most differences between local disk and object stores; these are the few the
job needs to know:

- **where a file is**: a URL that reopens a path anywhere (:func:`unstrip`), whether a
  filesystem is local disk or an object store, how one file's several spellings resolve to
  one location (:func:`resolved_location`), removing the empty folders a local run leaves
  (:func:`prune_empty`);
- **which version of a file it is**: :func:`file_version` (``size=N;etag=...`` or
  ``size=N;mtime=...``) and :func:`modified_at` (the input's listing, the lease's age on
  stores without conditional writes), from one list of the keys each fsspec backend names
  them by (:data:`VERSION_KEYS`, :data:`MTIME_KEYS`);
- **a file the job must never open**: :func:`refuse_special`, the one rule for a named
  pipe, a device or a socket (a read of one may never return);
- **refusal or passing fault**: :func:`raise_refusal`, what a failed storage call in a check
  before work becomes (a transient fault is raised as it is: a rerun may succeed; anything
  else is a refusal naming the file, exit 2).

Nothing here imports :mod:`pipeline.config` (the config's own checks may use it).
"""

from __future__ import annotations

import datetime as _dt
import os
import posixpath
import stat
from typing import Any, NoReturn, TypeVar

import fsspec

#: fsspec protocols of object stores (no folders; an atomic copy, no rename)
OBJECT_STORES = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss")
#: the keys of an fsspec ``info()`` record that name a file's content version (S3's ETag,
#: GCS's md5Hash / crc32c), in the order they are preferred
VERSION_KEYS = ("ETag", "etag", "md5Hash", "crc32c")
#: the keys of an fsspec ``info()`` record that hold its modification time (local
#: ``mtime``, S3 ``LastModified``, GCS ``updated``, Azure ``last_modified``, memory ``created``)
MTIME_KEYS = ("mtime", "LastModified", "last_modified", "updated", "created")

E = TypeVar("E", bound=Exception)


# ---------------------------------------------------------------------- where a file is
def protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    return fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether ``fs`` is local disk."""
    protos = protocols(fs)
    return "file" in protos or "local" in protos


def is_object_store(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether ``fs`` is an object store (S3, GCS, Azure)."""
    return any(p in OBJECT_STORES for p in protocols(fs))


def unstrip(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """A URL that reopens ``path`` anywhere: plain path for local files, else ``proto://path``."""
    return path if is_local(fs) else fs.unstrip_protocol(path)


def resolved_location(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """``path`` normalised on local disk: a local file's real path (symlinks, ``..``, ``//``,
    ``./`` resolved, relative paths made absolute); a glob keeps its pattern, only the folder
    before its first wildcard is resolved.  Elsewhere (object stores: S3, GCS, ...) a key is
    a string, not a path: ``a//b``, ``a/./b`` and ``a/x/../b`` are other objects than
    ``a/b``, so the key is kept as written (trailing ``/`` of a folder aside)."""
    if not is_local(fs):
        return path.rstrip("/") or path
    if any(c in path for c in "*?["):
        cut = min(path.index(c) for c in "*?[" if c in path)
        head, sep, tail = path[:cut].rpartition("/")
        if not sep:
            return path
        return resolved_location(fs, head or "/").rstrip("/") + "/" + tail + path[cut:]
    return os.path.realpath(path)


def same_location(fs_a: fsspec.AbstractFileSystem, a: str, fs_b: fsspec.AbstractFileSystem, b: str) -> bool:
    """Whether ``a`` on ``fs_a`` and ``b`` on ``fs_b`` are one folder by identity, whatever
    their spelling: on local disk their real paths (symlinks, ``.``, ``..``, ``//``
    resolved), or ``os.path.samefile`` when both exist (a bind mount, a hard-linked
    folder); elsewhere the same protocol, endpoint and bucket + key with ``.``, ``..``, ``//``
    and a trailing ``/`` normalised (an over-cautious answer where a store keeps ``a/./b``
    apart from ``a/b``: this decides what must not be deleted or read as another output)."""
    if is_local(fs_a) != is_local(fs_b):
        return False
    if is_local(fs_a):
        ra, rb = os.path.realpath(a), os.path.realpath(b)
        if ra == rb:
            return True
        try:
            return os.path.samefile(ra, rb)
        except OSError:
            return False
    if set(protocols(fs_a)) != set(protocols(fs_b)):
        return False
    from pipeline.retry import endpoint_of

    if endpoint_of(fs_a) != endpoint_of(fs_b):
        return False
    norm = lambda p: posixpath.normpath("/" + p.split("://", 1)[-1]).strip("/")  # noqa: E731
    return norm(a) == norm(b)


def under(path: str, folder: str) -> bool:
    """Whether ``path`` is ``folder`` or lies below it (string prefix by whole names)."""
    folder = folder.rstrip("/")
    return path == folder or path.startswith(folder + "/")


def prune_empty(folder: str) -> None:
    """Remove ``folder`` and its subfolders that are empty (local disk), deepest first."""
    if not os.path.isdir(folder) or os.path.islink(folder):
        return
    for dirpath, _, _ in sorted(os.walk(folder), key=lambda w: -len(w[0])):
        try:
            os.rmdir(dirpath)
        except OSError:  # not empty: a file that is not ours stays, and so does its folder
            pass


# ---------------------------------------------------------------------- which version
def file_version(info: dict[str, Any]) -> str:
    """What identifies this version of a file, from an fsspec ``info()`` record:
    ``size=N;etag=...`` where the store names the content (:data:`VERSION_KEYS`), else
    ``size=N;mtime=...`` (:data:`MTIME_KEYS`), else ``size=N``.  A file replaced by one of
    the same size with its mtime restored keeps its version on local disk (the JSONL
    reader's first-line check covers that case: :mod:`pipeline.input.rows`)."""
    size = info.get("size")
    for key in VERSION_KEYS:
        if info.get(key):
            return f"size={size};etag={str(info[key]).strip(chr(34))}"
    for key in MTIME_KEYS:
        if info.get(key) is not None:
            return f"size={size};mtime={info[key]}"
    return f"size={size}"


def modified_at(info: dict[str, Any]) -> float | None:
    """The modification time of an fsspec ``info()`` record as a POSIX timestamp (seconds),
    from the first of :data:`MTIME_KEYS` that parses (:func:`timestamp`); None when it has none."""
    for key in MTIME_KEYS:
        t = timestamp(info.get(key))
        if t is not None:
            return t
    return None


def timestamp(value: Any) -> float | None:
    """``value`` as a POSIX timestamp (seconds): a number, a ``datetime`` or an ISO 8601
    string (``Z`` for UTC accepted; the lease's ``heartbeat_at``); None for anything else."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, _dt.datetime):
        return value.timestamp()
    if isinstance(value, str):
        try:
            return _dt.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return None
    return None


# ---------------------------------------------------------------------- files never opened
_SPECIAL = {stat.S_IFIFO: "a named pipe (FIFO)", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
            stat.S_IFSOCK: "a socket"}


def special_kind(mode: int, folder_ok: bool = False) -> str | None:
    """What a file of ``mode`` (an ``st_mode``) is when the job must not read it: ``"a named
    pipe (FIFO)"``, ``"a character device"``, ``"a block device"``, ``"a socket"``, ``"a
    folder"`` (unless ``folder_ok``); None for a regular file (and a folder when ``folder_ok``).
    Use it on ``os.fstat`` of a descriptor opened with ``O_NONBLOCK`` where the job opens the
    file itself right after (nothing can be swapped in between), as the lease does."""
    if stat.S_ISREG(mode) or (folder_ok and stat.S_ISDIR(mode)):
        return None
    return "a folder" if stat.S_ISDIR(mode) else _SPECIAL.get(stat.S_IFMT(mode), "not a regular file")


def refuse_special(path: str, what: str, error: type[E], hint: str, folder_ok: bool = False) -> None:
    """Refuse a local ``path`` that exists but is not a regular file (nor, with
    ``folder_ok``, a folder): a read of a named pipe, a device (``/dev/zero``) or a socket may
    never return, so the job never opens one.

    The rule, the same for the input's files, the output's own files and the model folders:
    the mode of what a read would open, **links followed** (``os.stat``): a link to a FIFO
    blocks like the FIFO, and a link to a regular file is read like it (where links
    themselves are refused, as in the output folder, that check comes first).  A missing
    path, or a dangling link, is left to the caller's own checks.

    Args:
        path: a local path.
        what: how the message names it, e.g. ``"input shard '/in/p.jsonl'"``.
        error: the exception class raised (a :class:`~pipeline.config.JobRefused`).
        hint: what the user can do, ending the message.
        folder_ok: a folder is allowed (a model folder's subfolders).

    Raises:
        ``error``: "<what> is a named pipe (FIFO), not a regular file: a read of it may
            never return, so the job does not open it; <hint>".
    """
    try:
        mode = os.stat(path).st_mode
    except OSError:  # missing, or not reachable: left to the caller's own checks
        return
    kind = special_kind(mode, folder_ok)
    if kind is not None:
        raise error(f"{what} is {kind}, not a regular file: a read of it may never return, so the job does not "
                    f"open it; {hint}")


# ---------------------------------------------------------------------- refusal or passing fault
def raise_refusal(e: BaseException, error: type[E], what: str, hint: str = "") -> NoReturn:
    """Raise what a check before work raises for ``e``, the failure of a storage call
    (call it in the ``except`` block: ``except StorageError as e: raise_refusal(e,
    InputError, f"cannot list input {uri!r}")``):

    - ``e`` itself, as it is, when a later attempt may cure it (a
      :class:`pipeline.retry.StorageError` whose retries ran out on transient errors, or any
      error :func:`pipeline.retry.is_transient` calls transient): the input or output may be
      fine, so this is not a refusal (exit 1, "rerun");
    - ``e`` itself when it is an ``error`` already, or the ``error`` raised inside the
      retried call that ``e`` wraps (its own message, which names the file);
    - else a new ``error`` (a refusal, exit 2): ``"<what>: <Type>: <message>"`` of the
      underlying exception (for a StorageError, the one it was raised from; its message's
      first line), or with a ``hint``, ``"<what> (<Type>: <message>); <hint>"``.
    """
    from pipeline.retry import StorageError, is_transient

    cause = e.__cause__ if isinstance(e, StorageError) else None
    if isinstance(e, error):
        raise e
    if isinstance(cause, error):
        raise cause from None
    if e.transient if isinstance(e, StorageError) else is_transient(e):
        raise e
    inner = cause if cause is not None else e
    text = (str(inner).strip().splitlines() or [""])[0]
    detail = text if isinstance(inner, StorageError) else f"{type(inner).__name__}: {text}"
    raise error(f"{what} ({detail}); {hint}" if hint else f"{what}: {detail}") from None


def parquet_file(f):
    """A Parquet file (input or committed output) opened with its page checksums verified
    (``page_checksum_verification``): a page whose CRC-32 does not match, when the writer
    stored one (``write_page_checksum``), fails to read like a page that does not decode."""
    import pyarrow.parquet as pq

    return pq.ParquetFile(f, page_checksum_verification=True)
