"""An output's manifest as read back and checked: the commit log, and the records of earlier versions.

:func:`read_manifest` reads the commit log (:mod:`pipeline.output.commit_log`) and, for
outputs of earlier versions, the per-unit manifest entries (``_manifest/part-*.json``) and
publish intents (``_manifest/pending/``), and returns a :class:`Manifest`: the committed
units, the runs that wrote the output, whether it is complete.

Names read back from ``_manifest/`` are never trusted: before any is used (to delete a
dead run's files, to clear the output on ``overwrite``, to resume), every committed unit and
publish intent must name its own part (``part-NNNNN-uNNNNN.parquet`` for the record of that
unit; ``part-NNNNN.parquet`` for a whole-shard part of the layout before units) and exactly
that part's data files in this job's naming (:func:`~pipeline.layout.data_file_names`:
tagged with the run that wrote them, or the untagged names of earlier versions; plain names
directly in the folder, no separator, no ``..``, not absolute); anything else is refused
(:class:`ManifestDamaged`, naming the record), and nothing is deleted.
"""

from __future__ import annotations

import json
import posixpath
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from pipeline.output.commit_log import CommitLog, LogState, replay
from pipeline.output.records import Intent, RecordError, UnitRecord, decode_log_record
from pipeline.units import parse_part, part_name
from pipeline.layout import ENTRY_FILE, INTENT_FILE, MANIFEST, PENDING


class ManifestDamaged(ValueError):
    """A record under ``_manifest/`` is not this job's (the message names it and says what to do)."""


@dataclass
class Manifest:
    """An output's manifest, checked.

    Attributes:
        entries: part name -> manifest entry (:class:`~pipeline.output.records.UnitRecord`) of
            every committed unit (the commit log's, and the per-unit entries of earlier versions).
        log: the commit log's state (:class:`~pipeline.output.commit_log.LogState`).
        legacy: paths of the per-unit entries of earlier versions.
        intents: path -> publish intent of earlier versions (:class:`~pipeline.output.records.Intent`).
        leftovers: paths of records of earlier versions found empty or cut short (never
            finished: they name nothing).
    """

    entries: dict[str, UnitRecord] = field(default_factory=dict)
    log: LogState = field(default_factory=LogState)
    legacy: list[str] = field(default_factory=list)
    intents: dict[str, Intent] = field(default_factory=dict)
    leftovers: list[str] = field(default_factory=list)

    def named_files(self) -> set[str]:
        """The data files the committed units and the publish intents name."""
        return {n for e in list(self.entries.values()) + list(self.intents.values()) for n in e.files}

    def committed_files(self) -> set[str]:
        """The data files the committed units name."""
        return {n for e in self.entries.values() for n in e.files}

    @property
    def runs(self) -> list[str]:
        """The runs of the commit log (their data files are this job's, committed or orphans)."""
        return self.log.runs


def read_manifest(fs, root: str, io: Callable, url: str, log: CommitLog) -> Manifest:
    """Read and check an output's manifest (see the module docstring).

    Raises:
        ManifestDamaged: a record is not this job's, naming it.
        StorageError: the storage kept failing.
    """
    root = root.rstrip("/") or "/"
    m = Manifest()
    records = []
    listed = log.list()
    got = log.read([p for _, p in listed])
    for seq, path in listed:
        rel = path[len(root) + 1:]
        obj = _json(got[path], rel, url)
        try:
            records.append((seq, decode_log_record(seq, obj)))
        except RecordError as e:
            if e.field not in ("files", "checksums"):
                raise ManifestDamaged(_not_ours(url, rel, e.problem)) from None
            raise _not_its_names(url, rel, parse_part(e.part), e.problem, tagged=True) from None
    m.log = replay(records)
    log.seen(m.log.last_seq)
    for path, rel, unit, obj in _read_files(fs, root, io, url, posixpath.join(MANIFEST, "part-*.json"),
                                            ENTRY_FILE, m.leftovers):
        entry = check_entry(url, rel, unit, obj)
        part = entry.part
        m.legacy.append(path)
        if m.log.overwrite_seq is not None:
            continue  # an overwrite started the output afresh after it (and died before removing it)
        if part in m.log.entries:
            raise ManifestDamaged(f"output {url!r}: {part} is committed both by {rel} (an earlier version's entry) "
                                  "and by the commit log; set output.overwrite: true (--overwrite)")
        m.entries[part] = entry
    m.entries.update(m.log.entries)
    for path, rel, unit, obj in _read_files(fs, root, io, url, posixpath.join(MANIFEST, PENDING, "part-*.json"),
                                            INTENT_FILE, m.leftovers):
        m.intents[path] = check_entry(url, rel, unit, obj, intent_at=path)
    return m


def check_entry(url: str, rel: str, unit: tuple[int, int | None], obj: Any,
                intent_at: str | None = None) -> UnitRecord | Intent:
    """The per-unit entry of an earlier version (or, with ``intent_at``, its publish intent
    lying there) decoded from ``obj``, read from the manifest record ``rel`` of the part
    ``unit`` = ``(shard, split)``, if it names its own part and exactly that part's data files
    in the untagged naming of earlier versions.

    Raises:
        ManifestDamaged: naming ``rel`` (a name from ``_manifest/`` is never used before this check).
    """
    expect = part_name(*unit)
    try:
        if intent_at is not None:
            return Intent.from_json(obj, path=intent_at, part=expect)
        return UnitRecord.from_json(obj, earlier=expect)
    except RecordError as e:
        if e.field in (None, "part", "files", "checksums"):
            raise _not_its_names(url, rel, unit, e.problem, tagged=False) from None
        raise ManifestDamaged(_not_ours(url, rel, e.problem)) from None


def _not_its_names(url: str, rel: str, unit: tuple[int, int | None], problem: str, tagged: bool) -> ManifestDamaged:
    """The refusal of a record ``rel`` of the part ``unit`` that does not name its own part
    and that part's data files in this job's naming (``tagged`` with a run id: the commit log's)."""
    expect = part_name(*unit)
    stem = expect[: -len(".parquet")]
    who = f"shard {unit[0]}" if unit[1] is None else f"unit {unit[1]} of shard {unit[0]}"
    names = f"{stem}.<run>.parquet or {stem}.<run>.NNNNN.parquet" if tagged else f"{expect}, or {stem}-NNNNN.parquet"
    return ManifestDamaged(
        f"output {url!r}: {rel} {problem}, which are not the names this job gives {who} ({names}, directly in "
        f"the output folder); the job deletes only files it wrote, so it does nothing: remove {rel} (this job did "
        "not write it), or choose another output.uri")


def _not_ours(url: str, rel: str, problem: str) -> str:
    return (f"output {url!r}: {rel} {problem}: not a record of this job's commit log; the job deletes only files it "
            f"wrote, so it does nothing: remove {rel} (this job did not write it), or choose another output.uri")


def _json(raw: bytes, rel: str, url: str) -> Any:
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestDamaged(f"output {url!r}: {rel} is not a manifest record of this job ({e}); the job never "
                              "deletes files it did not write: remove it, or choose another output.uri") from None


def _read_files(fs, root: str, io: Callable, url: str, pattern: str, name: re.Pattern,
                leftovers: list[str]) -> list[tuple[str, str, tuple, Any]]:
    """``(path, relative path, (shard, split or None), parsed JSON)`` of the records of earlier
    versions matching the glob ``pattern`` whose name is ``name`` (others there are foreign:
    never read); those found empty or cut short go to ``leftovers``."""
    prefix = root + "/"

    def load() -> list[tuple[str, str, tuple, Any]]:
        try:
            paths = sorted(fs.glob(posixpath.join(root, pattern)))
        except FileNotFoundError:
            return []
        out = []
        for p in paths:
            m = name.fullmatch(posixpath.basename(p))
            if not m:
                continue
            rel = p[len(prefix):] if p.startswith(prefix) else p
            with fs.open(p, "rb") as f:
                raw = f.read()
            unit = (int(m.group(1)), None if m.group(2) is None else int(m.group(2)))
            if partial_record(raw, unit):
                if p not in leftovers:
                    leftovers.append(p)
                continue
            out.append((p, rel, unit, _json(raw, rel, url)))
        return out

    return io(load, f"read {posixpath.dirname(pattern)} of {url}")


def partial_record(raw: bytes, unit: tuple[int, int | None]) -> bool:
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


__all__ = ["Manifest", "ManifestDamaged", "read_manifest", "check_entry", "partial_record"]
