"""Attention over the KV cache in a verification pass: SDPA's grouped-query kernel
(``enable_gqa=True``) against the query heads of each key/value head folded into the query
length (what :mod:`pipeline.engine.fused` does), then the whole target pass ``t(n, B)``.

The default job's model shape (SmolLM2-135M: 9 query heads, 3 key/value heads, head size 64,
30 layers), float32, one torch thread, the process CPU clock.  For ``B`` rows in flight, a cache
of ``K`` positions and ``Q`` query tokens per row (a draft of ``Q - 1`` tokens), it prints the
median milliseconds of one layer's attention kernel both ways, measured in turn (``--repeats``
rounds of ``--calls`` calls each, so the machine's drift falls on both alike), their ratio,
and the saving per pass (``layers x`` the difference).  Then, unless ``--no-pass``, the
default job's engine's ``t(n, B) / t(1, B)`` (:func:`pipeline.engine.profile.verification_costs`
on XSum articles 200-207, the widths timed in turn in each of 7 rounds): how much a draft of ``n - 1`` tokens costs the target.  Not a test::

    python bench/bench_attention.py [--output reports/bench_attention]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

TITLE = "bench/bench_attention.py: SDPA's grouped-query kernel against folded query heads, and t(n, B)"


def _ms(fn, calls: int) -> float:
    fn()
    t = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - t) / calls * 1000


def kernels(batches, widths, cache_len: int, repeats: int, calls: int, heads=(9, 3), head_dim=64) -> list[dict]:
    import torch
    import torch.nn.functional as F

    nq, nk = heads
    group = nq // nk
    rows = []
    for b in batches:
        keys, values = torch.randn(b, nk, cache_len, head_dim), torch.randn(b, nk, cache_len, head_dim)
        for q_len in widths:
            q = torch.randn(b, nq, q_len, head_dim)
            mask = torch.zeros(b, 1, q_len, cache_len)
            gqa = lambda: F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
            folded = lambda: F.scaled_dot_product_attention(q.reshape(b, nk, group * q_len, head_dim), keys, values,
                                                            attn_mask=mask.repeat(1, 1, group, 1))
            torch.testing.assert_close(folded().view(b, nq, q_len, head_dim), gqa())
            a, f = [], []
            for _ in range(repeats):
                a.append(_ms(gqa, calls))
                f.append(_ms(folded, calls))
            rows.append({"rows": b, "query_tokens": q_len, "cache_len": cache_len, "gqa_ms": statistics.median(a),
                         "folded_ms": statistics.median(f)})
    return rows


def pass_costs(batches, widths, repeats: int = 7) -> dict[int, dict[int, float]]:
    """``t(n, B)`` seconds, median of ``repeats`` rounds in each of which every width is timed
    once in turn (:func:`pipeline.engine.profile.verification_costs`, one sample per call), so
    that the machine's drift falls on every width alike."""
    from bench_real import XSUM, prompts_of

    from pipeline.config import load_config
    from pipeline.engine.profile import _Rows, _settings, verification_costs
    from pipeline.loading import build_engine, load_job_models

    cfg = load_config(str(ROOT / "configs" / "summarize.yaml"), ["models.dtype=float32"])
    models = load_job_models(cfg, "cpu")
    prompts = prompts_of(cfg, models.tokenizer, range(200, 208), Path(XSUM))
    engine = build_engine(models, cfg.method.speculation_settings(), max(batches), "fixed", time.process_time)
    rows = _Rows(engine, prompts, max(batches), _settings(engine, None, 1 + max(widths)))
    out = {}
    for b in batches:
        batch = rows.first(b)
        samples = {n: [] for n in widths}
        for _ in range(repeats):
            for n, t in verification_costs(engine, batch, list(widths), repeats=1).items():
                samples[n].append(t)
        out[b] = {n: statistics.median(v) for n, v in samples.items()}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--widths", default="1,2,3,4,6")
    ap.add_argument("--cache-len", type=int, default=600, help="cached positions (the default job's prompts: ~550)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--no-pass", action="store_true", help="the kernels only (no model needed)")
    ap.add_argument("--output", default=None, help="write report.json / report.md here")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    batches = [int(x) for x in args.batches.split(",")]
    widths = [int(x) for x in args.widths.split(",")]
    rows = kernels(batches, widths, args.cache_len, args.repeats, args.calls)
    lines = ["| rows | query tokens | enable_gqa ms | folded ms | folded / gqa | saving per pass ms |",
             "|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['rows']} | {r['query_tokens']} | {r['gqa_ms']:.3f} | {r['folded_ms']:.3f} | "
              f"{r['folded_ms'] / r['gqa_ms']:.2f} | {(r['gqa_ms'] - r['folded_ms']) * args.layers:.1f} |" for r in rows]
    table = "\n".join(lines)
    print(f"one layer's attention kernel, cache of {args.cache_len} positions, one thread, CPU clock (median of "
          f"{args.repeats} x {args.calls} calls)\n{table}", flush=True)
    passes = None
    if not args.no_pass:
        passes = pass_costs(batches, widths)
        plines = ["| rows | " + " | ".join(f"t({n}, B) ms" for n in widths) + " | " +
                  " | ".join(f"t({n})/t(1)" for n in widths[1:]) + " |", "|" + "---:|" * (1 + 2 * len(widths) - 1)]
        for b, t in passes.items():
            plines.append(f"| {b} | " + " | ".join(f"{t[n] * 1000:.1f}" for n in widths) + " | " +
                          " | ".join(f"{t[n] / t[widths[0]]:.2f}" for n in widths[1:]) + " |")
        table += "\n\nThe default job's target pass (lean pass, folded heads):\n\n" + "\n".join(plines)
        print("\n".join(plines))
    if args.output:
        from bench_real import _commit, _machine

        out = Path(args.output)
        out.mkdir(parents=True, exist_ok=True)
        meta = {"command": "python bench/bench_attention.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                "commit": _commit(), "machine": _machine()}
        summary = [f"{r['rows']} row(s), {r['query_tokens']} query tokens: folded {r['folded_ms'] / r['gqa_ms']:.2f}x "
                   f"enable_gqa's time" for r in rows if r["query_tokens"] > 1]
        (out / "report.json").write_text(json.dumps({"title": TITLE, "meta": meta, "kernels": rows, "summary": summary,
                                                     "verify_s": passes}, indent=1))
        (out / "report.md").write_text(f"# bench_attention\n\n`{meta['command']}` at {meta['commit']} on "
                                       f"{meta['machine']}\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
