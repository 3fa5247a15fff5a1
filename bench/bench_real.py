"""Speculation on the real model we ship, against plain decoding, at 1 to 8 rows in flight.

The default job's model pair, prompt and chat template (``configs/summarize.yaml``:
SmolLM2-135M-Instruct; its drafters ``models/smollm2-135m-drafter`` for ``draft_model`` and
``models/smollm2-135m-eagle`` for ``eagle``), XSum articles 200-263 of
``../shared/data/xsum_helm_1000`` (held out from every drafter's training data), 64 new
tokens, greedy, one torch thread.  For every method and number of rows in flight it prints:

- tokens/s on the process CPU clock and on the wall clock, end to end (prefill included)
  and decode only (the engine's steps after admission);
- acceptance rate (accepted / drafted), mean accepted length (1 + accepted / draft steps),
  tokens per target pass, the share of steps that drafted;
- Leviathan et al.'s bound ``S = (1 - α^(k+1)) / ((1 - α)(1 + k c))`` (METRICS.md) from this
  run's measured α (the per-token acceptance that gives the measured mean accepted length
  at the mean draft length k of the steps that drafted) and c (one drafting position /
  one plain target step at the same number of rows), and efficiency = measured decode
  speedup / S;
- the rows identical to plain at the same number of rows.

Not a test: timings are one run each; the CPU clock is steadier than the wall clock on a
shared machine.  Every engine is built the way the job builds it (``pipeline.loading``),
one per method and batch size, warmed up on one short row first.  Usage::

    python bench/bench_real.py                       # the full run (~20-40 min on one core)
    python bench/bench_real.py --rows 200:204 --batch-sizes 1,2 --new-tokens 8   # a quick look
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_DRAFTERS = {"draft_model": "models/smollm2-135m-drafter", "eagle": "models/smollm2-135m-eagle"}
XSUM = ROOT.parent / "shared" / "data" / "xsum_helm_1000" / "xsum_0shot.jsonl"


class Clocks:
    """CPU and wall seconds spent in wrapped calls."""

    def __init__(self):
        self.cpu = self.wall = 0.0
        self.calls = 0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            self.calls += 1
            c, w = time.process_time(), time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.cpu += time.process_time() - c
                self.wall += time.perf_counter() - w

        return timed


def solve_alpha(mean_accepted_length: float, k: float) -> float:
    """α with ``(1 - α^(k+1)) / (1 - α) = mean_accepted_length`` (bisection; 0 .. 1)."""
    if mean_accepted_length <= 1.0 or k <= 0:
        return 0.0
    if mean_accepted_length >= k + 1:
        return 1.0
    lo, hi = 0.0, 1.0 - 1e-12
    for _ in range(200):
        mid = (lo + hi) / 2
        e = (1 - mid ** (k + 1)) / (1 - mid)
        lo, hi = (mid, hi) if e < mean_accepted_length else (lo, mid)
    return (lo + hi) / 2


def leviathan_bound(alpha: float, k: float, c: float) -> float:
    """``S = (1 - α^(k+1)) / ((1 - α)(1 + k c))`` (Leviathan et al. 2023, §3)."""
    e = k + 1 if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return e / (1 + k * c)


def prompts_of(cfg, rows: range) -> list[list[int]]:
    """The job's prompts (template, chat template) for XSum articles ``rows``, as token ids."""
    from pipeline.loading import load_engine
    from pipeline.prompts import PromptBuilder

    builder = PromptBuilder(load_engine(cfg, max_batch_size=1).models.tokenizer, cfg.task)
    lines = XSUM.read_text().splitlines()
    return [builder.build(json.loads(lines[i])["article"])[1] for i in rows]


def run_one(cfg, prompts, batch: int, new_tokens: int) -> dict:
    """One method at ``batch`` rows in flight: timings, statistics and token ids."""
    from pipeline.engine import GenerationSettings
    from pipeline.loading import load_engine

    loaded = load_engine(cfg, max_batch_size=batch)
    engine = loaded.engine
    engine.clock = time.process_time  # the rows' times and the load policy on the CPU clock
    settings = GenerationSettings(max_new_tokens=new_tokens, do_sample=False)
    engine.generate_batch([prompts[0][:32]], GenerationSettings(max_new_tokens=4, do_sample=False))  # warm-up
    if engine.policy is not None:  # the warm-up's measurements are not this run's
        from pipeline.engine.draft_length import DraftLengthPolicy

        engine.policy = DraftLengthPolicy(engine.spec.draft_length)
    admit, step, propose = Clocks(), Clocks(), Clocks()
    engine.admit, engine.step = admit.wrap(engine.admit), step.wrap(engine.step)
    asked = []
    if engine.proposer is not None:
        inner = engine.proposer.propose

        def counted(requests):
            asked.append(max(r.k for r in requests))
            return inner(requests)

        engine.proposer.propose = propose.wrap(counted)
    c0, w0 = time.process_time(), time.perf_counter()
    results = engine.generate_batch(prompts, settings, max_batch_size=batch)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(f"{len(errors)} rows failed, e.g. {errors[0]}")
    stats = [r.stats for r in results]
    new = sum(s.new_tokens for s in stats)
    drafted, accepted = sum(s.draft_tokens for s in stats), sum(s.accepted_tokens for s in stats)
    draft_steps, verify_steps = sum(s.draft_steps for s in stats), sum(s.verify_steps for s in stats)
    return {
        "rows": len(prompts), "batch": batch, "new_tokens": new,
        "cpu_s": cpu, "wall_s": wall, "decode_cpu_s": step.cpu, "decode_wall_s": step.wall,
        "tokens_per_s_cpu": new / cpu, "tokens_per_s_wall": new / wall,
        "decode_tokens_per_s_cpu": new / step.cpu, "decode_tokens_per_s_wall": new / step.wall,
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_accepted_length": 1 + accepted / draft_steps if draft_steps else None,
        "tokens_per_step": new / verify_steps if verify_steps else None,
        "draft_step_share": draft_steps / verify_steps if verify_steps else 0.0,
        "mean_draft_length": drafted / draft_steps if draft_steps else 0.0,
        "propose_s_per_position": propose.cpu / max(1, sum(asked)) if asked else 0.0,
        "propose_calls": len(asked), "step_calls": step.calls,
        "token_ids": [r.token_ids for r in results],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "summarize.yaml"))
    ap.add_argument("--methods", default="plain,draft_model,prompt_lookup,eagle")
    ap.add_argument("--batch-sizes", default="1,2,4,8")
    ap.add_argument("--rows", default="200:264", help="XSum rows a:b (held out from the drafters' training)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--set", action="append", default=[], help="config override section.key=value (every method)")
    ap.add_argument("--output", default=None, help="write report.json / report.md here (e.g. reports/bench_real)")
    args = ap.parse_args(argv)

    import torch

    from pipeline.config import load_config

    torch.set_num_threads(args.threads)
    a, b = (int(x) for x in args.rows.split(":"))
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    if methods[0] != "plain":
        methods = ["plain"] + [m for m in methods if m != "plain"]

    def config(method):
        sets = [f"method.name={method}"] + args.set
        if method in DEFAULT_DRAFTERS:
            sets.append(f"models.drafter={ROOT / DEFAULT_DRAFTERS[method]}")
        return load_config(args.config, sets)

    prompts = prompts_of(config("plain"), range(a, b))
    print(f"{len(prompts)} XSum articles ({a}-{b - 1}), prompt tokens {min(map(len, prompts))}-{max(map(len, prompts))}, "
          f"{args.new_tokens} new tokens, greedy, {args.threads} thread(s)", flush=True)
    runs: dict[str, dict[int, dict]] = {}
    for method in methods:
        cfg = config(method)
        for batch in sizes:
            r = run_one(cfg, prompts, batch, args.new_tokens)
            runs.setdefault(method, {})[batch] = r
            print(f"  {method:14s} B={batch}: {r['tokens_per_s_cpu']:.1f} tokens/s CPU ({r['cpu_s']:.0f} s)", flush=True)

    head = ("| method | rows in flight | tokens/s CPU | decode CPU | tokens/s wall | decode wall | speedup CPU "
            "| decode speedup CPU | acceptance | mean accepted length | tokens/step | drafting steps | α | k | c | S | "
            "efficiency | identical |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    ratios: dict[str, dict[int, float]] = {}
    for method, by_b in runs.items():
        for batch, r in by_b.items():
            p = runs["plain"][batch]
            speed = r["tokens_per_s_cpu"] / p["tokens_per_s_cpu"]
            dspeed = r["decode_tokens_per_s_cpu"] / p["decode_tokens_per_s_cpu"]
            same = sum(x == y for x, y in zip(r["token_ids"], p["token_ids"]))
            alpha = k = c = s_bound = eff = None
            if method != "plain" and r["mean_accepted_length"]:
                k = r["mean_draft_length"]
                alpha = solve_alpha(r["mean_accepted_length"], k)
                c = r["propose_s_per_position"] / (p["decode_cpu_s"] / p["step_calls"])  # per plain step
                s_bound = leviathan_bound(alpha, k, c)
                eff = dspeed / s_bound
            r.update({"speedup_cpu": speed, "decode_speedup_cpu": dspeed, "identical": same, "alpha": alpha,
                      "k": k, "c": c, "S": s_bound, "efficiency": eff})
            if method != "plain":
                ratios.setdefault(method, {})[batch] = speed
            f = lambda v, spec=".2f": "–" if v is None else format(v, spec)
            lines.append(f"| {method} | {batch} | {r['tokens_per_s_cpu']:.1f} | {r['decode_tokens_per_s_cpu']:.1f} | "
                         f"{r['tokens_per_s_wall']:.1f} | {r['decode_tokens_per_s_wall']:.1f} | {speed:.2f}× | "
                         f"{dspeed:.2f}× | {f(r['acceptance_rate'], '.3f')} | {f(r['mean_accepted_length'])} | "
                         f"{f(r['tokens_per_step'])} | {r['draft_step_share']:.2f} | {f(alpha)} | {f(k)} | {f(c, '.3f')} | "
                         f"{f(s_bound)}{'×' if s_bound else ''} | {f(eff)} | {same}/{len(r['token_ids'])} |")
    table = "\n".join(lines)
    print(table)
    def best(batch):
        vals = [v[batch] for v in ratios.values() if batch in v]
        return max(vals) if vals else float("nan")
    worst = min((x for v in ratios.values() for x in v.values()), default=float("nan"))
    tail = [f"best speculative / plain at 1 row: {best(1):.2f}×",
            f"best speculative / plain at {max(sizes)} rows: {best(max(sizes)):.2f}×",
            f"worst method / plain, any batch size: {worst:.2f}×"]
    print("\n".join(tail))
    if args.output:
        out = Path(args.output)
        out.mkdir(parents=True, exist_ok=True)
        meta = {"command": "python bench/bench_real.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                "rows": [a, b], "new_tokens": args.new_tokens, "threads": args.threads, "batch_sizes": sizes,
                "methods": methods, "machine": _machine()}
        slim = {m: {bb: {k2: v for k2, v in r.items() if k2 != "token_ids"} for bb, r in by_b.items()} for m, by_b in runs.items()}
        (out / "report.json").write_text(json.dumps({"meta": meta, "runs": slim, "summary": tail}, indent=1))
        (out / "report.md").write_text(f"# bench_real\n\n`{meta['command']}` on {meta['machine']}\n\n{table}\n\n"
                                       + "\n".join(f"- {t}" for t in tail) + "\n")
    return 0


def _machine() -> str:
    import os
    import platform

    import torch

    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"


if __name__ == "__main__":
    sys.exit(main())
