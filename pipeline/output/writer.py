"""Committing a run's units into an :class:`~pipeline.output.location.OutputLocation`,
in the driver, from the write stage's records (:mod:`pipeline.output.sink`): no output
row passes through here.

Commit protocol, per unit.  The write stage (on the workers) writes a unit's rows to
``_staging/<run_id>/<part stem>/`` as fragments of at most ``max_rows_per_file`` rows and
returns one record per fragment.  When the records of a unit cover its rows (every row
once, in row order: checked), the driver commits it: a *publish intent*
``_manifest/pending/<part stem>.<run_id>.json`` names the final file names; the fragments
are published (a rename on a local filesystem; copy + delete on S3, where a copy is
atomic: the object appears whole or not at all); then the unit's **manifest entry**
``_manifest/<part stem>.json`` is written: its files, the source URL and its fingerprint
(size + mtime or ETag), its shard, split, first row and rows, ``input.split_rows``, the
config fingerprint (pipeline.fingerprint), row and error counts, the run id and the
unit's totals.  The manifest entry is the unit's commit point; the intent is then
removed.  Files named by an intent but by no entry (a run died between the two) are not
committed: a later run rewrites the unit and removes them.  Units commit in the order
they complete.

The run holds the output's lease (:meth:`OutputWriter.acquire_lease`, :mod:`pipeline.output.lease`)
from before it reads the manifest to its end; every unit's commit and the final commit
first check that the lease is still this run's (:class:`pipeline.output.lease.LeaseLost`
otherwise), so a run that lost it publishes nothing more.

The run ends with :meth:`OutputWriter.commit`: files of dead publish intents are removed,
then ``_summary.json`` is written, every ``_staging/`` folder's files (this run's, and any
an interrupted run left) are removed, then ``_SUCCESS`` is written.  A reader that wants a
complete output checks ``_SUCCESS``; pyarrow's dataset discovery skips names starting
with ``_`` or ``.``, so ``pq.read_table(<dir>)`` reads the published files.

Every storage call goes through :func:`pipeline.retry.with_retries` (transient errors
retried with backoff, bounded by timeouts and a deadline; see ``retry:`` in the job config).
"""

from __future__ import annotations

import datetime as _dt
import json
import posixpath
import uuid
from typing import Any

import pyarrow as pa

from pipeline.config import OutputConfig
from pipeline.fingerprint import config_fingerprint
from pipeline.output.layout import MANIFEST, PENDING, STAGING, SUCCESS, SUMMARY, data_file_names, entry_name
from pipeline.output.lease import OutputLease
from pipeline.output.location import OutputError, OutputLocation
from pipeline.output.resume import ResumePlan, plan_resume
from pipeline.input.units import UNIT_COLUMN, Shard, Split, Unit
from pipeline.output.sink import write_fragments
from pipeline.schema import output_schema
from pipeline.summary import RunTotals


class RunError(RuntimeError):
    """The run's output does not match its input (rows lost, duplicated or out of order)."""


class OutputWriter:
    """Commits one run's units into its :class:`~pipeline.output.location.OutputLocation`
    (``location``), with a manifest entry per committed unit.

    Use: ``plan = prepare(units, identity)`` (driver, before models load: the resume plan)
    -> the write stage writes fragments on the workers (:meth:`sink_kwargs`) -> ``add_fragments(records)``
    for each batch of records, which commits every unit they complete -> ``commit(summary)``;
    on failure ``abort()``.  :meth:`write_part` stages and commits a unit given its rows
    in this process (tools and tests; the job's data path never does).

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
        self.entries: dict[str, dict[str, Any]] = {}  # part name -> manifest entry (committed)
        self.identity: dict[str, Any] | None = None
        self.config_fingerprint: str | None = None
        self.totals = RunTotals()  # this run's rows (from the fragments' records)
        self._units: dict[str, Any] = {}  # part name -> Unit of this run
        self._fragments: dict[str, list[dict[str, Any]]] = {}  # part -> records of a unit in flight
        self._rows: dict[str, int] = {}
        self.lease: OutputLease | None = None

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
        from pipeline.retry import StorageError

        loc = self.location
        lease = OutputLease(loc.fs, loc.root, self.run_id, url=loc.url(), io=loc.io,
                            timeout_s=self.cfg.lease_timeout_s, config_fingerprint=config_fingerprint)
        try:
            lease.acquire()
        except StorageError as e:
            if e.transient:
                raise
            raise OutputError(f"output {loc.url()!r} is not writable: {e}") from None
        self.lease = lease
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

    def prepare(self, units: list | None = None, identity: dict[str, Any] | None = None) -> ResumePlan:
        """Check the location for this run (:meth:`OutputLocation.inspect`: foreign files,
        names, overwrite), plan the resume (:func:`pipeline.output.resume.plan_resume`),
        and unless there is nothing to do make the location ready (markers removed, a
        writable staging folder).  Records the config identity every unit this run commits
        will carry.

        Args:
            units: this run's units (:class:`pipeline.input.units.Unit`; :class:`pipeline.input.units.Shard`
                objects stand for their units); None = no resume check (an output holding
                committed units is then refused).
            identity: :func:`pipeline.fingerprint.config_identity` of this run's config; None = not checked.

        Returns:
            The :class:`~pipeline.output.resume.ResumePlan`.

        Raises:
            OutputError, StorageError: as :meth:`OutputLocation.inspect` and :func:`plan_resume`.
        """
        self.identity = identity
        self.config_fingerprint = config_fingerprint(identity) if identity is not None else None
        loc = self.location
        entries = loc.inspect()
        if units is None and entries:
            raise OutputError(f"output {loc.url()!r} already holds committed units; set output.overwrite: true")
        units = [u for x in (units or []) for u in (x.units() if hasattr(x, "units") else [x])]
        plan = plan_resume(loc.url(), units, entries, identity, complete=bool(entries) and loc.complete())
        if not plan.nothing_to_do:
            loc.make_ready(self.staging)
        self.entries = dict(plan.entries)
        self._units = {u.part: u for u in plan.todo}
        return plan

    def sink_kwargs(self) -> dict[str, Any]:
        """The ``fn_kwargs`` of :func:`pipeline.output.sink.write_fragments` for this run."""
        return {"output": self.cfg.model_dump(), "retry": self.retry, "staging": self.staging,
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
        for rec in records.to_pylist():
            part = rec["part"]
            unit = self._units.get(part)
            if unit is None:
                raise RunError(f"the write stage returned rows of {part}, which this run does not do")
            self._fragments.setdefault(part, []).append(rec)
            self._rows[part] = self._rows.get(part, 0) + rec["rows"]
            self.totals.merge(json.loads(rec["totals"]))
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

    def commit_unit(self, unit: Any, fragments: list[dict[str, Any]]) -> list[str]:
        """Commit one unit from the records of its staged fragments (in row order once sorted
        by their first row): record the publish intent, publish the files under their final
        names, then write the manifest entry (the commit point).  Returns the final paths."""
        frags = sorted(fragments, key=lambda r: r["first_row"])
        self._check_lease()  # a run that lost its lease publishes nothing
        name = unit.part
        names = data_file_names(name, len(frags))
        totals = RunTotals()
        for r in frags:
            totals.merge(json.loads(r["totals"]))
        intent_path = self.location.path(MANIFEST, PENDING, f"{name[: -len('.parquet')]}.{self.run_id}.json")
        intent = {"part": name, "files": names, "run_id": self.run_id}
        self._write_json(intent_path, intent, f"write the publish intent of {name}")
        finals = [self.location.path(n) for n in names]
        for r, dst, n in zip(frags, finals, names):
            self._publish(r["path"], dst, n)
        shard = unit.shard
        entry = {
            "part": name,
            "files": names,
            "source_file": shard.url,
            "fingerprint": shard.fingerprint,
            "shard": shard.index,
            "split": unit.split_index,
            "start_row": unit.split.start,
            "rows": totals.rows,
            "split_rows": self.split_rows,
            "config_fingerprint": self.config_fingerprint,
            "config_identity": self.identity,
            "errors": totals.errors,
            "run_id": self.run_id,
            "committed_at": _dt.datetime.now(_dt.timezone.utc).isoformat(),
            "totals": totals.state(),
        }
        self._write_json(self.location.path(MANIFEST, entry_name(name)), entry,
                         f"write the manifest entry of {name}", staged_as=posixpath.join(self.staging, name + ".json"))
        self.location.remove(intent_path, f"remove the publish intent of {name}")
        self.written.extend(finals)
        self.entries[name] = entry
        return finals

    def write_part(self, unit: Any, table: pa.Table) -> str:
        """Stage and commit one unit given all its rows, in this process (tools and tests;
        the job writes on the workers).  ``unit``: a :class:`pipeline.input.units.Unit`, a
        :class:`pipeline.input.units.Shard` of one unit, or a bare shard index (its unit 0, no
        fingerprint).  Returns the path of its first data file."""
        unit = _as_unit(unit, table.num_rows)
        self._units.setdefault(unit.part, unit)
        rows = table.append_column(UNIT_COLUMN, pa.array([unit.part] * table.num_rows, pa.string()))
        if rows.num_rows == 0:
            import pyarrow.parquet as pq

            from pipeline.output.sink import FRAGMENT_SCHEMA, fragment_path

            path = fragment_path(self.staging, unit.part, unit.split.start, uuid.uuid4().hex[:12])

            def write() -> None:
                self.location.makedirs(posixpath.dirname(path))
                with self.fs.open(path, "wb") as f:
                    pq.write_table(output_schema(self.extra_columns).empty_table(), f)

            self.io(write, f"write {unit.part} to staging")
            rec = {"part": unit.part, "path": path, "first_row": unit.split.start, "last_row": unit.split.start - 1,
                   "rows": 0, "errors": 0, "totals": json.dumps(RunTotals().state()), "pid": 0, "host": "",
                   "consecutive": True}
            records = pa.Table.from_pylist([rec], schema=FRAGMENT_SCHEMA)
        else:
            records = write_fragments(rows, **self.sink_kwargs())
        return self.commit_unit(unit, records.to_pylist())[0]

    def _write_json(self, path: str, obj: dict[str, Any], what: str, staged_as: str | None = None) -> None:
        """Write a small JSON file whole or not at all (:meth:`OutputLocation.put_atomic`: a
        full disk leaves no empty or partial record); with ``staged_as``, write it there and
        publish it to ``path``."""
        self.location.put_atomic(staged_as or path, json.dumps(obj, default=str).encode(), what)
        if staged_as:
            self.io(lambda: self.location.makedirs(posixpath.dirname(path)), f"create {posixpath.dirname(path)}")
            self._publish(staged_as, path, what.replace("write ", ""))

    def _publish(self, src: str, dst: str, what: str) -> None:
        if self.location.local:  # an atomic rename
            self.io(lambda: self.fs.mv(src, dst), f"publish {what}")
            return

        def copy() -> None:  # S3: an atomic server-side copy, then drop the staged object
            self.fs.copy(src, dst)

        self.io(copy, f"publish {what}")
        self.location.remove(src, f"remove staged {what}")

    def commit(self, summary: dict[str, Any]) -> None:
        """Finish the output: remove the files of dead publish intents (never named by a
        manifest entry), write the summary, remove every staging folder, then ``_SUCCESS``."""
        loc = self.location
        self._check_lease()
        self.fs.invalidate_cache()
        intents = loc.read_intents()  # names checked: each is one of its shard's data files
        committed = {n for e in self.entries.values() for n in e.get("files") or [e["part"]]}
        for path, intent in sorted(intents.items()):
            for n in intent["files"]:
                if n not in committed:
                    loc.remove(loc.path(n), f"remove uncommitted {n}")
            loc.remove(path, f"remove the publish intent {posixpath.basename(path)}")
        loc.remove_owned(posixpath.join(MANIFEST, PENDING))

        loc.put_atomic(loc.path(SUMMARY), json.dumps(summary, indent=2, default=str).encode(), f"write {SUMMARY}")
        loc.remove_owned(STAGING)
        # atomic: a _SUCCESS cut short by a full disk must not say the output is complete
        loc.put_atomic(loc.path(SUCCESS), (self.run_id + "\n").encode(), f"write {SUCCESS}")

    def abort(self, cleanup: bool = True) -> None:
        """Drop this run's units in flight and (with ``cleanup``, best effort, no retries) its staging
        folder; never writes a marker.  Shards committed so far stay committed: a rerun
        resumes after them, and a later successful run removes any staging left behind."""
        self._fragments.clear()
        self._rows.clear()
        if not cleanup:
            return
        try:
            self.location.remove_owned(posixpath.join(STAGING, self.run_id), retry=False)
        except Exception:  # noqa: BLE001 - best effort
            pass


def _check_cover(unit: Any, frags: list[dict[str, Any]]) -> None:
    """Raise :class:`RunError` unless the fragments ``frags`` of ``unit`` hold each of its
    rows once, in row order (sorted by their first row, each a run of consecutive rows)."""
    frags = sorted(frags, key=lambda r: r["first_row"])
    at = unit.split.start
    for r in frags:
        if r["first_row"] != at or not r.get("consecutive", False):
            raise RunError(f"{unit.part} ({unit.shard.url!r}): its output rows do not cover rows "
                           f"{unit.split.start}..{unit.split.start + unit.num_rows - 1} once each, in order "
                           f"(a fragment holds rows {r['first_row']}..{r['last_row']}, {r['rows']} rows)")
        at += r["rows"]
    if at != unit.split.start + unit.num_rows:
        raise RunError(f"{unit.part}: {at - unit.split.start} of its {unit.num_rows} rows came back")


def _as_unit(unit: Any, rows: int):
    """A :class:`pipeline.input.units.Unit` from a Unit, a one-unit Shard or a bare shard index."""
    if isinstance(unit, int):
        return Unit(Shard(index=unit, url=None, format="jsonl", num_rows=rows), 0, Split(0, rows))
    if isinstance(unit, Shard):
        units = unit.units()
        if len(units) != 1:
            raise ValueError(f"shard {unit.url!r} has {len(units)} units: give write_part one of them")
        return units[0]
    return unit
