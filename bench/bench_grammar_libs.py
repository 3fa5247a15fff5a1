"""Compare grammar libraries on this CPU (issue 53): compile time of a JSON schema against
the SmolLM2 tokenizer, the per-token cost of a mask, and forced runs (jump-forward).

Run: ``.venv/bin/python bench/bench_grammar_libs.py`` (needs models/cache; CPU clock,
``time.process_time``).  Prints one line per library.  The figures are in
``docs/generation.md`` ("Choosing the grammar library").
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "people": {"type": "array", "items": {"type": "string"}},
        "location": {"type": "string"},
        "topic": {"type": "string", "enum": ["politics", "sport", "business", "science", "culture", "other"]},
        "year": {"type": "integer"},
    },
    "required": ["title", "people", "location", "topic", "year"],
    "additionalProperties": False,
}
OUTPUT = json.dumps({"title": "Storm hits coast", "people": ["Jane Doe", "John Smith"], "location": "Cornwall",
                     "topic": "science", "year": 2016})


def clock() -> float:
    return time.process_time()


WALL: dict[str, float] = {}


class Timed:
    """Both clocks over a block: CPU (``time.process_time``, every thread of the process) and wall."""

    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        self.c, self.w = time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        WALL[self.name] = time.perf_counter() - self.w
        WALL[self.name + "_cpu"] = time.process_time() - self.c


def measure_xgrammar(tok, vocab_size: int, ids: list[int]) -> dict:
    import xgrammar as xgr
    t0 = clock()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size)
    t1 = clock()
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    t2 = clock()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    t3 = clock()
    m = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, vocab_size)
    logits = torch.zeros(1, vocab_size)
    for t in ids:  # the same warm-up pass as llguidance's
        m.fill_next_token_bitmask(mask)
        m.accept_token(t)
    m.reset()
    with Timed("xgr_mask"):
        for t in ids:
            m.fill_next_token_bitmask(mask)
            xgr.apply_token_bitmask_inplace(logits, mask)
            assert m.accept_token(t), t
    m.reset()
    runs = []
    for t in ids:
        run = m.find_jump_forward_tokens() if hasattr(m, "find_jump_forward_tokens") else []
        if run:
            runs.append(len(run))
        m.accept_token(t)
    m.reset()
    t6 = clock()
    for t in ids:
        m.find_jump_forward_string()
        m.accept_token(t)
    t7 = clock()
    return dict(lib="xgrammar", tokenizer_s=t1 - t0, compile_s=t3 - t2, mask_us=1e6 * WALL["xgr_mask_cpu"] / len(ids),
                mask_wall_us=1e6 * WALL["xgr_mask"] / len(ids),
                ff_us=1e6 * (t7 - t6) / len(ids), ff_positions=len(runs), ff_tokens=sum(runs))


def measure_llguidance(tok, vocab_size: int, ids: list[int]) -> dict:
    import llguidance as llg
    import llguidance.hf
    import llguidance.torch as lt
    t0 = clock()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab_size)
    t1 = clock()
    grm = llg.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults={"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "})
    m = llg.LLMatcher(lltok, grm)
    assert not m.is_error(), m.get_error()
    t2 = clock()
    mask = lt.allocate_token_bitmask(1, vocab_size)
    # the same packed int32 bitmask as xgrammar's: applied with xgrammar's CPU kernel where it is
    # installed (llguidance.torch's own apply cost ~170 ms a call here), else by unpacking in torch
    try:
        from xgrammar import apply_token_bitmask_inplace as apply
    except ImportError:
        apply = lt.apply_token_bitmask_inplace
    logits = torch.zeros(1, vocab_size)
    for t in ids:  # a first pass warms the lexer's caches (its first masks take tens of ms)
        lt.fill_next_token_bitmask(m, mask, 0)
        m.consume_token(t)
    m.reset()
    with Timed("llg_mask"):
        for t in ids:
            lt.fill_next_token_bitmask(m, mask, 0)
            apply(logits, mask)
            assert m.consume_token(t), (t, m.get_error())
    m.reset()
    runs = []
    t5 = clock()
    for t in ids:
        run = m.compute_ff_tokens()
        if run:
            runs.append(len(run))
        m.consume_token(t)
    t6 = clock()
    return dict(lib="llguidance", tokenizer_s=t1 - t0, compile_s=t2 - t1, mask_us=1e6 * WALL["llg_mask_cpu"] / len(ids),
                mask_wall_us=1e6 * WALL["llg_mask"] / len(ids),
                ff_us=1e6 * (t6 - t5) / len(ids), ff_positions=len(runs), ff_tokens=sum(runs))


def main() -> None:
    from transformers import AutoTokenizer
    path = ROOT / "models" / "cache" / "SmolLM2-135M-Instruct"
    tok = AutoTokenizer.from_pretrained(path)
    vocab_size = json.loads((path / "config.json").read_text())["vocab_size"]
    ids = tok.encode(OUTPUT, add_special_tokens=False)
    print(f"schema: 5 keys (list of strings, enum); output {len(ids)} tokens; vocab {vocab_size}; CPU clock")
    for f in (measure_xgrammar, measure_llguidance):
        try:
            r = f(tok, vocab_size, ids)
        except Exception as e:  # noqa: BLE001 - a library missing or failing is a line of the table
            print(f"{f.__name__}: {type(e).__name__}: {e}")
            continue
        print(f"{r['lib']:<11} tokenizer {r['tokenizer_s']:.3f}s  compile {r['compile_s'] * 1e3:.1f}ms  "
              f"mask+apply {r['mask_wall_us']:.0f}us wall, {r['mask_us']:.0f}us CPU per token  forced-run query {r['ff_us']:.0f}us/token  "
              f"forced runs at {r['ff_positions']} positions, {r['ff_tokens']} tokens")


if __name__ == "__main__":
    main()
