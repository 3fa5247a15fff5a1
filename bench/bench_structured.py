"""Structured output: speculative against plain *constrained* decoding (issue 53).

JSON extraction from XSum news articles with SmolLM2-135M-Instruct (``models/cache``) on this
CPU: each row asks for a JSON object of a 5-key schema (a string, a list of strings, a
string, an enum, an integer; :data:`SCHEMA`), ``response_format`` ``json_schema``, greedy.  For
plain constrained decoding and each method, at 1 and 8 rows in flight, on a fresh engine
warmed up outside the timed region (``SpeculativeEngine.warm_up``, then one untimed batch of
other articles under the schema, then ``reset_learning``), it prints:

- tokens/s on the process CPU clock, end to end and decode only (the engine's steps), and
  the ratio to plain constrained decoding;
- the share of forced tokens (``forced_tokens / new_tokens``: tokens the grammar allowed
  alone), acceptance by draft source (drafted and accepted tokens of the drafts verified,
  per ``Draft.source``), acceptance rate, mean accepted length;
- Leviathan et al.'s bound ``S`` from this run's measured α, k and c, and the efficiency
  (measured decode speedup / S), as ``bench/bench_real.py`` computes them;
- the rows identical to plain constrained decoding, and the rows that parse and validate
  against the schema (jsonschema) among those not cut by their budget.

Usage::

    python bench/bench_structured.py                                  # 16 articles, 1 and 8 rows (~25 min)
    python bench/bench_structured.py --rows 300:304 --batch-sizes 1   # a quick look

Not a test: one run each, CPU clock (steadier than the wall clock on a shared machine).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_real import XSUM, DEFAULT_DRAFTERS, Probes, leviathan_of, tally  # noqa: E402

TOPICS = ["politics", "business", "sport", "science", "health", "crime", "culture", "other"]
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 120},
        "people": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 5},
        "location": {"type": "string", "maxLength": 40},
        "topic": {"type": "string", "enum": TOPICS},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
    },
    "required": ["title", "people", "location", "topic", "year"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "article", "schema": SCHEMA, "strict": True}}
INSTRUCTION = ("Read the news article and extract, as JSON: a short title, the people named in it, the main "
               "location, the topic (one of: " + ", ".join(TOPICS) + ") and the year it is about.\n\nArticle:\n")


def prompts_of(tokenizer, rows: range, article_chars: int, xsum: Path = XSUM) -> list[list[int]]:
    """Chat prompts (the tokenizer's chat template) asking for the JSON of XSum articles ``rows``."""
    from pipeline.corpora import xsum_rows

    articles = xsum_rows(Path(xsum).parents[1])  # the data folder
    out = []
    for i in rows:
        text = INSTRUCTION + articles[i]["text"][:article_chars]
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        out.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids))
    return out


class SourceTally:
    """Drafted and accepted tokens of the verified drafts, by source (wraps ``StepEngine._settle``)."""

    def __init__(self, engine):
        self.drafted, self.accepted = Counter(), Counter()
        inner = engine._settle

        def settle(row, primary, draft, verdict, tree_off):
            if len(draft):
                self.drafted[draft.source] += len(draft)
                self.accepted[draft.source] += verdict.accepted
            return inner(row, primary, draft, verdict, tree_off)

        engine._settle = settle

    def line(self) -> str:
        return ", ".join(f"{s} {self.accepted[s]}/{self.drafted[s]} ({self.accepted[s] / self.drafted[s]:.2f})"
                         for s in sorted(self.drafted)) or "no drafts"


def valid(text: str | None) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text or ""), SCHEMA)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def run(cfg, models, prompts, warm_prompts, batch: int, new_tokens: int) -> dict:
    """One method at ``batch`` rows in flight: a fresh engine warmed up, then timed on the CPU clock."""
    from pipeline.engine import GenerationSettings
    from pipeline.loading import build_engine

    engine = build_engine(models, cfg.method.speculation_settings(), batch, cfg.compute.draft_length, time.process_time)
    settings = GenerationSettings(max_new_tokens=new_tokens, do_sample=False, response_format=RESPONSE_FORMAT)
    engine.warm_up(batch, prompt_tokens=128)
    engine.generate_batch(warm_prompts[:batch], settings, max_batch_size=batch)  # the grammar's path, other rows
    engine.reset_learning()
    probes, sources = Probes(engine), SourceTally(engine)
    c0, w0 = time.process_time(), time.perf_counter()
    results = engine.generate_batch(prompts, settings, max_batch_size=batch)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(f"{len(errors)} rows failed, e.g. {errors[0]}")
    r = tally(results, probes, cpu, wall)
    stats = [x.stats for x in results]
    closed = [x for x in results if x.finish_reason == "stop"]
    r.update(batch=batch, sources=sources.line(), texts=[x.text for x in results],
             forced_share=sum(s.forced_tokens for s in stats) / max(1, sum(s.new_tokens for s in stats)),
             closed=len(closed), valid=sum(valid(x.text) and bool(x.grammar_complete) for x in closed),
             accepted_from={k: sum(getattr(s, f"accepted_from_{k}") for s in stats)
                            for k in ("prompt", "pool", "reference", "drafter", "grammar")})
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "summarize.yaml"))
    ap.add_argument("--methods", default="prompt_lookup,suffix,draft_model")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--rows", default="300:316", help="XSum rows a:b")
    ap.add_argument("--article-chars", type=int, default=1200)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)

    import torch

    from pipeline.config import load_config
    from pipeline.engine.grammar import compile_grammar
    from pipeline.loading import load_job_models

    torch.set_num_threads(args.threads)
    a, b = (int(x) for x in args.rows.split(":"))
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    methods = ["plain"] + [m for m in args.methods.split(",") if m and m != "plain"]
    runs: dict[str, dict[int, dict]] = {}
    prompts = None
    for method in methods:
        sets = [f"method.name={method}"]
        if method in DEFAULT_DRAFTERS:
            if not (ROOT / DEFAULT_DRAFTERS[method]).exists():
                print(f"  {method}: skipped, its drafter is not there")
                continue
            sets.append(f"models.drafter={ROOT / DEFAULT_DRAFTERS[method]}")
        cfg = load_config(args.config, sets)
        models = load_job_models(cfg, "cpu")
        if prompts is None:
            prompts = prompts_of(models.tokenizer, range(a, b), args.article_chars)
            warm = prompts_of(models.tokenizer, range(b, b + max(sizes)), args.article_chars)
            t0 = time.process_time()
            compile_grammar(RESPONSE_FORMAT, models.tokenizer, models.target.config.vocab_size)
            print(f"{len(prompts)} XSum articles ({a}-{b - 1}, first {args.article_chars} chars), prompt tokens "
                  f"{min(map(len, prompts))}-{max(map(len, prompts))}, {args.new_tokens} new tokens at most, greedy, "
                  f"5-key schema compiled in {time.process_time() - t0:.2f} s CPU (tokenizer included, once), "
                  f"{args.threads} thread(s), CPU clock", flush=True)
        for batch in sizes:
            r = runs.setdefault(method, {})[batch] = run(cfg, models, prompts, warm, batch, args.new_tokens)
            p = runs["plain"][batch]
            line = (f"  {method:14s} B={batch}: {r['tokens_per_s_cpu']:.1f} tokens/s, decode "
                    f"{r['decode_tokens_per_s_cpu']:.1f}")
            if method != "plain":
                lev = leviathan_of(r, p, True)
                same = sum(x == y for x, y in zip(r["token_ids"], p["token_ids"]))
                f = lambda v: "–" if v is None else f"{v:.2f}"  # noqa: E731
                line += (f"; {r['tokens_per_s_cpu'] / p['tokens_per_s_cpu']:.2f}x plain constrained end to end, "
                         f"decode {r['decode_tokens_per_s_cpu'] / p['decode_tokens_per_s_cpu']:.2f}x (bound S "
                         f"{f(lev['S'])}, efficiency {f(lev['efficiency'])}, α {f(lev['alpha'])}, k {f(lev['k'])}, "
                         f"c {f(lev['c'])}); acceptance {f(r['acceptance_rate'])}, mean accepted length "
                         f"{f(r['mean_accepted_length'])}; by source {r['sources']}; identical {same}/{len(prompts)}")
            line += (f"; forced {r['forced_share']:.0%} of tokens; valid {r['valid']}/{r['closed']} closed "
                     f"({len(prompts) - r['closed']} cut by the budget)")
            print(line, flush=True)
        del models
    print("example:", runs["plain"][sizes[0]]["texts"][0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
