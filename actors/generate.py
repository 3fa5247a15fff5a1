"""Stage 3, generate: the Ray actor that ``map_batches`` runs as an actor pool.

Each actor loads the model pair once (on its GPU when Ray gave it one, else on the CPU) and
builds one :class:`pipeline.engine.SpeculativeEngine` (:func:`pipeline.loading.load_engine`),
then feeds each whole batch to
:meth:`~pipeline.engine.SpeculativeEngine.generate_batch`: up to ``compute.max_batch_size``
rows are decoded in lockstep, and a finished row's slot takes the next row of the batch
at once (continuous batching).  When sampling, each row draws from its own generator,
seeded from ``generation.seed`` and the row's id (:func:`pipeline.loading.row_settings`), so a
row's output does not depend on which actor, batch or batch position it lands in.

A row that fails (null/empty/non-string prompt, a prompt longer than the target's
context, bad token ids) gets its ``error`` string and null statistics; the other rows of
the batch go on.  Should the batched call itself raise (a bug, a CUDA out-of-memory),
the batch is decoded again row by row, so that only the rows that fail alone get an
error.  A row is never retried beyond that.  A row that kills the process (segfault,
OOM kill) loses the actor: Ray restarts it (``compute.max_actor_restarts``) and
resubmits the batch (``compute.max_batch_retries``); a batch that keeps killing its
actor fails the run after those retries, with the shards committed so far kept.

Lossless audit (``audit.fraction`` > 0): a deterministic sample of rows is decoded a
second time with plain decoding (same model, same generation settings and seed) and the
token ids are compared; the row's ``audit`` is true on a match, false on a mismatch, null
when the row was not sampled (or failed).

Used as::

    ds.map_batches(GenerateActor, fn_constructor_kwargs={"config": cfg.model_dump()},
                   batch_format="pyarrow", batch_size=cfg.compute.rows_per_batch,
                   compute=ActorPoolStrategy(size=cfg.compute.num_actors),
                   num_gpus=cfg.compute.gpus_per_actor)
"""

from __future__ import annotations

import hashlib
import os
import resource
from typing import Any

import pyarrow as pa

from pipeline.config import JobConfig
from pipeline.loading import build_engine, limit_cpu_threads, load_engine, process_cpus, row_key, row_settings
from pipeline.models import model_ref
from pipeline.prompts import PromptBuilder
from pipeline.schema import OUTPUT_SCHEMA


class GenerateActor:
    """Callable class for ``map_batches``: a batch of INPUT_SCHEMA rows -> OUTPUT_SCHEMA rows.

    Args:
        config: a :class:`JobConfig` or its ``model_dump()`` (plain data crosses to the actor).
        device: force ``cpu``/``cuda``; default: ``cuda`` when visible, else ``cpu``.
    """

    def __init__(self, config: dict[str, Any] | JobConfig, device: str | None = None):
        self.cfg = config if isinstance(config, JobConfig) else JobConfig.model_validate(config)
        compute = self.cfg.compute
        limit_cpu_threads(process_cpus(self.cfg))
        loaded = load_engine(self.cfg, device, compute.max_batch_size)
        self.models, self.engine, self.settings = loaded.models, loaded.engine, loaded.settings
        self.load_time_s = loaded.load_time_s
        self.prompts = PromptBuilder(self.models.tokenizer, self.cfg.task)
        self.audit_fraction = self.cfg.audit.fraction
        self.audit_seed = self.cfg.audit.seed
        self.plain_engine = build_engine(self.models, None, compute.max_batch_size) if self.audit_fraction > 0 else None
        self.meta = {
            "method": self.cfg.method.name,
            "target_model": model_ref(self.cfg.models.target, self.cfg.models.gguf_file),
            "draft_model": model_ref(self.cfg.models.drafter, self.cfg.models.drafter_gguf_file)
            if self.cfg.uses_drafter else None,
        }
        self.rows_done = 0

    def generate_rows(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Input rows -> output rows (OUTPUT_SCHEMA fields), in order.  Never raises."""
        outs: list[dict[str, Any]] = []
        todo: list[tuple[int, list[int]]] = []  # (index in rows, prompt ids)
        for i, row in enumerate(rows):
            out: dict[str, Any] = {
                "id": row.get("id"),
                "source_file": row.get("source_file"),
                "source_row": row.get("source_row"),
                "prompt": None,
                **self.meta,
            }
            outs.append(out)
            try:
                if row.get("input_error"):
                    raise ValueError(row["input_error"])
                out["prompt"], ids = self.prompts.build(row.get("text"))
                todo.append((i, ids))
            except Exception as e:  # noqa: BLE001 - a bad row must not fail its batch
                out["error"] = f"{type(e).__name__}: {e}"
        settings = [row_settings(self.settings, row_key(rows[i])) for i, _ in todo]
        results = self._decode(self.engine, [ids for _, ids in todo], settings)
        audit = [j for j, (i, _) in enumerate(todo) if results[j].error is None and self.plain_engine is not None
                 and audit_selected(rows[i].get("source_file"), rows[i].get("source_row"),
                                    self.audit_fraction, self.audit_seed)]
        plain = self._decode(self.plain_engine, [todo[j][1] for j in audit], [settings[j] for j in audit]) if audit else []
        audited = {j: (p.token_ids == results[j].token_ids if p.error is None else None) for j, p in zip(audit, plain)}
        for j, ((i, _), res) in enumerate(zip(todo, results)):
            out = outs[i]
            if res.error is not None:
                out["error"] = res.error
                continue
            out.update(res.stats.to_columns())
            out["finish_reason"] = res.finish_reason
            out["output_text"] = self.models.tokenizer.decode(res.token_ids, skip_special_tokens=True)
            out["error"] = None
            out["audit"] = audited.get(j)
        self.rows_done += len(rows)
        return outs

    def generate_row(self, row: dict[str, Any]) -> dict[str, Any]:
        """One input row -> one output row (a batch of one)."""
        return self.generate_rows([row])[0]

    @staticmethod
    def _decode(engine, prompts: list[list[int]], settings: list) -> list:
        """``engine.generate_batch``; if the batched call raises, each row alone, so that
        only the rows that fail by themselves get an error."""
        from pipeline.engine import GenerationResult

        if not prompts:
            return []
        try:
            return engine.generate_batch(prompts, settings)
        except Exception:  # noqa: BLE001 - isolate the row(s) at fault
            results = []
            for ids, s in zip(prompts, settings):
                try:
                    results.append(engine.generate_batch([ids], [s])[0])
                except Exception as e:  # noqa: BLE001
                    _free_cuda_if_oom(e)
                    results.append(GenerationResult.failed(f"{type(e).__name__}: {e}"))
            return results

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = batch.to_pylist() if isinstance(batch, pa.Table) else _dict_batch_to_rows(batch)
        return pa.Table.from_pylist(self.generate_rows(rows), schema=OUTPUT_SCHEMA)

    def memory(self) -> dict[str, Any]:
        """This actor's memory: ``peak_rss_mb`` (max resident set of the process since start,
        MiB), ``rss_mb`` (now), ``cuda_peak_mb`` (max allocated by torch; None on CPU), ``rows``."""
        import psutil
        import torch

        cuda_peak = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None
        return {
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "rss_mb": psutil.Process(os.getpid()).memory_info().rss / 2**20,
            "cuda_peak_mb": cuda_peak,
            "rows": self.rows_done,
            "load_time_s": self.load_time_s,
            "device": self.models.device,
        }


def audit_selected(source_file: Any, source_row: Any, fraction: float, seed: int) -> bool:
    """Whether the lossless audit re-decodes this row: a hash of (shard URL, row, seed)
    mapped to [0, 1) is below ``fraction``; the same rows are chosen on every run."""
    if fraction <= 0:
        return False
    if fraction >= 1:
        return True
    h = hashlib.sha256(f"{seed}\x00{source_file}\x00{source_row}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64 < fraction


def _dict_batch_to_rows(batch: dict[str, Any]) -> list[dict[str, Any]]:
    keys = list(batch)
    n = len(batch[keys[0]]) if keys else 0
    return [{k: _py(batch[k][i]) for k in keys} for i in range(n)]


def _py(v: Any) -> Any:
    return v.item() if hasattr(v, "item") else v


def _free_cuda_if_oom(e: Exception) -> None:
    try:
        import torch

        if isinstance(e, torch.cuda.OutOfMemoryError):
            torch.cuda.empty_cache()
    except Exception:
        pass
