"""What each part of the CPU acceleration buys a node whose every core decodes, compiling included.

The job's layout: one process per core (``--procs``, default every core), one torch thread each,
as the job's actors run (``compute.cpus_per_actor: 1``).  Each process loads the default job's
target (SmolLM2-135M-Instruct, float32 on the CPU) and decodes its share of XSum articles
200-263 of ``../shared/data/xsum_helm_1000`` (held out: no drafter was trained on them), with the
job's prompt template and chat template (``bench_real.prompts_of``), plain greedy decoding,
``--new-tokens`` new tokens, ``compute.max_batch_size`` rows in flight (the config's).

Variants: every part on (``all on``), each part of :data:`pipeline.engine.cpu.PARTS` off in turn
(``-<part>``), and the whole acceleration off (``all off``: ``cpu.kernels=false``).  Each
variant runs on a fresh set of processes, in two conditions:

- **cold**: a fresh inductor cache (a new folder per variant and round, shared by the node's
  processes as a job's actors share theirs) and a fresh process: the time counts preparing the
  model (measuring kernels, compiling them) and its first batch, what an actor's first batch
  costs on a node that has compiled nothing yet;
- **warm**: the same processes decoding the same articles again right after: an actor's later
  batches (nothing is compiled or measured any more; plain decoding keeps no state across rows);
- **warm start** (``--warm-start``): new processes on the cache the cold ones filled, preparing
  (measuring, and loading the compiled code from disk) and decoding their first batch: an actor
  that starts on a node where an earlier actor or job has compiled.

The node's tokens/s on the CPU clock: the sum over processes of new tokens / that process's CPU
seconds (its own and its children's: inductor's C++ compiler runs as a child), each process
having its core; the wall clock is printed beside it.  Rounds interleave the variants (every
round runs every variant, in a rotated order) so that the machine's drift falls on all alike;
each figure is the median over rounds, and each variant's ratio to ``all on`` of the same round
is the median of those ratios.  A part pays where turning it off costs the node tokens/s cold
(over the job's first batch) and warm (over the rest).

Not a test.  Usage::

    python bench/bench_cpu_parts.py                                       # the figures of record (~hours)
    python bench/bench_cpu_parts.py --rounds 1 --rows 200:204 --new-tokens 16   # does it run (minutes)
    python bench/bench_cpu_parts.py --variants "all on,-rowdot" --output reports/bench_cpu_parts
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_real import XSUM, _commit, _machine, prompts_of  # noqa: E402

TITLE = "bench/bench_cpu_parts.py: each CPU part on the whole node (one process per core), cold and warm"
ALL_ON, ALL_OFF = "all on", "all off"
#: the conditions a variant is measured in (``warm start`` with ``--warm-start``)
CONDITIONS = ("cold", "warm start", "warm")


def variants() -> dict[str, dict]:
    """Every variant's ``cpu:`` options changed from all on (``{}``)."""
    from pipeline.engine.cpu import PARTS

    return {ALL_ON: {}, **{f"-{p}": {p: False} for p in PARTS}, ALL_OFF: {"kernels": False}}


# ---------------------------------------------------------------------------- one process
def _cpu_seconds() -> float:
    """CPU seconds of this process and its waited-for children (the C++ compiler)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def worker(spec: dict) -> None:
    """One process of the node: load, say ``ready``, wait for ``go``, then prepare + decode
    (cold) and decode again (warm); one JSON line of results on stdout."""
    import torch

    from pipeline.config import load_config
    from pipeline.engine import GenerationSettings
    from pipeline.engine.cpu import CpuOptions, prepare
    from pipeline.loading import build_engine, load_job_models

    torch.set_num_threads(1)
    cfg = load_config(spec["config"], spec["sets"])
    models = load_job_models(cfg, "cpu")
    prompts = prompts_of(cfg, models.tokenizer, spec["articles"], Path(spec["xsum"]))
    settings = GenerationSettings(max_new_tokens=spec["new_tokens"], do_sample=False)
    options = CpuOptions(**spec["options"])
    print("ready", flush=True)
    sys.stdin.readline()  # "go": every process of the node starts together
    out = {"articles": len(prompts)}
    c0, w0 = _cpu_seconds(), time.perf_counter()
    plan = prepare(models.target, options, "target")
    out["prepare"] = {"cpu_s": _cpu_seconds() - c0, "wall_s": time.perf_counter() - w0, "compile_s": plan.compile_s,
                      "measure_s": plan.measure_s, "prepare_s": plan.prepare_s, "kernels": plan.summary()}
    engine = build_engine(models, None, cfg.compute.max_batch_size, "fixed", time.process_time)  # keeps the plan
    for label in ("cold", "warm"):  # cold counts preparing: c0, w0 are from before it
        results = engine.generate_batch(prompts, settings)
        errors = [r.error for r in results if r.error]
        if errors:
            raise RuntimeError(errors[0])
        c1, w1 = _cpu_seconds(), time.perf_counter()
        out[label] = {"new_tokens": sum(r.stats.new_tokens for r in results), "cpu_s": c1 - c0, "wall_s": w1 - w0,
                      "token_ids": [r.token_ids for r in results]}
        c0, w0 = c1, w1
    print(json.dumps(out), flush=True)


# ---------------------------------------------------------------------------- the node
def run_node(args, name: str, changes: dict, cache: str) -> dict:
    """One variant on the node: ``args.procs`` processes together; their results summed."""
    procs = []
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECBATCH_CPU_")
           and k not in ("SPECBATCH_FUSED", "SPECBATCH_INDUCTOR", "TORCHINDUCTOR_CACHE_DIR")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    a, b = (int(x) for x in args.rows.split(":"))
    articles = list(range(a, b))
    for i in range(args.procs):
        spec = {"config": args.config, "sets": args.set, "articles": articles[i::args.procs], "xsum": args.xsum,
                "new_tokens": args.new_tokens, "options": {**changes, "compile_cache": cache}}
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(spec)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, env=env))
    try:
        for p in procs:
            line = p.stdout.readline()
            if line.strip() != "ready":
                raise RuntimeError(f"{name}: a worker did not start ({line.strip()!r}); its stderr says why")
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = [json.loads(p.stdout.readline()) for p in procs]
    finally:
        for p in procs:
            p.wait()
    node = {"variant": name, "prepare": [o["prepare"] for o in outs]}
    for label in ("cold", "warm"):
        node[label] = {
            "new_tokens": sum(o[label]["new_tokens"] for o in outs),
            "tokens_per_s_cpu": sum(o[label]["new_tokens"] / o[label]["cpu_s"] for o in outs),
            "tokens_per_s_wall": sum(o[label]["new_tokens"] for o in outs) / max(o[label]["wall_s"] for o in outs),
            "token_ids": [ids for o in outs for ids in o[label]["token_ids"]],
        }
    return node


def summarize(rounds: list[dict[str, dict]]) -> list[dict]:
    """Per variant: median node tokens/s cold and warm, the median ratio to all on of its round,
    the median prepare seconds per process, and its greedy outputs against all on's."""
    rows = []
    for name in rounds[0]:
        row = {"variant": name}
        for label in [c for c in CONDITIONS if c in rounds[0][name]]:
            tps = [r[name][label]["tokens_per_s_cpu"] for r in rounds]
            ratio = [r[name][label]["tokens_per_s_cpu"] / r[ALL_ON][label]["tokens_per_s_cpu"] for r in rounds]
            row[label] = {"tokens_per_s_cpu": statistics.median(tps), "ratio": statistics.median(ratio),
                          "tokens_per_s_wall": statistics.median(r[name][label]["tokens_per_s_wall"] for r in rounds)}
        preps = [p for r in rounds for p in r[name]["prepare"]]
        row["prepare_s"] = statistics.median(p["prepare_s"] for p in preps)  # wall, per process
        row["prepare_cpu_s"] = statistics.median(p["cpu_s"] for p in preps)
        row["compile_s"] = statistics.median(p["compile_s"] for p in preps)
        if "warm start prepare" in rounds[0][name]:  # preparing again on the node's filled cache
            row["warm_start_prepare_s"] = statistics.median(p["prepare_s"] for r in rounds for p in r[name]["warm start prepare"])
        ids, ref = rounds[0][name]["warm"]["token_ids"], rounds[0][ALL_ON]["warm"]["token_ids"]
        row["same_as_all_on"] = sum(x == y for x, y in zip(ids, ref))
        row["rows"] = len(ids)
        row["kernels"] = rounds[-1][name]["prepare"][0]["kernels"]
        rows.append(row)
    return rows


def table(rows: list[dict]) -> list[str]:
    conditions = [c for c in CONDITIONS if c in rows[0]]
    head = "".join(f" {c} tokens/s (CPU) | {c} / all on |" for c in conditions)
    lines = [f"| variant |{head} prepare CPU s | prepare wall s | compile wall s | greedy = all on |",
             "|---|" + "---:|" * (2 * len(conditions) + 4)]
    for r in rows:
        cells = "".join(f" {r[c]['tokens_per_s_cpu']:.1f} | {r[c]['ratio']:.3f} |" for c in conditions)
        lines.append(f"| {r['variant']} |{cells} {r['prepare_cpu_s']:.1f} | {r['prepare_s']:.1f} | {r['compile_s']:.1f} | "
                     f"{r['same_as_all_on']}/{r['rows']} |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--config", default=str(ROOT / "configs" / "summarize.yaml"))
    ap.add_argument("--set", action="append", default=[], help="config override section.key=value")
    ap.add_argument("--procs", type=int, default=os.cpu_count(), help="processes, one per core (default: every core)")
    ap.add_argument("--rows", default="200:264", help="XSum articles a:b (held out)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default=None, help="comma-separated variant names (default: all; 'all on' always runs)")
    ap.add_argument("--warm-start", action="store_true", help="also run each variant's processes again on the cache "
                    "its cold run filled (\"warm start\": preparing from a warm node cache, then the first batch)")
    ap.add_argument("--xsum", default=str(XSUM))
    ap.add_argument("--output", default=None, help="write report.json / report.md here (e.g. reports/bench_cpu_parts)")
    args = ap.parse_args(argv)
    if args.worker is not None:
        worker(json.loads(args.worker))
        return 0
    args.set = ["method.name=plain", "models.dtype=float32"] + args.set
    table_of = variants()
    names = [ALL_ON] + [n.strip() for n in (args.variants or ",".join(table_of)).split(",")
                        if n.strip() and n.strip() != ALL_ON]
    unknown = [n for n in names if n not in table_of]
    if unknown:
        print(f"bench_cpu_parts: unknown variant(s) {unknown}; known: {', '.join(table_of)}", file=sys.stderr)
        return 2
    load = os.getloadavg()[0]
    print(f"{args.procs} processes x 1 thread, XSum {args.rows}, {args.new_tokens} new tokens, plain greedy, "
          f"{args.rounds} round(s) of {len(names)} variants; load average {load:.1f} at start", flush=True)
    rounds = []
    with tempfile.TemporaryDirectory(prefix="bench_cpu_parts_") as tmp:
        for r in range(args.rounds):
            order = names[r % len(names):] + names[: r % len(names)]  # rotated: drift falls on every variant alike
            done = {}
            for name in order:
                cache = str(Path(tmp) / f"round{r}-{name.replace(' ', '_')}")
                done[name] = n = run_node(args, name, table_of[name], cache)
                if args.warm_start:  # new processes on the cache the cold ones filled: a later actor start on the node
                    again = run_node(args, name, table_of[name], cache)
                    n["warm start"], n["warm start prepare"] = again["cold"], again["prepare"]
                print(f"  round {r + 1} {name:24s} cold {n['cold']['tokens_per_s_cpu']:6.1f} tokens/s CPU "
                      f"(wall {n['cold']['tokens_per_s_wall']:6.1f}), warm {n['warm']['tokens_per_s_cpu']:6.1f} "
                      f"(wall {n['warm']['tokens_per_s_wall']:6.1f}); prepare {n['prepare'][0]['prepare_s']:.1f} s",
                      flush=True)
            rounds.append({name: done[name] for name in names})
    rows = summarize(rounds)
    lines = table(rows)
    print("\n".join(lines))
    if args.output:
        out = Path(args.output)
        out.mkdir(parents=True, exist_ok=True)
        meta = {"commit": _commit(), "machine": _machine(), "load_average_start": load, "load_average_end":
                os.getloadavg()[0], "procs": args.procs, "rows": args.rows, "new_tokens": args.new_tokens,
                "rounds": args.rounds, "config": args.config, "sets": args.set}
        (out / "report.json").write_text(json.dumps({"title": TITLE, "meta": meta, "variants": rows}, indent=2))
        (out / "report.md").write_text("\n".join([f"# {TITLE}", "", f"Commit {meta['commit']}, {meta['machine']}, "
                                                  f"load average {load:.1f} -> {meta['load_average_end']:.1f}.", "",
                                                  *lines, "", "Kernels chosen (last round, first process):", "",
                                                  *[f"- {r['variant']}: {r['kernels']}" for r in rows], ""]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
