"""Methods against plain decoding, interleaved: every group of rows is decoded by every variant in
turn, in one process, so that the machine's drift (on this shared machine the same fixed
setting measured 1.02x and 1.16x plain in two runs minutes apart) falls on all variants alike.

The default job's model and prompts (``configs/summarize.yaml``, XSum articles of
``../shared/data/xsum_helm_1000``), greedy, one torch thread, ``--batch`` rows in flight.  Each
variant's engine is built once the way the job builds it (``pipeline.loading``) and keeps its
draft-length policy's measurements across groups, as a job's actor does.  It prints, after
every few groups and at the end, each variant's tokens/s over plain's on the process CPU
clock (prefill included: the whole ``generate_batch`` call), and checks every variant's ids
against plain's.  Usage::

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

from bench_real import XSUM, _commit, _machine, prompts_of  # noqa: E402

TITLE = "bench/bench_interleaved.py: methods against plain, each group of rows decoded by every variant in turn"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "summarize.yaml"))
    ap.add_argument("--variants", required=True, help="comma-separated variants (plain is always run first)")
    ap.add_argument("--batch", type=int, default=1, help="rows in flight (and rows per group)")
    ap.add_argument("--rows", default="200:232", help="XSum rows a:b")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--xsum", default=str(XSUM))
    ap.add_argument("--output", default=None, help="write report.json / report.md here")
    args = ap.parse_args(argv)

    import torch

    from pipeline.config import load_config
    from pipeline.engine import GenerationSettings
    from pipeline.loading import build_engine, load_job_models

    torch.set_num_threads(1)
    a, b = (int(x) for x in args.rows.split(":"))
    base = load_config(args.config, ["models.dtype=float32"])
    models = load_job_models(base, "cpu")
    prompts = prompts_of(base, models.tokenizer, range(a, b), Path(args.xsum))
    labels = ["plain"] + [v.strip() for v in args.variants.split(",") if v.strip() and v.strip() != "plain"]
    engines = {}
    for label in labels:
        method, *overrides = label.split("@")
        cfg = load_config(args.config, ["models.dtype=float32", f"method.name={method}", *overrides])
        engine = build_engine(models, cfg.method.speculation_settings(), args.batch, cfg.compute.draft_length,
                              time.process_time)
        engine.generate_batch([prompts[0][:32]], GenerationSettings(max_new_tokens=4, do_sample=False))  # warm-up
        engine.reset_learning()  # the warm-up's rows are not this run's (its measured costs are kept)
        engines[label] = engine
    settings = GenerationSettings(max_new_tokens=args.new_tokens, do_sample=False)
    cpu = dict.fromkeys(labels, 0.0)
    tokens = dict.fromkeys(labels, 0)
    differ = dict.fromkeys(labels, 0)
    print(f"{len(prompts)} XSum articles ({a}-{b - 1}), {args.new_tokens} new tokens, greedy, {args.batch} row(s) in "
          f"flight, one thread, CPU clock, variants interleaved per group", flush=True)

    def ratios() -> dict[str, float]:
        plain = tokens["plain"] / cpu["plain"]
        return {label: tokens[label] / cpu[label] / plain for label in labels}

    groups = [prompts[i:i + args.batch] for i in range(0, len(prompts), args.batch)]
    for g, group in enumerate(groups):
        reference = None
        for label in labels:
            t = time.process_time()
            results = engines[label].generate_batch(group, settings, max_batch_size=args.batch)
            cpu[label] += time.process_time() - t
            tokens[label] += sum(len(r.token_ids) for r in results)
            ids = [r.token_ids for r in results]
            if reference is None:
                reference = ids
            else:
                differ[label] += sum(x != y for x, y in zip(ids, reference))
        if g % 4 == 3 or g == len(groups) - 1:
            print(f"  after {min(len(prompts), (g + 1) * args.batch)} rows: "
                  + ", ".join(f"{label} {r:.3f}×" for label, r in ratios().items() if label != "plain"), flush=True)
    final = ratios()
    lines = ["| variant | tokens/s CPU | / plain | rows differing from plain |", "|---|---:|---:|---:|"]
    lines += [f"| {label} | {tokens[label] / cpu[label]:.1f} | {final[label]:.3f}× | {differ[label]} |" for label in labels]
    table = "\n".join(lines)
    summary = [f"{label} / plain at {args.batch} row(s): {final[label]:.2f}×" for label in labels if label != "plain"]
    print(table)
    if args.output:
        out = Path(args.output)
        out.mkdir(parents=True, exist_ok=True)
        meta = {"command": "python bench/bench_interleaved.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                "rows": [a, b], "batch": args.batch, "new_tokens": args.new_tokens, "commit": _commit(),
                "machine": _machine()}
        runs = {label: {"tokens": tokens[label], "cpu_s": cpu[label], "over_plain": final[label],
                        "rows_differing": differ[label]} for label in labels}
        (out / "report.json").write_text(json.dumps({"title": TITLE, "meta": meta, "runs": runs, "summary": summary},
                                                    indent=1))
        (out / "report.md").write_text(f"# bench_interleaved\n\n`{meta['command']}` at {meta['commit']} on "
                                       f"{meta['machine']}\n\n{table}\n\n" + "\n".join(f"- {s}" for s in summary) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
