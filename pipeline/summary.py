"""Stage 5, summary: run-level totals from the output rows, and the run summary (``_summary.json``).

This module is the one owner of the summary's fields: :class:`RunTotals` (what is summed
over rows and units; a manifest entry carries a unit's), :class:`RunFacts` (what the run
knows of itself), :func:`run_summary` (the summary of a run that committed units) and
:func:`stored_summary` (of a run that had nothing to do).  Adding a field is one line:

- a count or time summed over rows or units: a line in :data:`COUNTERS` (then
  ``totals.<name> += ...`` where it is measured; it is stored in every manifest entry,
  summed on resume, and written to the summary);
- a fact of the run (a time, a setting, what the actors used): a field of :class:`RunFacts`
  (then set where it is known, in :func:`pipeline.run.run_job`);
- a figure of this run alone in ``this_run``: a name in :data:`THIS_RUN`.

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
- ``reused_rows`` / ``reused_tokens``: rows copied from the previous output
  (``output.previous``, :mod:`pipeline.reuse`) and their output tokens.  They are not decoded:
  every other count, time and rate (``new_tokens``, ``tokens_per_s``, ``acceptance_rate``...)
  is over the decoded rows only; ``rows`` and ``finish_reasons`` count both; the audit counts
  the reused rows it re-decoded in ``audit_rows`` / ``audit_mismatches`` (not in ``audit_speedup``:
  no decode time to compare).  ``previous`` (a :class:`RunFacts` field) says which output
  they came from, or why none.

The summary's ``cpu`` (:func:`cpu_summary`) says what the actors' loads chose for the CPU
(each weight shape's kernel per row count, the lean pass, the compiled layer) and what
compiling and measuring cost them.

A resumed run's summary covers every committed shard of the output: the totals of the
shards committed by earlier runs come from their manifest entries (:meth:`RunTotals.state`,
:meth:`RunTotals.merge`); ``this_run`` says which shards this run did and skipped, and
``generate_elapsed_s`` / ``tokens_per_s`` are this run's.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import socket
from collections import Counter
from typing import Any

import pyarrow as pa

from pipeline.engine.stats import COLUMNS, PER_POSITION, PY_TYPES, RATE_COLUMNS, SUMMED, RowStats

#: counts and times summed over rows and units besides :class:`RowStats`: name -> type (0 of it is
#: the start); each is an attribute of :class:`RunTotals`, kept in its :meth:`~RunTotals.state`
#: and written to the summary
COUNTERS: dict[str, type] = {
    "audit_rows": int,  # rows re-decoded by the lossless audit
    "audit_mismatches": int,  # ... whose plain decoding gave other token ids
    "audit_time_s": float,  # the method's engine time on the audited rows
    "audit_plain_time_s": float,  # plain decoding's on the same rows
    "warm_up_time_s": float,  # the actors' warm-ups, before their first batch (apart from the rows' times)
    "reused_rows": int,  # rows copied from the previous output (output.previous), not decoded
    "reused_tokens": int,  # ... their output tokens (not in new_tokens, nor in any rate)
}
#: the figures of this run alone in the summary's ``this_run`` (keys of :meth:`RunTotals.to_dict`)
THIS_RUN = ("rows", "errors", "new_tokens", "audit_rows", "audit_mismatches", "reused_rows")


class RunTotals:
    """Accumulates output tables (OUTPUT_SCHEMA) batch by batch.

    Attributes:
        stats: the :class:`RowStats` sum of every decoded row without error (a row copied
            from the previous output, ``reused_from`` set, is counted in ``reused_rows`` instead).
    """

    def __init__(self) -> None:
        self.rows = 0
        self.errors = 0
        self.stats = RowStats()
        self.finish_reasons: Counter[str] = Counter()
        self.error_kinds: Counter[str] = Counter()
        for name, kind in COUNTERS.items():
            setattr(self, name, kind())

    def state(self) -> dict[str, Any]:
        """Plain data that :meth:`merge` adds back (stored in each shard's manifest entry)."""
        return {
            "rows": self.rows, "errors": self.errors, "sums": {k: getattr(self.stats, k) for k in SUMMED},
            "finish_reasons": dict(self.finish_reasons), "error_kinds": dict(self.error_kinds),
            **{k: list(getattr(self.stats, k)) for k in PER_POSITION},
            **{name: getattr(self, name) for name in COUNTERS},
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
        for name, kind in COUNTERS.items():  # (absent from the entries of older versions: 0)
            setattr(self, name, getattr(self, name) + (state.get(name) or kind()))

    def add(self, table: pa.Table) -> None:
        self.rows += table.num_rows
        err = table.column("error")
        self.errors += table.num_rows - err.null_count
        for e in err.to_pylist():
            if e is not None:
                self.error_kinds[e.split(":", 1)[0]] += 1
        present = [c.name for c in COLUMNS if c.name in table.column_names]
        reused = table.column("reused_from").to_pylist() if "reused_from" in table.column_names else [None] * len(err)
        for row, e, r in zip(table.select(present).to_pylist(), err.to_pylist(), reused):
            if e is None and r is not None:  # copied, not decoded: no decode statistics
                self.reused_rows += 1
                self.reused_tokens += row.get("new_tokens") or 0
            elif e is None:  # a failed row's statistics are null
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
            **{name: getattr(self, name) for name in COUNTERS},
            "audit_speedup": self.audit_plain_time_s / self.audit_time_s if self.audit_time_s else None,
            "warm_up_time_s": self.warm_up_time_s,
            # the same counts under vLLM's per-request names, over the decoded rows (RowStats.vllm_metrics)
            "vllm": s.vllm_metrics(),
        }
        return d


#: a CPU plan's fields that are costs, not choices (two actors' plans differ in them only: one plan)
_PLAN_COSTS = ("compile_s", "measure_s", "prepare_s", "compiling")


def cpu_summary(posts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The run summary's ``cpu``: what the actors' loads did to their models for the CPU, from
    their posts (``{"host", "pid", "plans": {role: CpuPlan.describe()}, "lines": {role: CpuPlan.summary()}}``;
    :func:`pipeline.ray_setup.post_load_facts`).

    Returns:
        ``None`` without posts, else ``{"actors", "compile_s_max", "prepare_s_max", "plans",
        "headline"}``: ``plans`` holds each distinct set of choices (kernels per weight shape
        and row count, the parts on, the options) once, with ``actors`` (how many chose it) and
        their hosts; ``*_max`` is the slowest actor's total over its models (seconds of its
        load); ``headline`` is one line per role of the most common plan, for the printed summary.
    """
    if not posts:
        return None
    groups: dict[str, dict[str, Any]] = {}
    compile_max = prepare_max = 0.0
    for post in posts:
        plans = post.get("plans") or {}
        compile_max = max(compile_max, sum(p.get("compile_s") or 0.0 for p in plans.values()))
        prepare_max = max(prepare_max, sum(p.get("prepare_s") or 0.0 for p in plans.values()))
        choice = {role: {k: v for k, v in p.items() if k not in _PLAN_COSTS} for role, p in plans.items()}
        key = json.dumps(choice, sort_keys=True)
        group = groups.setdefault(key, {"actors": 0, "hosts": [], "roles": choice, "lines": post.get("lines") or {}})
        group["actors"] += 1
        if post.get("host") not in group["hosts"]:
            group["hosts"].append(post.get("host"))
    ordered = sorted(groups.values(), key=lambda g: -g["actors"])
    lines = ordered[0]["lines"]
    headline = "; ".join(lines.values()) if lines else None
    if len(ordered) > 1:
        headline = f"{headline} (and {len(ordered) - 1} other choice(s) among the actors: see _summary.json)"
    return {"actors": len(posts), "compile_s_max": round(compile_max, 3), "prepare_s_max": round(prepare_max, 3),
            "plans": [{k: g[k] for k in ("actors", "hosts", "roles")} for g in ordered], "headline": headline}


@dataclasses.dataclass
class RunFacts:
    """What a run knows of itself at its end: the summary's run-level fields, in this order
    (a field added here is written to ``_summary.json``)."""

    run_id: str
    output: str
    run_date: str | None  # output.partition_by_date's date, else None
    started_at: str  # ISO 8601, UTC
    finished_at: str
    elapsed_s: float  # the whole run, preflight included
    shards: int
    units: int  # committed ones, this run's and earlier runs'
    generate_elapsed_s: float | None  # the Ray Data stage, from its start to the last unit's records
    first_batch_s: float | None  # to the first unit's records
    audit: dict[str, Any]  # the audit's settings
    generation: dict[str, Any]  # the settings rows were decoded with: generation: plus the checkpoint's defaults
    config: dict[str, Any]  # the resolved config (secrets redacted)
    config_fingerprint: str | None
    environment: dict[str, Any] = dataclasses.field(default_factory=lambda: environment())
    cpu: dict[str, Any] | None = None  # what the actors' loads did for the CPU (cpu_summary), None without actors
    previous: dict[str, Any] | None = None  # output.previous resolved (pipeline.reuse.ReusePlan.facts); None: unset
    status: str = "succeeded"


def run_summary(facts: RunFacts, overall: RunTotals, this: RunTotals, entries: list[Any],
                units_run: list[str], units_skipped: list[str]) -> dict[str, Any]:
    """The summary of a run that committed units: ``facts``, the totals over every committed
    unit (``overall``: earlier runs' and this run's), this run's own figures (``this``), and
    the committed units (``entries``, their :class:`pipeline.output.records.UnitRecord`, in
    part order).  ``tokens_per_s`` is this run's new tokens over its ``generate_elapsed_s``."""
    mine = this.to_dict(generate_elapsed_s=facts.generate_elapsed_s)
    return {
        **dataclasses.asdict(facts),
        **overall.to_dict(generate_elapsed_s=facts.generate_elapsed_s),
        "tokens_per_s": mine["tokens_per_s"],
        "this_run": {"run_id": facts.run_id, "nothing_to_do": False, "units_run": list(units_run),
                     "units_skipped": list(units_skipped), **{k: mine[k] for k in THIS_RUN}},
        "runs": sorted({e.run_id for e in entries if e.run_id}),
        "parts": [{"part": e.part, "files": list(e.files), "source_file": e.source_file, "start_row": e.start_row,
                   "rows": e.rows, "errors": e.errors, "run_id": e.run_id} for e in entries],
    }


def stored_summary(stored: dict[str, Any], run_id: str, units_skipped: list[str]) -> dict[str, Any]:
    """The summary a run with nothing to do returns: the stored one (``_summary.json`` of the
    run that completed the output), with this run's ``this_run``."""
    return {**stored, "this_run": {"run_id": run_id, "nothing_to_do": True, "units_run": [],
                                   "units_skipped": list(units_skipped)}}


def environment() -> dict[str, Any]:
    """The Python and library versions, and the host, a run ran with."""
    env: dict[str, Any] = {"python": platform.python_version(), "host": socket.gethostname()}
    for mod in ("torch", "transformers", "ray", "pyarrow"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - a version is an aid only
            pass
    return env
