"""One job, top to bottom: check -> read -> prompt/generate (actor pool) -> write -> summary.

:func:`run_job` first checks everything that can be checked cheaply in the driver (config,
input shards, model paths, output location), so a bad job fails before Ray starts any
actor.  Then it builds the Ray Data dataset::

    shards (one item each) --map_batches(read_shards_batch)--> rows (INPUT_SCHEMA)
      --repartition(rows_per_batch rows per block)--> balanced blocks
      --map_batches(GenerateActor, actor pool)--> rows (OUTPUT_SCHEMA)

and streams the result back to the driver, which shows a progress bar of rows done,
collects each shard's rows and commits that shard (part, then manifest entry) as soon as
the shard is complete, and finally writes ``_summary.json`` and ``_SUCCESS`` (see
pipeline.write).

Reliability.  Shards already committed in the output by an earlier run of the same job
are skipped (resume; ``output.overwrite`` starts afresh).  A dead actor is restarted by
Ray (``compute.max_actor_restarts``) and its batch resubmitted (``compute.max_batch_retries``);
if Ray gives up, or the pool cannot run (every actor dead), the dataset raises and the run
fails with the shards committed so far intact.  Storage calls are retried with backoff
(``retry:``).  A run that fails leaves no ``_SUCCESS``; rerunning it does only the shards
that are missing.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import logging
import os
import platform
import socket
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

from pipeline.config import ConfigError, JobConfig
from pipeline.engine import GenerationSettings
from pipeline.engine.settings import resolve_generation_settings
from pipeline.models import check_models, checkpoint_generation_config
from pipeline.prompts import PromptBuilder
from pipeline.read import INPUT_SCHEMA, Shard, read_shards_batch, resolve_shards
from pipeline.summary import RunTotals
from pipeline.write import OUTPUT_SCHEMA, OutputWriter, part_name

log = logging.getLogger("specbatch")
REPO_ROOT = Path(__file__).resolve().parents[1]


class RunError(RuntimeError):
    """The run finished but its output does not match its input (rows lost or duplicated)."""


def preflight(cfg: JobConfig) -> tuple[list[Shard], OutputWriter, GenerationSettings]:
    """Every check that needs no model weights and no Ray.

    Returns the shards, the writer, and the generation settings every row is decoded with
    (the job's ``generation:`` with the target checkpoint's defaults filled in; the actors'
    engines resolve the same ones).

    Raises:
        InputError, ModelError, OutputError, ConfigError (all ``ValueError``), or
        ValueError for a chat template that is required but missing.
    """
    shards = resolve_shards(cfg.input, cfg.retry)
    checked = check_models(cfg.models, cfg.uses_drafter)
    PromptBuilder(checked["tokenizer"], cfg.task)  # task.chat_template: true needs a template
    generation = resolve_job_generation(cfg, checked["target_config"])
    writer = OutputWriter(cfg.output, retry=cfg.retry)
    writer.skip = writer.prepare(shards)
    return shards, writer, generation


def resolve_job_generation(cfg: JobConfig, target_config) -> GenerationSettings:
    """``generation:`` with the target checkpoint's ``generation_config`` defaults filled in
    (logged once); raises ConfigError naming the setting for a bad value from either."""
    checkpoint = checkpoint_generation_config(cfg.models.target, target_config, cfg.models.trust_remote_code)
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    try:
        return resolve_generation_settings(cfg.generation.generation_settings(), checkpoint,
                                           getattr(text, "vocab_size", None))
    except ValueError as e:
        raise ConfigError(f"generation: {e}") from None


def init_ray(cfg: JobConfig) -> None:
    """Join a cluster (``ray.address`` or ``RAY_ADDRESS``, as under ``ray job submit``) or
    start an embedded Ray.  Does nothing when Ray is already initialized (tests, notebooks)."""
    import ray

    if ray.is_initialized():
        return
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        return
    # Embedded: workers inherit this environment, so they can import pipeline/ and actors/.
    root = str(REPO_ROOT)
    pp = os.environ.get("PYTHONPATH", "")
    if root not in pp.split(os.pathsep):
        os.environ["PYTHONPATH"] = root + (os.pathsep + pp if pp else "")
    ray.init(include_dashboard=False)


def build_dataset(cfg: JobConfig, shards: list[Shard]):
    """The lazy Ray Data dataset of output rows (OUTPUT_SCHEMA) for ``shards``."""
    import ray
    from ray.data import ActorPoolStrategy

    from actors.generate import GenerateActor

    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # shards finish in order: bounded driver buffer
    ctx.enable_progress_bars = False  # the driver shows one bar of rows done instead
    ctx.print_on_execution_start = False
    ctx.wait_for_min_actors_s = cfg.compute.actor_start_timeout_s  # default -1: wait forever

    items = [s.to_dict() for s in shards]
    ds = ray.data.from_items(items, override_num_blocks=max(1, len(items)))
    ds = ds.map_batches(
        read_shards_batch,
        fn_kwargs={"cfg": cfg.input.model_dump(), "retry": cfg.retry.model_dump()},
        batch_size=1,
        batch_format="pyarrow",
        num_cpus=0.25,
    )
    ds = ds.repartition(target_num_rows_per_block=cfg.compute.rows_per_batch)
    ds = ds.map_batches(
        GenerateActor,
        fn_constructor_kwargs={"config": cfg.model_dump()},
        batch_size=cfg.compute.rows_per_batch,
        batch_format="pyarrow",
        compute=ActorPoolStrategy(size=cfg.compute.num_actors),
        num_gpus=cfg.compute.gpus_per_actor or None,
        num_cpus=cfg.compute.cpus_per_actor,
        # bounded fault tolerance (Ray Data's default is unbounded: a batch that kills its
        # actor every time would be retried forever)
        max_restarts=cfg.compute.max_actor_restarts,
        max_task_retries=cfg.compute.max_batch_retries,
    )
    return ds


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
        RunError: the output rows do not match the input rows.
        Any Ray / storage error during the run; the output then has no ``_SUCCESS``, and
        the shards committed before the error stay committed.
    """
    started = _dt.datetime.now(_dt.timezone.utc)
    t0 = time.perf_counter()
    shards, writer, generation = preflight(cfg)
    skip: set[int] = writer.skip
    todo = [s for s in shards if s.index not in skip]
    if writer.nothing_to_do:
        log.info("%s is complete: all %d shards committed; nothing to do", writer.url(), len(shards))
        summary = writer.read_summary()
        summary["this_run"] = {"run_id": writer.run_id, "nothing_to_do": True, "shards_run": [],
                               "shards_skipped": [part_name(s.index) for s in shards]}
        return summary
    total_rows = sum(s.num_rows for s in todo)
    log.info("%d shards (%d committed earlier, skipped), %d rows to do -> %s (run %s)",
             len(shards), len(skip), total_rows, writer.url(), writer.run_id)
    try:
        init_ray(cfg)
        totals = RunTotals()  # this run's rows
        pending: dict[str, list[pa.Table]] = {}
        counts: dict[str, int] = {s.url: 0 for s in todo}
        by_url = {s.url: s for s in todo}

        def flush(shard: Shard) -> None:
            tables = pending.pop(shard.url, [])
            table = pa.concat_tables(tables) if tables else OUTPUT_SCHEMA.empty_table()
            table = table.sort_by("source_row") if table.num_rows else table
            shard_totals = RunTotals()
            shard_totals.add(table)
            writer.write_part(shard, table, shard_totals.state())

        for s in todo:
            if s.num_rows == 0:
                flush(s)
        t_gen = time.perf_counter()
        first: tuple[float, int] | None = None  # (seconds to the first output batch, its new tokens)
        if total_rows:
            ds = build_dataset(cfg, [s for s in todo if s.num_rows])
            with _progress(total_rows, progress) as bar:
                for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
                    if batch.num_rows == 0:
                        continue
                    batch = _with_audit_column(batch)
                    totals.add(batch)
                    if first is None:
                        first = (time.perf_counter() - t_gen, totals.to_dict()["new_tokens"])
                    for url, sub in _split_by_shard(batch):
                        if url not in by_url:
                            raise RunError(f"output row from unknown shard {url!r}")
                        pending.setdefault(url, []).append(sub)
                        counts[url] += sub.num_rows
                        if counts[url] > by_url[url].num_rows:
                            raise RunError(f"shard {url!r}: more output rows than its {by_url[url].num_rows} input rows")
                        if counts[url] == by_url[url].num_rows:
                            flush(by_url[url])
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
            "output": writer.url(),
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
            "parts": [{k: e.get(k) for k in ("part", "source_file", "rows", "errors", "run_id")} for e in entries],
            "config": cfg.resolved(),
            "environment": _environment(),
        }
        expected = sum(s.num_rows for s in shards)
        if overall.rows != expected:
            raise RunError(f"committed rows {overall.rows} != input rows {expected}")
        writer.commit(summary)
        log.info("run %s committed: %d rows (%d errors) in %s; this run: %d shards, %d skipped",
                 writer.run_id, overall.rows, overall.errors, writer.url(), len(todo), len(skip))
        if overall.audit_rows:
            log.info("audit: %d rows re-decoded with plain decoding, %d mismatches",
                     overall.audit_rows, overall.audit_mismatches)
        return summary
    except BaseException:
        writer.abort()
        raise


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


__all__ = ["run_job", "preflight", "build_dataset", "init_ray", "RunError", "INPUT_SCHEMA"]
