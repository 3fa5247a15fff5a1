"""Online serving benchmark (not a test): latency and throughput of the Ray Serve app
(``pipeline/serve/``) under 1, 8 and 32 concurrent clients, speculative vs plain.

For each method it deploys the app of ``configs/summarize.yaml`` (demo model pair, one
replica with every core of the machine) on an embedded Ray, then for each concurrency ``c``
runs ``c`` clients that each send greedy ``/v1/completions`` requests one after another
(the summarize job's prompts, as token ids: the demo articles of ``data/demo_prompts.jsonl``,
or with ``--xsum`` the first XSum articles of ``../shared/data/xsum_helm_1000``) until
``max(--min-requests, 2c)`` requests are answered.  It prints, per
method and concurrency: p50 / p95 request latency (seconds, client side, HTTP included),
total tokens/s (completion tokens of all requests / wall time of the level), the mean
tokens per target pass and acceptance rate from the responses' ``speculation`` objects,
and each speculative method's ratio to plain at the same concurrency.  It also checks that
every greedy output equals plain's (differences must be float32 near-ties).

    python bench/bench_serve.py                          # plain and draft_model, 32 new tokens
    python bench/bench_serve.py --methods plain draft_model prompt_lookup --max-tokens 64 --xsum
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) by linear interpolation (numpy's default)."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    lo, hi = int(pos), min(int(pos) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


async def run_level(url: str, prompts: list[list[int]], clients: int, requests: int, max_tokens: int):
    """``clients`` concurrent clients, ``requests`` requests in all; returns
    ``(latencies, outputs by prompt index, speculation objects, wall seconds)``."""
    import httpx

    todo = list(range(requests))
    latencies, outputs, specs = [], {}, []

    async def client(http):
        while todo:
            i = todo.pop(0)
            body = {"prompt": prompts[i % len(prompts)], "max_tokens": max_tokens, "temperature": 0,
                    "return_token_ids": True}
            t0 = time.perf_counter()
            r = await http.post("/v1/completions", json=body)
            latencies.append(time.perf_counter() - t0)
            r.raise_for_status()
            out = r.json()
            outputs[i] = out["choices"][0]["token_ids"]
            specs.append(out["speculation"])

    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=clients)) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        wall = time.perf_counter() - t0
    return latencies, outputs, specs, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(REPO / "configs" / "summarize.yaml"))
    ap.add_argument("--methods", nargs="+", default=["plain", "draft_model"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--min-requests", type=int, default=8, help="requests per level at least (else 2 x clients)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-batch-size", type=int, default=32, help="serve.max_batch_size")
    ap.add_argument("--cpus", type=float, default=os.cpu_count(), help="serve.cpus_per_replica (torch threads)")
    ap.add_argument("--port", type=int, default=0, help="HTTP port (0: a free one)")
    ap.add_argument("--xsum", action="store_true", help="XSum articles (about 650 prompt tokens) instead of the demo ones")
    args = ap.parse_args()

    import socket

    import ray
    from ray import serve
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench_batch import load_prompts
    from pipeline.engine import RowStats
    from pipeline.engine.exactness import first_difference_is_near_tie
    from pipeline.config import load_config
    from pipeline.serve import app_builder

    cfg = load_config(args.config)
    tok = AutoTokenizer.from_pretrained(cfg.models.target)
    if args.xsum:
        prompts = load_prompts(tok, max(args.min_requests, 2 * max(args.concurrency)))
    else:
        from pipeline.prompts import PromptBuilder

        builder = PromptBuilder(tok, cfg.task)
        texts = [json.loads(line)["text"] for line in (REPO / "data" / "demo_prompts.jsonl").read_text().splitlines()]
        prompts = [builder.build(t)[1] for t in texts]
    port = args.port
    if not port:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    os.environ["PYTHONPATH"] = str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")
    ray.init(include_dashboard=False, configure_logging=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    print(f"# bench_serve: {len(prompts)} {'XSum' if args.xsum else 'demo'} prompts (mean {statistics.mean(map(len, prompts)):.0f} tokens), "
          f"{args.max_tokens} new tokens, greedy, one replica ({args.cpus:g} CPUs, max_batch_size "
          f"{args.max_batch_size}), target {Path(cfg.models.target).name}, load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores at start", flush=True)
    print(f"\n{'method':14s} {'clients':>7s} {'requests':>8s} {'p50 s':>7s} {'p95 s':>7s} {'tokens/s':>9s} "
          f"{'tok/step':>8s} {'accept':>6s} {'vs plain':>9s}", flush=True)
    table, outputs = {}, {}
    try:
        for method in args.methods:
            overrides = {"config": args.config, "method.name": method, "serve.cpus_per_replica": str(args.cpus),
                         "serve.max_batch_size": str(args.max_batch_size), "serve.max_ongoing_requests": "256"}
            serve.delete("specbatch")  # free the cores of the last method's replica first
            serve.run(app_builder(overrides), name="specbatch", route_prefix="/")
            asyncio.run(run_level(url, prompts, 1, 2, args.max_tokens))  # warm-up
            for c in args.concurrency:
                n = max(args.min_requests, 2 * c)
                lat, outs, specs, wall = asyncio.run(run_level(url, prompts, c, n, args.max_tokens))
                tokens = sum(len(o) for o in outs.values())
                total = RowStats.total(RowStats.from_columns(s) for s in specs)  # the speculation objects
                steps, accept = total.verify_steps, total.acceptance_rate
                table[method, c] = tokens / wall
                outputs.setdefault(method, {}).update(outs)
                ratio = f"{table[method, c] / table['plain', c]:.2f}x" if ("plain", c) in table and method != "plain" else ""
                print(f"{method:14s} {c:7d} {n:8d} {percentile(lat, .5):7.2f} {percentile(lat, .95):7.2f} "
                      f"{tokens / wall:9.1f} {tokens / steps:8.2f} {accept if accept is not None else float('nan'):6.2f} "
                      f"{ratio:>9s}", flush=True)
        if "plain" in args.methods and len(args.methods) > 1:
            print()
            for method in args.methods:
                if method == "plain":
                    continue
                ratios = ", ".join(f"{c} clients {table[method, c] / table['plain', c]:.2f}x" for c in args.concurrency)
                print(f"{method} / plain tokens/s: {ratios}")
            target = AutoModelForCausalLM.from_pretrained(cfg.models.target).eval()
            for method in args.methods:
                if method == "plain":
                    continue
                ref = outputs["plain"]
                same = [i for i in outputs[method] if outputs[method][i] == ref.get(i)]
                differ = [i for i in outputs[method] if i in ref and i not in same]
                ties = sum(first_difference_is_near_tie(target, prompts[i % len(prompts)], outputs[method][i], ref[i])
                           for i in differ)
                print(f"{method}: {len(same)}/{len(same) + len(differ)} outputs equal plain's "
                      f"({ties} of {len(differ)} differing at a near-tie)")
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
