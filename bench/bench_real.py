"""Speculation on the real model we ship, against plain decoding, at 1 to 16 rows in flight.

The default job's model pair, prompt and chat template (``configs/summarize.yaml``:
SmolLM2-135M-Instruct; its drafters ``models/smollm2-135m-drafter`` for ``draft_model`` and
``models/smollm2-135m-eagle`` for ``eagle``), XSum articles 200-263 of
``../shared/data/xsum_helm_1000`` (held out from every drafter's training data), 64 new
tokens, greedy, one torch thread.  For every method and number of rows in flight it prints:

- tokens/s on the process CPU clock and on the wall clock, end to end (prefill included)
  and decode only (the engine's steps after admission);
- acceptance rate (accepted / drafted), mean accepted length (1 + accepted / draft steps),
  tokens per target pass, the share of steps that drafted;
- Leviathan et al.'s bound ``S = (1 - α^(k+1)) / ((1 - α)(1 + k c))`` (docs/metrics.md) from this
  run's measured α (the per-token acceptance that gives the measured mean accepted length
  at the mean draft length k of the steps that drafted) and c (one drafting position /
  one plain target step at the same number of rows), and efficiency = measured decode
  speedup / S; for a token-tree variant (its steps verified trees), S comes from the
  acceptance measured per node instead: ``S = E / (1 + n c)``, with ``E`` the measured mean
  accepted length (1 + the accepted path's nodes per drafting step) and ``n`` the mean
  nodes per tree, the bound of a verify pass that cost one plain step whatever its width;
  the efficiency then shows what the wider pass costs;
- the rows identical to plain at the same number of rows.

Not a test: timings are one run each; the CPU clock is steadier than the wall clock on a
shared machine.  Every engine is built the way the job builds it (``pipeline.loading``), a
fresh one per method and batch size, so no job-wide draft source (suffix's tree of earlier
outputs) has seen the rows it is timed on, and warmed up outside the timed region as an
actor is at start (:meth:`~pipeline.engine.SpeculativeEngine.warm_up`: synthetic rows at
every number of rows in flight up to the run's, then what they taught it forgotten).  The
default methods: plain, draft_model, prompt_lookup, suffix, eagle and suffix's token trees
(``suffix@method.num_candidates=4``), at 1, 2, 4, 8 and 16 rows in flight.  Each run's line
prints its ratio to plain with Leviathan's bound and the efficiency beside it.  Usage::

    python bench/bench_real.py                       # the full run (~1 h on one core)
    python bench/bench_real.py --rows 200:204 --batch-sizes 1,2 --new-tokens 8   # a quick look
    python bench/bench_real.py --methods prompt_lookup,prompt_lookup@method.num_candidates=4   # tree variant

A method variant ``name@section.key=value[@...]`` runs method ``name`` with those overrides,
reported under the whole string (trees: ``@method.num_candidates=C``; their statistics add
the share of steps that verified a tree and its mean size in nodes).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.engine.cost_model import leviathan_expected_tokens, leviathan_speedup  # noqa: E402

DEFAULT_DRAFTERS = {"draft_model": "models/smollm2-135m-drafter", "eagle": "models/smollm2-135m-eagle"}
#: ../shared of the checkout (or of the folder above it: a git worktree one level deeper)
XSUM = next((p for p in (ROOT.parent / "shared", ROOT.parents[1] / "shared") if p.is_dir()), ROOT.parent / "shared") \
    / "data" / "xsum_helm_1000" / "xsum_0shot.jsonl"



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
        e = leviathan_expected_tokens(mid, k)
        lo, hi = (mid, hi) if e < mean_accepted_length else (lo, mid)
    return (lo + hi) / 2


def leviathan_bound(alpha: float, k: float, c: float) -> float:
    """``S = (1 - α^(k+1)) / ((1 - α)(1 + k c))`` (Leviathan et al. 2023, §3)."""
    return leviathan_speedup(alpha, k, c)


def tree_bound(mean_accepted_length: float, nodes: float, c: float) -> float:
    """``S = E / (1 + n c)``: a token tree's bound from its measured acceptance per node
    (``E``, tokens per drafting step) and drafting cost (``n`` nodes at ``c`` plain steps
    each), its verify pass taken as one plain step (SpecInfer's premise: a pass flat in its
    width)."""
    return mean_accepted_length / (1 + nodes * c)


def prompts_of(cfg, tokenizer, rows: range, xsum: Path = XSUM, article_chars: int | None = None) -> list[list[int]]:
    """The job's prompts (template, chat template) for XSum articles ``rows``, as token ids;
    each article cut to its first ``article_chars`` characters when given (None: whole)."""
    from pipeline.prompts import PromptBuilder

    builder = PromptBuilder(tokenizer, cfg.task)
    lines = Path(xsum).read_text().splitlines()
    return [builder.build(json.loads(lines[i])["article"][:article_chars])[1] for i in rows]


class Probes:
    """What a run of an engine measures besides its rows' statistics: CPU and wall seconds of
    its admissions, its steps and its proposer's calls, and the draft length asked per call."""

    def __init__(self, engine):
        self.admit, self.step, self.propose = Clocks(), Clocks(), Clocks()
        self.asked: list[int] = []
        engine.admit, engine.step = self.admit.wrap(engine.admit), self.step.wrap(engine.step)
        if engine.proposer is not None:
            inner = engine.proposer.propose

            def counted(requests):
                self.asked.append(max(r.k for r in requests))
                return inner(requests)

            engine.proposer.propose = self.propose.wrap(counted)


def warm_engine(cfg, models, batch: int, cpu_clock: bool, warm_up_prompt: int = 128):
    """The engine of ``cfg``'s method at ``batch`` rows in flight, built as the job builds it, warmed
    up outside any timed region (:meth:`SpeculativeEngine.warm_up`: synthetic rows at every number of
    rows in flight up to ``batch``; then what they taught it is forgotten, its measured costs kept)."""
    from pipeline.loading import build_engine

    clock = time.process_time if cpu_clock else time.perf_counter
    engine = build_engine(models, cfg.method.speculation_settings(), batch, cfg.compute.draft_length, clock)
    engine.warm_up(batch, prompt_tokens=warm_up_prompt)
    return engine


def run_one(cfg, models, prompts, batch: int, new_tokens: int, cpu_clock: bool, warm_up_prompt: int = 128) -> dict:
    """One method at ``batch`` rows in flight on loaded ``models``, on a fresh engine (no draft
    source has seen these rows) warmed up first: timings, statistics and ids."""
    from pipeline.engine import GenerationSettings

    engine = warm_engine(cfg, models, batch, cpu_clock, warm_up_prompt)
    settings = GenerationSettings(max_new_tokens=new_tokens, do_sample=False)
    probes = Probes(engine)
    c0, w0 = time.process_time(), time.perf_counter()
    results = engine.generate_batch(prompts, settings, max_batch_size=batch)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(f"{len(errors)} rows failed, e.g. {errors[0]}")
    return {**tally(results, probes, cpu, wall), "batch": batch}


def tally(results, probes: Probes, cpu: float, wall: float) -> dict:
    """A run's record from its results, its :class:`Probes` and its CPU and wall seconds."""
    step, propose, asked = probes.step, probes.propose, probes.asked
    stats = [r.stats for r in results]
    new = sum(s.new_tokens for s in stats)
    drafted, accepted = sum(s.draft_tokens for s in stats), sum(s.accepted_tokens for s in stats)
    draft_steps, verify_steps = sum(s.draft_steps for s in stats), sum(s.verify_steps for s in stats)
    tree_steps, tree_nodes = sum(s.tree_steps for s in stats), sum(s.tree_nodes for s in stats)
    return {
        "tree_step_share": tree_steps / verify_steps if verify_steps else 0.0,
        "mean_tree_nodes": tree_nodes / tree_steps if tree_steps else None,
        "rows": len(results), "new_tokens": new,
        "cpu_s": cpu, "wall_s": wall, "decode_cpu_s": step.cpu, "decode_wall_s": step.wall,
        "tokens_per_s_cpu": new / cpu, "tokens_per_s_wall": new / wall,
        "decode_tokens_per_s_cpu": new / step.cpu, "decode_tokens_per_s_wall": new / step.wall,
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_accepted_length": 1 + accepted / draft_steps if draft_steps else None,
        "tokens_per_step": new / verify_steps if verify_steps else None,
        "draft_step_share": draft_steps / verify_steps if verify_steps else 0.0,
        "mean_draft_length": drafted / draft_steps if draft_steps else 0.0,
        "propose_s_per_position": propose.cpu / max(1, sum(asked)) if asked else 0.0,
        "propose_wall_s_per_position": propose.wall / max(1, sum(asked)) if asked else 0.0,
        "propose_calls": len(asked), "step_calls": step.calls,
        "token_ids": [r.token_ids for r in results],
    }


def leviathan_of(r: dict, p: dict, cpu_clock: bool) -> dict:
    """Leviathan et al.'s bound of run ``r`` against plain's ``p`` at the same rows in flight, from
    what ``r`` measured (see the module docstring): ``alpha``, ``k``, ``c``, ``S`` and the
    ``efficiency`` (measured decode speedup / ``S``); Nones where ``r`` never drafted."""
    dkey, dsec = ("decode_tokens_per_s_cpu", "decode_cpu_s") if cpu_clock else ("decode_tokens_per_s_wall", "decode_wall_s")
    out = dict.fromkeys(("alpha", "k", "c", "S", "efficiency"))
    if not r.get("mean_accepted_length") or r is p:
        return out
    k = r["mean_draft_length"]
    alpha = solve_alpha(r["mean_accepted_length"], k)
    per_pos = r["propose_s_per_position"] if cpu_clock else r["propose_wall_s_per_position"]
    c = per_pos / (p[dsec] / p["step_calls"])  # one drafting position / one plain step
    s_bound = leviathan_bound(alpha, k, c)
    if r.get("tree_step_share") and r.get("mean_tree_nodes"):  # trees: per-node acceptance
        alpha = None
        s_bound = tree_bound(r["mean_accepted_length"], r["mean_tree_nodes"], c)
    return {"alpha": alpha, "k": k, "c": c, "S": s_bound, "efficiency": (r[dkey] / p[dkey]) / s_bound}


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "summarize.yaml"))
    ap.add_argument("--methods", default="plain,draft_model,prompt_lookup,suffix,eagle,suffix@method.num_candidates=4",
                    help="methods, comma-separated; a variant name@section.key=value[@...] runs method name with those "
                    "overrides, reported under the whole string (e.g. prompt_lookup@compute.draft_length=fixed)")
    ap.add_argument("--batch-sizes", default="1,2,4,8,16")
    ap.add_argument("--rows", default="200:264", help="XSum rows a:b (held out from the drafters' training)")
    ap.add_argument("--min-rows", type=int, default=None,
                    help="run B rows in flight on max(min_rows, 2B) of the rows only (the GPU check's budget)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--article-chars", type=int, default=None,
                    help="cut each article to its first N characters (default: whole; gpu_check's CPU quick mode: short prefills)")
    ap.add_argument("--xsum", default=str(XSUM), help="the XSum JSONL (default: ../shared/data/xsum_helm_1000/xsum_0shot.jsonl)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--warm-up-prompt", type=int, default=128,
                    help="prompt tokens of each engine's synthetic warm-up rows (SpeculativeEngine.warm_up)")
    ap.add_argument("--device", default="cpu", help="cpu | cuda (the models' device)")
    ap.add_argument("--dtype", default=None, help="models.dtype (default: the config's; float32 on the CPU)")
    ap.add_argument("--set", action="append", default=[], help="config override section.key=value (every method), or method:section.key=value "
                    "(that method only, e.g. eagle:method.draft_vocab_size=4096)")
    ap.add_argument("--output", default=None, help="write report.json / report.md here (e.g. reports/bench_real)")
    return ap.parse_args(argv)


def measure(args: argparse.Namespace) -> tuple[dict[str, dict[int, dict]], list, object]:
    """Each method (plain first) at each number of rows in flight, a fresh warmed engine each
    (:func:`run_one`), printed as it goes; returns ``(runs, prompts, target)``: ``runs[method][B]``
    is :func:`run_one`'s record, ``prompts`` the articles' token ids, ``target`` the target model
    (for the exactness check)."""

    import torch

    from pipeline.config import load_config
    from pipeline.loading import load_job_models

    torch.set_num_threads(args.threads)
    a, b = (int(x) for x in args.rows.split(":"))
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    methods = ["plain"] + [m.strip() for m in args.methods.split(",") if m.strip() and m.strip() != "plain"]
    cpu_clock = args.device == "cpu"
    clock_name = "CPU" if cpu_clock else "wall"

    def config(label):
        method, *variant = label.split("@")
        sets = [f"method.name={method}"] + ([f"models.dtype={args.dtype}"] if args.dtype else [])
        if method in DEFAULT_DRAFTERS:
            sets.append(f"models.drafter={ROOT / DEFAULT_DRAFTERS[method]}")
        for s in args.set:
            scope, sep, rest = s.partition(":")
            if not sep or "=" in scope:  # section.key=value: every method
                sets.append(s)
            elif scope in (method, label):
                sets.append(rest)
        return load_config(args.config, sets + variant)

    def rows_for(batch: int, n: int) -> int:
        return n if args.min_rows is None else min(n, max(args.min_rows, 2 * batch))

    runs: dict[str, dict[int, dict]] = {}
    prompts = target = None
    f_ = lambda v: "–" if v is None else f"{v:.2f}"  # noqa: E731
    for method in methods:
        cfg = config(method)
        drafter = cfg.models.drafter if cfg.uses_drafter else None
        if drafter and not Path(drafter).exists():
            print(f"  {method}: skipped, its drafter {drafter} is not there", flush=True)
            continue
        models = load_job_models(cfg, args.device)
        if prompts is None:
            prompts, target = prompts_of(cfg, models.tokenizer, range(a, b), args.xsum, args.article_chars), models.target
            print(f"{len(prompts)} XSum articles ({a}-{b - 1}), prompt tokens {min(map(len, prompts))}-"
                  f"{max(map(len, prompts))}, {args.new_tokens} new tokens, greedy, {args.device} "
                  f"{cfg.models.dtype}, {args.threads} thread(s), {clock_name} clock", flush=True)
        for batch in sizes:
            r = run_one(cfg, models, prompts[: rows_for(batch, len(prompts))], batch, args.new_tokens, cpu_clock,
                        args.warm_up_prompt)
            runs.setdefault(method, {})[batch] = r
            key_of = "tokens_per_s_cpu" if cpu_clock else "tokens_per_s_wall"
            p = runs.get("plain", {}).get(batch)
            if p is not None and method != "plain":
                lev = leviathan_of(r, p, cpu_clock)
                speed = (f", {r[key_of] / p[key_of]:.2f}× plain (bound S {f_(lev['S'])}, efficiency "
                         f"{f_(lev['efficiency'])})")
            else:
                speed = ""
            print(f"  {method:14s} B={batch}: {r[key_of]:.1f} tokens/s {clock_name} "
                  f"({r['cpu_s' if cpu_clock else 'wall_s']:.1f} s){speed}", flush=True)
        del models
    return runs, prompts, target


def tabulate(runs: dict[str, dict[int, dict]], prompts: list, target, cpu_clock: bool) -> tuple[str, dict]:
    """The report's table (one line per method and number of rows in flight: speed against
    plain, acceptance, Leviathan's bound and the efficiency, rows identical to plain); each
    record gets its figures added.  Returns ``(table, ratios)``: ``ratios[method][B]`` is its
    speedup over plain."""
    from pipeline.engine.exactness import compare_rows

    clock_name = "CPU" if cpu_clock else "wall"
    key, dkey = ("tokens_per_s_cpu", "decode_tokens_per_s_cpu") if cpu_clock else ("tokens_per_s_wall", "decode_tokens_per_s_wall")
    head = (f"| method | rows in flight | tokens/s CPU | decode CPU | tokens/s wall | decode wall | speedup {clock_name} "
            f"| decode speedup {clock_name} | acceptance | mean accepted length | tokens/step | drafting steps | α | k | c "
            "| S | efficiency | tree steps | tree nodes | identical | at a near-tie |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    ratios: dict[str, dict[int, float]] = {}
    f = lambda v, spec=".2f": "–" if v is None else format(v, spec)
    for method, by_b in runs.items():
        for batch, r in by_b.items():
            p = runs["plain"][batch]
            speed, dspeed = r[key] / p[key], r[dkey] / p[dkey]
            n = len(r["token_ids"])
            checks = compare_rows(target, prompts[:n], r["token_ids"], p["token_ids"])
            same = sum(c.identical for c in checks)
            ties = sum(1 for c in checks if not c.identical and c.near_tie)
            lev = leviathan_of(r, p, cpu_clock)
            alpha, k, c, s_bound, eff = (lev[x] for x in ("alpha", "k", "c", "S", "efficiency"))
            r.update({"speedup": speed, "decode_speedup": dspeed, "identical": same, "near_ties": ties,
                      "largest_gap": max((c_.gap for c_ in checks if not c_.identical), default=None), **lev})
            if method != "plain":
                ratios.setdefault(method, {})[batch] = speed
            lines.append(f"| {method} | {batch} | {r['tokens_per_s_cpu']:.1f} | {r['decode_tokens_per_s_cpu']:.1f} | "
                         f"{r['tokens_per_s_wall']:.1f} | {r['decode_tokens_per_s_wall']:.1f} | {speed:.2f}× | "
                         f"{dspeed:.2f}× | {f(r['acceptance_rate'], '.3f')} | {f(r['mean_accepted_length'])} | "
                         f"{f(r['tokens_per_step'])} | {r['draft_step_share']:.2f} | {f(alpha)} | {f(k)} | {f(c, '.3f')} | "
                         f"{f(s_bound)}{'×' if s_bound else ''} | {f(eff)} | {r['tree_step_share']:.2f} | "
                         f"{f(r['mean_tree_nodes'], '.1f')} | {same}/{n} | {ties} |")
    table = "\n".join(lines)
    return table, ratios


def main(argv=None) -> int:
    args = parse_args(argv)
    from pipeline.engine.exactness import NEAR_TIE, NEAR_TIE_ULPS

    a, b = (int(x) for x in args.rows.split(":"))
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    cpu_clock = args.device == "cpu"
    clock_name = "CPU" if cpu_clock else "wall"
    runs, prompts, target = measure(args)
    table, ratios = tabulate(runs, prompts, target, cpu_clock)
    print(table)
    bad = [(m, bb) for m, by_b in runs.items() for bb, r in by_b.items() if r["identical"] + r["near_ties"] < len(r["token_ids"])]

    def best(batch):
        vals = [v[batch] for v in ratios.values() if batch in v]
        return max(vals) if vals else float("nan")

    worst = min((x for v in ratios.values() for x in v.values()), default=float("nan"))
    ends = sorted({min(sizes), max(sizes)})  # the fewest and the most rows in flight measured
    tail = [f"best speculative / plain at {n} row{'s' if n > 1 else ''}: {best(n):.2f}×" for n in ends] + [
            f"worst method / plain, any batch size: {worst:.2f}×"]
    bound = f"{NEAR_TIE:g}" if cpu_clock and args.dtype in (None, "float32", "auto") else (
        f"{NEAR_TIE:g} in float32, {NEAR_TIE_ULPS} units in the last place of the top logit in half precision")
    note = (f"rows differing from plain away from a near-tie (top-2 logit gap above {bound}): {bad}" if bad else
            f"every row identical to plain or differing first at a near-tie (top-2 logit gap below {bound})")
    print(note)
    print("\n".join(tail))
    if args.output:
        out = Path(args.output)
        out.mkdir(parents=True, exist_ok=True)
        meta = {"command": "python bench/bench_real.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                "rows": [a, b], "new_tokens": args.new_tokens, "threads": args.threads, "batch_sizes": sizes,
                "device": args.device, "dtype": args.dtype, "clock": clock_name, "methods": list(runs),
                "machine": _machine(), "commit": _commit()}
        slim = {m: {bb: {k2: v for k2, v in r.items() if k2 != "token_ids"} for bb, r in by_b.items()} for m, by_b in runs.items()}
        (out / "report.json").write_text(json.dumps({"meta": meta, "runs": slim, "summary": tail, "exactness": note}, indent=1))
        (out / "report.md").write_text(f"# bench_real\n\n`{meta['command']}` at {meta['commit']} on {meta['machine']}"
                                       f"\n\n{table}\n\n{note}\n\n" + "\n".join(f"- {t}" for t in tail) + "\n")
    return 1 if bad else 0


def _commit() -> str | None:
    import subprocess

    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _machine() -> str:
    import os
    import platform

    import torch

    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores{gpu}, torch {torch.__version__}"


if __name__ == "__main__":
    sys.exit(main())
