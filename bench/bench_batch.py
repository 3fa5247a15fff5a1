"""Batched decoding benchmark (not a test): tokens/s of speculation at batch sizes 1 .. 32
against the best plain batched decoding a user has without specbatch.

On the demo pair (``models/demo-target``, ``models/demo-drafter``) and the first XSum
articles of ``../shared/data/xsum_helm_1000`` (the summarize job's prompt template),
greedy, in one process with the machine's cores, it measures:

  (a) plain batched ``generate()`` at its best batch size among 1, 4, 8, 16, 32, 64 (left
      padding), and transformers' own continuous batching, ``model.generate_batch()``
      (SDPA attention); the better of the two is "best plain";
  (b) our plain batched decoding (``SpeculativeEngine.generate_batch``, method plain);
  (c) our draft_model and prompt_lookup at batch sizes 1, 4, 8, 16, 32, each with its
      speedup over (b) at the same batch size; the engine picks the draft length per
      step from the verification cost it measures (down to plain steps as the batch
      grows), so speculation should never lose much to (b).

Every row of (b) and (c) is checked equal to our single-row plain greedy output (rows
that differ must differ at a float32 near-tie; the count is printed).  Tokens are new
tokens up to and including EOS; rates are total tokens / total seconds of the run
(docs/metrics.md).  The last two lines are the headline ratios::

    speculative / plain at batch 4: X.XX×
    best speculative / best plain generate(): X.XX×

    python bench/bench_batch.py                 # 256 articles, 64 new tokens (about 30-60 min on 2 cores)
    python bench/bench_batch.py --quick         # 16 articles, 32 new tokens, batch 1, 4, 16, draft_model only
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
XSUM = REPO.parent / "shared" / "data" / "xsum_helm_1000" / "xsum_0shot.jsonl"


def load_prompts(tokenizer, n: int) -> list[list[int]]:
    """The summarize job's prompts (default template, chat template when the tokenizer has
    one) for the first ``n`` XSum articles that fit the target's context."""
    from pipeline.config import TaskConfig
    from pipeline.prompts import PromptBuilder

    from pipeline.corpora import HELM_PREFIX, HELM_SUFFIX, strip_wrapper as _strip

    builder = PromptBuilder(tokenizer, TaskConfig())
    prompts = []
    with open(XSUM, encoding="utf-8") as f:
        for line in f:
            ids = builder.build(_strip(json.loads(line)["article"], HELM_PREFIX, HELM_SUFFIX))[1]
            if len(ids) < 2048 - 128:
                prompts.append(ids)
            if len(prompts) == n:
                break
    return prompts


def count_new(row: list[int], eos: set[int]) -> list[int]:
    out = []
    for t in row:
        out.append(t)
        if t in eos:
            break
    return out


def hf_generate(model, prompts, max_new_tokens, batch, pad, eos):
    """Plain batched generate() with left padding; returns (outputs, seconds)."""
    outs = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        rows = prompts[i : i + batch]
        width = max(len(r) for r in rows)
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=pad)
        outs.extend(count_new(r, eos) for r in out[:, width:].tolist())
    return outs, time.perf_counter() - t0


def hf_continuous(model, prompts, max_new_tokens, eos):
    """transformers' continuous batching (``generate_batch``); returns (outputs, seconds)."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=sorted(eos) or None)
    t0 = time.perf_counter()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
    seconds = time.perf_counter() - t0
    ordered = [result[k] for k in sorted(result, key=lambda k: int(str(k).rsplit("_", 1)[-1]))]
    return [count_new(list(r.generated_tokens), eos) for r in ordered], seconds


def ours(engine, prompts, max_new_tokens, batch):
    from pipeline.engine import GenerationSettings

    t0 = time.perf_counter()
    results = engine.generate_batch(prompts, GenerationSettings(max_new_tokens=max_new_tokens), max_batch_size=batch)
    return results, time.perf_counter() - t0


def near_tie_check(target, prompts, outputs, reference):
    """Rows that differ from the reference, and how many first differ at a near-tie
    (pipeline/engine/exactness.py)."""
    from pipeline.engine.exactness import compare_rows, summarize

    s = summarize(compare_rows(target, prompts, outputs, reference))
    return s["differ"], s["differ_at_near_tie"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(REPO / "models" / "demo-target"))
    ap.add_argument("--drafter", default=str(REPO / "models" / "demo-drafter"))
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    ap.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    ap.add_argument("--methods", nargs="+", default=["draft_model", "prompt_lookup"])
    ap.add_argument("--k", type=int, default=5, help="draft_model num_assistant_tokens")
    ap.add_argument("--lookup-k", type=int, default=10, help="prompt_lookup_num_tokens")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true",
                    help="16 articles, 32 new tokens, batch sizes 1, 4, 16, draft_model only (under 3 minutes)")
    args = ap.parse_args()
    if args.quick:
        args.rows, args.max_new_tokens, args.batch_sizes = 16, 32, [1, 4, 16]
        args.hf_batch_sizes, args.methods = [8, 16], ["draft_model"]
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.engine import GenerationSettings, SpeculationSettings, SpeculativeEngine

    dtype = getattr(torch, args.dtype)
    tok = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype, attn_implementation="sdpa").to(args.device).eval()
    drafter = AutoModelForCausalLM.from_pretrained(args.drafter, dtype=dtype).to(args.device).eval()
    prompts = load_prompts(tok, args.rows)
    eos_id = target.generation_config.eos_token_id
    eos = set(eos_id if isinstance(eos_id, list) else [eos_id]) if eos_id is not None else set()
    pad = tok.pad_token_id if tok.pad_token_id is not None else (min(eos) if eos else 0)
    print(f"# bench_batch: {len(prompts)} XSum prompts (mean {sum(map(len, prompts)) / len(prompts):.0f} tokens), "
          f"{args.max_new_tokens} new tokens, greedy, {args.dtype} on {args.device}, torch threads {args.threads}, "
          f"target {Path(args.target).name}, drafter {Path(args.drafter).name}", flush=True)

    # warm-up (allocator, kernels) on a few rows
    warm = SpeculativeEngine(target, tokenizer=tok)
    warm.generate_batch(prompts[:4], None, max_batch_size=4)

    rate = lambda outs, sec: sum(len(o) for o in outs) / sec
    print(f"\n{'(a) plain, transformers':44s} {'tokens/s':>9s}", flush=True)
    best_plain, best_plain_name = 0.0, ""
    for b in args.hf_batch_sizes:
        outs, sec = hf_generate(target, prompts, args.max_new_tokens, b, pad, eos)
        r = rate(outs, sec)
        print(f"  generate(), batches of {b:<3d}{'':17s} {r:9.1f}", flush=True)
        if r > best_plain:
            best_plain, best_plain_name = r, f"generate() batch {b}"
    try:
        outs, sec = hf_continuous(target, prompts, args.max_new_tokens, eos)
        r = rate(outs, sec)
        print(f"  generate_batch() (continuous batching){'':5s} {r:9.1f}", flush=True)
        if r > best_plain:
            best_plain, best_plain_name = r, "generate_batch()"
    except Exception as e:  # noqa: BLE001 - report and go on
        print(f"  generate_batch() failed: {type(e).__name__}: {e}", flush=True)
    print(f"  best plain: {best_plain:.1f} tokens/s ({best_plain_name})", flush=True)

    single = SpeculativeEngine(target, tokenizer=tok, max_batch_size=1)
    reference = [r.token_ids for r in single.generate_batch(prompts, GenerationSettings(max_new_tokens=args.max_new_tokens))]

    specs = {"draft_model": (SpeculationSettings(method="draft_model", num_assistant_tokens=args.k), drafter),
             "prompt_lookup": (SpeculationSettings(method="prompt_lookup", prompt_lookup_num_tokens=args.lookup_k), None)}
    plain = SpeculativeEngine(target, tokenizer=tok, max_batch_size=max(args.batch_sizes))
    engines = {m: SpeculativeEngine(target, specs[m][0], drafter=specs[m][1], tokenizer=tok,
                                    max_batch_size=max(args.batch_sizes)) for m in args.methods}
    print(f"\n{'batch':>5s} {'(b) ours plain':>15s} " + " ".join(f"{m:>22s}" for m in args.methods)
          + "   rows = single-row plain (differ at near-tie)", flush=True)
    table = {}
    for b in args.batch_sizes:
        res, sec = ours(plain, prompts, args.max_new_tokens, b)
        plain_rate = rate([r.token_ids for r in res], sec)
        same = sum(r.token_ids == ref for r, ref in zip(res, reference))
        cells, notes = [], [f"plain {same}/{len(prompts)}"]
        table[b] = {"plain": plain_rate}
        for m in args.methods:
            res_m, sec_m = ours(engines[m], prompts, args.max_new_tokens, b)
            r = rate([x.token_ids for x in res_m], sec_m)
            table[b][m] = r
            cells.append(f"{r:9.1f} ({r / plain_rate:4.2f}×)")
            outs = [x.token_ids for x in res_m]
            differ, ties = near_tie_check(target, prompts, outs, reference)
            notes.append(f"{m} {len(prompts) - differ}/{len(prompts)} ({ties} near-tie)")
        print(f"{b:5d} {plain_rate:15.1f} " + " ".join(f"{c:>22s}" for c in cells) + "   " + ", ".join(notes), flush=True)

    ours_plain_best = max(v["plain"] for v in table.values())
    spec_best, spec_name = max(((v[m], f"{m} batch {b}") for b, v in table.items() for m in args.methods))
    crossover = [b for b in args.batch_sizes if any(table[b][m] > table[b]["plain"] for m in args.methods)]
    print(f"\nour plain at its best / best plain: {ours_plain_best / best_plain:.2f}×")
    print(f"best speculative: {spec_best:.1f} tokens/s ({spec_name})")
    print("speculation beats our plain at batch sizes: " + (", ".join(map(str, crossover)) or "none")
          + (f" (crossover after batch {max(crossover)})" if crossover and max(crossover) < max(args.batch_sizes) else ""))
    if 4 in table:
        print(f"speculative / plain at batch 4: {max(table[4][m] for m in args.methods) / table[4]['plain']:.2f}×")
    print(f"best speculative / best plain generate(): {spec_best / best_plain:.2f}×")


if __name__ == "__main__":
    main()
