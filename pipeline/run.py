"""One job, top to bottom: check -> read -> prompt/generate (actor pool) -> write -> summary.

:func:`run_job` first checks everything that can be checked cheaply in the driver (config,
input shards, model paths and architectures, the prompt template rendered once, the output
location and its manifest), so a bad job fails before Ray starts any actor.  Then it
builds the Ray Data dataset::

    shards (one item each) --map_batches(read_shards_batch)--> rows (INPUT_SCHEMA)
      --pipeline.processor.Processor:
          repartition(rows_per_batch rows per block)--> balanced blocks
          --map_batches(GenerateActor, actor pool)--> rows (OUTPUT_SCHEMA)

(the processor is the public stage users put in their own pipelines: one code path)

and streams the result back to the driver, which shows a progress bar of rows done,
writes each shard's rows to staging as they come (at most ``output.max_rows_per_file``
rows of a shard held at a time), commits each shard (its files, then its manifest entry)
as soon as it is complete, and finally writes ``_summary.json`` and ``_SUCCESS`` (see
pipeline.write; the output's layout and the resume check: pipeline.output).

Resource plan.  The read and repartition stages ask Ray for no CPU (they are I/O and
slicing, at most two read tasks at a time), so they never wait behind an actor pool that
holds every CPU (``num_actors x cpus_per_actor`` = the cluster's CPUs, the normal plan on
a GPU node: one actor per GPU).  A plan that asks for more CPUs or GPUs than the cluster
has (or than any one node has, per actor) is refused with the numbers (:class:`PlanError`;
on a cluster that may autoscale it is only logged).  Whatever the cause, a run whose
driver receives no output row for ``compute.stall_timeout_s`` fails with
:class:`StallError` instead of waiting forever.

Reliability.  Shards already committed in the output by an earlier run of the same job
(same input, same config fingerprint) are skipped (resume; ``output.overwrite`` starts
afresh).  A dead actor is restarted by Ray (``compute.max_actor_restarts``) and its batch
resubmitted (``compute.max_batch_retries``); if Ray gives up, or the pool cannot run
(every actor dead), the dataset raises and the run fails with the shards committed so far
intact.  Storage calls are retried with backoff within timeouts and a deadline
(``retry:``).  A run that fails or is interrupted leaves no ``_SUCCESS``; rerunning it
does only the shards that are missing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import logging
import os
import platform
import re
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pyarrow as pa

from pipeline.config import ConfigError, JobConfig, JobRefused
from pipeline.engine import GenerationSettings
from pipeline.fingerprint import config_fingerprint, config_identity
from pipeline.output import part_name
from pipeline.processor import Processor, check_generation, resolve_job_generation  # noqa: F401 (re-exported)
from pipeline.read import Shard, partition_keys, read_shards_batch, resolve_shards
from pipeline.retry import StorageError
from pipeline.schema import INPUT_SCHEMA
from pipeline.summary import RunTotals
from pipeline.write import OutputWriter

log = logging.getLogger("specbatch")
REPO_ROOT = Path(__file__).resolve().parents[1]


class RunError(RuntimeError):
    """The run finished but its output does not match its input (rows lost or duplicated)."""


class PlanError(JobRefused):
    """The actor pool asks for more CPUs or GPUs than the cluster (or any one node) has."""


class StallError(RuntimeError):
    """No output row came back for ``compute.stall_timeout_s`` seconds."""


class ActorPoolError(RuntimeError):
    """The actor pool gave up: an actor died more often than ``compute.max_actor_restarts``
    allows, a batch whose actor kept dying was resubmitted ``compute.max_batch_retries``
    times, or an actor was lost with a batch in flight (its node died, or it could not be
    reached: Ray's ``ActorUnavailableError``, which it does not resubmit); raised from
    Ray's own error."""


def preflight(cfg: JobConfig) -> tuple[list[Shard], OutputWriter, GenerationSettings]:
    """Every check that needs no model weights and no Ray.

    Returns the shards, the writer (holding the output's lease: the caller releases it with
    ``writer.release_lease()``), and the generation settings every row is decoded with
    (the job's ``generation:`` with the target checkpoint's defaults filled in; the actors'
    engines resolve the same ones).

    Raises:
        InputError, ModelError, OutputError, ConfigError (all :class:`JobRefused`): a bad
            input, model (path, architecture, vocabulary), prompt or chat template, generation
            setting (explicit or the checkpoint's), or output location (foreign files, another
            config or input committed there).
        LeaseHeld (a :class:`JobRefused`): another run holds the output's lease.
        StorageError: the storage kept failing with transient errors.
    """
    shards = resolve_shards(cfg.input, cfg.retry, cfg.output)
    generation = check_generation(cfg)  # models, the template rendered once, generation settings
    writer = OutputWriter(cfg.output, retry=cfg.retry)
    identity = run_identity(cfg, generation, shards)
    writer.acquire_lease(config_fingerprint(identity))  # before the manifest is read: one run at a time
    writer.extra_columns = partition_keys(shards)
    try:
        writer.skip = writer.prepare(shards, identity)
    except BaseException as e:
        writer.abandon_lease() if isinstance(e, StorageError) else writer.release_lease()
        raise
    return shards, writer, generation


def run_identity(cfg: JobConfig, generation: GenerationSettings, shards: list[Shard]) -> dict[str, Any]:
    """:func:`pipeline.fingerprint.config_identity` of a run: with its resolved generation
    settings (greedy: no sampling settings), and ``input.format`` counted as ``auto`` when
    ``auto`` reads every shard in that format."""
    from pipeline.read import file_kind

    auto = cfg.input.model_copy(update={"format": "auto"})
    as_auto = cfg.input.format != "auto" and bool(shards) and all(
        file_kind(s.url, auto)[0] == s.format for s in shards)
    return config_identity(cfg, generation, format_is_auto=as_auto)


def init_ray(cfg: JobConfig) -> bool:
    """Join a cluster (``ray.address`` or ``RAY_ADDRESS``, as under ``ray job submit``) or
    start an embedded Ray.  Does nothing when Ray is already initialized (tests, notebooks).

    ``ray.init`` replaces the process's SIGTERM handler (with one that exits at once); the
    handler the caller had installed stays in place while Ray starts (:func:`_sigterm_kept`)
    and is put back after (see pipeline.cli: interrupts).

    Returns:
        True when this call started an embedded Ray (its resources are all there will be).
    """
    import ray

    if ray.is_initialized():
        return False
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
    on_main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if on_main else None
    try:
        if address:
            with _sigterm_kept(previous):
                ray.init(address=address, log_to_driver=True)
            return False
        # Embedded: workers inherit this environment, so they can import pipeline/ and actors/.
        root = str(REPO_ROOT)
        pp = os.environ.get("PYTHONPATH", "")
        if root not in pp.split(os.pathsep):
            os.environ["PYTHONPATH"] = root + (os.pathsep + pp if pp else "")
        # Ray >= 2.5x turns token authentication on for a new local cluster (RAY_AUTH_MODE
        # unset) and warns that it did: that is the setting we want, so the warning is noise.
        logging.getLogger("ray._private.authentication.authentication_token_setup").addFilter(_TokenAuthDefault())
        # Actors' own output (a traceback when one dies loading a model, once per restart)
        # goes to Ray's log files, not the job's console: the job reports failures itself.
        with _sigterm_kept(previous):
            ray.init(include_dashboard=False, log_to_driver=False)
        return True
    finally:
        if on_main and callable(previous):
            signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _sigterm_kept(handler) -> Iterator[None]:
    """While Ray starts, the caller's SIGTERM handler (``handler``, when it is one: the job's,
    pipeline.cli) stays the process's, in place of the ones ``ray.init`` installs (Ray's
    driver handler exits with status 15 and no line; its embedded node's drains for up to
    30 s first).  A SIGTERM that comes while ``ray.init`` runs is held until it returns (an
    exception raised inside it, in the middle of an import or of starting the node, would
    leave half a Ray behind to fail at exit), then given to ``handler``: the job stops as at
    any other time, one line and exit 143.  A second SIGTERM meanwhile is given at once.
    With no handler of the caller's (a library user), Ray's are installed as usual."""
    if not callable(handler) or threading.current_thread() is not threading.main_thread():
        yield
        return
    import ray._private.utils as ray_utils

    original = getattr(ray_utils, "set_sigterm_handler", None)
    held: list[int] = []

    def hold(signum, frame) -> None:
        if held:
            handler(signum, frame)
        held.append(signum)

    def keep(sigterm_handler) -> None:
        log.debug("Ray's SIGTERM handler not installed: the job's stays")

    import ray._private.ray_constants as ray_constants

    if original is not None:  # (another Ray version: its handlers are replaced afterwards, by init_ray)
        ray_utils.set_sigterm_handler = keep
    # the driver's C++ core worker would install its failure-signal handler for SIGTERM too
    # (it prints "*** SIGTERM received ***" and aborts, exit -6); Ray's processes keep theirs
    no_cpp_handler = getattr(ray_constants, "RAY_DISABLE_FAILURE_SIGNAL_HANDLER", None)
    ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True
    signal.signal(signal.SIGTERM, hold)
    try:
        yield
    finally:
        if original is not None:
            ray_utils.set_sigterm_handler = original
        ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = no_cpp_handler
        signal.signal(signal.SIGTERM, handler)
        if held:
            handler(held[0], None)


class _TokenAuthDefault(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Token authentication is enabled for this Ray cluster")


def check_resource_plan(cfg: JobConfig, embedded: bool) -> None:
    """Refuse an actor pool the cluster can never hold.

    Raises:
        PlanError: ``num_actors x cpus_per_actor`` CPUs (or ``x gpus_per_actor`` GPUs) are
            more than the cluster has, or one actor's share is more than any one node has;
            only logged when joining a cluster, which an autoscaler may grow.
    """
    import ray

    c = cfg.compute
    total = ray.cluster_resources()
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    problems = []
    for res, per_actor, key in (("CPU", c.cpus_per_actor, "cpus_per_actor"), ("GPU", c.gpus_per_actor, "gpus_per_actor")):
        if not per_actor:
            continue
        need, have = c.num_actors * per_actor, total.get(res, 0)
        if need > have:
            problems.append(f"compute.num_actors={c.num_actors} x compute.{key}={per_actor:g} = {need:g} {res}s, "
                            f"but the cluster has {have:g}")
        biggest = max((n.get(res, 0) for n in nodes), default=0)
        if nodes and per_actor > biggest:
            problems.append(f"compute.{key}={per_actor:g} {res}s per actor, but no node has more than {biggest:g}")
    if not problems:
        return
    message = "the actor pool cannot be scheduled: " + "; ".join(problems)
    if embedded:
        raise PlanError(message + "; lower compute.num_actors or the per-actor resources")
    log.warning("%s; waiting for the cluster to grow (up to compute.actor_start_timeout_s=%d s)",
                message, c.actor_start_timeout_s)


#: Ray Data console messages that say nothing to a user of this job (they still reach
#: Ray Data's log file): our own progress bar replaces Ray Data's, the run's end is logged
#: by the job itself (Ray Data's "execution finished" also shows on an interrupt), and a
#: failure is reported by the job in one line, its traceback in a log file (pipeline.cli),
#: where Ray Data would print the stack trace again (a 30-line one when an actor died) and
#: ask for a Ray bug report.
_RAY_DATA_NOISE = ("Progress bars disabled", "Progress bars for operators disabled", "Exception occurred in",
                   "Full stack trace", "An exception was raised from a task of operator")
#: ... and those that name the operator first (``MapBatches(GenerateActor): actors died ...``)
_RAY_DATA_NOISE_WITHIN = (": actors died during initialization",)


class _QuietRayData(logging.Filter):
    """Drops Ray Data's info records and known noise; passes every other logger's records
    (a handler of ``ray.data`` may be shared with the root logger, e.g. under pytest)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name != "ray.data" and not record.name.startswith("ray.data."):
            return True
        msg = str(record.msg)
        return (record.levelno >= logging.WARNING and not msg.startswith(_RAY_DATA_NOISE)
                and not any(n in msg for n in _RAY_DATA_NOISE_WITHIN))


def _quiet_ray_data_console() -> None:
    """Show only Ray Data's warnings and errors on the console (minus the known noise)."""
    for handler in logging.getLogger("ray.data").handlers:
        if not isinstance(handler, logging.FileHandler) and not any(isinstance(f, _QuietRayData) for f in handler.filters):
            handler.addFilter(_QuietRayData())


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


def build_dataset(cfg: JobConfig, shards: list[Shard], generation: GenerationSettings | None = None,
                  embedded: bool = False):
    """The lazy Ray Data dataset of output rows (OUTPUT_SCHEMA, then the input's Hive
    partition columns) for ``shards``: the read stage, then the :class:`Processor`."""
    import ray
    from ray.data import TaskPoolStrategy

    _quiet_ray_data_console()
    explain_actor_args_error(cfg)
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # shards finish in order: bounded driver buffer
    ctx.enable_progress_bars = False  # the driver shows one bar of rows done instead
    ctx.print_on_execution_start = False

    items = [s.to_dict() for s in shards]
    ds = ray.data.from_items(items, override_num_blocks=max(1, len(items)))
    ds = ds.map_batches(
        read_shards_batch,
        fn_kwargs={"cfg": cfg.input.model_dump(), "retry": cfg.retry.model_dump(),
                   "partition_keys": partition_keys(shards)},
        batch_size=1,
        batch_format="pyarrow",
        num_cpus=0,  # I/O: never waits behind actors that hold every CPU (see the module docstring)
        compute=TaskPoolStrategy(size=min(2, len(items))),  # shards read at a time (a task holds one shard's rows)
    )
    # INPUT_SCHEMA's text and id columns; the job's own output columns
    return Processor(cfg, generation=generation, text_column="text", id_column="id", columns="job",
                     embedded=embedded)(ds)


def zero_cpu(ds):
    """Make the repartition stage ask for no CPU.  ``Dataset.repartition`` takes no resource
    arguments and its tasks default to 1 CPU, which an actor pool holding every CPU would
    never leave free (the job hung there); its logical operator carries the remote args."""
    args = getattr(getattr(getattr(ds, "_logical_plan", None), "dag", None), "ray_remote_args", None)
    if not isinstance(args, dict):
        raise RuntimeError("this Ray version's repartition operator has no ray_remote_args: "
                           "pipeline.run.zero_cpu needs updating")
    args["num_cpus"] = 0
    return ds


_zero_cpu = zero_cpu


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

    def on_alarm(signum, frame) -> None:
        idle = time.monotonic() - last[0]
        if idle >= timeout_s:
            signal.setitimer(signal.ITIMER_REAL, 0)
            raise StallError(f"no output row came back for {idle:.0f} s (compute.stall_timeout_s={timeout_s:g}): "
                             f"the run is stuck; {describe()}")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    interval = min(timeout_s, 5.0)
    signal.setitimer(signal.ITIMER_REAL, interval, interval)
    try:
        yield beat
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
                f"{c.gpus_per_actor:g} GPU); cluster: {res}.  Committed shards are kept: rerun to resume")

    return describe


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="row", desc="rows done", disable=not enabled, file=sys.stderr, dynamic_ncols=True)


def run_job(cfg: JobConfig, *, progress: bool = True) -> dict[str, Any]:
    """Run one job to completion and return its summary (also written as ``_summary.json``).

    Shards already committed in the output by an earlier run (same source file, same
    fingerprint) are skipped unless ``output.overwrite``; when all are committed and the
    output is complete, nothing is written and the stored summary is returned (with
    ``this_run.nothing_to_do: true``).

    Raises:
        InputError, ModelError, OutputError, ConfigError: before any model loads.
        PlanError: the actor pool is larger than the (embedded) cluster.
        StallError: no output row came back for ``compute.stall_timeout_s``.
        ActorPoolError: actors kept dying: the restarts or the batch retries ran out.
        StorageError: a storage call failed after its retries or its deadline.
        RunError: the output rows do not match the input rows.
        LeaseHeld: another run holds the output's lease (before any work); LeaseLost:
            this run lost it (it publishes nothing more).
        Any Ray error during the run, or KeyboardInterrupt; the output then has no
        ``_SUCCESS``, and the shards committed before stay committed.
    """
    started = _dt.datetime.now(_dt.timezone.utc)
    t0 = time.perf_counter()
    shards, writer, generation = preflight(cfg)
    try:
        return _run_leased(cfg, shards, writer, generation, started, t0, progress)
    finally:
        writer.release_lease()  # every exit path this process lives through; a killed one's goes stale


def _run_leased(cfg: JobConfig, shards: list[Shard], writer: OutputWriter, generation: GenerationSettings,
                started: _dt.datetime, t0: float, progress: bool) -> dict[str, Any]:
    """:func:`run_job` after its preflight, holding the output's lease."""
    skip: set[int] = writer.skip
    todo = [s for s in shards if s.index not in skip]
    if writer.location.nothing_to_do:
        log.info("%s is complete: all %d shards committed; nothing to do", writer.location.url(), len(shards))
        summary = writer.location.read_summary()
        summary["this_run"] = {"run_id": writer.run_id, "nothing_to_do": True, "shards_run": [],
                               "shards_skipped": [part_name(s.index) for s in shards]}
        return summary
    total_rows = sum(s.num_rows for s in todo)
    log.info("%d shards (%d committed earlier, skipped), %d rows to do -> %s (run %s)",
             len(shards), len(skip), total_rows, writer.location.url(), writer.run_id)
    try:
        totals = RunTotals()  # this run's rows
        shard_totals: dict[str, RunTotals] = {}  # shards in flight
        counts: dict[str, int] = {s.url: 0 for s in todo}
        by_url = {s.url: s for s in todo}

        for s in todo:
            if s.num_rows == 0:
                writer.finish_shard(s, RunTotals().state())
        t_gen = time.perf_counter()
        first: tuple[float, int] | None = None  # (seconds to the first output batch, its new tokens)
        if total_rows:
            embedded = init_ray(cfg)
            ds = build_dataset(cfg, [s for s in todo if s.num_rows], generation, embedded=embedded)
            describe = _stall_report(cfg, lambda: totals.rows, total_rows)
            with _progress(total_rows, progress) as bar, stall_guard(cfg.compute.stall_timeout_s, describe) as beat:
                for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
                    beat()
                    if batch.num_rows == 0:
                        continue
                    batch = _with_audit_column(batch)
                    totals.add(batch)
                    if first is None:
                        first = (time.perf_counter() - t_gen, totals.to_dict()["new_tokens"])
                    for url, sub in _split_by_shard(batch):
                        if url not in by_url:
                            raise RunError(f"output row from unknown shard {url!r}")
                        shard = by_url[url]
                        counts[url] += sub.num_rows
                        if counts[url] > shard.num_rows:
                            raise RunError(f"shard {url!r}: more output rows than its {shard.num_rows} input rows")
                        writer.add_rows(shard, sub)
                        shard_totals.setdefault(url, RunTotals()).add(sub)
                        if counts[url] == shard.num_rows:
                            writer.finish_shard(shard, shard_totals.pop(url).state())
                    bar.update(batch.num_rows)
        generate_elapsed = time.perf_counter() - t_gen
        missing = {u: (counts[u], by_url[u].num_rows) for u in counts if counts[u] != by_url[u].num_rows}
        if missing:
            raise RunError(f"rows missing from the output (got, expected) per shard: {missing}")
        overall = RunTotals()  # every committed shard: earlier runs' and this run's
        entries = [writer.entries[k] for k in sorted(writer.entries)]
        for e in entries:
            overall.merge(e.get("totals"))
        this = totals.to_dict(generate_elapsed_s=generate_elapsed)
        summary = {
            "run_id": writer.run_id,
            "status": "succeeded",
            "output": writer.location.url(),
            "run_date": cfg.output.effective_run_date() if cfg.output.partition_by_date else None,
            "started_at": started.isoformat(),
            "finished_at": _dt.datetime.now(_dt.timezone.utc).isoformat(),
            "elapsed_s": time.perf_counter() - t0,
            "shards": len(shards),
            **overall.to_dict(),
            "generate_elapsed_s": generate_elapsed,
            "tokens_per_s": this["tokens_per_s"],  # this run's new tokens / this run's generate time
            **_first_batch(first),
            "audit": {"fraction": cfg.audit.fraction, "seed": cfg.audit.seed,
                      "greedy": not generation.do_sample},
            # the settings rows were decoded with: generation: plus the checkpoint's defaults
            "generation": dataclasses.asdict(generation),
            "this_run": {
                "run_id": writer.run_id,
                "nothing_to_do": False,
                "shards_run": [part_name(s.index) for s in todo],
                "shards_skipped": [part_name(i) for i in sorted(skip)],
                "rows": this["rows"], "errors": this["errors"], "new_tokens": this["new_tokens"],
                "audit_rows": this["audit_rows"], "audit_mismatches": this["audit_mismatches"],
            },
            "runs": sorted({e.get("run_id") for e in entries if e.get("run_id")}),
            "parts": [{k: e.get(k) for k in ("part", "files", "source_file", "rows", "errors", "run_id")}
                      for e in entries],
            "config": cfg.resolved(),
            "config_fingerprint": writer.config_fingerprint,
            "environment": _environment(),
        }
        expected = sum(s.num_rows for s in shards)
        if overall.rows != expected:
            raise RunError(f"committed rows {overall.rows} != input rows {expected}")
        writer.commit(summary)
        log.info("run %s committed: %d rows (%d errors) in %s; this run: %d shards, %d skipped",
                 writer.run_id, overall.rows, overall.errors, writer.location.url(), len(todo), len(skip))
        if overall.audit_rows:
            log.info("audit: %d rows re-decoded with plain decoding, %d mismatches",
                     overall.audit_rows, overall.audit_mismatches)
        return summary
    except BaseException as e:
        # a failing storage would make the clean-up hang too: a later successful run removes it,
        # and the lease is left to go stale (a rerun in this process takes it over at once)
        writer.abort(cleanup=not isinstance(e, StorageError))
        if isinstance(e, StorageError):
            writer.abandon_lease()
        pool = _actor_pool_failure(cfg, e, started)
        if pool is not None:
            raise ActorPoolError(pool) from e
        raise


def _actor_pool_failure(cfg: JobConfig, e: BaseException, started: _dt.datetime) -> str | None:
    """What ran out when the run failed on a dead actor (Ray's actor table: this run's pool
    actors, their restarts and state), or None when ``e`` is no such failure (or the table
    cannot be read).  An actor that died in its constructor (a model that does not load) is
    left to Ray's own message, which carries the cause."""
    try:
        from ray.exceptions import ActorUnavailableError, RayActorError

        died = _raised_from(e, RayActorError)  # Ray Data may raise it from another error
        # an exception in the constructor (a model that does not load) carries its cause; a
        # process killed while it restarts (in its constructor again) is a death like another
        if died is None or getattr(died, "actor_init_failed", False):
            return None
        e = died
        if isinstance(e, ActorUnavailableError) or _NODE_DIED.search(str(e)):
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
    return None


def _raised_from(e: BaseException | None, kind: type) -> BaseException | None:
    """``e`` or the first exception of kind ``kind`` it was raised from (its cause or context)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, kind):
            return e
        e = e.__cause__ or e.__context__
    return None


#: Ray's words for an actor whose node died (``ActorDiedError``: "... because its node has died")
_NODE_DIED = re.compile(r"\bnode\b[^\n]*\b(died|dead|lost)\b", re.I)


def _lost_actor(e: BaseException) -> str:
    """The line for an actor that went away with a batch in flight: its node was lost (the
    raylet and its processes killed, the machine gone) or it could not be reached.  Ray
    does not resubmit a batch that may have run on an actor it could not reach, so the
    run stops; the rerun does only the shards not committed."""
    try:
        import ray

        dead = sum(not n.get("Alive") for n in ray.nodes())
    except Exception:  # noqa: BLE001 - the node table is an aid to the message only
        dead = 0
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


def _with_audit_column(batch: pa.Table) -> pa.Table:
    """Batches from an actor of an older schema have no ``audit`` column: add a null one."""
    if "audit" in batch.column_names:
        return batch
    return batch.append_column("audit", pa.nulls(batch.num_rows, pa.bool_()))


def _first_batch(first: tuple[float, int] | None) -> dict[str, Any]:
    """``first_batch_s``: seconds from the dataset start to the first output batch (actor
    start-up, model loading and one batch): the pipeline's fixed start-up cost."""
    return {"first_batch_s": first[0] if first else None}


def _split_by_shard(batch: pa.Table):
    urls = batch.column("source_file").to_pylist()
    if len(set(urls)) == 1:
        yield urls[0], batch
        return
    import pyarrow.compute as pc

    for url in dict.fromkeys(urls):
        yield url, batch.filter(pc.equal(batch.column("source_file"), url))


def _environment() -> dict[str, Any]:
    env: dict[str, Any] = {"python": platform.python_version(), "host": socket.gethostname()}
    for mod in ("torch", "transformers", "ray", "pyarrow"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:
            pass
    return env


__all__ = ["run_job", "preflight", "build_dataset", "init_ray", "check_resource_plan", "stall_guard",
           "RunError", "PlanError", "StallError", "ActorPoolError", "INPUT_SCHEMA"]
