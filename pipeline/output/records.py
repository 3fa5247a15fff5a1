"""The commit protocol's records, typed: one frozen dataclass per record, each its own
encoding (``to_json``) and decoding (``from_json``, which validates).

- :class:`EpochRecord`, :class:`UnitRecord`, :class:`FinalRecord`: the three kinds of record
  of the commit log (``_manifest/log/NNNNNNNNNN.json``, :mod:`pipeline.output.commit_log`);
  :func:`decode_log_record` reads any of them.  A :class:`UnitRecord` is also a unit's
  *manifest entry*: the per-unit entries of earlier versions (``_manifest/part-*.json``)
  decode to one too (``earlier=True``).
- :class:`FileCheck`: one data file's SHA-256, size and rows (a unit record's ``checksums``).
- :class:`Intent`: a publish intent of an earlier version (``_manifest/pending/``), read only.
- :class:`Fragment`: the write stage's record of one staged fragment (:data:`FRAGMENT_SCHEMA`,
  a row of the table :mod:`pipeline.output.sink` returns to the driver).

The bytes on disk are today's: ``to_json`` gives the keys in the order the writer always
wrote them, every key present (``null`` where unset), and :meth:`LogRecord.encode` is
``json.dumps(to_json(), default=str)``; a record read back re-encodes to the same bytes.
Keys a record does not know are ignored on reading.  A record that is not the job's raises
:class:`RecordError`, which names the field (``field``) and says what is wrong (``problem``,
a phrase such as ``names the run 'x y'``); :mod:`pipeline.output.manifest` puts it in the
message that names the file.  No other module reads a record by string key.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

import pyarrow as pa

from pipeline.layout import RUN_ID, data_file_names
from pipeline.units import parse_part

#: the kinds of record of the commit log, in the order a run writes them
KINDS = ("epoch", "unit", "final")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_BAD_CHECKSUMS = "holds checksums that are not one SHA-256, size and row count per data file it names"


class RecordError(ValueError):
    """A record that is not one this job writes.

    Attributes:
        field: the key at fault (None: the record as a whole, e.g. not a JSON object).
        problem: what is wrong, a phrase that follows the record's name (``names the run 'x'``).
        part: the part a unit record names, once checked (None: not yet, or not a unit record).
    """

    def __init__(self, field: str | None, problem: str, part: str | None = None):
        super().__init__(problem)
        self.field, self.problem, self.part = field, problem, part


# ----------------------------------------------------------------------------- validation
def _object(obj: Any) -> Mapping[str, Any]:
    if not isinstance(obj, dict):
        raise RecordError(None, f"holds a {type(obj).__name__}, not a record")
    return obj


def _count(obj: Mapping[str, Any], key: str, nullable: bool = True) -> int | None:
    """An integer >= 0 (not a bool) at ``key``; None when absent or null and ``nullable``."""
    v = obj.get(key)
    if v is None and nullable:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise RecordError(key, f"has {key} {v!r}, not a whole number >= 0")
    return v


def _text(obj: Mapping[str, Any], key: str) -> str | None:
    v = obj.get(key)
    if v is not None and not isinstance(v, str):
        raise RecordError(key, f"has {key} {v!r}, not a string")
    return v


def _mapping(obj: Mapping[str, Any], key: str) -> dict[str, Any] | None:
    v = obj.get(key)
    if v is not None and not isinstance(v, dict):
        raise RecordError(key, f"has {key} {_short(v)}, not an object")
    return v


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 120 else r[:117] + "..."


# ----------------------------------------------------------------------------- checksums
@dataclass(frozen=True)
class FileCheck:
    """What the write stage measured on the bytes of one data file it wrote.

    Attributes:
        sha256: the SHA-256 of the file's bytes (64 lower-case hex digits).
        size: its size in bytes.
        rows: its rows.
    """

    sha256: str
    size: int
    rows: int

    def to_json(self) -> dict[str, Any]:
        return {"sha256": self.sha256, "size": self.size, "rows": self.rows}

    @classmethod
    def from_json(cls, obj: Any) -> "FileCheck":
        """Raises: RecordError (``field`` ``checksums``) unless a SHA-256 and two counts."""
        if (not isinstance(obj, dict) or not isinstance(obj.get("sha256"), str) or not _SHA256.fullmatch(obj["sha256"])
                or any(not isinstance(obj.get(k), int) or isinstance(obj.get(k), bool) or obj[k] < 0
                       for k in ("size", "rows"))):
            raise RecordError("checksums", _BAD_CHECKSUMS)
        return cls(obj["sha256"], obj["size"], obj["rows"])


# ----------------------------------------------------------------------------- the commit log
@dataclass(frozen=True)
class LogRecord:
    """What every record of the commit log carries: its number and its run (both set by
    :meth:`pipeline.output.commit_log.CommitLog.append`; None before)."""

    kind: ClassVar[str] = ""
    seq: int | None = None
    run_id: str | None = None

    def _fields(self) -> dict[str, Any]:  # the kind's own fields, in the order written
        raise NotImplementedError

    def to_json(self) -> dict[str, Any]:
        """The record as written: ``kind``, the kind's fields, ``seq``, ``run_id``."""
        return {"kind": self.kind, **self._fields(), "seq": self.seq, "run_id": self.run_id}

    def encode(self) -> bytes:
        """The record's bytes in the commit log."""
        return json.dumps(self.to_json(), default=str).encode()

    def numbered(self, seq: int, run_id: str | None) -> "LogRecord":
        """This record as record ``seq`` of run ``run_id``."""
        return dataclasses.replace(self, seq=seq, run_id=run_id)


@dataclass(frozen=True)
class EpochRecord(LogRecord):
    """A run begins writing the output (it holds the lease): from here on only it may commit.

    Attributes:
        overwrite: the run starts the output afresh (what came before no longer counts).
        config_fingerprint: the run's config fingerprint (None: not given).
        owner: ``user@host`` of the run; pid: its process id; at: when (ISO 8601, UTC).
    """

    kind: ClassVar[str] = "epoch"
    overwrite: bool = False
    config_fingerprint: str | None = None
    owner: str | None = None
    pid: int | None = None
    at: str | None = None

    def _fields(self) -> dict[str, Any]:
        return {"overwrite": self.overwrite, "config_fingerprint": self.config_fingerprint, "owner": self.owner,
                "pid": self.pid, "at": self.at}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> "EpochRecord":
        v = obj.get("overwrite", False)
        if not isinstance(v, bool):
            raise RecordError("overwrite", f"has overwrite {v!r}, not true or false")
        return cls(seq=obj.get("seq"), run_id=obj.get("run_id"), overwrite=v,
                   config_fingerprint=_text(obj, "config_fingerprint"), owner=_text(obj, "owner"),
                   pid=_count(obj, "pid"), at=_text(obj, "at"))


@dataclass(frozen=True)
class UnitRecord(LogRecord):
    """A unit's commit, and its manifest entry.

    Attributes:
        part: the unit's part name (``part-00003-u00002.parquet``; ``part-00003.parquet``: a
            whole shard, in the layout before units).
        files: its data files, in row order (tagged with ``run_id``; untagged: earlier versions).
        source_file: the input file's URL; fingerprint: its size + mtime or ETag.
        shard, split: the unit's shard and split index; start_row: its first row in the file;
        rows: its rows; split_rows: ``input.split_rows`` of the run.
        config_fingerprint, config_identity: the run's config (:mod:`pipeline.fingerprint`).
        errors: its error rows; committed_at: when (ISO 8601, UTC).
        totals: the unit's :meth:`pipeline.summary.RunTotals.state`.
        checksums: data file -> its :class:`FileCheck` (None: a version before checksums).
    """

    kind: ClassVar[str] = "unit"
    part: str = ""
    files: tuple[str, ...] = ()
    source_file: str | None = None
    fingerprint: str | None = None
    shard: int | None = None
    split: int | None = None
    start_row: int | None = None
    rows: int | None = None
    split_rows: int | None = None
    config_fingerprint: str | None = None
    config_identity: dict[str, Any] | None = None
    errors: int | None = None
    committed_at: str | None = None
    totals: dict[str, Any] | None = None
    checksums: Mapping[str, FileCheck] | None = None

    def _fields(self) -> dict[str, Any]:
        return {"part": self.part, "files": list(self.files), "source_file": self.source_file,
                "fingerprint": self.fingerprint, "shard": self.shard, "split": self.split, "start_row": self.start_row,
                "rows": self.rows, "split_rows": self.split_rows, "config_fingerprint": self.config_fingerprint,
                "config_identity": self.config_identity, "errors": self.errors, "committed_at": self.committed_at,
                "totals": self.totals,
                "checksums": None if self.checksums is None else {n: c.to_json() for n, c in self.checksums.items()}}

    def check_of(self, name: str) -> FileCheck | None:
        """The checksum of the data file ``name`` (None: the record carries none)."""
        return (self.checksums or {}).get(name)

    @classmethod
    def from_json(cls, obj: Any, *, earlier: str | None = None) -> "UnitRecord":
        """A ``unit`` record of the commit log (its kind, number and run checked by
        :func:`decode_log_record`) or, with ``earlier`` (the part its file name gives), the
        per-unit entry of an earlier version: its files untagged, ``[part]`` when absent.

        Raises:
            RecordError: naming the field: a part that is not a part name (``earlier``: not
                that one), files that are not exactly the part's data files in this job's
                naming, checksums that are not one per file, a field of another type.
        """
        obj = _object(obj)
        part = obj.get("part")
        if (part != earlier) if earlier is not None else (not isinstance(part, str) or parse_part(part) is None):
            raise RecordError("part", f"names the part {part!r}")
        run_id = obj.get("run_id")
        files = obj.get("files", [part] if earlier is not None else None)
        if (not isinstance(files, list) or not files
                or files != data_file_names(part, len(files), None if earlier is not None else run_id)):
            raise RecordError("files", f"names the files {_short(files)}", part)
        checksums = obj.get("checksums")
        if checksums is not None:
            if not isinstance(checksums, dict) or set(checksums) != set(files):
                raise RecordError("checksums", _BAD_CHECKSUMS, part)
            try:
                checksums = {n: FileCheck.from_json(c) for n, c in checksums.items()}
            except RecordError as e:
                raise RecordError(e.field, e.problem, part) from None
        if run_id is not None and not isinstance(run_id, str):
            raise RecordError("run_id", f"names the run {run_id!r}")
        return cls(seq=obj.get("seq") if earlier is None else None, run_id=run_id, part=part, files=tuple(files),
                   source_file=_text(obj, "source_file"), fingerprint=_text(obj, "fingerprint"),
                   shard=_count(obj, "shard"), split=_count(obj, "split"), start_row=_count(obj, "start_row"),
                   rows=_count(obj, "rows"), split_rows=_count(obj, "split_rows"),
                   config_fingerprint=_text(obj, "config_fingerprint"),
                   config_identity=_mapping(obj, "config_identity"), errors=_count(obj, "errors"),
                   committed_at=_text(obj, "committed_at"), totals=_mapping(obj, "totals"), checksums=checksums)


@dataclass(frozen=True)
class FinalRecord(LogRecord):
    """The run's end: every unit committed under one config fingerprint.

    Attributes:
        config_fingerprint: the run's; units: the units committed; rows: their rows; at: when.
    """

    kind: ClassVar[str] = "final"
    config_fingerprint: str | None = None
    units: int | None = None
    rows: int | None = None
    at: str | None = None

    def _fields(self) -> dict[str, Any]:
        return {"config_fingerprint": self.config_fingerprint, "units": self.units, "rows": self.rows, "at": self.at}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> "FinalRecord":
        return cls(seq=obj.get("seq"), run_id=obj.get("run_id"), config_fingerprint=_text(obj, "config_fingerprint"),
                   units=_count(obj, "units"), rows=_count(obj, "rows"), at=_text(obj, "at"))


_BY_KIND: dict[str, type] = {"epoch": EpochRecord, "unit": UnitRecord, "final": FinalRecord}


def decode_log_record(seq: int, obj: Any) -> EpochRecord | UnitRecord | FinalRecord:
    """Record ``seq`` of the commit log from its parsed JSON: its kind, its number, its run
    id, then the kind's own fields (:meth:`UnitRecord.from_json` checks a unit's part, files
    and checksums).

    Raises:
        RecordError: naming the field at fault.
    """
    obj = _object(obj)
    if obj.get("kind") not in KINDS:
        raise RecordError("kind", f"is of kind {obj.get('kind')!r}, not one of {', '.join(KINDS)}")
    if obj.get("seq") != seq:
        raise RecordError("seq", f"says it is record {obj.get('seq')!r}")
    if not isinstance(obj.get("run_id"), str) or not RUN_ID.fullmatch(obj["run_id"]):
        raise RecordError("run_id", f"names the run {obj.get('run_id')!r}")
    return _BY_KIND[obj["kind"]].from_json(obj)


# ----------------------------------------------------------------------------- earlier versions
@dataclass(frozen=True)
class Intent:
    """A publish intent of an earlier version (``_manifest/pending/``): the files a run was
    about to publish for ``part``.  Read, never written; its files are orphans unless committed.

    Attributes:
        path: where it lies (the intent file); part, files, run_id: as written.
    """

    path: str
    part: str
    files: tuple[str, ...]
    run_id: str | None = None

    @classmethod
    def from_json(cls, obj: Any, *, path: str, part: str) -> "Intent":
        """Raises: RecordError, as :meth:`UnitRecord.from_json` with ``earlier=part``."""
        entry = UnitRecord.from_json(obj, earlier=part)
        return cls(path, entry.part, entry.files, entry.run_id)


# ----------------------------------------------------------------------------- the write stage
#: the write stage's records (:class:`Fragment`), one row per staged fragment
FRAGMENT_SCHEMA = pa.schema([
    ("part", pa.string()), ("path", pa.string()), ("first_row", pa.int64()), ("last_row", pa.int64()),
    ("rows", pa.int64()), ("errors", pa.int64()), ("totals", pa.string()), ("pid", pa.int64()),
    ("host", pa.string()), ("consecutive", pa.bool_()), ("sha256", pa.string()), ("size", pa.int64()),
])


@dataclass(frozen=True)
class Fragment:
    """One staged fragment of a unit, as the write stage returns it to the driver.

    Attributes:
        part: its unit's part name; path: the staged file (a path on the output's filesystem).
        first_row, last_row: its first and last ``source_row``; rows: its rows; errors: its error rows.
        totals: its :meth:`pipeline.summary.RunTotals.state`, as JSON text.
        pid, host: the process that wrote it.
        consecutive: its rows are consecutive, each once, no gap.
        sha256, size: of the bytes written.
    """

    part: str
    path: str
    first_row: int
    last_row: int
    rows: int
    errors: int
    totals: str
    pid: int
    host: str
    consecutive: bool
    sha256: str
    size: int

    def to_json(self) -> dict[str, Any]:
        """A row of :data:`FRAGMENT_SCHEMA`."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, row: Mapping[str, Any]) -> "Fragment":
        """From a row of :data:`FRAGMENT_SCHEMA` (a table the write stage returned).

        Raises:
            RecordError: a field of :data:`FRAGMENT_SCHEMA` is missing.
        """
        missing = [f for f in FRAGMENT_SCHEMA.names if f not in row]
        if missing:
            raise RecordError(missing[0], f"lacks {missing[0]}")
        return cls(**{f: row[f] for f in FRAGMENT_SCHEMA.names})

    @property
    def check(self) -> FileCheck:
        """Its :class:`FileCheck` (what its unit's record carries)."""
        return FileCheck(self.sha256, self.size, self.rows)


def fragments_of(table: pa.Table) -> list[Fragment]:
    """The records of a table of :data:`FRAGMENT_SCHEMA`."""
    return [Fragment.from_json(r) for r in table.to_pylist()]


def fragment_table(fragments: list[Fragment]) -> pa.Table:
    """A table of :data:`FRAGMENT_SCHEMA` holding ``fragments``."""
    return pa.Table.from_pylist([f.to_json() for f in fragments], schema=FRAGMENT_SCHEMA)


__all__ = ["KINDS", "RecordError", "FileCheck", "LogRecord", "EpochRecord", "UnitRecord", "FinalRecord",
           "decode_log_record", "Intent", "FRAGMENT_SCHEMA", "Fragment", "fragments_of", "fragment_table"]
