"""The commit protocol: one class, :class:`OutputWriter`, owns its phases, named after Ray
Data's ``Datasink`` hooks where they fit:

- :meth:`~OutputWriter.on_write_start` (driver, once): read the manifest, plan the resume, begin the run;
- :meth:`~OutputWriter.write` (the workers, per block: a ``map_batches`` function, with
  :meth:`~OutputWriter.write_kwargs`): a unit's rows -> staged Parquet fragments, one
  :class:`~pipeline.output.records.Fragment` record each (:mod:`pipeline.output.sink`);
- :meth:`~OutputWriter.add_fragments` (driver, as records stream back; no Datasink hook: a
  Datasink commits once, this protocol per unit): commit every unit the records complete;
- :meth:`~OutputWriter.on_write_complete` (driver, once): the ``final`` record, ``_SUCCESS``;
- :meth:`~OutputWriter.on_write_failed` (driver): drop what is in flight; committed units stay.

Its records are typed (:mod:`pipeline.output.records`).  No output row passes through the
driver: it commits from the write stage's records.

The run holds the output's lease (:meth:`OutputWriter.acquire_lease`, :mod:`pipeline.output.lease`)
from before it reads the manifest to its end.  Every commit is a record of the output's
commit log (:mod:`pipeline.output.commit_log`), created once by the storage's
create-exclusive write after the last record the run has seen: a run that lost its lease
(a paused process whose lease went stale and was taken over) finds that place taken by the
taker's ``epoch`` record, and its commit fails (:class:`~pipeline.output.lease.LeaseLost`),
whatever the timing.  The lease is also checked before each unit, to stop early.

Begin (:meth:`OutputWriter.on_write_start`): read the manifest, plan the resume; unless there is
nothing to do, append this run's ``epoch`` record (from now on no other run can commit),
then quarantine the staging of every other run (a run that lost its lease can then publish
none of its files: they are gone), and on ``overwrite`` clear the output.

Commit protocol, per unit.  The write stage (on the workers) writes a unit's rows to
``_staging/<run_id>/<part stem>/`` as fragments of at most ``max_rows_per_file`` rows and
returns one record per fragment.  When the records of a unit cover its rows (every row
once, in row order: checked), the driver commits it: the fragments are published under
names carrying the run's id (:func:`~pipeline.layout.data_file_names`: two runs
never write one name), by a rename on a local filesystem, a copy + delete on S3 (where a
copy is atomic: the object appears whole or not at all); then the unit's ``unit`` record
(its manifest entry: its files, the source URL and its fingerprint (size + mtime or ETag),
its shard, split, first row and rows, ``input.split_rows``, the config fingerprint
(pipeline.fingerprint), row and error counts, the run id, the unit's totals, and each data
file's SHA-256, size and rows, ``checksums``, which every reader checks) is
appended to the commit log: the unit's commit point.  Files published by a run that then
died or lost its lease are *orphans* (its run id is in the log, no committed unit names
them): the next run removes them.  Units commit in the order they complete.

The run ends with :meth:`OutputWriter.on_write_complete`: the manifest is read again and every entry
must carry this run's config fingerprint; orphans are removed; ``_summary.json`` and
``_SUCCESS`` are staged; the ``final`` record is appended (the run's own commit point);
then ``_summary.json`` and ``_SUCCESS`` are published from staging (so a run that lost its
lease, whose staging was quarantined, cannot publish them) and the staging removed.  A
reader that wants a complete output checks :func:`pipeline.output.is_complete` (``_SUCCESS``
naming the run of the log's last record, a ``final`` one); pyarrow's dataset discovery
skips names starting with ``_`` or ``.``, so ``pq.read_table(<dir>)`` reads the published
files of a complete output.

Every storage call goes through :func:`pipeline.retry.with_retries` (transient errors
retried with backoff, bounded by timeouts and a deadline; see ``retry:`` in the job config).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import posixpath
import uuid
from typing import Any

import pyarrow as pa

from pipeline.config import OutputConfig
from pipeline.fingerprint import config_fingerprint
from pipeline.output.commit_log import SlotTaken
from pipeline.output.records import (EpochRecord, FinalRecord, Fragment, LogRecord, UnitRecord, fragment_table,
                                     fragments_of)
from pipeline.layout import STAGING, SUCCESS, SUMMARY, data_file_names
from pipeline.output.lease import LeaseLost, OutputLease, holder_name
from pipeline.output.location import OutputError, OutputLocation
from pipeline.output.manifest import Manifest
from pipeline.output.resume import ResumePlan, plan_resume
from pipeline.units import UNIT_COLUMN, Shard, Split, Unit
from pipeline.output.sink import write_fragments
from pipeline.retry import StorageError
from pipeline.schema import output_schema
from pipeline.summary import RunTotals


class RunError(RuntimeError):
    """The run's output does not match its input (rows lost, duplicated or out of order)."""


class OutputWriter:
    """Commits one run's units into its :class:`~pipeline.output.location.OutputLocation`
    (``location``), with a manifest entry per committed unit.

    Use: ``plan = on_write_start(units, identity)`` (driver, before models load: the resume
    plan) -> :meth:`write` writes fragments on the workers (``map_batches(OutputWriter.write,
    fn_kwargs=writer.write_kwargs())``) -> ``add_fragments(records)`` for each batch of
    records, which commits every unit they complete -> ``on_write_complete(summary)``; on
    failure ``on_write_failed(error)``.  :meth:`write_part` stages and commits a unit given
    its rows in this process (tools and tests; the job's data path never does).

    Args:
        cfg: the output section; the directory is ``cfg.location()``.
        run_id: this run's id (default: random).
        retry: a RetryConfig (or its dict) for storage calls; None = defaults.
        extra_columns: columns written after OUTPUT_SCHEMA's: the input's Hive partition keys.
        split_rows: ``input.split_rows``, recorded in each manifest entry (a resume with
            other units names it).
    """

    def __init__(self, cfg: OutputConfig, run_id: str | None = None, retry: Any = None,
                 extra_columns: list[str] | tuple[str, ...] = (), split_rows: int | None = None):
        self.cfg = cfg
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self.retry = retry.model_dump() if hasattr(retry, "model_dump") else retry
        self.location = OutputLocation(cfg, retry)
        self.fs, self.io = self.location.fs, self.location.io
        self.staging = self.location.staging_dir(self.run_id)
        self.extra_columns = list(extra_columns)
        self.split_rows = split_rows
        self.written: list[str] = []  # final paths of the files this run published
        self.entries: dict[str, UnitRecord] = {}  # part name -> manifest entry (committed)
        self.identity: dict[str, Any] | None = None
        self.config_fingerprint: str | None = None
        self.totals = RunTotals()  # this run's rows (from the fragments' records)
        self._units: dict[str, Any] = {}  # part name -> Unit of this run
        self._fragments: dict[str, list[Fragment]] = {}  # part -> records of a unit in flight
        self._rows: dict[str, int] = {}
        self.lease: OutputLease | None = None
        self.log = self.location.commit_log(self.run_id)  # where this run's commits go
        self.manifest: Manifest | None = None  # as read by on_write_start

    def acquire_lease(self, config_fingerprint: str | None = None) -> OutputLease:
        """Take the output's lease for this run (``output.lease_timeout_s``; see
        :mod:`pipeline.output.lease`); from now on every publish first checks it is still ours.
        Release it with :meth:`release_lease`.

        Raises:
            LeaseHeld: another run holds it.
            LeaseUnreadable: ``_lease.json`` is not a lease of this job.
            OutputError: the location is not writable.
            StorageError: the storage kept failing with transient errors.
        """
        loc = self.location
        lease = OutputLease(loc.fs, loc.root, self.run_id, url=loc.url(), io=loc.io,
                            timeout_s=self.cfg.lease_timeout_s, config_fingerprint=config_fingerprint)
        try:
            lease.acquire()
        except StorageError as e:  # transient: raised as it is; else a refusal (pipeline.storage.raise_refusal)
            loc.refused(e, "writable")
        self.lease = lease
        self.log.careful = not lease.atomic_create  # a store that ignores conditional writes: read back
        return lease

    def release_lease(self) -> None:
        """Release the lease (if held; never raises)."""
        if self.lease is not None:
            self.lease.release()

    def abandon_lease(self) -> None:
        """After a storage failure: stop renewing the lease and leave it, touching no
        storage (:meth:`pipeline.output.lease.OutputLease.abandon`)."""
        if self.lease is not None:
            self.lease.abandon()

    def _check_lease(self) -> None:
        if self.lease is not None:
            self.lease.check()

    def on_write_start(self, units: list | None = None, identity: dict[str, Any] | None = None) -> ResumePlan:
        """Check the location for this run (:meth:`OutputLocation.inspect`: foreign files,
        names, orphans), plan the resume (:func:`pipeline.output.resume.plan_resume`), and
        unless there is nothing to do begin the run: its ``epoch`` record in the commit log
        (no other run can commit after it), the staging of every other run quarantined, the
        output cleared on ``overwrite``, the markers removed and a writable staging folder.
        Records the config identity every unit this run commits will carry.

        Args:
            units: this run's units (:class:`pipeline.units.Unit`; :class:`pipeline.units.Shard`
                objects stand for their units); None = no resume check (an output holding
                committed units is then refused).
            identity: :func:`pipeline.fingerprint.config_identity` of this run's config; None = not checked.

        Returns:
            The :class:`~pipeline.output.resume.ResumePlan`.

        Raises:
            OutputError, StorageError: as :meth:`OutputLocation.inspect` and :func:`plan_resume`.
            LeaseLost: other runs keep committing to the output (this run holds no lease).
        """
        self.identity = identity
        self.config_fingerprint = config_fingerprint(identity) if identity is not None else None
        loc = self.location
        units = [u for x in (units or []) for u in (x.units() if hasattr(x, "units") else [x])]
        for _ in range(5):  # another run committed between our read and our epoch: read again
            m = loc.inspect(self.log)
            if not self.cfg.overwrite:
                loc.check_committed_sizes(m)  # a resume keeps the committed files: they must be whole
            if self.cfg.overwrite:
                plan = plan_resume(loc.url(), units, {}, identity)
            else:
                if not units and m.entries:
                    raise OutputError(f"output {loc.url()!r} already holds committed units; set output.overwrite: true")
                plan = plan_resume(loc.url(), units, m.entries, identity,
                                   complete=bool(m.entries) and loc.complete(m))
                if plan.nothing_to_do:
                    if loc.orphans or m.intents:
                        loc.remove_orphans(m)
                    self.manifest, self.entries = m, dict(plan.entries)
                    return plan
            try:
                epoch = self._begin()
            except Exception as e:  # noqa: BLE001 - the first write: a location that is not writable
                loc.refused(e, "writable")
            if epoch is not None:
                break
        else:
            raise LeaseLost(f"output {loc.url()!r}: other runs keep committing to it while this one starts; is a run "
                            "without the lease writing it?")
        loc.quarantine(self.run_id)
        if self.cfg.overwrite:
            loc.clear(m, keep_from=epoch)
        loc.make_ready(self.staging)
        self.manifest, self.entries = m, dict(plan.entries)
        self._units = {u.part: u for u in plan.todo}
        return plan

    def _begin(self) -> int | None:
        """Append this run's ``epoch`` record; None when another run wrote there first."""
        try:
            return self.log.append(EpochRecord(overwrite=bool(self.cfg.overwrite),
                                               config_fingerprint=self.config_fingerprint, owner=holder_name(),
                                               pid=os.getpid(), at=_now())).seq
        except SlotTaken:
            return None

    def _append(self, record: LogRecord, what: str) -> LogRecord:
        """Append a ``unit`` or ``final`` record (returned as written); a place taken means
        another run took the output over: :class:`LeaseLost`, and the lease is given up."""
        try:
            return self.log.append(record)
        except SlotTaken as e:
            taken = e
        taker = taken.record.run_id if taken.record is not None else None
        raise self._lost(f"record {taken.seq} of its commit log, where {what} was to go, was written by run "
                         f"{taker or 'another run'}, which took the output over")

    def _lost(self, why: str) -> LeaseLost:
        message = (f"output {self.location.url()!r}: this run lost the output ({why}); it publishes nothing more, "
                   "and the output belongs to the run that took it over")
        if self.lease is not None:
            self.lease.lose(message)
        return LeaseLost(message)

    #: the write phase, on the workers: a ``map_batches`` function (:func:`pipeline.output.sink.write_fragments`),
    #: its keyword arguments :meth:`write_kwargs`; returns the :data:`~pipeline.output.records.FRAGMENT_SCHEMA`
    #: records :meth:`add_fragments` takes
    write = staticmethod(write_fragments)

    def write_kwargs(self) -> dict[str, Any]:
        """The ``fn_kwargs`` of :meth:`write` for this run."""
        return {"output": self.cfg, "retry": self.retry, "staging": self.staging,  # validated once, here
                "extra_columns": list(self.extra_columns)}

    # ------------------------------------------------------------------ committing units
    def add_fragments(self, records: pa.Table) -> list[str]:
        """Take a batch of the write stage's records (:data:`pipeline.output.sink.FRAGMENT_SCHEMA`)
        and commit every unit whose rows they complete.  Returns the parts committed.

        Raises:
            RunError: a record of a unit this run does not do, or more rows than the unit has.
            LeaseLost, StorageError: from the commit.
        """
        done = []
        for frag in fragments_of(records):
            part = frag.part
            unit = self._units.get(part)
            if unit is None:
                raise RunError(f"the write stage returned rows of {part}, which this run does not do")
            self._fragments.setdefault(part, []).append(frag)
            self._rows[part] = self._rows.get(part, 0) + frag.rows
            self.totals.merge(json.loads(frag.totals))
            if self._rows[part] > unit.num_rows:
                raise RunError(f"{part} ({unit.shard.url!r} rows {unit.split.start}..): more output rows "
                               f"({self._rows[part]}) than its {unit.num_rows} input rows")
            if self._rows[part] == unit.num_rows:
                frags = self._fragments.pop(part)
                _check_cover(unit, frags)
                self.commit_unit(unit, frags)
                self._rows.pop(part)
                done.append(part)
        return done

    def missing(self) -> dict[str, tuple[int, int]]:
        """Units of this run not committed: part -> (rows received, rows expected)."""
        return {p: (self._rows.get(p, 0), u.num_rows) for p, u in self._units.items() if p not in self.entries}

    def commit_unit(self, unit: Any, fragments: list[Fragment]) -> list[str]:
        """Commit one unit from the records of its staged fragments (in row order once sorted
        by their first row): publish the files under their final names (carrying this run's
        id), then append the unit's record to the commit log (the commit point).  Returns the
        final paths.

        Raises:
            LeaseLost: this run lost the output (its lease, its staging or its place in the log).
            StorageError: the storage kept failing.
        """
        frags = sorted(fragments, key=lambda r: r.first_row)
        self._check_lease()  # stop early; the commit log is what fences
        name = unit.part
        names = data_file_names(name, len(frags), self.run_id)
        totals = RunTotals()
        for r in frags:
            totals.merge(json.loads(r.totals))
        finals = [self.location.path(n) for n in names]
        for r, dst, n in zip(frags, finals, names):
            self._publish(r.path, dst, n)
        shard = unit.shard
        entry = UnitRecord(
            part=name, files=tuple(names), source_file=shard.url, fingerprint=shard.fingerprint, shard=shard.index,
            split=unit.split_index, start_row=unit.split.start, rows=totals.rows, split_rows=self.split_rows,
            config_fingerprint=self.config_fingerprint, config_identity=self.identity, errors=totals.errors,
            committed_at=_now(), totals=totals.state(),
            # each data file's SHA-256, size and rows: every reader of committed output checks them
            checksums={n: r.check for r, n in zip(frags, names)})
        self.entries[name] = self._append(entry, f"the commit of {name}")
        self.written.extend(finals)
        return finals

    def write_part(self, unit: Any, table: pa.Table) -> str:
        """Stage and commit one unit given all its rows, in this process (tools and tests;
        the job writes on the workers).  ``unit``: a :class:`pipeline.units.Unit`, a
        :class:`pipeline.units.Shard` of one unit, or a bare shard index (its unit 0, no
        fingerprint).  Returns the path of its first data file."""
        unit = _as_unit(unit, table.num_rows)
        self._units.setdefault(unit.part, unit)
        rows = table.append_column(UNIT_COLUMN, pa.array([unit.part] * table.num_rows, pa.string()))
        if rows.num_rows == 0:
            from pipeline.output.sink import fragment_path, parquet_bytes

            path = fragment_path(self.staging, unit.part, unit.split.start, uuid.uuid4().hex[:12])
            data, sha256, size = parquet_bytes(output_schema(self.extra_columns).empty_table())

            def write() -> None:
                self.location.makedirs(posixpath.dirname(path))
                with self.fs.open(path, "wb") as f:
                    f.write(data)

            self.io(write, f"write {unit.part} to staging")
            records = fragment_table([Fragment(
                part=unit.part, path=path, first_row=unit.split.start, last_row=unit.split.start - 1, rows=0,
                errors=0, totals=json.dumps(RunTotals().state()), pid=0, host="", consecutive=True, sha256=sha256,
                size=size)])
        else:
            records = self.write(rows, **self.write_kwargs())
        return self.commit_unit(unit, fragments_of(records))[0]

    def _publish(self, src: str, dst: str, what: str) -> None:
        """Move a staged file of this run to its final name (a rename; on an object store an
        atomic copy, then the staged object removed).

        Raises:
            LeaseLost: the staged file is gone: another run quarantined this run's staging.
        """
        def move() -> None:
            if self.location.local:
                os.rename(src, dst)
            else:
                self.fs.copy(src, dst)

        try:
            self.io(move, f"publish {what}")
            gone = False
        except Exception as e:  # noqa: BLE001 - a missing source (or a StorageError raised from one)
            if not isinstance(e, FileNotFoundError) and not isinstance(e.__cause__, FileNotFoundError):
                raise
            gone = True
        if gone:  # (raised outside the handler: the storage did not fail, the run lost the output)
            raise self._lost(f"its staged {posixpath.basename(src)} for {what} is gone: another run quarantined "
                             "this run's staging")
        if not self.location.local:
            self.location.remove(src, f"remove staged {what}")

    def on_write_complete(self, summary: dict[str, Any]) -> None:
        """Finish the output: check that every committed unit carries this run's config
        fingerprint, remove orphans, append the ``final`` record, then publish
        ``_summary.json`` and ``_SUCCESS`` from staging and remove the staging.

        Raises:
            RunError: the manifest now holds units of another config, or others than this run knows.
            LeaseLost: this run lost the output.
            StorageError: the storage kept failing.
        """
        loc = self.location
        self._check_lease()
        m = loc.manifest(self.log)
        if m.log.holder not in (None, self.run_id):
            raise self._lost(f"its commit log's last run is {m.log.holder}")
        fingerprints = sorted({str(e.config_fingerprint) for e in m.entries.values()})
        if len(fingerprints) > 1 or (m.entries and self.config_fingerprint is not None
                                     and fingerprints != [self.config_fingerprint]):
            raise RunError(f"output {loc.url()!r}: its committed units carry {len(fingerprints)} config fingerprints "
                           f"({', '.join(fingerprints[:3])}), not only this run's {self.config_fingerprint}: not "
                           "marked complete; rerun with --overwrite")
        if set(m.entries) != set(self.entries):
            extra = sorted(set(m.entries) ^ set(self.entries))
            raise RunError(f"output {loc.url()!r}: its manifest and this run disagree on {len(extra)} unit(s) "
                           f"({', '.join(extra[:3])}): not marked complete; rerun to resume")
        loc.remove_orphans(m)
        staged = {name: posixpath.join(self.staging, name) for name in (SUMMARY, SUCCESS)}
        loc.put_atomic(staged[SUMMARY], json.dumps(summary, indent=2, default=str).encode(), f"stage {SUMMARY}")
        loc.put_atomic(staged[SUCCESS], (self.run_id + "\n").encode(), f"stage {SUCCESS}")
        self._append(FinalRecord(config_fingerprint=self.config_fingerprint, units=len(m.entries),
                                 rows=sum(e.rows or 0 for e in m.entries.values()), at=_now()), "its final record")
        self._publish(staged[SUMMARY], loc.path(SUMMARY), SUMMARY)
        self._publish(staged[SUCCESS], loc.path(SUCCESS), SUCCESS)  # last: the output is complete
        loc.remove_owned(posixpath.join(STAGING, self.run_id))  # (other runs' went at the start: quarantine)

    def on_write_failed(self, error: BaseException | None = None) -> None:
        """The run failed with ``error``: drop this run's units in flight and (best effort, no
        retries) its staging folder; never writes a marker.  Shards committed so far stay
        committed: a rerun resumes after them, and a later successful run removes any staging
        left behind.  After a :class:`~pipeline.retry.StorageError` the storage is left alone
        (its clean-up would hang too) and the lease abandoned, to go stale (a rerun in this
        process takes it over at once)."""
        self._fragments.clear()
        self._rows.clear()
        if isinstance(error, StorageError):
            self.abandon_lease()
            return
        try:
            self.location.remove_owned(posixpath.join(STAGING, self.run_id), retry=False)
        except Exception:  # noqa: BLE001 - best effort
            pass


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat()


def _check_cover(unit: Any, frags: list[Fragment]) -> None:
    """Raise :class:`RunError` unless the fragments ``frags`` of ``unit`` hold each of its
    rows once, in row order (sorted by their first row, each a run of consecutive rows)."""
    frags = sorted(frags, key=lambda r: r.first_row)
    at = unit.split.start
    for r in frags:
        if r.first_row != at or not r.consecutive:
            raise RunError(f"{unit.part} ({unit.shard.url!r}): its output rows do not cover rows "
                           f"{unit.split.start}..{unit.split.start + unit.num_rows - 1} once each, in order "
                           f"(a fragment holds rows {r.first_row}..{r.last_row}, {r.rows} rows)")
        at += r.rows
    if at != unit.split.start + unit.num_rows:
        raise RunError(f"{unit.part}: {at - unit.split.start} of its {unit.num_rows} rows came back")


def _as_unit(unit: Any, rows: int):
    """A :class:`pipeline.units.Unit` from a Unit, a one-unit Shard or a bare shard index."""
    if isinstance(unit, int):
        return Unit(Shard(index=unit, url=None, format="jsonl", num_rows=rows), 0, Split(0, rows))
    if isinstance(unit, Shard):
        units = unit.units()
        if len(units) != 1:
            raise ValueError(f"shard {unit.url!r} has {len(units)} units: give write_part one of them")
        return units[0]
    return unit
