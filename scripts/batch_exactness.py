"""float32 batched speculation against single-row plain greedy, on real text.

The demo pair on the first XSum articles (the summarize job's prompts), greedy: every row
of a batched draft_model and prompt_lookup run (batch 16 by default) is compared with the
same row decoded alone with plain decoding.  Rows must be identical, or first differ at a
near-tie (the target's top-2 logit gap below 1e-3; see pipeline/engine/exactness.py).

    python scripts/batch_exactness.py                 # 256 articles, 64 new tokens
    python scripts/batch_exactness.py --rows 32 --max-new-tokens 32

Prints one line per method and exits 1 if a row differs away from a near-tie.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))


def check(rows: int, max_new_tokens: int, batch: int, methods, threads: int | None = None) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench_batch import load_prompts
    from pipeline.engine import GenerationSettings, SpeculationSettings, SpeculativeEngine
    from pipeline.engine.exactness import compare_rows, summarize

    if threads:
        torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(REPO / "models" / "demo-target")
    target = AutoModelForCausalLM.from_pretrained(REPO / "models" / "demo-target", dtype=torch.float32).eval()
    drafter = AutoModelForCausalLM.from_pretrained(REPO / "models" / "demo-drafter", dtype=torch.float32).eval()
    prompts = load_prompts(tok, rows)
    settings = GenerationSettings(max_new_tokens=max_new_tokens)
    references = [r.token_ids for r in SpeculativeEngine(target, max_batch_size=1).generate_batch(prompts, settings)]
    specs = {"draft_model": (SpeculationSettings(method="draft_model", num_assistant_tokens=5), drafter),
             "prompt_lookup": (SpeculationSettings(method="prompt_lookup", prompt_lookup_num_tokens=10), None)}
    out = {}
    for m in methods:
        spec, d = specs[m]
        engine = SpeculativeEngine(target, spec, drafter=d, max_batch_size=batch)
        results = engine.generate_batch(prompts, settings)
        out[m] = summarize(compare_rows(target, prompts, [r.token_ids for r in results], references))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--methods", nargs="+", default=["draft_model", "prompt_lookup"])
    args = ap.parse_args()
    result = check(args.rows, args.max_new_tokens, args.batch, args.methods)
    bad = False
    for m, s in result.items():
        print(f"{m} (batch {args.batch}): {json.dumps(s)}")
        bad |= s["differ"] != s["differ_at_near_tie"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
