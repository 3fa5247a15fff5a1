"""Benchmark of the pipeline (not a test): on the same rows, tokens/s of

  1. the bare engine (no Ray Data, models already loaded), fed batches of ``rows_per_batch`` rows
     as the actor is, ``max_batch_size`` rows in flight;
  2. the pipeline: ``run_job`` with an embedded Ray and one actor (end to end from the
     dataset start, so actor start-up and model loading count; and the actor's own
     engine time, sum of row ``wall_time_s``), i.e. the pipeline's overhead;
  3. plain batched decoding with transformers' ``generate()`` on batches of 8 rows,
     greedy, no speculation, left padding (what a user gets without specbatch);

and the peak memory of one actor after 100 and after 1,000 rows (it must not grow; batches of
``rows_per_batch`` rows, ``max_batch_size`` in flight).

    python bench/bench_pipeline.py                       # demo models if present, else tiny random ones
    python bench/bench_pipeline.py --target models/demo-target --drafter models/demo-drafter \
        --input data/demo_prompts.jsonl --rows 64 --max-new-tokens 32 --method draft_model

The bare engine and generate() run, by default, in one Ray worker process (a plain Ray task,
no Ray Data, no actor pool), with as many torch threads as an actor has CPUs
(``compute.cpus_per_actor``): on a shared 2-core machine a process's speed depends a lot on
its threads and scheduling, and this keeps the comparison with the actor fair.
Tokens are new tokens of the target tokenizer, counted up to and including EOS; rates
are total tokens / total seconds (docs/metrics.md).  Rows cycle through the input file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "pipeline"))  # tiny.py: random models when no demo models


def load_texts(path: str | None, n: int) -> list[str]:
    texts: list[str] = []
    if path and Path(path).exists():
        for line in Path(path).read_text().splitlines():
            if line.strip():
                t = json.loads(line).get("text")
                if isinstance(t, str) and t.strip():
                    texts.append(t)
    if not texts:
        from tiny import SENTENCES

        texts = list(SENTENCES)
    return [texts[i % len(texts)] for i in range(n)]


def best_of(repeats, fn):
    """Run ``fn() -> (tokens, seconds)`` ``repeats`` times; keep the fastest (shared machines are noisy)."""
    runs = [fn() for _ in range(repeats)]
    return min(runs, key=lambda r: r[1] / max(r[0], 1))


def bench_engine(cfg, texts, repeats=1):
    from pipeline.loading import load_engine
    from pipeline.prompts import PromptBuilder

    loaded = load_engine(cfg, "cpu")  # as the actor builds it
    m, engine, settings = loaded.models, loaded.engine, loaded.settings
    builder = PromptBuilder(m.tokenizer, cfg.task)
    engine.generate(builder.build(texts[0])[1], settings)  # warm-up
    batch = cfg.compute.rows_per_batch

    def once():  # as the actor does: each batch of rows_per_batch rows to generate_batch
        new = 0
        t0 = time.perf_counter()
        for i in range(0, len(texts), batch):
            prompts = [builder.build(t)[1] for t in texts[i:i + batch]]
            new += sum(r.stats.new_tokens for r in engine.generate_batch(prompts, settings))
        return new, time.perf_counter() - t0

    new, sec = best_of(repeats, once)
    return new, sec, m, builder


def bench_hf_generate(m, builder, texts, max_new_tokens, batch=8, repeats=1):
    import torch

    tok = m.tokenizer
    tok.padding_side = "left"
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    eos = m.target.generation_config.eos_token_id
    eos_set = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
    prompts = [builder.build(t)[1] for t in texts]

    def run(rows):
        width = max(len(r) for r in rows)
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        with torch.no_grad():
            out = m.target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                    do_sample=False, pad_token_id=pad)
        n = 0
        for row in out[:, width:].tolist():
            for tok_id in row:
                n += 1
                if tok_id in eos_set:
                    break
        return n

    run(prompts[:batch])  # warm-up

    def once():
        new = 0
        t0 = time.perf_counter()
        for i in range(0, len(prompts), batch):
            new += run(prompts[i:i + batch])
        return new, time.perf_counter() - t0

    return best_of(repeats, once)


def baselines(cfg_dump: dict, texts, max_new_tokens: int, repeats: int, threads: int):
    """Bare engine and HF generate(), one after the other, in the calling process."""
    from pipeline.config import JobConfig
    from pipeline.loading import limit_cpu_threads

    limit_cpu_threads(threads)  # as many as an actor gets
    cfg = JobConfig.model_validate(cfg_dump)
    new_e, sec_e, models, builder = bench_engine(cfg, texts, repeats)
    new_h, sec_h = bench_hf_generate(models, builder, texts, max_new_tokens, repeats=repeats)
    return new_e, sec_e, new_h, sec_h


def bench_pipeline(cfg, texts, workdir: Path):
    from pipeline.run import run_job

    inp = workdir / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)))
    cfg.input.uri = str(inp)
    cfg.output.uri = str(workdir / "out")
    cfg.output.overwrite = True
    t0 = time.perf_counter()
    summary = run_job(cfg, progress=False)
    return summary, time.perf_counter() - t0


def bench_memory(cfg, texts, checkpoints=(100, 1000)):
    import pyarrow as pa
    import ray

    from actors.generate import GenerateActor
    from pipeline.schema import INPUT_SCHEMA

    actor = ray.remote(num_cpus=1)(GenerateActor).remote(cfg.model_dump(), device=None)
    first = ray.get(actor.memory.remote())
    results = [("after load", first)]
    done = 0
    batch = cfg.compute.rows_per_batch
    t0 = time.perf_counter()
    for target in checkpoints:
        while done < target:
            n = min(batch, target - done)
            rows = [{"source_file": "bench", "source_row": done + i, "id": str(done + i),
                     "text": texts[(done + i) % len(texts)], "input_error": None} for i in range(n)]
            out = ray.get(actor.__call__.remote(pa.Table.from_pylist(rows, schema=INPUT_SCHEMA)))
            assert out.num_rows == n
            done += n
        results.append((f"after {target} rows", ray.get(actor.memory.remote())))
    ray.kill(actor)
    return results, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None)
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--tiny", action="store_true", help="tiny random models even when the demo models exist")
    ap.add_argument("--input", default=str(REPO / "data" / "demo_prompts.jsonl"))
    ap.add_argument("--method", default="draft_model")
    ap.add_argument("--rows", type=int, default=64, help="rows for the throughput comparison")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--rows-per-batch", type=int, default=32, help="compute.rows_per_batch (the actor's batch)")
    ap.add_argument("--max-batch-size", type=int, default=16, help="compute.max_batch_size (rows in flight)")
    ap.add_argument("--memory-rows", type=int, nargs="+", default=[100, 1000])
    ap.add_argument("--memory-max-new-tokens", type=int, default=16)
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--repeats", type=int, default=2, help="bare engine and generate(): best of this many runs")
    ap.add_argument("--baselines-in", choices=["ray", "process"], default="ray",
                    help="run the bare engine and generate() in a Ray worker process (default; same process "
                         "conditions as the actor) or in this process")
    args = ap.parse_args()

    import ray

    from pipeline.config import load_config
    from pipeline.loading import process_cpus

    work = Path(tempfile.mkdtemp(prefix="bench_pipeline_"))
    target, drafter = args.target, args.drafter
    if target is None:
        if not args.tiny and (REPO / "models" / "demo-target" / "config.json").exists():
            target, drafter = str(REPO / "models" / "demo-target"), str(REPO / "models" / "demo-drafter")
        else:
            from tiny import make_model_pair

            target, drafter = make_model_pair(work / "models", hidden=64, layers=2)
            args.input = None
    texts = load_texts(args.input, args.rows)
    sets = [f"models.target={target}", f"models.drafter={drafter}", f"method.name={args.method}",
            f"generation.max_new_tokens={args.max_new_tokens}", "compute.num_actors=1",
            f"compute.rows_per_batch={args.rows_per_batch}", f"compute.max_batch_size={args.max_batch_size}"]
    cfg = load_config(str(REPO / "configs" / "demo-summarize.yaml"), sets)

    threads = max(1, int(process_cpus(cfg)))
    print(f"# bench_pipeline: torch threads={threads} target={target} drafter={drafter} method={args.method} "
          f"rows={len(texts)} max_new_tokens={args.max_new_tokens} cpus={os.cpu_count()} baselines in {args.baselines_in}",
          flush=True)
    os.environ["PYTHONPATH"] = str(REPO) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    base_args = (cfg.model_dump(), texts, args.max_new_tokens, args.repeats, threads)
    if args.baselines_in == "ray":  # a Ray worker process, like the actor: same process conditions
        new_e, sec_e, new_h, sec_h = ray.get(ray.remote(num_cpus=threads)(baselines).remote(*base_args))
    else:
        new_e, sec_e, new_h, sec_h = baselines(*base_args)
    summary, sec_run = bench_pipeline(cfg.model_copy(deep=True), texts, work)
    new_p, sec_p = summary["new_tokens"], summary["generate_elapsed_s"]

    rows = [  # (path, new tokens, seconds, tokens/s)
        (f"bare engine (no pipeline, models loaded, best of {args.repeats})", new_e, sec_e, new_e / sec_e),
        ("pipeline end to end (1 actor, incl. actor start + load)", new_p, sec_p, new_p / sec_p),
        ("pipeline actor engine time (sum of row wall_time_s)", new_p, summary["engine_time_s"],
         new_p / summary["engine_time_s"]),
        (f"HF generate(), batches of 8, no speculation, best of {args.repeats}", new_h, sec_h, new_h / sec_h),
    ]
    print(f"\n{'path':58s} {'new tokens':>10s} {'seconds':>9s} {'tokens/s':>9s} {'vs bare':>8s}")
    base = new_e / sec_e
    for name, n, sec, rate in rows:
        ns = f"{n:10d}" if n is not None else f"{'':10s}"
        ss = f"{sec:9.2f}" if sec is not None else f"{'':9s}"
        rs, vs = (f"{rate:9.2f}", f"{rate / base:8.2f}") if rate else (f"{'-':>9s}", f"{'-':>8s}")
        print(f"{name:58s} {ns} {ss} {rs} {vs}")
    print(f"\npipeline: {summary['rows']} rows, {summary['errors']} errors, acceptance_rate="
          f"{summary['acceptance_rate']}, mean_accepted_length={summary['mean_accepted_length']}, "
          f"run_job wall {sec_run:.1f} s, first batch after {summary['first_batch_s']:.1f} s")

    if not args.skip_memory:
        cfg_mem = cfg.model_copy(deep=True)
        cfg_mem.generation.max_new_tokens = args.memory_max_new_tokens
        mem, sec_m = bench_memory(cfg_mem, texts, tuple(args.memory_rows))
        print(f"\nactor memory (max_new_tokens={args.memory_max_new_tokens}, {sec_m:.0f} s):")
        print(f"{'point':24s} {'peak RSS MiB':>12s} {'RSS MiB':>9s} {'CUDA peak MiB':>14s}")
        for name, m in mem:
            cuda = f"{m['cuda_peak_mb']:.0f}" if m["cuda_peak_mb"] is not None else "-"
            print(f"{name:24s} {m['peak_rss_mb']:12.1f} {m['rss_mb']:9.1f} {cuda:>14s}")
    ray.shutdown()


if __name__ == "__main__":
    main()
