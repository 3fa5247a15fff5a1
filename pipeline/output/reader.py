"""One reader of committed output: what a job output holds, as its commit log commits it.

Every tool that reads a job's output reads it here (:class:`CommittedOutput`):
``jobs/report.py`` (:mod:`pipeline.report`), ``jobs/train_drafter.py --from``,
``scripts/near_ties.py``, and a nightly run reading the night before
(:func:`previous_partition`).  The rules, one for all of them:

- **Only committed files are read**: the data files the committed units name (the ``unit``
  records of the commit log that count, :func:`~pipeline.output.commit_log.replay`, and the
  per-unit entries of earlier versions: read and checked by
  :meth:`~pipeline.output.location.OutputLocation.manifest`), in part order.  A data file no
  committed unit names (an *orphan*: a killed run's part published before its record, one
  of a run that lost its lease, or one of a run in progress) is counted and named
  (:attr:`CommittedOutput.uncommitted`), never read; staging and markers never are.
- **Unfinished is said**: :attr:`CommittedOutput.finished` is whether the output is
  complete (:meth:`~pipeline.output.location.OutputLocation.complete`, as
  :func:`pipeline.output.is_complete` says: ``_SUCCESS`` naming the run whose ``final``
  record ends the commit log; a ``_SUCCESS`` alone does not count).  An unfinished
  output is still read (its committed units are whole), and :meth:`CommittedOutput.describe`
  says so.
- **One config**: an output whose committed units carry different config fingerprints is
  refused by name (:class:`OutputReadError`), unless the caller asks for it (``mixed_ok``).
  This version's writer never leaves one (the commit log's fencing keeps a run that lost
  its lease from committing, issue 50's paused-run case, and a resume under another config
  is refused: :func:`~pipeline.output.resume.plan_resume`); an earlier version's output (its
  per-unit entries) may be mixed, and so may records edited by hand.
- **Every byte checked**: each committed data file is read whole and checked against its
  unit's record (``checksums``: the SHA-256, size and rows the write stage measured on the
  bytes it wrote, :func:`pipeline.output.sink.parquet_bytes`) before any of its rows is
  yielded; a file that is missing, of another size or hash, or that does not decode as
  Parquet raises :class:`DamagedFile`, naming it and its unit, or (``on_damaged``: the
  nightly reuse) is passed to the caller, which leaves its rows out.  A file of an output
  written before checksums existed is read *unverified* (it must still decode; counted in
  :attr:`CommittedOutput.unverified`).
- **Bounded memory**: :meth:`CommittedOutput.batches` streams record batches file by file
  (each file at most ``output.max_rows_per_file`` rows); :meth:`~CommittedOutput.table`
  gathers them for small outputs.  Each row can carry its provenance: its unit's part name
  (:data:`~pipeline.units.UNIT_COLUMN`) and the run that committed it (:data:`RUN_COLUMN`).

A folder that holds ``date=`` partitions and no manifest of its own is read through its
one partition; with several it is refused, naming them (pass one, or let
:func:`previous_partition` choose).  The reader writes nothing: a run's leftovers are the
next run's to clear.
"""

from __future__ import annotations

import datetime as _dt
import posixpath
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import pyarrow as pa

from pipeline.config import JobRefused, OutputConfig
from pipeline.units import UNIT_COLUMN
from pipeline.layout import DATA_FILE, MANIFEST, SUCCESS, SUMMARY, entry_name, log_record
from pipeline.output.location import OutputLocation
from pipeline.output.records import UnitRecord
from pipeline.retry import StorageError
from pipeline.storage import raise_refusal

#: the provenance column naming the run that committed each row's unit (its ``run_id``)
RUN_COLUMN = "_run_id"
_DAY = re.compile(r"date=(\d{4}-\d{2}-\d{2})")


class OutputReadError(JobRefused):
    """A job output cannot be read as committed output: it does not exist, holds no
    committed unit, mixes configs, is a folder of several ``date=`` partitions, or a
    committed file is missing or damaged (exit 2 in a command line)."""


class DamagedFile(OutputReadError):
    """A committed data file that fails its check: missing, unreadable, of another size or
    SHA-256 than its unit's record says, or not decodable as Parquet.

    Attributes:
        name: the file, relative to the output folder; ``part``: its unit; ``reason``: what
            failed (a phrase); ``rows``: the rows its record gives it (None: not known).
    """

    def __init__(self, message: str, name: str, part: str, reason: str, rows: int | None):
        super().__init__(message)
        self.name, self.part, self.reason, self.rows = name, part, reason, rows


@dataclass
class CommittedOutput:
    """A job output's committed units.  Open one with :meth:`open`.

    Attributes:
        url: the output folder (a full URL; a ``date=`` partition when the folder given held one).
        location: its :class:`~pipeline.output.location.OutputLocation`.
        entries: part name -> manifest entry of every committed unit (its ``unit`` record
            of the commit log, or its per-unit entry of an earlier version), in part order
            (names checked).
        finished: the output is complete (:meth:`OutputLocation.complete`: a run's ``final``
            record ends the commit log and ``_SUCCESS`` names that run).
        summary: ``_summary.json`` when there, else None.
        uncommitted: data files in the folder that no committed unit names (orphans: not read).
        unverified: committed data files read that carry no checksum (written by a version
            before checksums: decoded, not hashed).
    """

    url: str
    location: OutputLocation
    entries: dict[str, UnitRecord]
    finished: bool
    summary: dict[str, Any] | None
    uncommitted: list[str] = field(default_factory=list)
    unverified: list[str] = field(default_factory=list)

    # ------------------------------------------------------------------ opening
    @classmethod
    def open(cls, url: str, storage_options: dict[str, Any] | None = None, retry: Any = None, *,
             mixed_ok: bool = False) -> "CommittedOutput":
        """Read the manifest of the job output ``url`` (local path or any fsspec URL).

        Raises:
            OutputReadError: ``url`` does not exist, is a file, is an empty folder, holds no
                committed unit, holds several ``date=`` partitions, or (unless ``mixed_ok``)
                its entries carry different config fingerprints: each named.
            OutputError: a manifest record is not this job's (names checked).
            StorageError: the storage kept failing with transient errors.
        """
        try:
            loc = OutputLocation(OutputConfig(uri=url, partition_by_date=False,
                                              storage_options=dict(storage_options or {})), retry)
        except (ValueError, OSError) as e:
            raise OutputReadError(f"cannot open the output {url!r}: {type(e).__name__}: {e}") from None
        try:
            m = loc.manifest()
            if not m.entries:
                return cls._without_manifest(url, loc, storage_options, retry, mixed_ok)
            finished = loc.complete(m)
            summary = loc.read_summary() if loc.exists(loc.path(SUMMARY)) else None
            listed = loc.listing()
        except StorageError as e:
            raise_refusal(e, OutputReadError, f"cannot read the output {url!r}")
        named = m.committed_files()
        uncommitted = sorted(p for p in listed if "/" not in p and DATA_FILE.fullmatch(p) and p not in named)
        out = cls(loc.url(), loc, dict(sorted(m.entries.items())), finished, summary, uncommitted)
        if not mixed_ok:
            out.refuse_mixed()
        return out

    @classmethod
    def _without_manifest(cls, url: str, loc: OutputLocation, storage_options, retry, mixed_ok) -> "CommittedOutput":
        """An output folder with no committed unit: its one ``date=`` partition, or a refusal
        saying what it is (missing, a file, empty, partitions, other files)."""
        listing = loc.listing()
        days = sorted({p.split("/", 1)[0] for p in listing
                       if _DAY.fullmatch(p.split("/", 1)[0]) and f"/{MANIFEST}/" in p})
        if len(days) == 1:
            return cls.open(loc.url(days[0]), storage_options, retry, mixed_ok=mixed_ok)
        if days:
            raise OutputReadError(f"the output {url!r} holds {len(days)} date partitions ({', '.join(days)}), not one "
                                  f"job output: pass one of them, e.g. {loc.url(days[-1])}")
        if listing:
            what = (f"holds {len(listing)} file(s) but no committed unit (no {MANIFEST}/ record): not a job output, or "
                    "one whose first run committed nothing yet")
        elif loc.fs.isfile(loc.root):
            what = "is a file, not a job output folder"
        elif loc.fs.isdir(loc.root):
            what = "is an empty folder: no run has committed anything there"
        else:
            what = "does not exist"
        raise OutputReadError(f"the output {url!r} {what}")

    # ------------------------------------------------------------------ what it holds
    @property
    def parts(self) -> list[str]:
        """The committed parts, in order."""
        return list(self.entries)

    @property
    def rows_committed(self) -> int:
        """Rows the committed units count (error rows included)."""
        return sum(e.rows or 0 for e in self.entries.values())

    @property
    def fingerprints(self) -> dict[str | None, list[str]]:
        """Config fingerprint -> the parts committed under it (None: an entry without one)."""
        out: dict[str | None, list[str]] = {}
        for part, e in self.entries.items():
            out.setdefault(e.config_fingerprint, []).append(part)
        return out

    @property
    def runs(self) -> dict[str | None, list[str]]:
        """Run id -> the parts that run committed."""
        out: dict[str | None, list[str]] = {}
        for part, e in self.entries.items():
            out.setdefault(e.run_id, []).append(part)
        return out

    @property
    def config_fingerprint(self) -> str | None:
        """The one config fingerprint of every committed unit (None: entries without one).

        Raises:
            OutputReadError: the units carry several (:meth:`refuse_mixed`).
        """
        self.refuse_mixed()
        return next(iter(self.fingerprints), None)

    def refuse_mixed(self) -> None:
        """Refuse an output whose units were committed under several configs.

        Raises:
            OutputReadError: naming each fingerprint, its number of units and one of them.
        """
        fps = self.fingerprints
        if len(fps) > 1:
            shown = "; ".join(f"{fp or 'none'}: {len(parts)} unit(s), e.g. {parts[0]}" for fp, parts in fps.items())
            raise OutputReadError(f"the output {self.url!r} mixes units committed under {len(fps)} configs ({shown}): "
                                  "its rows are not one job's; rerun the job with --overwrite, or read each "
                                  "config's output apart")

    @property
    def config_identity(self) -> dict[str, Any]:
        """The config identity (:func:`pipeline.fingerprint.config_identity`) the units
        were committed with (the first entry's; one config: :attr:`config_fingerprint`)."""
        return next(iter(self.entries.values())).config_identity or {}

    def describe(self) -> str:
        """One line: where, how many units and rows by how many runs, finished or not, and
        the data files not read."""
        runs = len(self.runs)
        state = "finished" if self.finished else (f"unfinished (no {SUCCESS} of a run whose final record ends the "
                                                  "commit log: a run was killed, lost its lease or is in progress)")
        line = (f"{self.url}: {len(self.entries)} committed unit(s), {self.rows_committed} row(s), by {runs} "
                f"run{'s' if runs > 1 else ''}; {state}")
        if self.uncommitted:
            shown = ", ".join(self.uncommitted[:3]) + (" ..." if len(self.uncommitted) > 3 else "")
            line += f"; {len(self.uncommitted)} data file(s) no committed unit names, not read: {shown}"
        return line

    def record_of(self, part: str) -> str:
        """The record committing ``part``, relative to the output folder: its commit log
        record (``_manifest/log/NNNNNNNNNN.json``), or the per-unit entry of an earlier version."""
        seq = self.entries[part].seq
        return log_record(seq) if seq is not None else f"{MANIFEST}/{entry_name(part)}"

    # ------------------------------------------------------------------ rows
    def files(self) -> list[tuple[str, str, str | None]]:
        """``(part, data file, run id)`` of every committed data file, in part and row order."""
        return [(part, name, e.run_id) for part, e in self.entries.items() for name in e.files]

    def batches(self, columns: list[str] | None = None, batch_size: int = 8192,
                provenance: bool = True, on_damaged: Callable[[DamagedFile], None] | None = None
                ) -> Iterator[pa.RecordBatch]:
        """The committed rows as record batches, file by file (memory bounded by one file:
        each is read whole and checked, :meth:`read_file`, before any of its rows is
        yielded).  ``columns``: those only (a column a file lacks, from an older version, is
        null); ``provenance``: :data:`UNIT_COLUMN` and :data:`RUN_COLUMN` appended;
        ``on_damaged``: called with each :class:`DamagedFile`, whose rows are then left out
        (None: raised).

        Raises:
            DamagedFile (an :class:`OutputReadError`): a committed data file is missing or
                fails its check, naming it (unless ``on_damaged``).
            StorageError: the storage kept failing with transient errors.
        """
        for part, name, run_id in self.files():
            try:
                got = self.read_file(part, name, columns, batch_size)
            except DamagedFile as e:
                if on_damaged is None:
                    raise
                on_damaged(e)
                continue
            for batch in got:
                yield _completed(batch, columns, part, run_id, provenance)

    def read_file(self, part: str, name: str, columns: list[str] | None = None,
                  batch_size: int = 8192) -> list[pa.RecordBatch]:
        """The record batches of the committed data file ``name`` of unit ``part``, read
        whole and checked: its size, SHA-256 and rows against the unit's ``checksums``
        (an older version's file without them: only decoded, and listed in :attr:`unverified`),
        its Parquet pages decoded (page CRCs verified where written).

        Raises:
            DamagedFile: saying which check failed.
            StorageError: the storage kept failing with transient errors.
        """
        import hashlib

        from pipeline.storage import parquet_file

        entry = self.entries[part]
        check = entry.check_of(name)
        rows = check.rows if check else (entry.rows if len(entry.files) == 1 else None)
        path = self.location.path(name)

        def damaged(reason: str) -> DamagedFile:
            return DamagedFile(f"the output {self.url!r}: {name}, a data file of the committed unit {part} "
                               f"({self.record_of(part)} names it), {reason}", name, part, reason, rows)

        try:
            data = self.location.io(lambda: self.location.fs.cat_file(path), f"read {name}")
        except Exception as e:  # noqa: BLE001 - a missing file (raised as it is, or as a StorageError's cause)
            if isinstance(e, FileNotFoundError) or isinstance(e.__cause__, FileNotFoundError):
                raise damaged("is missing") from None
            raise
        if check is not None:
            if len(data) != check.size:
                raise damaged(f"is {len(data)} bytes, not the {check.size} its record says (cut short or replaced)")
            if hashlib.sha256(data).hexdigest() != check.sha256:
                raise damaged("does not hash to the SHA-256 its record says (its content was changed)")
        try:
            pf = parquet_file(pa.BufferReader(data))
            names = pf.schema_arrow.names
            cols = None if columns is None else [c for c in columns if c in names]
            got = list(pf.iter_batches(batch_size=batch_size, columns=cols))
        except (pa.ArrowException, OSError, ValueError) as e:
            raise damaged(f"does not decode as Parquet ({type(e).__name__}: {' '.join(str(e).split())[:160]})") from None
        n = sum(b.num_rows for b in got)
        if rows is not None and n != rows:
            raise damaged(f"holds {n} rows, not the {rows} its record says")
        if check is None and name not in self.unverified:
            self.unverified.append(name)
        return got

    def table(self, columns: list[str] | None = None, provenance: bool = True) -> pa.Table:
        """Every committed row in one table (files of older versions' schemas promoted)."""
        tables = [pa.Table.from_batches([b]) for b in self.batches(columns, provenance=provenance)]
        if not tables:
            return _empty(columns, provenance)
        return pa.concat_tables(tables, promote_options="default") if len(tables) > 1 else tables[0]

    def rows(self, columns: list[str] | None = None, provenance: bool = True) -> Iterator[dict[str, Any]]:
        """The committed rows as dicts, one batch in memory at a time."""
        for batch in self.batches(columns, provenance=provenance):
            yield from batch.to_pylist()


def _completed(batch: pa.RecordBatch, columns: list[str] | None, part: str, run_id: str | None,
               provenance: bool) -> pa.RecordBatch:
    """``batch`` with the ``columns`` it lacks as nulls (in ``columns``' order) and, with
    ``provenance``, its part and run id."""
    from pipeline.schema import OUTPUT_SCHEMA

    arrays, fields = list(batch.columns), list(batch.schema)
    if columns is not None:
        have = {f.name: (a, f) for a, f in zip(arrays, fields)}
        arrays, fields = [], []
        for c in columns:
            a, f = have.get(c) or (None, OUTPUT_SCHEMA.field(c) if c in OUTPUT_SCHEMA.names else pa.field(c, pa.null()))
            arrays.append(a if a is not None else pa.nulls(batch.num_rows, f.type))
            fields.append(f)
    if provenance:
        arrays += [pa.array([part] * batch.num_rows, pa.string()), pa.array([run_id] * batch.num_rows, pa.string())]
        fields += [pa.field(UNIT_COLUMN, pa.string()), pa.field(RUN_COLUMN, pa.string())]
    return pa.RecordBatch.from_arrays(arrays, schema=pa.schema(fields))


def _empty(columns: list[str] | None, provenance: bool) -> pa.Table:
    from pipeline.schema import OUTPUT_SCHEMA

    fields = list(OUTPUT_SCHEMA) if columns is None else [
        OUTPUT_SCHEMA.field(c) if c in OUTPUT_SCHEMA.names else pa.field(c, pa.null()) for c in columns]
    if provenance:
        fields += [pa.field(UNIT_COLUMN, pa.string()), pa.field(RUN_COLUMN, pa.string())]
    return pa.schema(fields).empty_table()


def previous_partition(uri: str, before: str | _dt.date | None = None, storage_options: dict[str, Any] | None = None,
                       retry: Any = None) -> str | None:
    """The latest ``date=`` partition of the output ``uri`` (``output.uri`` of a job with
    ``output.partition_by_date``) earlier than ``before`` that is complete
    (:meth:`OutputLocation.complete`, as :attr:`CommittedOutput.finished`): the night before
    of a nightly job (``--previous auto``).  ``before``: a date or ``YYYY-MM-DD`` (None:
    today in UTC).  Returns its URL, or None when there is none (a first night, or only
    unfinished ones).  Partitions whose run did not finish are passed over, those with a
    ``_SUCCESS`` that does not count (one a run that lost its lease published late) too.

    Raises:
        ValueError: ``before`` is not a date.
        OutputError: a record of a candidate's manifest is not this job's.
        StorageError: the storage kept failing with transient errors.
    """
    day = (before if isinstance(before, _dt.date) else _dt.date.fromisoformat(before) if before
           else _dt.datetime.now(_dt.timezone.utc).date()).isoformat()
    loc = OutputLocation(OutputConfig(uri=uri, partition_by_date=False, storage_options=dict(storage_options or {})),
                         retry)

    def finished_days() -> list[str]:
        try:
            markers = loc.fs.glob(loc.path("date=*", SUCCESS))
        except FileNotFoundError:
            return []
        return [m.group(1) for p in markers if (m := _DAY.fullmatch(posixpath.basename(posixpath.dirname(p))))]

    earlier = sorted(d for d in loc.io(finished_days, f"list the date partitions of {loc.url()}") if d < day)
    for d in reversed(earlier):  # latest first: a manifest read per partition passed over
        night = loc.url(f"date={d}")
        if OutputLocation(OutputConfig(uri=night, partition_by_date=False,
                                       storage_options=dict(storage_options or {})), retry).complete():
            return night
    return None
