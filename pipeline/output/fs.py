"""Filesystem helpers shared by the input and the output side (one owner for each).

fsspec hides most differences between local disk and object stores; these are the few
the job needs to know: how to name a path as a URL that reopens it anywhere
(:func:`unstrip`), whether a filesystem is local disk or an object store, how one file's
several spellings resolve to one location (:func:`resolved_location`), and how to remove
the empty folders a local run leaves (:func:`prune_empty`).
"""

from __future__ import annotations

import os

import fsspec

#: fsspec protocols of object stores (no folders; an atomic copy, no rename)
OBJECT_STORES = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss")


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


def prune_empty(folder: str) -> None:
    """Remove ``folder`` and its subfolders that are empty (local disk), deepest first."""
    if not os.path.isdir(folder) or os.path.islink(folder):
        return
    for dirpath, _, _ in sorted(os.walk(folder), key=lambda w: -len(w[0])):
        try:
            os.rmdir(dirpath)
        except OSError:  # not empty: a file that is not ours stays, and so does its folder
            pass
