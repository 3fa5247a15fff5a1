"""Measurements of the tuner on the pilot: its rows, the pilot runs of each method, and
the confirmation runs of candidates.  Every time is seconds of one clock (the tuner's:
wall time, or the process's CPU time on a shared CPU machine).

- :func:`read_pilot` -- the first rows of the job's own input (stage 1 and 2 of the job:
  :mod:`pipeline.input`, :mod:`pipeline.prompts`), each prompt built and timed; rows the
  job would turn into error rows are set aside (and counted);
- :func:`run_pilot` -- one engine over the pilot rows: per-row statistics (acceptance by
  draft position, prefill, new tokens), the engine's time and the time outside its steps;
- :func:`measure_candidate` -- a candidate as the actor runs it: the rows in batches of
  ``rows_per_batch``, each through ``generate_batch`` with ``batch_size`` rows in flight.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

from pipeline import loading
from pipeline.config import JobConfig
from pipeline.engine import GenerationResult, GenerationSettings, RowStats
from pipeline.prompts import PromptBuilder
from pipeline.input import read_shard, resolve_shards
from pipeline.output import listing_view


@dataclass
class PilotInput:
    """The pilot sample.

    Attributes:
        ids: row ids (``None`` where the input has none).
        keys: what seeds each row's sampling in the actor (:func:`pipeline.loading.row_key`).
        prompts: token ids of each usable row's prompt.
        build_s: seconds to build each prompt (template, chat template, tokenizer).
        skipped: ``(id, reason)`` of rows among the first ones that the job would turn into
            error rows (they cost nearly nothing and teach nothing).
        corpus_rows: rows of the whole input (every shard).
    """

    ids: list[Any] = field(default_factory=list)
    keys: list[Any] = field(default_factory=list)
    prompts: list[list[int]] = field(default_factory=list)
    build_s: list[float] = field(default_factory=list)
    skipped: list[tuple[Any, str]] = field(default_factory=list)
    corpus_rows: int = 0


def read_pilot(cfg: JobConfig, tokenizer, rows: int, context: int | None, clock: Callable[[], float]) -> PilotInput:
    """The first ``rows`` rows of the job's input (in shard order).

    Raises:
        InputError: the input is missing or unreadable (as for the job).
        ValueError: no row among them can make a prompt.
    """
    shards = resolve_shards(cfg.input, cfg.retry, listing_view(cfg.output, cfg.retry))
    out = PilotInput(corpus_rows=sum(s.num_rows for s in shards))
    builder = PromptBuilder(tokenizer, cfg.task)
    seen = 0
    for shard in shards:
        if seen >= rows:
            break
        for row in read_shard(shard, cfg.input, cfg.retry).to_pylist():
            if seen >= rows:
                break
            seen += 1
            if row.get("input_error"):
                out.skipped.append((row.get("id"), row["input_error"]))
                continue
            t0 = clock()
            try:
                ids = builder.build(row.get("text"))[1]
            except ValueError as e:
                out.skipped.append((row.get("id"), str(e)))
                continue
            spent = clock() - t0
            if context is not None and len(ids) >= context:
                out.skipped.append((row.get("id"), f"the prompt has {len(ids)} tokens, more than the target's "
                                                   f"context allows ({context})"))
                continue
            out.ids.append(row.get("id"))
            out.keys.append(loading.row_key(row))
            out.prompts.append(ids)
            out.build_s.append(spent)
    if not out.prompts:
        raise ValueError(f"none of the first {seen} input rows makes a usable prompt: "
                         + "; ".join(f"{i}: {r}" for i, r in out.skipped[:3]))
    return out


def row_settings(settings: GenerationSettings, keys: list[Any]) -> list[GenerationSettings]:
    """Per-row settings as the actor makes them (:func:`pipeline.loading.row_settings`): when
    sampling with a seed, each row's own seed from the job's seed and its key."""
    return [loading.row_settings(settings, key) for key in keys]


@dataclass
class PilotRun:
    """One method over the pilot rows.

    Attributes:
        method, k, batch_size: what ran (the load policy off: every step drafts ``k``).
        seconds: the ``generate_batch`` call(s), engine clock.
        results: one :class:`GenerationResult` per pilot row, in order.
    """

    method: str
    k: int
    batch_size: int
    seconds: float
    results: list[GenerationResult]

    @functools.cached_property
    def stats(self) -> RowStats:
        """The :class:`RowStats` sum of the rows without error (counts, per-position lists, rates)."""
        return RowStats.total(r.stats for r in self.results if r.error is None)

    @property
    def tokens_per_s(self) -> float:
        return self.stats.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def outside_s_per_row(self) -> float:
        """Engine time not in any row's statistics (row set-up, results), per row."""
        return max(0.0, self.seconds - self.stats.wall_time_s) / max(1, len(self.results))


def run_pilot(engine, prompts: list[list[int]], settings: list[GenerationSettings], batch_size: int,
              clock: Callable[[], float]) -> PilotRun:
    """Decode every pilot prompt with ``engine`` (``batch_size`` rows in flight)."""
    t0 = clock()
    results = engine.generate_batch(prompts, settings, max_batch_size=batch_size)
    seconds = clock() - t0
    return PilotRun(engine.spec.method, engine.spec.k_max if engine.proposer else 0, batch_size, seconds,
                    results)


def measure_candidate(engine, prompts: list[list[int]], settings: list[GenerationSettings], batch_size: int,
                      rows_per_batch: int, clock: Callable[[], float]) -> tuple[float, list[GenerationResult]]:
    """Seconds (engine clock) and results of the rows decoded as the actor does: batches of
    ``rows_per_batch`` rows, ``batch_size`` in flight."""
    results: list[GenerationResult] = []
    seconds = 0.0
    for start in range(0, len(prompts), rows_per_batch):
        t0 = clock()
        results += engine.generate_batch(prompts[start:start + rows_per_batch], settings[start:start + rows_per_batch],
                                         max_batch_size=batch_size)
        seconds += clock() - t0
    return seconds, results
