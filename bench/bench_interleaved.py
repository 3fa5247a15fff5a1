"""Methods against plain decoding, interleaved: every group of rows is decoded by every variant in
turn, in one process, so that the machine's drift (on this shared machine the same fixed
setting measured 1.02x and 1.16x plain in two runs minutes apart) falls on all variants alike.

The default job's model and prompts (``configs/summarize.yaml``, XSum articles of
``../shared/data/xsum_helm_1000``), greedy, one torch thread, at each number of rows in flight
of ``--batch`` (default 1, 2, 4, 8 and 16; a group holds that many rows).  For each number of
rows in flight every variant gets a fresh engine, built the way the job builds it
(``pipeline.loading``) and warmed up outside the timed region as an actor is at start
(:meth:`~pipeline.engine.SpeculativeEngine.warm_up`); it keeps what it learns across the groups,
as a job's actor does, and never sees a row twice (so suffix's job-wide tree holds only other
rows' outputs).  The variant that goes first rotates from group to group.  It prints, after every
few groups, each variant's tokens/s over plain's on the process CPU clock (prefill included:
the whole ``generate_batch`` call), and at the end a table with Leviathan's bound ``S`` from the
measured α, mean k and cost ratio c and the efficiency (measured decode speedup / ``S``) beside
each ratio (:func:`bench_real.leviathan_of`), and checks every variant's ids against plain's.
Usage::

    python bench/bench_interleaved.py                  # every method, 1-16 rows in flight
    python bench/bench_interleaved.py --batch 1 \\
        --variants "prompt_lookup@method.num_assistant_tokens=3,prompt_lookup@method.num_assistant_tokens=3@compute.draft_length=fixed"

A variant is ``name@section.key=value[@...]`` (bench/bench_real.py's syntax).  Not a test.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_real import (DEFAULT_DRAFTERS, XSUM, Probes, _commit, _machine, leviathan_of, prompts_of,  # noqa: E402
                        tally, warm_engine)

TITLE = "bench/bench_interleaved.py: methods against plain, each group of rows decoded by every variant in turn"
VARIANTS = "draft_model,prompt_lookup,suffix,eagle,suffix@method.num_candidates=4"


def _config(path: str, label: str):
    from pipeline.config import load_config

    method, *overrides = label.split("@")
    sets = ["models.dtype=float32", f"method.name={method}"]
    if method in DEFAULT_DRAFTERS:
        sets.append(f"models.drafter={ROOT / DEFAULT_DRAFTERS[method]}")
    return load_config(path, sets + overrides)


def run_batch(labels: list[str], configs: dict, models: dict, prompts: list, batch: int, new_tokens: int,
              warm_up_prompt: int) -> dict[str, dict]:
    """Every variant at ``batch`` rows in flight, groups of ``batch`` rows interleaved: its record
    (:func:`bench_real.tally`) with ``over_plain``, ``rows_differing`` and Leviathan's bound."""
    from pipeline.engine import GenerationSettings

    engines = {label: warm_engine(configs[label], models[label], batch, True, warm_up_prompt) for label in labels}
    probes = {label: Probes(engine) for label, engine in engines.items()}
    settings = GenerationSettings(max_new_tokens=new_tokens, do_sample=False)
    results = {label: [] for label in labels}
    cpu, wall = dict.fromkeys(labels, 0.0), dict.fromkeys(labels, 0.0)
    differ = dict.fromkeys(labels, 0)
    groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    for g, group in enumerate(groups):
        turn = g % len(labels)
        ids = {}
        for label in labels[turn:] + labels[:turn]:
            c, w = time.process_time(), time.perf_counter()
            out = engines[label].generate_batch(group, settings, max_batch_size=batch)
            cpu[label] += time.process_time() - c
            wall[label] += time.perf_counter() - w
            errors = [r.error for r in out if r.error]
            if errors:
                raise RuntimeError(f"{label}: {len(errors)} rows failed, e.g. {errors[0]}")
            results[label] += out
            ids[label] = [r.token_ids for r in out]
        for label in labels:
            differ[label] += sum(x != y for x, y in zip(ids[label], ids["plain"]))
        if g % 4 == 3 or g == len(groups) - 1:
            rate = {label: sum(r.stats.new_tokens for r in results[label]) / cpu[label] for label in labels}
            print(f"  B={batch}, after {min(len(prompts), (g + 1) * batch)} rows: "
                  + ", ".join(f"{label} {rate[label] / rate['plain']:.3f}×" for label in labels if label != "plain"),
                  flush=True)
    runs = {label: {**tally(results[label], probes[label], cpu[label], wall[label]), "batch": batch,
                    "rows_differing": differ[label]} for label in labels}
    plain = runs["plain"]
    for label, r in runs.items():
        r["over_plain"] = r["tokens_per_s_cpu"] / plain["tokens_per_s_cpu"]
        r["decode_over_plain"] = r["decode_tokens_per_s_cpu"] / plain["decode_tokens_per_s_cpu"]
        r.update(leviathan_of(r, plain, True))
        r.pop("token_ids")
    return runs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "summarize.yaml"))
    ap.add_argument("--variants", default=VARIANTS, help=f"comma-separated variants (plain is always run; default {VARIANTS})")
    ap.add_argument("--batch", default="1,2,4,8,16", help="rows in flight (and rows per group), comma-separated")
    ap.add_argument("--rows", default="200:232", help="XSum rows a:b")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--warm-up-prompt", type=int, default=128, help="prompt tokens of the engines' warm-up rows")
    ap.add_argument("--xsum", default=str(XSUM))
    ap.add_argument("--output", default=None, help="write report.json / report.md here")
    args = ap.parse_args(argv)

    import torch

    from pipeline.loading import load_job_models

    torch.set_num_threads(1)
    a, b = (int(x) for x in args.rows.split(":"))
    sizes = [int(x) for x in str(args.batch).split(",")]
    labels = ["plain"] + [v.strip() for v in args.variants.split(",") if v.strip() and v.strip() != "plain"]
    configs, models, loaded = {}, {}, {}
    for label in list(labels):
        cfg = _config(args.config, label)
        drafter = cfg.models.drafter if cfg.uses_drafter else None
        if drafter and not Path(drafter).exists():
            print(f"  {label}: skipped, its drafter {drafter} is not there", flush=True)
            labels.remove(label)
            continue
        if drafter not in loaded:  # one load per drafter (the target's weights are the same)
            loaded[drafter] = load_job_models(cfg, "cpu")
        configs[label], models[label] = cfg, loaded[drafter]
    prompts = prompts_of(configs["plain"], models["plain"].tokenizer, range(a, b), Path(args.xsum))
    print(f"{len(prompts)} XSum articles ({a}-{b - 1}), {args.new_tokens} new tokens, greedy, {sizes} row(s) in "
          f"flight, one thread, CPU clock, variants interleaved per group, every engine warmed up first", flush=True)
    runs: dict[str, dict[int, dict]] = {label: {} for label in labels}
    for batch in sizes:
        for label, r in run_batch(labels, configs, models, prompts, batch, args.new_tokens, args.warm_up_prompt).items():
            runs[label][batch] = r
    f = lambda v, spec=".2f": "–" if v is None else format(v, spec)  # noqa: E731
    lines = ["| variant | rows in flight | tokens/s CPU | / plain | decode / plain | acceptance | α | k | c | S | "
             "efficiency | rows differing from plain |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {label} | {batch} | {r['tokens_per_s_cpu']:.1f} | {r['over_plain']:.3f}× | {r['decode_over_plain']:.3f}× | "
              f"{f(r['acceptance_rate'], '.3f')} | {f(r['alpha'])} | {f(r['k'])} | {f(r['c'], '.3f')} | {f(r['S'])} | "
              f"{f(r['efficiency'])} | {r['rows_differing']} |" for label in labels for batch, r in runs[label].items()]
    table = "\n".join(lines)
    summary = [f"{label} / plain at {batch} row(s): {r['over_plain']:.2f}× (bound {f(r['S'])}×, efficiency "
               f"{f(r['efficiency'])})" for label in labels if label != "plain" for batch, r in runs[label].items()]
    print(table)
    if args.output:
        out = Path(args.output)
        out.mkdir(parents=True, exist_ok=True)
        meta = {"command": "python bench/bench_interleaved.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                "rows": [a, b], "batch_sizes": sizes, "new_tokens": args.new_tokens, "commit": _commit(),
                "machine": _machine(), "clock": "CPU"}
        (out / "report.json").write_text(json.dumps({"title": TITLE, "meta": meta, "runs": runs, "summary": summary},
                                                    indent=1))
        (out / "report.md").write_text(f"# bench_interleaved\n\n`{meta['command']}` at {meta['commit']} on "
                                       f"{meta['machine']}\n\n{table}\n\n" + "\n".join(f"- {s}" for s in summary) + "\n")
    return 1 if any(r["rows_differing"] for by_b in runs.values() for r in by_b.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
