"""Two nights of the default job (issue 48): night 2 with ``--previous`` (unchanged rows copied,
edited rows drafting from their previous output) against night 2 decoded plainly, by kind of row.

Night 1 decodes ``--rows`` XSum articles (``../shared/data/xsum_helm_1000`` through
:func:`pipeline.corpora.xsum_rows`), or with ``--corpus translation`` Spec-Bench's German-English
translation prompts (:func:`pipeline.corpora.spec_bench_rows`, with ``configs/translate.yaml``),
with the default job's config (``configs/summarize.yaml``:
its model, template, method and draft length; greedy, ``--new-tokens``).  Night 2 holds the same
rows, ``--unchanged`` of them as they were, ``--edited`` with one sentence replaced (by a
sentence of another article), and the rest replaced by articles night 1 never saw (new rows).
Night 2 runs twice, each on a fresh engine built as the job builds it
(:func:`bench_real.warm_engine`: warmed up outside the timed region, then what the warm-up taught
it forgotten):

- **plain night 2** (no ``--previous``, ``method.name=plain``): every row decoded by plain
  decoding, the issue's baseline (``--baseline method`` decodes it with the job's method instead);
- **night 2 with --previous**: an unchanged row is copied (its reuse key computed,
  :func:`pipeline.reuse.row_reuse_key`, and looked up among night 1's keys: that work is its
  time); an edited row is decoded with its id's night-1 output as its reference
  (:mod:`pipeline.engine.reference`); a new row is decoded as in the plain night.

Each kind of row is decoded as one group (``--batch`` rows in flight) by both runs in turn (the
first alternating by kind), timed on the process CPU clock.  It prints, per kind and overall, the
tokens and CPU seconds of both runs and the ratio of their tokens/s (and of their decoding alone,
the prompts' prefill left out: the engines run on the CPU clock), the accepted tokens by draft
source, and checks that every output of night 2 with ``--previous`` is the plain night's, token for
token (a copied row included).  Exit 1 when an output differs.  Not a test; a short run proves it
works (``--rows 200:210 --new-tokens 16``); figures of record need a quiet machine.

Usage::

    python bench/bench_nightly.py --rows 200:300 --new-tokens 64 [--output reports/bench_nightly/report.json]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_real import warm_engine  # noqa: E402

KINDS = ("unchanged", "edited", "new")


def edit_one_sentence(text: str, other: str, seed: int) -> str:
    """``text`` with one of its sentences (a middle one, chosen by ``seed``) replaced by a
    sentence of ``other``; a text of one sentence gets ``other``'s first sentence appended."""
    mine = re.split(r"(?<=[.!?])\s+", text.strip())
    theirs = re.split(r"(?<=[.!?])\s+", other.strip())
    new = theirs[min(len(theirs) - 1, seed % max(1, len(theirs)))]
    if len(mine) < 2:
        return f"{text.strip()} {new}"
    at = 1 + seed % (len(mine) - 1)
    return " ".join(mine[:at] + [new] + mine[at + 1:])


def nights(rows: list[dict], spare: list[dict], unchanged: float, edited: float) -> tuple[list[dict], list[dict]]:
    """Night 1's rows and night 2's (each with its ``kind``): the first ``unchanged`` share as
    they were, the next ``edited`` share with one sentence changed, the rest new articles."""
    n = len(rows)
    a, b = round(n * unchanged), round(n * (unchanged + edited))
    night2 = []
    for i, r in enumerate(rows):
        if i < a:
            night2.append(dict(r, kind="unchanged"))
        elif i < b:
            night2.append(dict(r, kind="edited", text=edit_one_sentence(r["text"], spare[i % len(spare)]["text"], i)))
        else:
            night2.append(dict(spare[i % len(spare)], kind="new"))
    return rows, night2


def run(args) -> dict:
    from pipeline.config import load_config
    from pipeline.corpora import spec_bench_rows, xsum_rows
    from pipeline.engine import GenerationSettings
    from pipeline.loading import load_job_models
    from pipeline.prompts import PromptBuilder
    from pipeline.reuse import row_reuse_key

    import torch

    torch.set_num_threads(1)
    cfg = load_config(args.config, ["models.dtype=float32", *args.set])
    models = load_job_models(cfg, "cpu")
    builder = PromptBuilder(models.tokenizer, cfg.task)
    a, b = (int(x) for x in args.rows.split(":"))
    corpus = xsum_rows(args.data) if args.corpus == "xsum" else spec_bench_rows(args.data, "translation")
    spare = corpus[b:b + (b - a)] if b + (b - a) <= len(corpus) else corpus[:a]
    night1, night2 = nights(corpus[a:b], spare, args.unchanged, args.edited)
    settings = GenerationSettings(max_new_tokens=args.new_tokens, do_sample=False)
    prompt = {}
    for r in night1 + night2:
        prompt[(r["id"], r["text"])] = builder.build(r["text"])[1]
    print(f"night 1: {len(night1)} {args.corpus} rows ({a}-{b - 1}); night 2: "
          + ", ".join(f"{sum(r['kind'] == k for r in night2)} {k}" for k in KINDS)
          + f"; method {cfg.method.name}, {args.batch} rows in flight, {args.new_tokens} new tokens, greedy, "
          "one thread, CPU clock, every engine warmed up first", flush=True)

    engine = warm_engine(cfg, models, args.batch, True, args.warm_up_prompt)
    first = engine.generate_batch([prompt[(r["id"], r["text"])] for r in night1], settings, max_batch_size=args.batch)
    previous = {r["id"]: res.token_ids for r, res in zip(night1, first)}
    keys = {row_reuse_key("bench", prompt[(r["id"], r["text"])], settings): r["id"] for r in night1}

    base_cfg = cfg if args.baseline == "method" else load_config(args.config, ["models.dtype=float32", *args.set,
                                                                               "method.name=plain"])
    plain_engine = warm_engine(base_cfg, models, args.batch, True, args.warm_up_prompt)
    reuse_engine = warm_engine(cfg, models, args.batch, True, args.warm_up_prompt)
    out: dict = {"kinds": {}, "rows": args.rows, "method": cfg.method.name, "baseline": base_cfg.method.name,
                 "batch": args.batch,
                 "new_tokens": args.new_tokens}
    differing = 0
    for turn, kind in enumerate(KINDS):
        group = [r for r in night2 if r["kind"] == kind]
        ids = [prompt[(r["id"], r["text"])] for r in group]
        timed = {}

        def plain_night():
            return plain_engine.generate_batch(ids, settings, max_batch_size=args.batch)

        def reuse_night():
            if kind == "unchanged":  # copied: the key and its look-up are the work
                return [previous[keys[row_reuse_key("bench", p, settings)]] for p in ids]
            refs = [previous.get(r["id"]) for r in group] if kind == "edited" else None
            return reuse_engine.generate_batch(ids, settings, max_batch_size=args.batch, references=refs)

        for name, fn in (("plain", plain_night), ("previous", reuse_night))[:: 1 if turn % 2 == 0 else -1]:
            c = time.process_time()
            res = fn() if group else []
            timed[name] = (time.process_time() - c, res)
        (c_plain, r_plain), (c_prev, r_prev) = timed["plain"], timed["previous"]
        tokens = sum(len(x.token_ids) for x in r_plain)
        prev_ids = [x if isinstance(x, list) else x.token_ids for x in r_prev]
        diff = sum(p != q.token_ids for p, q in zip(prev_ids, r_plain))
        differing += diff
        stats = [x.stats for x in r_prev if not isinstance(x, list)]
        # the engines' clock is the CPU clock (warm_engine): the prompts' prefill apart, the same for both runs
        pf_plain, pf_prev = sum(x.stats.prefill_time_s or 0.0 for x in r_plain), sum(x.prefill_time_s or 0.0 for x in stats)
        out["kinds"][kind] = {
            "rows": len(group), "tokens": tokens, "cpu_s_plain": c_plain, "cpu_s_previous": c_prev,
            "tokens_per_s_plain": tokens / c_plain if c_plain and tokens else None,
            "tokens_per_s_previous": tokens / c_prev if c_prev and tokens else None,
            "ratio": c_plain / c_prev if c_prev and tokens else None, "rows_differing": diff,
            "prefill_cpu_s_plain": pf_plain, "prefill_cpu_s_previous": pf_prev,
            "decode_ratio": (c_plain - pf_plain) / (c_prev - pf_prev) if c_prev - pf_prev > 0 and tokens else None,
            "accepted_by_source": {s: sum(getattr(x, f"accepted_from_{s}") for x in stats)
                                   for s in ("prompt", "pool", "reference", "drafter")},
            "accepted_by_source_plain": {s: sum(getattr(x.stats, f"accepted_from_{s}") for x in r_plain)
                                         for s in ("prompt", "pool", "reference", "drafter")},
        }
    k = out["kinds"].values()
    c_plain, c_prev = sum(x["cpu_s_plain"] for x in k), sum(x["cpu_s_previous"] for x in k)
    out["overall"] = {"tokens": sum(x["tokens"] for x in k), "cpu_s_plain": c_plain, "cpu_s_previous": c_prev,
                      "ratio": c_plain / c_prev if c_prev else None}
    out["rows_differing"] = differing
    return out


def table(out: dict) -> str:
    f = lambda v, spec=".2f": "–" if v is None else format(v, spec)  # noqa: E731
    lines = ["| rows | n | tokens | CPU s plain | CPU s --previous | tokens/s plain | tokens/s --previous | "
             "--previous / plain | decode only | accepted from reference | rows differing |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for kind, x in out["kinds"].items():
        lines.append(f"| {kind} | {x['rows']} | {x['tokens']} | {x['cpu_s_plain']:.2f} | {x['cpu_s_previous']:.3f} | "
                     f"{f(x['tokens_per_s_plain'], '.1f')} | {f(x['tokens_per_s_previous'], '.1f')} | "
                     f"{f(x['ratio'])}× | {f(x['decode_ratio'])}× | {x['accepted_by_source']['reference']} | "
                     f"{x['rows_differing']} |")
    o = out["overall"]
    lines.append(f"| all | {sum(x['rows'] for x in out['kinds'].values())} | {o['tokens']} | {o['cpu_s_plain']:.2f} | "
                 f"{o['cpu_s_previous']:.2f} | | | {f(o['ratio'])}× | | | {out['rows_differing']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", choices=("xsum", "translation"), default="xsum",
                    help="night 1's rows: XSum articles (the summarize job) or Spec-Bench's German-English "
                    "translation prompts (the translate job)")
    ap.add_argument("--config", default=None, help="the job config (default: configs/summarize.yaml for xsum, "
                    "configs/translate.yaml for translation)")
    ap.add_argument("--set", action="append", default=[], help="a config override section.key=value (repeatable)")
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data"), help="../shared/data")
    ap.add_argument("--rows", default="200:300", help="XSum rows a:b of night 1 (new rows come from after b)")
    ap.add_argument("--unchanged", type=float, default=0.7)
    ap.add_argument("--edited", type=float, default=0.2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4, help="rows in flight (the default job's max_batch_size)")
    ap.add_argument("--warm-up-prompt", type=int, default=128, help="tokens of the warm-up's synthetic prompts")
    ap.add_argument("--baseline", choices=("plain", "method"), default="plain",
                    help="night 2 without --previous decoded by plain decoding (default) or by the job's method")
    ap.add_argument("--output", default=None, help="write the figures as JSON here")
    args = ap.parse_args(argv)
    if args.config is None:
        args.config = str(ROOT / "configs" / ("summarize.yaml" if args.corpus == "xsum" else "translate.yaml"))
    if not 0 <= args.unchanged + args.edited <= 1:
        ap.error("--unchanged + --edited must be between 0 and 1")
    out = run(args)
    print(table(out))
    e, o = out["kinds"]["edited"], out["overall"]
    f = lambda v: "–" if v is None else f"{v:.2f}×"  # noqa: E731
    print(f"goals: night 2 overall {f(o['ratio'])} plain (goal 3×); edited rows {f(e['ratio'])} (goal 1.5×); "
          f"outputs differing from plain: {out['rows_differing']} (goal 0)")
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(out, indent=2) + "\n")
    return 1 if out["rows_differing"] else 0


if __name__ == "__main__":
    sys.exit(main())
