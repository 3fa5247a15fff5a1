"""One job, top to bottom: check -> read -> prompt/generate (actor pool) -> write -> commit -> summary.

:func:`run_job` first checks everything that can be checked cheaply in the driver (config,
input shards and their units, model paths and architectures, the prompt template
rendered once, the output location, its manifest and the resume plan), so a bad job fails
before Ray starts any actor.  Then it builds the Ray Data dataset::

    units (one item each) --map_batches(read_units_batch)--> one block of rows per unit (INPUT_SCHEMA, _unit)
      --pipeline.processor.Processor (rebatch=False): each unit's block decoded by one actor task,
          rows_per_batch rows per call, in order --> rows (OUTPUT_SCHEMA, _unit)
      --map_batches(OutputWriter.write, on the workers)--> staged Parquet fragments; one record each

(the processor is the public stage users put in their own pipelines: one code path) and
streams the write stage's *records* back to the driver (never the rows: its memory stays
flat as rows grow), which shows a progress bar of rows done and commits each unit (its
files, then its manifest entry) as soon as its records cover its rows, in the order
units complete (no ``preserve_order``), and finally writes ``_summary.json`` and
``_SUCCESS`` (pipeline.output.writer; the layout: pipeline.layout; the resume plan:
pipeline.output.resume).  Ray set-up and the resource plan: pipeline.ray_setup.  Whatever
the cause, a run whose driver receives no record for ``compute.stall_timeout_s`` fails
with :class:`StallError` instead of waiting forever (a record comes when a unit's rows
are written: the timeout must be longer than one unit's work).

Nightly reuse (``output.previous``, :mod:`pipeline.reuse`): the previous output is resolved
and checked in the preflight (a folder that is not a job output is refused); once Ray runs,
its committed rows are read by one task into a table the actors share, and a row whose reuse
key it holds is copied, not decoded.

Reliability.  Units already committed in the output by an earlier run of the same job
(same input, same config fingerprint) are skipped (resume; ``output.overwrite`` starts
afresh), so an interrupt loses at most the units in flight.  A dead actor is restarted by
Ray (``compute.max_actor_restarts``) and its batch resubmitted
(``compute.max_batch_retries``); if Ray gives up, or the pool cannot run (every actor
dead), the dataset raises and the run fails with the units committed so far intact.
Storage calls are retried with backoff within timeouts and a deadline (``retry:``).  A
run that fails or is interrupted leaves no ``_SUCCESS``; rerunning it does only the units
that are missing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import datetime as _dt
import logging
import re
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator


from pipeline.config import JobConfig
from pipeline.engine import GenerationSettings
from pipeline.errors import raised_from
from pipeline.fingerprint import config_fingerprint, config_identity
from pipeline.output import OutputWriter, ResumePlan, RunError, listing_view
from pipeline.processor import (Processor, check_generation, check_generation_and_vocabulary,  # noqa: F401
                                resolve_job_generation)
from pipeline.ray_setup import (PlanError, check_resource_plan, init_ray, open_load_board,  # noqa: F401
                                quiet_ray_data_console, read_load_board)
from pipeline.input import Shard, carried_columns, partition_keys, read_units_batch, resolve_shards, units_of
from pipeline.retry import StorageError
from pipeline.reuse import ReusePlan, plan_reuse, share_previous
from pipeline.schema import INPUT_SCHEMA
from pipeline.summary import RunFacts, RunTotals, cpu_summary, run_summary, stored_summary
from pipeline.switches import check_environment

log = logging.getLogger("specbatch")
REPO_ROOT = Path(__file__).resolve().parents[1]


class StallError(RuntimeError):
    """No output row came back for ``compute.stall_timeout_s`` seconds."""


class ActorPoolError(RuntimeError):
    """The actor pool gave up: an actor died more often than ``compute.max_actor_restarts``
    allows, a batch whose actor kept dying was resubmitted ``compute.max_batch_retries``
    times, or an actor was lost with a batch in flight (its node died, or it could not be
    reached: Ray's ``ActorUnavailableError``, which it does not resubmit); raised from
    Ray's own error."""


@dataclasses.dataclass
class Preflight:
    """What :func:`preflight` found: the input's shards, the resume plan (its ``todo``
    units are this run's), the writer (holding the output's lease), the generation
    settings every row is decoded with, and what rows are copied from (``output.previous``)."""

    shards: list[Shard]
    plan: ResumePlan
    writer: OutputWriter
    generation: GenerationSettings
    reuse: ReusePlan
    #: the input columns the read stage carries to the actors and the output keeps (after the
    #: partition keys), or None: the prompt is the text column alone (:func:`pipeline.input.carried_columns`)
    carry: list[str] | None = None


def preflight(cfg: JobConfig) -> Preflight:
    """Every check that needs no model weights and no Ray, the environment's switches first
    (:func:`pipeline.switches.check_environment`).

    The writer holds the output's lease: the caller releases it with
    ``writer.release_lease()``.  The generation settings are the job's ``generation:``
    with the target checkpoint's defaults filled in, resolved here once and handed to the actors.

    Raises:
        InputError, ModelError, OutputError, ConfigError (all :class:`JobRefused`): a bad
            ``SPECBATCH_*`` environment variable, input, model (path, architecture, vocabulary), prompt or chat template, generation
            setting (explicit or the checkpoint's), or output location (foreign files, another
            config or input committed there, units of another ``input.split_rows``).
        OutputReadError (a :class:`JobRefused`): ``output.previous`` names a folder that is not
            a job output (:func:`pipeline.reuse.plan_reuse`).
        LeaseHeld (a :class:`JobRefused`): another run holds the output's lease.
        StorageError: the storage kept failing with transient errors.
    """
    check_environment()  # the SPECBATCH_* switches, before an actor would die of a bad one
    every = cfg.task.name == "generate"  # the generate job keeps every input column on output
    need = cfg.prompt_columns()
    shards = resolve_shards(cfg.input, cfg.retry, listing_view(cfg.output, cfg.retry), columns=need, list_columns=every)
    carry = carried_columns(shards, need, every, cfg.input.id_column, cfg.input.text_column)
    generation, vocab_size = check_generation_and_vocabulary(cfg)  # models, the template once, generation settings
    writer = OutputWriter(cfg.output, retry=cfg.retry, extra_columns=partition_keys(shards) + list(carry or []),
                          split_rows=cfg.input.split_rows)
    identity = run_identity(cfg, generation, shards)
    reuse = plan_reuse(cfg, identity, greedy=not generation.do_sample, own_url=writer.location.url())
    reuse.vocab_size = vocab_size
    writer.acquire_lease(config_fingerprint(identity))  # before the manifest is read: one run at a time
    try:
        plan = writer.on_write_start(units_of(shards), identity)
    except BaseException as e:
        writer.abandon_lease() if isinstance(e, StorageError) else writer.release_lease()
        raise
    return Preflight(shards, plan, writer, generation, reuse, carry)


def run_identity(cfg: JobConfig, generation: GenerationSettings, shards: list[Shard]) -> dict[str, Any]:
    """:func:`pipeline.fingerprint.config_identity` of a run: with its resolved generation
    settings (greedy: no sampling settings), and ``input.format`` counted as ``auto`` when
    ``auto`` reads every shard in that format."""
    from pipeline.input import file_kind

    auto = cfg.input.model_copy(update={"format": "auto"})
    as_auto = cfg.input.format != "auto" and bool(shards) and all(
        file_kind(s.url, auto)[0] == s.format for s in shards)
    return config_identity(cfg, generation, format_is_auto=as_auto)


_EXPLAINED: set[str] = set()


def explain_actor_args_error(cfg: JobConfig) -> None:
    """Say once, in one INFO line, what Ray's ``ERROR ... has constructor arguments in the
    object store and max_restarts > 0`` means (ray-project/ray#53727, #57733).  Ray's driver
    logs it (from C++, to stderr: no logging filter reaches it) for every actor pool with
    restarts: Ray Data always hands each actor its code and constructor arguments by object
    reference (``ray.put`` of the map transformer), whatever their size, so it cannot be
    avoided by passing less (the job passes the config as plain data, a few KB).  The
    reference is held by the dataset for the whole run, so a restart finds it."""
    if cfg.compute.max_actor_restarts <= 0 or "actor-args" in _EXPLAINED:
        return
    _EXPLAINED.add("actor-args")
    log.info("Ray logs an ERROR that the actor pool 'has constructor arguments in the object store and "
             "max_restarts > 0': Ray Data passes every actor its code by object reference, which this run holds "
             "until it ends, so restarts (compute.max_actor_restarts=%d) find it; nothing to do (Ray issue 53727)",
             cfg.compute.max_actor_restarts)


def build_dataset(cfg: JobConfig, units: list, writer: OutputWriter, generation: GenerationSettings | None = None,
                  embedded: bool = False, partition_columns: list[str] | None = None,
                  reuse: dict[str, Any] | None = None, load_board=None, carry: list[str] | None = None):
    """The lazy Ray Data dataset of the write stage's records (one per staged fragment,
    :data:`pipeline.output.records.FRAGMENT_SCHEMA`) for ``units``: the read stage (one
    block per unit), the :class:`Processor` (with the run's ``reuse``:
    :func:`pipeline.reuse.share_previous`, and ``load_board``, where its actors post their
    loads' facts), then the write phase on the workers (:meth:`OutputWriter.write`)."""
    import ray
    from ray.data import TaskPoolStrategy

    quiet_ray_data_console()
    explain_actor_args_error(cfg)
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = False  # units commit as they complete: a slow one holds back none
    ctx.enable_progress_bars = False  # the driver shows one bar of rows done instead
    ctx.print_on_execution_start = False

    items = [{"unit": json.dumps(u.to_dict())} for u in units]
    ds = ray.data.from_items(items, override_num_blocks=max(1, len(items)))
    ds = ds.map_batches(
        read_units_batch,
        fn_kwargs={"cfg": cfg.input.model_dump(), "retry": cfg.retry.model_dump(),
                   "partition_keys": list(partition_columns or []), "carry": carry},
        batch_size=1,
        batch_format="pyarrow",
        num_cpus=0,  # I/O: never waits behind actors that hold every CPU (pipeline.ray_setup)
        compute=TaskPoolStrategy(size=min(2, len(items))),  # units read at a time (a task holds one unit's rows)
    )
    # INPUT_SCHEMA's text and id columns; the job's own output columns; one actor task per unit
    ds = Processor(cfg, generation=generation, text_column="text", id_column="id", columns="job",
                   embedded=embedded, rebatch=False, reuse=reuse, load_board=load_board, carry=carry)(ds)
    return ds.map_batches(OutputWriter.write, fn_kwargs=writer.write_kwargs(), batch_size=None,
                          batch_format="pyarrow", num_cpus=0)


@contextlib.contextmanager
def stall_guard(timeout_s: float, describe: Callable[[], str]) -> Iterator[Callable[[], None]]:
    """Raise :class:`StallError` in the main thread when the returned ``beat()`` has not
    been called for ``timeout_s`` seconds (checked every ``min(timeout_s, 5)`` s with
    SIGALRM, which also interrupts a blocking wait on Ray).  Off in other threads."""
    last = [time.monotonic()]

    def beat() -> None:
        last[0] = time.monotonic()

    if threading.current_thread() is not threading.main_thread():
        yield beat
        return

    fired: list[StallError] = []

    def on_alarm(signum, frame) -> None:
        idle = time.monotonic() - last[0]
        if idle >= timeout_s:
            signal.setitimer(signal.ITIMER_REAL, 0)
            fired.append(StallError(f"no output row came back for {idle:.0f} s (compute.stall_timeout_s={timeout_s:g}): "
                                    f"the run is stuck; {describe()}"))
            raise fired[0]

    previous = signal.signal(signal.SIGALRM, on_alarm)
    interval = min(timeout_s, 5.0)
    signal.setitimer(signal.ITIMER_REAL, interval, interval)
    try:
        yield beat
    except BaseException as e:
        # the alarm may land inside code that re-raises what it interrupted as something else
        # (a C call: SystemError "returned a result with an exception set"; Ray Data replaces
        # that error's cause): the stall is still the reason the run stopped
        if fired and not isinstance(e, StallError):
            raise fired[0] from e
        raise
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _stall_report(cfg: JobConfig, done: Callable[[], int], total: int) -> Callable[[], str]:
    def describe() -> str:
        try:
            import ray

            have, free = ray.cluster_resources(), ray.available_resources()
            res = ", ".join(f"{k} {free.get(k, 0):g} free of {have[k]:g}" for k in ("CPU", "GPU") if k in have)
        except Exception:  # noqa: BLE001 - best effort
            res = "unknown"
        c = cfg.compute
        return (f"{done()} of {total} rows done; actor pool {c.num_actors} x ({c.cpus_per_actor:g} CPU, "
                f"{c.gpus_per_actor:g} GPU); cluster: {res}.  Committed units are kept: rerun to resume")

    return describe


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="row", desc="rows done", disable=not enabled, file=sys.stderr, dynamic_ncols=True)


def run_job(cfg: JobConfig, *, progress: bool = True) -> dict[str, Any]:
    """Run one job to completion and return its summary (also written as ``_summary.json``).

    Units already committed in the output by an earlier run (same source file, same
    fingerprint, same units) are skipped unless ``output.overwrite``; when all are
    committed and the output is complete, nothing is written and the stored summary is
    returned (with ``this_run.nothing_to_do: true``).

    Raises:
        InputError, ModelError, OutputError, ConfigError: before any model loads.
        PlanError: the actor pool is larger than the (embedded) cluster.
        StallError: no unit's rows came back for ``compute.stall_timeout_s``.
        ActorPoolError: actors kept dying: the restarts or the batch retries ran out.
        StorageError: a storage call failed after its retries or its deadline.
        RunError: the output rows do not match the input rows.
        LeaseHeld: another run holds the output's lease (before any work); LeaseLost:
            this run lost it (it publishes nothing more).
        Any Ray error during the run, or KeyboardInterrupt; the output then has no
        ``_SUCCESS``, and the units committed before stay committed.
    """
    started = _dt.datetime.now(_dt.timezone.utc)
    t0 = time.perf_counter()
    pre = preflight(cfg)
    try:
        return _run_leased(cfg, pre, started, t0, progress)
    finally:
        pre.writer.release_lease()  # every exit path this process lives through; a killed one's goes stale


def _run_leased(cfg: JobConfig, pre: Preflight, started: _dt.datetime, t0: float, progress: bool) -> dict[str, Any]:
    """:func:`run_job` after its preflight, holding the output's lease."""
    plan, writer = pre.plan, pre.writer
    if plan.nothing_to_do:
        log.info("%s is complete: all %d parts committed; nothing to do", writer.location.url(), len(plan.done))
        return stored_summary(writer.location.read_summary(), writer.run_id, plan.done)
    total_rows = sum(u.num_rows for u in plan.todo)
    log.info("%d shards in %d units (%d committed earlier, skipped), %d rows to do -> %s (run %s)",
             len(pre.shards), len(plan.todo) + len(plan.done), len(plan.done), total_rows, writer.location.url(),
             writer.run_id)
    try:
        generate_elapsed, first, loads = _decode_and_commit(cfg, pre, total_rows, progress)
        summary = _finish(cfg, pre, started, t0, generate_elapsed, first, loads)
        writer.on_write_complete(summary)
        log.info("run %s committed: %d rows (%d errors) in %s; this run: %d units, %d skipped", writer.run_id,
                 summary["rows"], summary["errors"], writer.location.url(), len(plan.todo), len(plan.done))
        if summary["audit_rows"]:
            log.info("audit: %d rows re-decoded with plain decoding, %d mismatches",
                     summary["audit_rows"], summary["audit_mismatches"])
        return summary
    except BaseException as e:
        writer.on_write_failed(e)  # committed units stay; after a storage failure the lease is left to go stale
        pool = _actor_pool_failure(cfg, e, started)
        if pool is not None:
            raise ActorPoolError(pool) from e
        raise


def with_expected_tokens(cfg: JobConfig, rows: int, generation: GenerationSettings) -> JobConfig:
    """``cfg`` with ``cpu.expected_tokens`` set, when left null, to what one actor of the pool is
    expected to decode: its share of ``rows`` (over the pool's smallest size) x
    ``generation.max_new_tokens`` x (1 + ``audit.fraction``, the plain re-decoding of audited
    rows).  The actor's load compiles only what these tokens repay (:mod:`pipeline.engine.cpu.payoff`)."""
    if cfg.cpu.expected_tokens is not None:
        return cfg
    per_actor = -(-rows // max(1, cfg.compute.min_actors))
    tokens = int(per_actor * generation.max_new_tokens * (1 + cfg.audit.fraction))
    return cfg.model_copy(update={"cpu": cfg.cpu.model_copy(update={"expected_tokens": tokens})})


def _decode_and_commit(cfg: JobConfig, pre: Preflight, total_rows: int,
                       progress: bool) -> tuple[float, float | None, list]:
    """Decode this run's units on the actor pool and commit each as its records come back.
    Returns the seconds of the Ray Data stage and to the first unit's records (None: no rows),
    and the actors' load facts (this run's own load board: :func:`pipeline.ray_setup.open_load_board`).

    Raises:
        RunError: a unit's rows did not all come back.
    """
    writer = pre.writer
    cfg = with_expected_tokens(cfg, total_rows, pre.generation)
    for u in pre.plan.todo:
        if u.num_rows == 0:
            writer.write_part(u, _empty_rows(writer))  # an empty file: no rows to decode
    t_gen = time.perf_counter()
    first: float | None = None
    loads: list = []
    if total_rows:
        embedded = init_ray(cfg)
        board = open_load_board()
        ds = build_dataset(cfg, [u for u in pre.plan.todo if u.num_rows], writer, pre.generation, embedded=embedded,
                           partition_columns=[c for c in writer.extra_columns if c not in (pre.carry or [])],
                           reuse=share_previous(pre.reuse, cfg), load_board=board, carry=pre.carry)
        describe = _stall_report(cfg, lambda: writer.totals.rows, total_rows)
        with _progress(total_rows, progress) as bar, stall_guard(cfg.compute.stall_timeout_s, describe) as beat:
            for records in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
                beat()
                if records.num_rows == 0:
                    continue
                if first is None:
                    first = time.perf_counter() - t_gen
                before = writer.totals.rows
                writer.add_fragments(records)
                bar.update(writer.totals.rows - before)
        loads = read_load_board(board)
    generate_elapsed = time.perf_counter() - t_gen
    missing = writer.missing()
    if missing:
        raise RunError(f"rows missing from the output (got, expected) per unit: {dict(list(missing.items())[:10])}"
                       + (f" and {len(missing) - 10} more units" if len(missing) > 10 else ""))
    return generate_elapsed, first, loads


def _finish(cfg: JobConfig, pre: Preflight, started: _dt.datetime, t0: float, generate_elapsed: float,
            first: float | None, loads: list) -> dict[str, Any]:
    """The run summary (:func:`pipeline.summary.run_summary`) over every committed unit, with
    the actors' load facts ``loads`` (:func:`pipeline.summary.cpu_summary`).

    Raises:
        RunError: the committed rows are not the input's.
    """
    writer = pre.writer
    entries = [writer.entries[k] for k in sorted(writer.entries)]
    overall = RunTotals()  # every committed part: earlier runs' and this run's
    for e in entries:
        overall.merge(e.totals)
    expected = sum(s.num_rows for s in pre.shards)
    if overall.rows != expected:
        raise RunError(f"committed rows {overall.rows} != input rows {expected}")
    facts = RunFacts(
        run_id=writer.run_id, output=writer.location.url(),
        run_date=cfg.output.effective_run_date() if cfg.output.partition_by_date else None,
        started_at=started.isoformat(), finished_at=_dt.datetime.now(_dt.timezone.utc).isoformat(),
        elapsed_s=time.perf_counter() - t0, shards=len(pre.shards), units=len(pre.plan.todo) + len(pre.plan.done),
        generate_elapsed_s=generate_elapsed, first_batch_s=first,
        audit={"fraction": cfg.audit.fraction, "seed": cfg.audit.seed, "greedy": not pre.generation.do_sample},
        generation=dataclasses.asdict(pre.generation), config=cfg.resolved(),
        config_fingerprint=writer.config_fingerprint, previous=pre.reuse.facts(),
        cpu=cpu_summary(loads))  # the actors' CPU plans (this run's load board)
    return run_summary(facts, overall, writer.totals, entries, [u.part for u in pre.plan.todo], pre.plan.done)


def _empty_rows(writer: OutputWriter):
    """An empty table of the writer's output schema (an empty unit's file)."""
    from pipeline.schema import output_schema

    return output_schema(writer.extra_columns).empty_table()


def _actor_pool_failure(cfg: JobConfig, e: BaseException, started: _dt.datetime) -> str | None:
    """What ran out when the run failed on a dead actor (Ray's actor table: this run's pool
    actors, their restarts and state), or None when ``e`` is no such failure (or the table
    cannot be read).  An actor that died in its constructor (a model that does not load) is
    left to Ray's own message, which carries the cause."""
    try:
        from ray.exceptions import ActorUnavailableError, RayActorError

        died = raised_from(e, RayActorError)  # Ray Data may raise it from another error
        # an exception in the constructor (a model that does not load) carries its cause; a
        # process killed while it restarts (in its constructor again) is a death like another
        if died is None or getattr(died, "actor_init_failed", False):
            return None
        e = died
        unreachable = isinstance(e, ActorUnavailableError)
        if _NODE_DIED.search(str(e)) or (unreachable and _dead_nodes()):  # a node was lost: say that first
            return _lost_actor(e)
        from ray._private import state

        since_ms = started.timestamp() * 1000 - 1000
        pool = [a for a in state.actors().values() if str(a.get("ActorClassName", "")).startswith("MapWorker(")
                and (a.get("StartTime") or 0) >= since_ms]
    except Exception:  # noqa: BLE001 - the table is an aid to the message only
        return None
    c = cfg.compute
    restarts = sum(a.get("NumRestarts") or 0 for a in pool)
    if any(a.get("State") == "DEAD" and (a.get("NumRestarts") or 0) >= c.max_actor_restarts for a in pool):
        times = c.max_actor_restarts + 1
        return (f"the actor pool ran out of restarts: an actor died {times} time{'s' if times > 1 else ''}, and "
                f"compute.max_actor_restarts={c.max_actor_restarts} allows {c.max_actor_restarts} restarts "
                f"({type(e).__name__}: {_first_line(e)}); a row that kills its process (out of memory?) or a "
                "failing node: find it in Ray's logs, then rerun to resume")
    if restarts:
        return (f"a batch failed after compute.max_batch_retries={c.max_batch_retries} resubmissions: its actor "
                f"kept dying ({restarts} actor restarts so far, compute.max_actor_restarts={c.max_actor_restarts}; "
                f"{type(e).__name__}: {_first_line(e)}); a row that kills its process (out of memory?) or a failing "
                "node: find it in Ray's logs, then rerun to resume")
    if unreachable:
        return _lost_actor(e)
    return None


def _dead_nodes() -> int:
    """How many nodes Ray's node table lists as dead (0 when it cannot be read)."""
    try:
        import ray

        return sum(not n.get("Alive") for n in ray.nodes())
    except Exception:  # noqa: BLE001 - the node table is an aid to the message only
        return 0


#: Ray's words for an actor whose node died (``ActorDiedError``: "... because its node has died")
_NODE_DIED = re.compile(r"\bnode\b[^\n]*\b(died|dead|lost)\b", re.I)


def _lost_actor(e: BaseException) -> str:
    """The line for an actor that went away with a batch in flight: its node was lost (the
    raylet and its processes killed, the machine gone) or it could not be reached.  Ray
    does not resubmit a batch that may have run on an actor it could not reach, so the
    run stops; the rerun does only the shards not committed."""
    dead = _dead_nodes()
    where = "its node or process went away" + (f"; the cluster lists {dead} dead node(s)" if dead else "")
    text = _first_line(e).replace("The task may or may not have been executed on the actor.", "").strip()
    return (f"the actor pool lost an actor with a batch in flight ({where}) and Ray gave up on that batch, so "
            f"the pool cannot recover in this run ({type(e).__name__}: {_shorten(text, 160)}); rerun the same "
            "command to do only the shards not committed")


def _shorten(text: str, n: int) -> str:
    return text if len(text) <= n else text[:n - 3] + "..."


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[0] if lines else ""


__all__ = ["run_job", "preflight", "Preflight", "build_dataset", "stall_guard",
           "RunError", "StallError", "ActorPoolError", "INPUT_SCHEMA"]
