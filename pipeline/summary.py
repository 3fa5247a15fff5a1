"""Stage 5, summary: run-level totals from the output rows.

The totals are one :class:`~pipeline.engine.stats.RowStats` summed over the rows without
error (its rates and its older-schema defaults: :mod:`pipeline.engine.stats`), plus the
run's row, error, finish-reason and audit counts.  Rates follow ``docs/metrics.md``:
tokens and steps are summed over rows first, then divided (never a mean of per-row rates).

- ``acceptance_rate`` = sum(accepted_tokens) / sum(draft_tokens)  (null when nothing drafted)
- ``mean_accepted_length`` = 1 + sum(accepted_tokens) / sum(draft_steps)  (vLLM's mean
  acceptance length: steps without a draft left out; null when nothing drafted)
- ``tokens_per_step`` = sum(new_tokens) / sum(verify_steps)  (every step counted)
- ``draft_steps``: from rows written before that column existed (and from manifest
  entries of such shards) it is derived as ``drafted_per_position[0]``, which counts the
  same steps; a ``prefill_time_s`` such rows lack is unknown (null), and so are the
  totals that need it
- ``tokens_per_s`` = sum(new_tokens) / ``generate_elapsed_s``, the wall time of the Ray
  Data stage (from starting the dataset to the last row back: all actors in parallel,
  including actor start-up and model loading), i.e. what a user of the pipeline gets
- ``engine_tokens_per_s`` = sum(new_tokens) / sum(wall_time_s): one actor's throughput
- ``accepted_per_position`` / ``drafted_per_position``: summed element-wise over rows;
  ``acceptance_by_position[i]`` = accepted / drafted at draft position i+1.
- ``audit_rows`` / ``audit_mismatches``: rows re-decoded by the lossless audit, and those
  whose plain decoding gave other token ids (see ``audit:`` in the job config).
- ``audit_speedup``: on the audited rows, the engine time plain decoding took over the time
  the job's method took (``sum(audit_plain_time_s) / sum(wall_time_s)``, both the actor's
  engine clock, the same rows, decoded together per batch of rows): the speedup of speculation over plain
  decoding this run measured (null without audited rows; 1.0 for ``plain``).
- ``warm_up_time_s``: seconds the actors spent warming up their engines before their first
  batch (summed over actors: each reports it on its first output row), kept out of every
  row's times and of ``audit_speedup``.

A resumed run's summary covers every committed shard of the output: the totals of the
shards committed by earlier runs come from their manifest entries (:meth:`RunTotals.state`,
:meth:`RunTotals.merge`); ``this_run`` says which shards this run did and skipped, and
``generate_elapsed_s`` / ``tokens_per_s`` are this run's.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pyarrow as pa

from pipeline.engine.stats import COLUMNS, PER_POSITION, PY_TYPES, RATE_COLUMNS, SUMMED, RowStats


class RunTotals:
    """Accumulates output tables (OUTPUT_SCHEMA) batch by batch.

    Attributes:
        stats: the :class:`RowStats` sum of every row without error.
    """

    def __init__(self) -> None:
        self.rows = 0
        self.errors = 0
        self.stats = RowStats()
        self.finish_reasons: Counter[str] = Counter()
        self.error_kinds: Counter[str] = Counter()
        self.audit_rows = 0
        self.audit_mismatches = 0
        self.audit_time_s = 0.0  # the method's engine time on the audited rows
        self.audit_plain_time_s = 0.0  # plain decoding's on the same rows
        self.warm_up_time_s = 0.0  # the actors' warm-ups, before their first batch

    def state(self) -> dict[str, Any]:
        """Plain data that :meth:`merge` adds back (stored in each shard's manifest entry)."""
        return {
            "rows": self.rows, "errors": self.errors, "sums": {k: getattr(self.stats, k) for k in SUMMED},
            "finish_reasons": dict(self.finish_reasons), "error_kinds": dict(self.error_kinds),
            **{k: list(getattr(self.stats, k)) for k in PER_POSITION},
            "audit_rows": self.audit_rows, "audit_mismatches": self.audit_mismatches,
            "audit_time_s": self.audit_time_s, "audit_plain_time_s": self.audit_plain_time_s,
            "warm_up_time_s": self.warm_up_time_s,
        }

    def merge(self, state: dict[str, Any] | None) -> None:
        """Add a :meth:`state` back (a manifest entry's totals, of this or an older version)."""
        if not state:
            return
        self.rows += state.get("rows", 0)
        self.errors += state.get("errors", 0)
        self.stats.merge(RowStats.from_columns({**(state.get("sums") or {}),
                                                **{k: state.get(k) for k in PER_POSITION}}))
        self.finish_reasons.update(state.get("finish_reasons") or {})
        self.error_kinds.update(state.get("error_kinds") or {})
        self.audit_rows += state.get("audit_rows", 0)
        self.audit_mismatches += state.get("audit_mismatches", 0)
        self.audit_time_s += state.get("audit_time_s", 0.0)
        self.audit_plain_time_s += state.get("audit_plain_time_s", 0.0)
        self.warm_up_time_s += state.get("warm_up_time_s", 0.0)

    def add(self, table: pa.Table) -> None:
        self.rows += table.num_rows
        err = table.column("error")
        self.errors += table.num_rows - err.null_count
        for e in err.to_pylist():
            if e is not None:
                self.error_kinds[e.split(":", 1)[0]] += 1
        present = [c.name for c in COLUMNS if c.name in table.column_names]
        for row, e in zip(table.select(present).to_pylist(), err.to_pylist()):
            if e is None:  # a failed row's statistics are null
                self.stats.merge(RowStats.from_columns(row))
        for r in table.column("finish_reason").to_pylist():
            if r is not None:
                self.finish_reasons[r] += 1
        if "audit" in table.column_names:
            audit = table.column("audit")
            self.audit_rows += len(audit) - audit.null_count
            self.audit_mismatches += sum(1 for a in audit.to_pylist() if a is False)
        if "audit_plain_time_s" in table.column_names:
            for plain, spec in zip(table.column("audit_plain_time_s").to_pylist(), table.column("wall_time_s").to_pylist()):
                if plain is not None and spec is not None:
                    self.audit_plain_time_s += plain
                    self.audit_time_s += spec
        if "warm_up_time_s" in table.column_names:
            self.warm_up_time_s += sum(s for s in table.column("warm_up_time_s").to_pylist() if s is not None)

    def to_dict(self, generate_elapsed_s: float | None = None) -> dict[str, Any]:
        s = self.stats
        sums = {c.name: None if getattr(s, c.name) is None else PY_TYPES[c.type](getattr(s, c.name))
                for c in COLUMNS if c.name in SUMMED}
        d: dict[str, Any] = {
            "rows": self.rows,
            "errors": self.errors,
            "ok_rows": self.rows - self.errors,
            "error_kinds": dict(self.error_kinds),
            "finish_reasons": dict(self.finish_reasons),
            # every summed count and time of RowStats under its own name (the engine's time as engine_time_s),
            # and the rates the output has a column for
            **{k: v for k, v in sums.items() if k != "wall_time_s"},
            **{name: getattr(s, name) for name in RATE_COLUMNS},
            "engine_time_s": sums["wall_time_s"],
            "engine_tokens_per_s": s.tokens_per_s,
            # decode throughput: the target's prompt prefill (same for every method) left out
            "decode_tokens_per_s": s.decode_tokens_per_s,
            "generate_elapsed_s": generate_elapsed_s,
            "tokens_per_s": s.new_tokens / generate_elapsed_s if generate_elapsed_s else None,
            "drafted_per_position": s.drafted_per_position,
            "accepted_per_position": s.accepted_per_position,
            "acceptance_by_position": s.acceptance_by_position,
            "audit_rows": self.audit_rows,
            "audit_mismatches": self.audit_mismatches,
            "audit_speedup": self.audit_plain_time_s / self.audit_time_s if self.audit_time_s else None,
            "warm_up_time_s": self.warm_up_time_s,
        }
        return d
