"""Outputs of a tuning: the tuned config, ``tune_report.md`` with its plots, and
``tune_report.json`` (the same figures as data).

Plots (PNG, beside the report): predicted against measured tokens/s of each confirmed
candidate; acceptance by draft position of each method; predicted tokens/s by draft
length; the target's verification cost ``t(n, B)``.
"""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path
from typing import Any

import yaml

from pipeline.config import load_config
from pipeline.engine.methods import PLAIN
from pipeline.report import _plt
from pipeline.tune.predict import Candidate
from pipeline.tune.tuner import REFERENCE_ROWS, TuneResult

TUNED_NAME = "tuned.yaml"
REPORT_NAME = "tune_report.md"


def _save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _fmt(v, spec=".1f") -> str:
    return "–" if v is None else format(v, spec)


def plot_predicted_vs_measured(result: TuneResult, path: Path) -> None:
    plt = _plt()
    cands = result.confirmed or result.candidates[:1]
    labels = [c.label + (" *" if c is result.chosen else "") for c in cands]
    xs = range(len(cands))
    fig, ax = plt.subplots(figsize=(max(6, 1.8 * len(cands)), 4))
    w = 0.38
    b1 = ax.bar([x - w / 2 for x in xs], [c.confirm_predicted_tokens_per_s or c.predicted_tokens_per_s for c in cands],
                w, label="predicted")
    b2 = ax.bar([x + w / 2 for x in xs], [c.measured_tokens_per_s or 0.0 for c in cands], w, label="measured")
    ax.bar_label(b1, fmt="%.1f")
    ax.bar_label(b2, fmt="%.1f")
    ax.set_xticks(list(xs), labels, rotation=12)
    ax.set_ylabel(f"tokens / s ({result.options.clock} clock)")
    ax.set_title("Confirmation runs: predicted vs measured tokens/s (* = chosen)")
    ax.set_ylim(0, 1.25 * max([1.0] + [c.confirm_predicted_tokens_per_s or c.predicted_tokens_per_s for c in cands]
                              + [c.measured_tokens_per_s or 0 for c in cands]))
    ax.legend(loc="upper right")
    _save(fig, path)


def plot_acceptance(result: TuneResult, path: Path) -> None:
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, run in result.pilots.items():
        if name == PLAIN or not run.stats.drafted_per_position:
            continue
        alpha = run.stats.token_acceptance_by_position
        xs = list(range(1, len(alpha) + 1))
        ax1.plot(xs, [a if a is not None else float("nan") for a in alpha], marker="o", label=name)
        model = next(m for m in result.models if m.method == name)
        ax2.plot(range(1, len(model.reach) + 1), model.reach, marker="o", label=name)
    ax1.set_xlabel("draft position i")
    ax1.set_ylabel("α_i: accepted given all before it were")
    ax1.set_title("Per-token acceptance by position (pilot)")
    ax2.set_xlabel("draft position i")
    ax2.set_ylabel("A_i: steps whose first i draft tokens were accepted")
    ax2.set_title("Reach A_i per verify step (E(k) = 1 + Σ A_i)")
    for ax in (ax1, ax2):
        ax.set_ylim(0, 1.02)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    _save(fig, path)


def plot_predicted_by_k(result: TuneResult, path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    for m in result.models:
        own = [c for c in result.candidates if c.method == m.method]
        if not own:
            continue
        best_b = max(own, key=lambda c: c.predicted_tokens_per_s).batch_size
        pts = sorted((c.k, c.predicted_tokens_per_s) for c in own if c.batch_size == best_b)
        if m.method == PLAIN:
            ax.axhline(pts[0][1], color="grey", linestyle="--", label=f"plain B={best_b}")
        else:
            ax.plot([k for k, _ in pts], [v for _, v in pts], marker="o", label=f"{m.method} B={best_b}")
    ax.set_xlabel("draft length k")
    ax.set_ylabel(f"predicted tokens / s ({result.options.clock} clock)")
    ax.set_title("Predicted tokens/s by draft length (each method at its best B)")
    ax.legend()
    _save(fig, path)


def plot_verify_cost(result: TuneResult, path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    for b, row in sorted(result.profiles[PLAIN].verify_s.items()):
        ns = sorted(row)
        ax.plot(ns, [row[n] * 1e3 for n in ns], marker="o", label=f"B={b}")
    ax.set_xlabel("tokens verified per row n (= draft length + 1)")
    ax.set_ylabel("ms per target pass")
    ax.set_yscale("log")
    ax.set_title("Target verification cost t(n, B)")
    ax.legend(ncol=2)
    _save(fig, path)


PLOTS = {
    "tune_predicted_vs_measured.png": plot_predicted_vs_measured,
    "tune_acceptance_by_position.png": plot_acceptance,
    "tune_predicted_by_k.png": plot_predicted_by_k,
    "tune_verify_cost.png": plot_verify_cost,
}


def _candidate_row(rank: int | str, c: Candidate, result: TuneResult) -> str:
    model = next(m for m in result.models if m.method == c.method)
    ratio = (c.measured_tokens_per_s / c.confirm_predicted_tokens_per_s
             if c.measured_tokens_per_s and c.confirm_predicted_tokens_per_s else None)
    same = f"{c.same_output}/{c.compared_rows}" if c.same_output is not None else "–"
    chosen = " **chosen**" if c is result.chosen else ""
    adaptive = c.adaptive_draft_length or c.params.get("num_assistant_tokens_schedule", "constant") != "constant" or \
        c.params.get("assistant_confidence_threshold")
    e = "–" if adaptive else f"{model.expected_tokens(c.k):.2f}"
    return (f"| {rank} | {c.label}{chosen} | {c.rows_per_batch} | {e} | "
            f"{'–' if adaptive else f'{c.model_tokens_per_s:.1f}'} | {c.predicted_tokens_per_s:.1f} | {_fmt(c.confirm_predicted_tokens_per_s)} | "
            f"{_measured(c)} | {_fmt(ratio, '.2f')} | {same} |")


def _measured(c: Candidate) -> str:
    """The median tokens/s, with the range over the rounds when there were several."""
    if not c.measured_tokens_per_s or len(c.round_s) < 2:
        return _fmt(c.measured_tokens_per_s)
    tokens = c.measured_tokens_per_s * c.measured_s  # the same every round
    rates = sorted(tokens / s for s in c.round_s)
    return f"{c.measured_tokens_per_s:.1f} ({rates[0]:.1f}–{rates[-1]:.1f})"


def summary(result: TuneResult) -> dict[str, Any]:
    """The headline figures, as data (also printed by ``jobs/tune.py``)."""
    c = result.chosen
    base = result.baseline()
    total = result.timings["total"]
    run = result.estimated_run_s()
    ref = result.estimated_run_s(REFERENCE_ROWS)
    return {
        "chosen": c.label,
        "method": result.tuned_config["method"],
        "compute": {k: result.tuned_config["compute"][k] for k in ("max_batch_size", "rows_per_batch",
                                                                   "draft_length")},
        "predicted_tokens_per_s": c.predicted_tokens_per_s,
        "model_tokens_per_s": c.model_tokens_per_s,
        "calibration": result.calibration,
        "measured_tokens_per_s_pilot": c.measured_tokens_per_s,
        "plain_predicted_tokens_per_s": base.predicted_tokens_per_s if base else None,
        "plain_measured_tokens_per_s_pilot": base.measured_tokens_per_s if base else None,
        "clock": result.options.clock,
        "tuning_s": total,
        "tuning_wall_s": result.wall_timings["total"],
        "input_rows": result.pilot.corpus_rows,
        "estimated_run_s": run,
        "tuning_share_of_run": total / run if run else None,
        "estimated_run_s_10000_rows": ref,
        "tuning_share_10000_rows": total / ref if ref else None,
    }


def markdown(result: TuneResult) -> str:
    s = summary(result)
    c = result.chosen
    base = result.baseline()
    clock = result.options.clock
    unit = "CPU seconds of the process" if clock == "cpu" else "wall seconds"
    lines = [f"# Tuning of `{result.config_path or 'the default config'}`", ""]
    speed = ""
    if base is not None and base is not c and base.measured_tokens_per_s and c.measured_tokens_per_s:
        speed = (f" — {c.measured_tokens_per_s / base.measured_tokens_per_s:.2f}× the best plain setting "
                 f"({base.label}, {base.measured_tokens_per_s:.1f} tokens/s measured)")
    lines += [f"**Chosen: {c.label}** (rows_per_batch {c.rows_per_batch}): predicted "
              f"**{c.predicted_tokens_per_s:.1f} tokens/s**, measured {_fmt(c.measured_tokens_per_s)} tokens/s on the "
              f"pilot rows{speed}. Tuned config: [`{TUNED_NAME}`]({TUNED_NAME}) (`method:` "
              f"{json.dumps(result.tuned_config['method'])}; `compute:` {json.dumps(s['compute'])}).", ""]
    lines += [f"Times are {unit} (`--clock {clock}`)"
              + ("; on a machine shared with other work this is what a dedicated core would take, and wall time is "
                 "longer by the share of the CPU the process gets." if clock == "cpu" else "."), ""]
    lines += ["## Tuning time", "",
              f"Tuning took **{s['tuning_s']:.0f} s** ({result.wall_timings['total']:.0f} s wall): "
              + ", ".join(f"{k} {v:.0f} s" for k, v in result.timings.items() if k != "total") + ".",
              f"Pilot: the first {result.options.rows} input rows ({len(result.pilot_rows)} usable"
              + (f"; {len(result.pilot.skipped)} would be error rows" if result.pilot.skipped else "")
              + f"), every method over all of them at its longest draft with {result.options.pilot_batch_size} "
                "rows in flight.", "",
              f"| corpus | rows | estimated run (tuned config, {result.num_actors} actor"
              f"{'s' if result.num_actors != 1 else ''}) | tuning / run |",
              "| --- | ---: | ---: | ---: |",
              f"| this input | {s['input_rows']} | {s['estimated_run_s']:.0f} s | "
              f"{_fmt(100 * s['tuning_share_of_run'] if s['tuning_share_of_run'] is not None else None, '.1f')} % |",
              f"| reference | {REFERENCE_ROWS} | {s['estimated_run_s_10000_rows']:.0f} s | "
              f"{_fmt(100 * s['tuning_share_10000_rows'] if s['tuning_share_10000_rows'] is not None else None, '.1f')}"
              " % (goal: under 10 %) |", "",
              f"Machine: {result.machine.get('cpu_count')} CPUs, device {result.machine.get('device')}, torch threads "
              f"{result.machine.get('torch_threads')}, load average {result.machine.get('load_average_start')} at the "
              f"start and {result.machine.get('load_average_end')} at the end.", ""]

    lines += ["## Candidates", "",
              "Every (method, k, B) was predicted; the top ones (and the best plain one) were confirmed on the pilot "
              "rows as the actor runs them, and the fastest measured was chosen. E(k) = expected tokens per row per "
              "step.", "",
              f"The model's figures are scaled by {result.calibration:.3f}, the pilot runs' measured time over the "
              "model's prediction of them (same rows, same minutes); confirmation runs decode the first "
              f"{result.options.confirm_rows} pilot rows, and their prediction is for those rows. They ran in "
              f"{result.options.confirm_rounds} interleaved rounds (the order rotated by one per round); measured is "
              "the median round, with the range over the rounds.", "",
              "| rank | candidate | rows/batch | E(k) | model tokens/s | predicted tokens/s | predicted, confirmation "
              "rows | measured, confirmation rows | measured / predicted | same output as pilot |",
              "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    shown = result.candidates[:10]
    for i, cand in enumerate(result.candidates):
        if cand in shown or cand in result.confirmed:
            lines.append(_candidate_row(i + 1, cand, result))
    for cand in result.confirmed:
        if cand not in result.candidates:  # per-row adaptive variants: measured, not modelled
            lines.append(_candidate_row("adaptive", cand, result))
    lines += ["", f"{len(result.candidates)} candidates in all.", "",
              "![predicted vs measured](tune_predicted_vs_measured.png)", "",
              "![predicted by draft length](tune_predicted_by_k.png)", ""]

    lines += ["## Acceptance on the pilot", "",
              "| method | K | draft tokens | acceptance rate | mean accepted length | tokens/step | steps with a draft "
              "| per-token α by position |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for name, run in result.pilots.items():
        if name == PLAIN:
            continue
        st = run.stats
        lines.append(f"| {name} | {run.k} | {st.draft_tokens} | {_fmt(st.acceptance_rate, '.3f')} | "
                     f"{_fmt(st.mean_accepted_length, '.2f')} | {_fmt(st.tokens_per_step, '.2f')} | "
                     f"{st.draft_steps}/{st.verify_steps} | "
                     + ", ".join(_fmt(a, ".2f") for a in st.token_acceptance_by_position) + " |")
    lines += ["", "![acceptance by position](tune_acceptance_by_position.png)", ""]

    grid = result.profiles[PLAIN].verify_s
    widths = sorted({n for row in grid.values() for n in row})
    lines += ["## Measured costs", "",
              "Target verification pass t(n, B), ms (n tokens verified per row, B rows; median of "
              f"{result.options.repeats}):", "",
              "| B | " + " | ".join(f"n={n}" for n in widths) + " |", "| ---: |" + " ---: |" * len(widths)]
    for b, row in sorted(grid.items()):
        lines.append(f"| {b} | " + " | ".join(_fmt(row.get(n, None) and row[n] * 1e3, ".2f") for n in widths) + " |")
    lines += ["", "![verification cost](tune_verify_cost.png)", "",
              "Per step, ms, by batch size: the proposer (a fixed part and a part per draft token, a least-squares "
              "line over the k measured), the loop's bookkeeping; c = drafter cost per token / t(1, B) "
              "(Leviathan's cost ratio).", "",
              "| method | B | per step | per draft token | bookkeeping | c | admission per prompt token |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for m in result.models:
        for b in sorted(m.overhead):
            fixed, per_token = m.propose.get(b, (0.0, 0.0))
            c_ratio = per_token / grid[b][1] if b in grid and grid[b].get(1) else None
            lines.append(f"| {m.method} | {b} | {fixed * 1e3:.2f} | {per_token * 1e3:.3f} | {m.overhead[b] * 1e3:.2f} "
                         f"| {_fmt(c_ratio, '.3f')} | {m.admit_s_per_token * 1e3:.4f} |")
    lines += ["", "## How the prediction works", "",
              "Leviathan et al. (2023, §3) generalised with the measured costs "
              "(`pipeline/engine/cost_model.py`, the formula the engine's draft length by load uses too): a step of "
              "b rows drafting k tokens emits E(k) = 1 + A_1 + … + A_k tokens per row, A_i being the pilot's share "
              "of verify steps whose first i draft tokens were all accepted, and takes "
              "T(b, k) = t(k+1, b)·P(some row drafts) + t(1, b)·(1 − P) + proposer(b, k) + bookkeeping(b). "
              "The pilot rows are replayed through the actor's schedule (batches of rows_per_batch rows, B in "
              "flight, ⌈N_r / E(k)⌉ steps per row, rows draining at the end of each batch), each row also paying "
              "its measured prefill, its drafter admission and the per-row work outside the steps; predicted "
              "tokens/s = Σ new tokens / Σ seconds (`pipeline/tune/predict.py`). The same replay of each pilot run "
              f"(its method at its longest draft, {result.options.pilot_batch_size} rows in flight) against the "
              f"measured pilot time gives the calibration factor ({result.calibration:.3f}) applied to every "
              "candidate.", ""]
    if result.notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in result.notes] + [""]
    return "\n".join(lines)


def write_outputs(result: TuneResult, out_dir: str | Path) -> dict[str, Path]:
    """Write the tuned config (validated as ``--print-config`` does), the report, its JSON
    and plots into ``out_dir``; returns their paths.

    Raises:
        ConfigError: the tuned config does not load (never written then).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    c = result.chosen
    header = (f"# Tuned by jobs/tune.py on {_dt.date.today().isoformat()} from "
              f"{result.config_path or 'the default config'}: {c.label}, rows_per_batch {c.rows_per_batch}.\n"
              f"# Predicted {c.predicted_tokens_per_s:.1f} tokens/s ({result.options.clock} clock) from "
              f"{len(result.pilot_rows)} pilot rows; measured {_fmt(c.measured_tokens_per_s)} on them. "
              f"See {REPORT_NAME}.\n")
    text = header + yaml.safe_dump(result.tuned_config, sort_keys=False, allow_unicode=True)
    tmp = out / (TUNED_NAME + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    try:
        load_config(tmp)
    except Exception:
        tmp.unlink()
        raise
    tuned = out / TUNED_NAME
    tmp.replace(tuned)
    for name, fn in PLOTS.items():
        fn(result, out / name)
    report = out / REPORT_NAME
    report.write_text(markdown(result), encoding="utf-8")
    data = {"summary": summary(result), "options": vars(result.options) | {"batch_sizes": list(result.options.batch_sizes)},
            "timings": result.timings, "wall_timings": result.wall_timings, "machine": result.machine,
            "notes": result.notes, "mismatches": result.mismatches,
            "candidates": [_cand(c) for c in result.candidates],
            "confirmed": [_cand(c) for c in result.confirmed],
            # the chosen fixed k measured again in the adaptive variants' rounds: what they were compared with
            "adaptive_reference": None if result.adaptive_reference is None else _cand(result.adaptive_reference),
            "models": [vars(m) for m in result.models],
            "pilot": {name: {"k": r.k, "batch_size": r.batch_size, "seconds": r.seconds, **r.stats.to_dict()}
                      for name, r in result.pilots.items()},
            "profiles": {name: p.to_dict() for name, p in result.profiles.items()}}
    (out / "tune_report.json").write_text(json.dumps(data, indent=2, default=str), encoding="utf-8")
    return {"config": tuned, "report": report}


def _cand(c: Candidate) -> dict[str, Any]:
    return {"label": c.label, "method": c.method, "k": c.k, "batch_size": c.batch_size,
            "rows_per_batch": c.rows_per_batch, "predicted_s": c.predicted_s,
            "predicted_tokens_per_s": c.predicted_tokens_per_s, "model_tokens_per_s": c.model_tokens_per_s,
            "confirm_predicted_tokens_per_s": c.confirm_predicted_tokens_per_s, "measured_s": c.measured_s,
            "measured_tokens_per_s": c.measured_tokens_per_s, "round_s": c.round_s, "same_output": c.same_output,
            "compared_rows": c.compared_rows, "params": c.params, "adaptive_draft_length": c.adaptive_draft_length}
