"""Stage 5, summary: run-level totals from the output rows.

Rates follow ``shared/METRICS.md``: tokens and steps are summed over rows first, then
divided (never a mean of per-row rates).

- ``acceptance_rate`` = sum(accepted_tokens) / sum(draft_tokens)  (null when nothing drafted)
- ``mean_accepted_length`` = 1 + sum(accepted_tokens) / sum(draft_steps)  (vLLM's mean
  acceptance length: steps without a draft left out; null when nothing drafted)
- ``tokens_per_step`` = sum(new_tokens) / sum(verify_steps)  (every step counted)
- ``draft_steps``: from rows written before that column existed (and from manifest
  entries of such shards) it is derived as ``drafted_per_position[0]``, which counts the
  same steps
- ``tokens_per_s`` = sum(new_tokens) / ``generate_elapsed_s``, the wall time of the Ray
  Data stage (from starting the dataset to the last row back: all actors in parallel,
  including actor start-up and model loading), i.e. what a user of the pipeline gets
- ``engine_tokens_per_s`` = sum(new_tokens) / sum(wall_time_s): one actor's throughput
- ``accepted_per_position`` / ``drafted_per_position``: summed element-wise over rows;
  ``acceptance_by_position[i]`` = accepted / drafted at draft position i+1.
- ``audit_rows`` / ``audit_mismatches``: rows re-decoded by the lossless audit, and those
  whose plain decoding gave other token ids (see ``audit:`` in the job config).

A resumed run's summary covers every committed shard of the output: the totals of the
shards committed by earlier runs come from their manifest entries (:meth:`RunTotals.state`,
:meth:`RunTotals.merge`); ``this_run`` says which shards this run did and skipped, and
``generate_elapsed_s`` / ``tokens_per_s`` are this run's.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

_SUMS = ("prompt_tokens", "new_tokens", "verify_steps", "draft_tokens", "accepted_tokens", "draft_steps",
         "draft_time_s", "prefill_time_s", "verify_time_s", "wall_time_s")


def _add_lists(acc: list[int], values: list[int] | None) -> None:
    if not values:
        return
    if len(values) > len(acc):
        acc.extend([0] * (len(values) - len(acc)))
    for i, v in enumerate(values):
        acc[i] += v


class RunTotals:
    """Accumulates output tables (OUTPUT_SCHEMA) batch by batch."""

    def __init__(self) -> None:
        self.rows = 0
        self.errors = 0
        self.sums: dict[str, float] = {k: 0 for k in _SUMS}
        self.finish_reasons: Counter[str] = Counter()
        self.error_kinds: Counter[str] = Counter()
        self.drafted_per_position: list[int] = []
        self.accepted_per_position: list[int] = []
        self.audit_rows = 0
        self.audit_mismatches = 0

    def state(self) -> dict[str, Any]:
        """Plain data that :meth:`merge` adds back (stored in each shard's manifest entry)."""
        return {
            "rows": self.rows, "errors": self.errors, "sums": dict(self.sums),
            "finish_reasons": dict(self.finish_reasons), "error_kinds": dict(self.error_kinds),
            "drafted_per_position": list(self.drafted_per_position),
            "accepted_per_position": list(self.accepted_per_position),
            "audit_rows": self.audit_rows, "audit_mismatches": self.audit_mismatches,
        }

    def merge(self, state: dict[str, Any] | None) -> None:
        if not state:
            return
        self.rows += state.get("rows", 0)
        self.errors += state.get("errors", 0)
        sums = dict(state.get("sums") or {})
        if "draft_steps" not in sums:  # a shard committed before draft_steps existed
            sums["draft_steps"] = (state.get("drafted_per_position") or [0])[0]
        for k, v in sums.items():
            if k in self.sums:
                self.sums[k] += v or 0
        self.finish_reasons.update(state.get("finish_reasons") or {})
        self.error_kinds.update(state.get("error_kinds") or {})
        _add_lists(self.drafted_per_position, state.get("drafted_per_position"))
        _add_lists(self.accepted_per_position, state.get("accepted_per_position"))
        self.audit_rows += state.get("audit_rows", 0)
        self.audit_mismatches += state.get("audit_mismatches", 0)

    def add(self, table: pa.Table) -> None:
        self.rows += table.num_rows
        err = table.column("error")
        self.errors += table.num_rows - err.null_count
        for e in err.to_pylist():
            if e is not None:
                self.error_kinds[e.split(":", 1)[0]] += 1
        for k in _SUMS:
            if k == "draft_steps" and k not in table.column_names:  # rows of an older schema
                s = sum((v or [0])[0] for v in table.column("drafted_per_position").to_pylist())
            else:
                s = pc.sum(table.column(k)).as_py()
            self.sums[k] += s or 0
        for r in table.column("finish_reason").to_pylist():
            if r is not None:
                self.finish_reasons[r] += 1
        for v in table.column("drafted_per_position").to_pylist():
            _add_lists(self.drafted_per_position, v)
        for v in table.column("accepted_per_position").to_pylist():
            _add_lists(self.accepted_per_position, v)
        if "audit" in table.column_names:
            audit = table.column("audit")
            self.audit_rows += len(audit) - audit.null_count
            self.audit_mismatches += sum(1 for a in audit.to_pylist() if a is False)

    def to_dict(self, generate_elapsed_s: float | None = None) -> dict[str, Any]:
        s = self.sums
        new = int(s["new_tokens"])
        d: dict[str, Any] = {
            "rows": self.rows,
            "errors": self.errors,
            "ok_rows": self.rows - self.errors,
            "error_kinds": dict(self.error_kinds),
            "finish_reasons": dict(self.finish_reasons),
            "prompt_tokens": int(s["prompt_tokens"]),
            "new_tokens": new,
            "verify_steps": int(s["verify_steps"]),
            "draft_tokens": int(s["draft_tokens"]),
            "accepted_tokens": int(s["accepted_tokens"]),
            "draft_steps": int(s["draft_steps"]),
            "acceptance_rate": s["accepted_tokens"] / s["draft_tokens"] if s["draft_tokens"] else None,
            "mean_accepted_length": 1 + s["accepted_tokens"] / s["draft_steps"] if s["draft_steps"] else None,
            "tokens_per_step": new / s["verify_steps"] if s["verify_steps"] else None,
            "draft_time_s": s["draft_time_s"],
            "prefill_time_s": s["prefill_time_s"],
            "verify_time_s": s["verify_time_s"],
            "engine_time_s": s["wall_time_s"],
            "engine_tokens_per_s": new / s["wall_time_s"] if s["wall_time_s"] else None,
            # decode throughput: the target's prompt prefill (same for every method) left out
            "decode_tokens_per_s": (new / (s["wall_time_s"] - s["prefill_time_s"])
                                    if s["wall_time_s"] > s["prefill_time_s"] else None),
            "generate_elapsed_s": generate_elapsed_s,
            "tokens_per_s": new / generate_elapsed_s if generate_elapsed_s else None,
            "drafted_per_position": self.drafted_per_position,
            "accepted_per_position": self.accepted_per_position,
            "acceptance_by_position": [
                a / d if d else None for a, d in zip(self.accepted_per_position, self.drafted_per_position)
            ],
            "audit_rows": self.audit_rows,
            "audit_mismatches": self.audit_mismatches,
        }
        return d
