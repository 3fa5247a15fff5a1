"""The node benchmark: what a whole node decodes, speculative against plain, with every core busy.

A batch job runs one actor per core (``compute.num_actors`` = the cores, ``compute.cpus_per_actor``
= 1: one torch thread each), and its cores share one memory bus, so a figure measured on one
thread of an otherwise quiet machine overstates what speculation buys a node.  This benchmark
runs the job's own layout: ``--actors`` (default: every core) Ray actors of the job's actor class
(:class:`actors.generate.GenerateActor`, with the Ray resources the job's pool reserves,
:func:`pipeline.ray_setup.pool_plan`), each built from the default job's config
(``configs/summarize.yaml``) with the audit on, so that it holds the job's engine and the plain
engine on one model pair and warms both up at start, as a job's actor does.  Then, for each
number of rows in flight (``--batch-sizes``, default 1, 2, 4, 8, 16: the actors' engines'
``max_batch_size``), in rounds:

- every actor gets its own slice of XSum articles (``--rows``, default 200-263, held out from
  the drafters' training; each actor starts at another article and never sees one twice at a
  number of rows in flight, so suffix's job-wide tree never replays a timed row);
- all actors decode their slices with the speculative engine at once, then all with the plain
  engine (the next round: plain first), each call through the actor's own batch path
  (``GenerateActor.__call__`` on an Arrow batch of the job's input rows);
- each actor's engine forgets what it learned (``reset_learning``) when the number of rows in
  flight changes, since the same articles come again.

The node's tokens/s on the process CPU clock is ``actors x sum(new tokens) / sum(actor CPU
seconds)`` (each actor's CPU time, inside the calls; steadier than the wall clock on a shared
machine, and on a node with a core per actor the two agree); on the wall clock it is
``sum(new tokens) / the rounds' wall time`` (from the moment every actor starts to the last one
done).  Beside each ratio: Leviathan's bound from the measured acceptance α, mean draft length
k and cost ratio c (one drafting position / one plain step, both on the actors' CPU clocks) and
the efficiency, measured decode speedup / bound (:func:`bench_real.leviathan_of`); and the rows
identical to plain, or differing first at a near-tie (each actor checks its own).  Usage::

    python bench/bench_node.py                                      # the figure of record
    python bench/bench_node.py --methods suffix,prompt_lookup,draft_model,eagle,suffix@method.num_candidates=4
    python bench/bench_node.py --batch-sizes 1,2 --new-tokens 16 --rounds 1 --output reports/bench_node \\
        --note "a short run on a shared machine"                    # a quick look

It writes ``report.json`` / ``report.md`` (``--output``) in the shape ``scripts/results_block.py``
reads (``title``, ``meta``, ``runs``, ``summary``).  Not a test.  Exit 1 when a row differs from
plain away from a near-tie.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from actors.generate import GenerateActor  # noqa: E402
from bench_real import DEFAULT_DRAFTERS, XSUM, Probes, _commit, _machine, leviathan_of, tally  # noqa: E402

VARIANTS = ("speculative", "plain")


class NodeActor(GenerateActor):
    """The job's actor (its engine and the audit's plain engine, both warmed up at start), with
    the calls a benchmark round needs: which engine decodes a batch, the probes of each engine,
    the check of the round's outputs."""

    def __init__(self, config: dict):
        super().__init__(config, device="cpu")
        if self.plain_engine is None:
            raise ValueError("bench_node's actors need audit.fraction > 0 (the plain engine)")
        self.engines = {"speculative": self.engine, "plain": self.plain_engine}
        self.runs: dict[str, dict] = {}
        self.round: dict[str, list] = {}

    def ready(self) -> float:
        """The seconds the warm-up took (the call returns once the actor is built)."""
        return self.warm_up_time_s

    def begin(self, batch: int) -> None:
        """A new number of rows in flight: both engines run ``batch`` rows at once, measured by
        fresh probes, and forget what earlier rows taught them (the same rows come again)."""
        for variant, engine in self.engines.items():
            engine.reset_learning()
            engine.max_batch_size = batch
            for attr in ("admit", "step", "generate_batch"):  # back to the class's methods
                vars(engine).pop(attr, None)
            if engine.proposer is not None:
                vars(engine.proposer).pop("propose", None)
            run = self.runs[variant] = {"probes": Probes(engine), "results": [], "prompts": [], "cpu": 0.0, "wall": 0.0}
            inner = engine.generate_batch

            def captured(prompts, settings=None, max_batch_size=None, inner=inner, run=run):
                results = inner(prompts, settings, max_batch_size)
                run["results"] += results
                run["prompts"] += [list(p) for p in prompts]
                return results

            engine.generate_batch = captured

    def decode(self, variant: str, rows: list[dict]) -> int:
        """``rows`` (job input rows) through the job's batch path with one engine; new tokens."""
        import pyarrow as pa

        from pipeline.schema import INPUT_SCHEMA

        run = self.runs[variant]
        before = len(run["results"])
        self.engine, self.plain_engine = self.engines[variant], None  # no audit inside a timed call
        c, w = time.process_time(), time.perf_counter()
        try:
            self(pa.Table.from_pylist(rows, schema=INPUT_SCHEMA))
        finally:
            run["cpu"] += time.process_time() - c
            run["wall"] += time.perf_counter() - w
            self.engine, self.plain_engine = self.engines["speculative"], self.engines["plain"]
        self.round[variant] = run["results"][before:]
        return sum(len(r.token_ids) for r in self.round[variant])

    def check(self) -> list[tuple[bool, bool, float | None]]:
        """This round's speculative outputs against plain's: per row (identical, at a near-tie, gap)."""
        from pipeline.engine.exactness import compare_rows

        spec, plain = self.round["speculative"], self.round["plain"]
        prompts = self.runs["plain"]["prompts"][-len(plain):]
        checks = compare_rows(self.models.target, prompts, [r.token_ids for r in spec], [r.token_ids for r in plain])
        return [(c.identical, (not c.identical) and c.near_tie, c.gap) for c in checks]

    def collect(self) -> dict[str, tuple]:
        """Per engine: its results (statistics and ids), its probes, CPU and wall seconds."""
        return {v: (r["results"], r["probes"], r["cpu"], r["wall"]) for v, r in self.runs.items()}


def _merge(parts: list[tuple]) -> tuple:
    """The actors' ``collect()`` of one engine as one run: results and probes put together."""
    results, probes = [], Probes.__new__(Probes)
    probes.admit, probes.step, probes.propose, probes.asked = (Clock(), Clock(), Clock(), [])
    cpu = wall = 0.0
    for res, pr, c, w in parts:
        results += res
        for name in ("admit", "step", "propose"):
            mine, theirs = getattr(probes, name), getattr(pr, name)
            mine.cpu, mine.wall, mine.calls = mine.cpu + theirs.cpu, mine.wall + theirs.wall, mine.calls + theirs.calls
        probes.asked += pr.asked
        cpu, wall = cpu + c, wall + w
    return results, probes, cpu, wall


class Clock:
    """Summed clocks of several actors (``bench_real.Clocks``' fields)."""

    def __init__(self):
        self.cpu = self.wall = 0.0
        self.calls = 0


def rows_of(a: int, b: int, xsum: Path) -> list[dict]:
    """XSum articles ``a .. b-1`` as the job's input rows (``pipeline.schema.INPUT_SCHEMA``)."""
    lines = Path(xsum).read_text().splitlines()
    return [{"source_file": str(xsum), "source_row": i, "id": f"xsum-{i}", "text": json.loads(lines[i])["article"],
             "input_error": None} for i in range(a, b)]


def slices(rows: list[dict], actors: int, per_actor: int, rounds: int) -> list[list[list[dict]]]:
    """``[round][actor]`` rows: each actor starts at another row and takes the next ``per_actor``
    rows each round, never one twice (so ``rounds * per_actor <= len(rows)``)."""
    n = len(rows)
    return [[[rows[(a * n // actors + r * per_actor + j) % n] for j in range(per_actor)] for a in range(actors)]
            for r in range(rounds)]


def run_method(label: str, args, rows: list[dict], sizes: list[int]) -> dict[int, dict]:
    """One method's actors on the node, every number of rows in flight: per batch size its
    node figures, its records (``bench_real.tally``) and the exactness check."""
    import ray

    from pipeline.config import load_config
    from pipeline.ray_setup import pool_plan

    method, *variant = label.split("@")
    sets = [f"method.name={method}", f"compute.num_actors={args.actors}", "compute.cpus_per_actor=1",
            f"compute.max_batch_size={max(sizes)}", "audit.fraction=1.0"]
    if method in DEFAULT_DRAFTERS:
        sets.append(f"models.drafter={ROOT / DEFAULT_DRAFTERS[method]}")
    cfg = load_config(args.config, sets + args.set + variant)
    remote = ray.remote(num_cpus=pool_plan(cfg, embedded=True).cpus, max_restarts=0)(NodeActor)
    actors = [remote.remote(cfg.model_dump()) for _ in range(args.actors)]
    warm = ray.get([a.ready.remote() for a in actors])
    print(f"{label}: {args.actors} actors ready, warm-up {min(warm):.1f}-{max(warm):.1f} s each", flush=True)
    out: dict[int, dict] = {}
    try:
        for batch in sizes:
            ray.get([a.begin.remote(batch) for a in actors])
            per_actor = min(max(args.min_rows_per_actor, 2 * batch), len(rows))
            rounds = max(1, min(args.rounds, len(rows) // per_actor))
            wall = dict.fromkeys(VARIANTS, 0.0)
            checks = []
            for r, work in enumerate(slices(rows, args.actors, per_actor, rounds)):
                for v in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
                    t = time.perf_counter()
                    ray.get([a.decode.remote(v, mine) for a, mine in zip(actors, work)])
                    wall[v] += time.perf_counter() - t
                checks += [c for part in ray.get([a.check.remote() for a in actors]) for c in part]
            collected = ray.get([a.collect.remote() for a in actors])
            rec = {v: tally(*_merge([c[v] for c in collected])) for v in VARIANTS}
            for v in VARIANTS:
                rec[v].pop("token_ids")
                rec[v]["node_tokens_per_s_cpu"] = args.actors * rec[v]["tokens_per_s_cpu"]
                rec[v]["node_tokens_per_s_wall"] = rec[v]["new_tokens"] / wall[v]
                rec[v]["rounds_wall_s"] = wall[v]
            spec, plain = rec["speculative"], rec["plain"]
            entry = {"batch": batch, "rounds": rounds, "rows_per_actor_per_round": per_actor,
                     "speedup_cpu": spec["node_tokens_per_s_cpu"] / plain["node_tokens_per_s_cpu"],
                     "speedup_wall": spec["node_tokens_per_s_wall"] / plain["node_tokens_per_s_wall"],
                     "decode_speedup_cpu": spec["decode_tokens_per_s_cpu"] / plain["decode_tokens_per_s_cpu"],
                     "rows": len(checks), "identical": sum(c[0] for c in checks), "near_ties": sum(c[1] for c in checks),
                     "largest_gap": max((c[2] for c in checks if not c[0]), default=None),
                     **leviathan_of(spec, plain, True), "speculative": spec, "plain": plain}
            out[batch] = entry
            f = lambda v: "–" if v is None else f"{v:.2f}"  # noqa: E731
            print(f"  {label} B={batch}: node {spec['node_tokens_per_s_cpu']:.1f} / {plain['node_tokens_per_s_cpu']:.1f} "
                  f"tokens/s CPU = {entry['speedup_cpu']:.2f}× plain (wall {entry['speedup_wall']:.2f}×; bound S "
                  f"{f(entry['S'])}, efficiency {f(entry['efficiency'])}), {entry['identical']}/{entry['rows']} "
                  f"identical, {entry['near_ties']} at a near-tie", flush=True)
    finally:
        for a in actors:
            ray.kill(a)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "summarize.yaml"))
    ap.add_argument("--methods", default=None, help="methods or variants name@section.key=value (default: the config's)")
    ap.add_argument("--actors", type=int, default=os.cpu_count(), help="actors, one per core (default: every core)")
    ap.add_argument("--batch-sizes", default="1,2,4,8,16", help="rows in flight per actor")
    ap.add_argument("--rows", default="200:264", help="XSum rows a:b (held out from the drafters' training)")
    ap.add_argument("--rounds", type=int, default=4, help="rounds per number of rows in flight (fewer when the rows run out)")
    ap.add_argument("--min-rows-per-actor", type=int, default=2,
                    help="rows each actor decodes per round: max(this, 2 B), at most the rows there are")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--xsum", default=str(XSUM))
    ap.add_argument("--set", action="append", default=[], help="a config override section.key=value (every method)")
    ap.add_argument("--note", default=None, help="said after the title (e.g. where and how briefly it was measured)")
    ap.add_argument("--output", default=None, help="write report.json / report.md here (reports/bench_node)")
    args = ap.parse_args(argv)

    from pipeline.config import load_config
    from pipeline.ray_setup import init_ray

    a, b = (int(x) for x in args.rows.split(":"))
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    base = load_config(args.config, [f"generation.max_new_tokens={args.new_tokens}", *args.set])
    args.set = [f"generation.max_new_tokens={args.new_tokens}", *args.set]
    methods = [m.strip() for m in (args.methods or base.method.name).split(",") if m.strip() and m.strip() != "plain"]
    rows = rows_of(a, b, Path(args.xsum))
    pp = os.environ.get("PYTHONPATH", "")  # the actors unpickle NodeActor, which imports bench_real
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "bench")] + ([pp] if pp else []))
    init_ray(base)
    print(f"{len(rows)} XSum articles ({a}-{b - 1}), {args.new_tokens} new tokens, {base.generation.do_sample and 'sampled' or 'greedy'}, "
          f"{args.actors} actors x 1 thread, {sizes} rows in flight per actor, CPU clock; {_machine()}", flush=True)
    runs: dict[str, dict[int, dict]] = {}
    for label in methods:
        cfg = load_config(args.config, [f"method.name={label.split('@')[0]}"])
        drafter = (ROOT / DEFAULT_DRAFTERS[cfg.method.name]) if cfg.method.name in DEFAULT_DRAFTERS else cfg.models.drafter
        if cfg.uses_drafter and not Path(drafter).exists():
            print(f"  {label}: skipped, its drafter {drafter} is not there", flush=True)
            continue
        runs[label] = run_method(label, args, rows, sizes)
    return report(args, runs, sizes, (a, b), argv)


def _summary_line(label: str, by_b: dict) -> str:
    """One method's line: its speedup over plain (CPU clock) at each number of rows in flight,
    then the range of Leviathan's bound, e.g. ``suffix: 1.03 / 0.98× plain at 1 / 2 rows (bound 1.58-1.99×)``."""
    ratios = " / ".join(f"{e['speedup_cpu']:.2f}" for e in by_b.values())
    sizes = " / ".join(str(batch) for batch in by_b)
    bounds = sorted(e["S"] for e in by_b.values() if e.get("S") is not None)
    bound = "" if not bounds else f" (bound {bounds[0]:.2f}×)" if bounds[0] == bounds[-1] else (
        f" (bound {bounds[0]:.2f}-{bounds[-1]:.2f}×)")
    return f"{label}: {ratios}× plain at {sizes} row{'s' if len(by_b) > 1 or max(map(int, by_b)) > 1 else ''}{bound}"


def report(args, runs: dict[str, dict[int, dict]], sizes: list[int], rows: tuple[int, int], argv) -> int:
    """The table, the summary lines and, with ``--output``, report.json / report.md."""
    f = lambda v, spec=".2f": "–" if v is None else format(v, spec)  # noqa: E731
    lines = ["| method | rows in flight per actor | node tokens/s CPU, speculative | plain | speedup CPU | speedup wall "
             "| decode speedup CPU | acceptance | α | k | c | S | efficiency | identical | at a near-tie |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, by_b in runs.items():
        for batch, e in by_b.items():
            s, p = e["speculative"], e["plain"]
            lines.append(f"| {label} | {batch} | {s['node_tokens_per_s_cpu']:.1f} | {p['node_tokens_per_s_cpu']:.1f} | "
                         f"{e['speedup_cpu']:.2f}× | {e['speedup_wall']:.2f}× | {e['decode_speedup_cpu']:.2f}× | "
                         f"{f(s['acceptance_rate'], '.3f')} | {f(e['alpha'])} | {f(e['k'])} | {f(e['c'], '.3f')} | "
                         f"{f(e['S'])} | {f(e['efficiency'])} | {e['identical']}/{e['rows']} | {e['near_ties']} |")
    table = "\n".join(lines)
    summary = [_summary_line(label, by_b) for label, by_b in runs.items()]
    bad = [(label, batch) for label, by_b in runs.items() for batch, e in by_b.items()
           if e["identical"] + e["near_ties"] < e["rows"]]
    note = (f"rows differing from plain away from a near-tie: {bad}" if bad else
            "every row identical to plain or differing first at a near-tie")
    print(table)
    print(note)
    print("\n".join(summary))
    if args.output:
        a, b = rows
        title = (f"bench/bench_node.py: one actor per core ({args.actors} x 1 thread), XSum {a}-{b - 1}, "
                 f"{args.new_tokens} new tokens, {', '.join(map(str, sizes))} rows in flight, CPU clock")
        if args.note:
            title += f"; {args.note}"
        meta = {"command": "python bench/bench_node.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                "config": os.path.relpath(args.config, ROOT), "rows": [a, b], "new_tokens": args.new_tokens,
                "actors": args.actors, "threads_per_actor": 1, "batch_sizes": sizes, "rounds": args.rounds,
                "clock": "CPU", "machine": _machine(), "commit": _commit(), "note": args.note}
        out = Path(args.output)
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps({"title": title, "meta": meta, "runs": runs, "summary": summary,
                                                     "exactness": note}, indent=1))
        (out / "report.md").write_text(f"# bench_node\n\n{title}\n\n`{meta['command']}` at {meta['commit']}\n\n{table}\n\n"
                                       f"{note}\n\n" + "\n".join(f"- {s}" for s in summary) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
