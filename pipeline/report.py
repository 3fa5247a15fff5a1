"""Run report: one or more job outputs (one per method) -> ``report.md`` + PNG plots.

    python jobs/report.py out/xsum-plain out/xsum-draft out/xsum-pld --output reports/xsum

Each input is a job output directory (local path, ``s3://bucket/prefix``, any fsspec URL),
read as committed output (:class:`pipeline.output.reader.CommittedOutput`): the data files
its commit log commits (``pipeline.schema.OUTPUT_SCHEMA``), never a killed run's parts that no
record names nor staging, and the run summary ``_summary.json`` when present.  A run that did
not finish (no ``_SUCCESS`` of the run whose ``final`` record ends the log) is reported on what it committed, and said to be unfinished; an
output that mixes configs is refused.  Everything in the report is recomputed from the
per-row Parquet, following ``docs/metrics.md``: tokens and steps are summed over rows
first, then divided.

Figures, per run (labelled by its ``method``; a second run of the same method gets the
directory name appended):

- ``acceptance rate`` = Σ accepted_tokens / Σ draft_tokens (rows without error)
- ``mean accepted length`` = 1 + Σ accepted_tokens / Σ draft_steps: vLLM's and llama.cpp's
  mean acceptance length, steps without a draft left out (``draft_steps`` of outputs written
  before that column existed is ``drafted_per_position[0]``, which counts the same steps)
- ``tokens/step`` = Σ new_tokens / Σ verify_steps: tokens per target forward pass, every
  step counted (what the speedup follows; 1 for plain decoding)
- ``tokens/s`` = Σ new_tokens / Σ wall_time_s: the engine's decode throughput of one actor
  (model loading and Ray start-up excluded); ``job tokens/s`` is the summary's
  ``tokens_per_s`` (new tokens over the wall time of the whole generate stage)
- ``speedup`` = tokens/s of the run / tokens/s of the baseline run (``plain`` unless told
  otherwise), both over the *same rows*: ids present, without error and decoded in both runs
  (a row a nightly run copied from its previous output, ``reused_from`` set, has no decode
  statistics: it counts in ``reused`` and in no figure)
- ``decode tokens/s`` = Σ new_tokens / Σ (wall_time_s − prefill_time_s): the target's prompt
  prefill, the same work for every method, left out (a drafter's own prefill stays in, it is
  a cost of speculation); ``decode speedup`` its ratio to the baseline's on the same rows.
  Both are empty for outputs written before the ``prefill_time_s`` column existed.
- ``same output`` = rows whose ``output_text`` equals the baseline's (greedy decoding must
  give 100 %)
- ``bound S`` = the expected wall-time speedup of Leviathan et al. 2023 (arXiv 2211.17192,
  §3), ``S = (1 − α^(k+1)) / ((1 − α)(k·c + 1))``, from the run's own measured figures on
  the common rows: α the per-token acceptance of that paper (the chance a draft token is
  accepted given that every token before it was), estimated from the per-position counts as
  Σ accepted / Σ evaluated with evaluated at position 1 = drafted_per_position[0] and at
  position i > 1 = min(accepted_per_position[i-2], drafted_per_position[i-1]) (exact when no
  draft was cut short by the budget).  It is higher than the acceptance rate (accepted /
  drafted), which also counts the tokens after a rejection.  k is the draft length (the
  longest draft verified, i.e. the configured ``num_assistant_tokens`` /
  ``prompt_lookup_num_tokens``), and c = drafter seconds per draft token (Σ draft_time_s /
  Σ draft_tokens) / the baseline's seconds per target step (Σ (wall_time_s − prefill_time_s)
  / Σ verify_steps); the drafter's own prompt prefill is in its draft time, so c is an upper
  estimate.  ``efficiency`` = decode speedup / S (speedup / S without prefill times)
  (docs/metrics.md).  S assumes every step drafts k tokens, so it overstates the gain of methods
  that often draft fewer (prompt lookup without a match).

Accepted length per step.  The per-row Parquet has no per-step record, but the
per-position counts determine the distribution exactly
(:attr:`pipeline.engine.stats.RowStats.accepted_length_steps`).
"""

from __future__ import annotations

import json
import math
import posixpath
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from pipeline.engine.cost_model import leviathan_speedup
from pipeline.engine.stats import COLUMNS as STAT_COLUMNS
from pipeline.engine.stats import RATE_COLUMNS, RowStats

#: what a run output must hold: its rows' ids, methods and errors, and every statistics
#: column that outputs of every version have (a newer one an older output lacks takes its
#: default: pipeline.engine.stats.COLUMNS)
_NEEDED = ("id", "method", "error", *(c.name for c in STAT_COLUMNS if c.older is None and c.name not in RATE_COLUMNS))


class ReportError(ValueError):
    """A run output cannot be read (not a job output, mixed configs, missing columns)."""


@dataclass
class Run:
    """One job output, loaded: its committed rows, summary, and whether its run finished
    (``note``: :meth:`~pipeline.output.reader.CommittedOutput.describe`)."""

    uri: str
    table: pa.Table
    summary: dict[str, Any] | None
    label: str = ""
    finished: bool = True
    note: str = ""

    @property
    def method(self) -> str:
        methods = [m for m in self.table.column("method").to_pylist() if m]
        if methods:
            return max(set(methods), key=methods.count)
        cfg = (self.summary or {}).get("config", {})
        return (cfg.get("method") or {}).get("name") or posixpath.basename(self.uri.rstrip("/"))


def load_run(uri: str, storage_options: dict[str, Any] | None = None) -> Run:
    """Read a run output's committed rows and its summary
    (:class:`pipeline.output.reader.CommittedOutput`: a folder holding one ``date=``
    partition is read through it).

    Raises:
        ReportError: not a job output (missing, empty, no committed unit, several date
            partitions), units of several configs, a needed column missing.
    """
    from pipeline.config import JobRefused
    from pipeline.output.reader import CommittedOutput

    try:
        out = CommittedOutput.open(uri, storage_options)
        table = out.table(provenance=False)
    except JobRefused as e:
        raise ReportError(str(e)) from None
    missing = [c for c in _NEEDED if c not in table.column_names]
    if missing:
        raise ReportError(f"run output {uri!r} lacks column(s) {missing}; is it a specbatch job output?")
    return Run(uri=uri, table=table, summary=out.summary, finished=out.finished, note=out.describe())


@dataclass
class Stats(RowStats):
    """Run-level totals over a set of rows: their :class:`RowStats` sum (every rate of
    :mod:`pipeline.engine.stats`; ``prefill_time_s`` None when some row has none: an older
    output), the number of rows and each row's tokens per step."""

    rows: int = 0
    row_tokens_per_step: list[float] = field(default_factory=list)


def row_stats(table: pa.Table, ids: set[str] | None = None) -> Stats:
    """:class:`Stats` of the rows without error (and, if given, whose id is in ``ids``)."""
    s = Stats()
    present = [c.name for c in STAT_COLUMNS if c.name in table.column_names]
    for row, rid, err in zip(table.select(present).to_pylist(), table.column("id").to_pylist(),
                             table.column("error").to_pylist()):
        if err is not None or row["verify_steps"] is None:
            continue
        if ids is not None and rid not in ids:
            continue
        one = RowStats.from_columns(row)
        s.rows += 1
        s.merge(one)
        if one.tokens_per_step is not None:
            s.row_tokens_per_step.append(one.tokens_per_step)
    return s


def _ok_ids(table: pa.Table) -> set[str]:
    """Ids of the rows decoded without error (copied rows left out: see the module docstring)."""
    ids, err = table.column("id").to_pylist(), table.column("error").to_pylist()
    return {i for i, e, r in zip(ids, err, _reused(table)) if e is None and r is None and i is not None}


def _reused(table: pa.Table) -> list[str | None]:
    """Each row's ``reused_from`` (all None for an output written before the column existed)."""
    return table.column("reused_from").to_pylist() if "reused_from" in table.column_names else [None] * table.num_rows


def _outputs(table: pa.Table) -> dict[str, str]:
    if "output_text" not in table.column_names:
        return {}
    return dict(zip(table.column("id").to_pylist(), table.column("output_text").to_pylist()))


def speedup_bound(alpha: float | None, k: int, c: float) -> float | None:
    """Expected wall-time speedup ``S(α, k, c) = (1 − α^(k+1)) / ((1 − α)(k·c + 1))``
    (Leviathan et al. 2023, arXiv 2211.17192, §3; docs/metrics.md): α per-token acceptance rate,
    k draft length (tokens), c drafter/target cost per step.  ``None`` without drafts (k = 0
    or α unknown); α = 1 takes the limit ``(k + 1) / (k·c + 1)``."""
    if alpha is None or k <= 0:
        return None
    return leviathan_speedup(alpha, k, c)


def _bound(s: Stats, base: Stats | None) -> tuple[float | None, float | None, int]:
    """(S, c, k) of a run's common-row stats against the baseline's (see the module docstring)."""
    k = len(s.drafted_per_position)
    if base is None or not base.verify_steps or not s.draft_tokens:
        return None, None, k
    base_time = base.decode_time_s if base.decode_time_s is not None else base.wall_time_s
    if not base_time:
        return None, None, k
    c = (s.draft_time_s / s.draft_tokens) / (base_time / base.verify_steps)
    return speedup_bound(s.token_acceptance, k, c), c, k


def summarize_runs(runs: list[Run], baseline: str = "plain") -> dict[str, Any]:
    """Per-run figures, and comparisons with the baseline run over common rows.

    Returns ``{"baseline": label | None, "common_rows": n, "runs": [row dicts]}``; each row
    dict has ``label, method, uri, rows, errors, acceptance_rate, draft_steps,
    mean_accepted_length, tokens_per_step, tokens_per_s, decode_tokens_per_s, decode_speedup,
    job_tokens_per_s, speedup, same_output, compared_rows, k, cost_ratio, speedup_bound,
    efficiency`` and the
    :class:`Stats` of all its rows (``stats``) and of the common rows (``common``).
    """
    labels: dict[str, int] = {}
    for r in runs:
        lab = r.label or r.method
        if lab in labels:
            lab = f"{lab} ({posixpath.basename(r.uri.rstrip('/'))})"
        labels[lab] = 1
        r.label = lab
    base = next((r for r in runs if r.method == baseline), None)
    common = set.intersection(*[_ok_ids(r.table) for r in runs]) if runs else set()
    base_common = row_stats(base.table, common) if base else None
    base_out = _outputs(base.table) if base else {}
    out = []
    for r in runs:
        s_all = row_stats(r.table)
        s_c = row_stats(r.table, common)
        d: dict[str, Any] = {
            "label": r.label, "method": r.method, "uri": r.uri, "finished": r.finished, "output": r.note,
            "rows": r.table.num_rows,
            "errors": r.table.num_rows - r.table.column("error").null_count,
            "reused": sum(x is not None for x in _reused(r.table)),
            "acceptance_rate": s_all.acceptance_rate, "draft_steps": s_all.draft_steps,
            "mean_accepted_length": s_all.mean_accepted_length, "tokens_per_step": s_all.tokens_per_step,
            "tokens_per_s": s_all.tokens_per_s, "decode_tokens_per_s": s_all.decode_tokens_per_s,
            "decode_speedup": None,
            "job_tokens_per_s": (r.summary or {}).get("tokens_per_s"),
            "stats": s_all, "common": s_c, "speedup": None, "same_output": None, "compared_rows": len(common),
            "k": None, "cost_ratio": None, "speedup_bound": None, "efficiency": None,
        }
        if base_common is not None and base_common.tokens_per_s and s_c.tokens_per_s:
            d["speedup"] = s_c.tokens_per_s / base_common.tokens_per_s
        if base_common is not None and base_common.decode_tokens_per_s and s_c.decode_tokens_per_s:
            d["decode_speedup"] = s_c.decode_tokens_per_s / base_common.decode_tokens_per_s
        d["speedup_bound"], d["cost_ratio"], d["k"] = _bound(s_c, base_common)
        measured = d["decode_speedup"] if d["decode_speedup"] is not None else d["speedup"]
        d["efficiency"] = measured / d["speedup_bound"] if measured is not None and d["speedup_bound"] else None
        if base is not None and base_out:
            mine = _outputs(r.table)
            d["same_output"] = sum(1 for i in common if mine.get(i) == base_out.get(i))
        out.append(d)
    return {"baseline": base.label if base else None, "common_rows": len(common), "runs": out}


def _fmt(v, spec=".3f", none="–") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return none
    return format(v, spec)


def _rows_ok(d: dict[str, Any]) -> str:
    """Rows without error: those decoded, and those a nightly run copied (not in the figures)."""
    decoded = d["rows"] - d["errors"] - d["reused"]
    return f"{decoded} + {d['reused']} copied" if d["reused"] else str(decoded)


def markdown_table(result: dict[str, Any]) -> str:
    b = result["baseline"] or "baseline"
    head = (f"| method | rows ok | acceptance rate | mean accepted length | tokens/step | tokens/s | "
            f"speedup vs {b} | decode tokens/s | decode speedup | bound S(α,k,c) | efficiency | job tokens/s | "
            f"same output as {b} |")
    lines = [head, "| --- |" + " ---: |" * 12]
    for d in result["runs"]:
        same = (f"{d['same_output']}/{d['compared_rows']}" if d["same_output"] is not None else "–")
        lines.append(
            f"| {d['label']} | {_rows_ok(d)} | {_fmt(d['acceptance_rate'])} | "
            f"{_fmt(d['mean_accepted_length'], '.2f')} | {_fmt(d['tokens_per_step'], '.2f')} | "
            f"{_fmt(d['tokens_per_s'], '.1f')} | "
            f"{_fmt(d['speedup'], '.2f')}{'×' if d['speedup'] is not None else ''} | "
            f"{_fmt(d['decode_tokens_per_s'], '.1f')} | "
            f"{_fmt(d['decode_speedup'], '.2f')}{'×' if d['decode_speedup'] is not None else ''} | "
            f"{_fmt(d['speedup_bound'], '.2f')}{'×' if d['speedup_bound'] is not None else ''} | "
            f"{_fmt(d['efficiency'], '.2f')} | "
            f"{_fmt(d['job_tokens_per_s'], '.1f')} | {same} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- plots
def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_accepted_length(result, path: Path) -> None:
    plt = _plt()
    runs = result["runs"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    kmax = max((len(d["stats"].accepted_length_steps) for d in runs), default=1)
    width = 0.8 / max(1, len(runs))
    for n, d in enumerate(runs):
        counts = d["stats"].accepted_length_steps
        tot = sum(counts) or 1
        xs = [j + (n - (len(runs) - 1) / 2) * width for j in range(len(counts))]
        ax1.bar(xs, [c / tot for c in counts], width=width, label=d["label"])
    ax1.set_xticks(range(kmax))
    ax1.set_xlabel("accepted draft tokens in a verify step")
    ax1.set_ylabel("fraction of verify steps")
    ax1.set_title("Accepted length per step")
    ax1.legend()
    vals = [d["stats"].row_tokens_per_step for d in runs]
    hi = max((max(v) for v in vals if v), default=2.0)
    bins = [1 + i * (hi - 1) / 20 for i in range(21)] if hi > 1 else 10
    for d, v in zip(runs, vals):
        if v:
            ax2.hist(v, bins=bins, alpha=0.5, label=d["label"])
    ax2.set_xlabel("tokens per step of a row (new tokens / verify steps)")
    ax2.set_ylabel("rows")
    ax2.set_title("Per-row tokens per step")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_acceptance_by_position(result, path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    drew = False
    for d in result["runs"]:
        acc = d["stats"].acceptance_by_position
        if not acc:
            continue
        drew = True
        xs = list(range(1, len(acc) + 1))
        ax.plot(xs, [a if a is not None else float("nan") for a in acc], marker="o", label=d["label"])
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted / drafted at this position")
    ax.set_ylim(0, 1.02)
    ax.set_title("Acceptance by draft position")
    if drew:
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no drafts in these runs", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_throughput(result, path: Path) -> None:
    plt = _plt()
    runs = result["runs"]
    labels = [d["label"] for d in runs]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    tps = [d["tokens_per_s"] or 0.0 for d in runs]
    bars = ax1.bar(labels, tps, color="tab:blue")
    ax1.bar_label(bars, fmt="%.1f")
    ax1.set_ylabel("new tokens / s (engine)")
    ax1.set_title("Throughput")
    xs = list(range(len(runs)))
    series = [("end to end", [d["speedup"] or 0.0 for d in runs], "tab:green")]
    if any(d["decode_speedup"] is not None for d in runs):
        series.append(("decode (prefill left out)", [d["decode_speedup"] or 0.0 for d in runs], "tab:olive"))
    width = 0.8 / len(series)
    for n, (name, vals, color) in enumerate(series):
        bars = ax2.bar([x + (n - (len(series) - 1) / 2) * width for x in xs], vals, width=width, color=color, label=name)
        ax2.bar_label(bars, fmt="%.2f×")
    ax2.set_xticks(xs, labels)
    ax2.set_ylim(0, 1.3 * max([1.0] + [v for _, vals, _ in series for v in vals]))  # room for labels, legend
    ax2.legend(loc="upper left")
    ax2.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax2.set_ylabel(f"speedup vs {result['baseline'] or 'baseline'} (same rows)")
    ax2.set_title("Speedup")
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", labelrotation=15)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


PLOTS = {
    "accepted_length.png": plot_accepted_length,
    "acceptance_by_position.png": plot_acceptance_by_position,
    "throughput.png": plot_throughput,
}


def _run_models(run: Run | None) -> dict[str, Any]:
    """A run's ``target_model`` / ``draft_model`` (its rows' most common) and its summary's
    ``environment`` (host and versions), for ``report.json``."""
    if run is None:
        return {}
    out: dict[str, Any] = {}
    for name in ("target_model", "draft_model"):
        if name in run.table.column_names:
            values = [v for v in run.table.column(name).to_pylist() if v]
            out[name] = max(set(values), key=values.count) if values else None
    out["environment"] = (run.summary or {}).get("environment")
    return out


def provenance(command: str | None = None) -> dict[str, Any]:
    """Where a measurement comes from, for its ``report.json``: the command, the commit of this
    checkout (``-dirty`` when tracked files differ from it; ``None`` outside a git checkout),
    the machine (processor, cores, accelerator, torch version) and the engine's CPU options in
    this process (``cpu``: :class:`pipeline.engine.cpu.CpuOptions` with the environment's
    overrides, as a model prepared here without other options gets them; ``cpu_kernels``: their
    master switch).  ``reports/README.md`` and the README's results block
    (``scripts/results_block.py``) read it."""
    import os
    import platform
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str | None:
        try:
            r = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    commit = git("rev-parse", "--short=7", "HEAD")
    if commit and git("status", "--porcelain", "--untracked-files=no"):
        commit += "-dirty"
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    try:
        import torch

        if torch.cuda.is_available():
            machine += f", {torch.cuda.get_device_name(0)}"
        machine += f", torch {torch.__version__}"
    except Exception:  # noqa: BLE001 - provenance never fails a report
        pass
    from pipeline.engine.cpu import with_environment

    try:
        cpu: dict[str, Any] = with_environment().to_dict()
    except ValueError as e:  # a bad SPECBATCH_CPU_* variable: said, not raised (provenance never fails a report)
        cpu = {"kernels": None, "error": str(e)}
    return {"command": command or " ".join(["python", *sys.argv]), "commit": commit, "machine": machine,
            "cpu_kernels": cpu["kernels"], "cpu": cpu}


def write_report(uris: list[str], out_dir: str | Path, *, storage_options: dict | None = None,
                 baseline: str = "plain", title: str = "specbatch run report",
                 command: str | None = None) -> dict[str, Any]:
    """Load the runs, write ``report.md``, ``report.json`` and the PNGs into ``out_dir``.

    ``report.json`` holds the title, :func:`provenance` (``meta``: ``command``, or this
    process's command line; the commit; the machine) and per run its figures, its models and
    its run summary's ``environment``.

    Returns the :func:`summarize_runs` result (``Stats`` objects included).
    """
    runs = [load_run(u, storage_options) for u in uris]
    result = summarize_runs(runs, baseline=baseline)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, fn in PLOTS.items():
        fn(result, out / name)
    lines = [f"# {title}", "", markdown_table(result), ""]
    if result["baseline"]:
        lines.append(f"Speedup and same-output columns compare each run with `{result['baseline']}` over the "
                     f"{result['common_rows']} rows that every run completed without error. tokens/s = Σ new tokens / "
                     "Σ per-row engine wall time; job tokens/s (from the run summary) also counts the Ray stage's "
                     "start-up and model loading. decode tokens/s leaves out the target's prompt prefill (the "
                     "same work for every method). bound S(α,k,c) is the expected speedup of Leviathan et al. "
                     "(2023) from the run's own per-token α (the chance a draft token is accepted when all before "
                     "it were; not the acceptance rate), k and measured drafter/target cost ratio c; efficiency = "
                     "decode speedup / S (docs/metrics.md).")
    else:
        lines.append(f"No `{baseline}` run given: no speedup column.")
    lines += ["", "Rates are run-level: tokens and steps summed over rows, then divided (docs/metrics.md).", ""]
    lines += ["## Runs", ""]
    unfinished = [d["label"] for d in result["runs"] if not d["finished"]]
    if unfinished:
        lines += [f"**Unfinished:** {', '.join(unfinished)}: no `_SUCCESS` (a run was killed or is in progress); "
                  "the figures cover the units it committed.", ""]
    lines += [f"- `{d['output']}`" for d in result["runs"]] + [""]
    for d in result["runs"]:
        s = d["stats"]
        lines.append(f"- **{d['label']}** (`{d['uri']}`): {d['rows']} rows, {d['errors']} errors; "
                     f"{s.new_tokens} new tokens in {s.verify_steps} verify steps ({s.draft_steps} with a draft); "
                     f"{s.accepted_tokens}/{s.draft_tokens} draft tokens accepted; engine time {s.wall_time_s:.1f} s"
                     + (f", target prefill {d['common'].prefill_time_s:.1f} s on the common rows (the same work in "
                        "every run: compare it across runs to see how steady the machine was)"
                        if d["common"].prefill_time_s is not None and d["common"].rows else "")
                     + (f"; per-token α = {d['common'].token_acceptance:.3f}, k = {d['k']}, c = {d['cost_ratio']:.3f}"
                        if d["cost_ratio"] is not None else ""))
        if s.acceptance_by_position:
            lines.append("  - acceptance by draft position: "
                         + ", ".join(f"{i + 1}: {_fmt(a, '.2f')}" for i, a in enumerate(s.acceptance_by_position)))
    lines += ["", "## Plots", "",
              "![accepted length per step](accepted_length.png)", "",
              "Left: verify steps by number of accepted draft tokens (0 includes steps that drafted nothing), "
              "reconstructed exactly from the per-position counts. Right: per-row tokens per step (new tokens / "
              "verify steps).", "",
              "![acceptance by draft position](acceptance_by_position.png)", "",
              "![tokens/s and speedup](throughput.png)", ""]
    (out / "report.md").write_text("\n".join(lines), encoding="utf-8")
    by_uri = {r.uri: r for r in runs}
    plain = {"title": title, "meta": provenance(command), "baseline": result["baseline"],
             "common_rows": result["common_rows"], "runs": [
        {k: v for k, v in d.items() if k not in ("stats", "common")}
        | {"acceptance_by_position": d["stats"].acceptance_by_position,
           "token_acceptance": d["stats"].token_acceptance,
           "accepted_length_steps": d["stats"].accepted_length_steps}
        | _run_models(by_uri.get(d["uri"]))
        for d in result["runs"]]}
    (out / "report.json").write_text(json.dumps(plain, indent=2), encoding="utf-8")
    return result
