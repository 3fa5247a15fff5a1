"""Engine benchmark: our loop against transformers ``generate()``, method by method.

Runs the same rows through our engine and through ``generate()`` with the same method,
models and settings (greedy; outputs checked equal), and prints per method the wall-time
ratios ``ours / generate()`` and ``speculative / plain`` measured in this one run.

Two random Llama targets on CPU: a small one (a few million parameters), where per-step
overhead shows, and a large one (tens of millions), where the forward pass dominates;
each with a small random drafter (acceptance ~0: pure overhead) and the oracle drafter
(a copy of the target: acceptance 1.0, so the controlled upper bound).

Not a test: timings are noisy on shared machines.  Usage::

    python bench/bench_engine.py [--rows 4] [--new-tokens 64] [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline.engine import GenerationSettings, SpeculationSettings, SpeculativeEngine

K = 4


def llama(vocab: int, hidden: int, layers: int, seed: int) -> LlamaForCausalLM:
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 8 / 3), num_hidden_layers=layers,
        num_attention_heads=max(2, hidden // 64), num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=2048, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


def setup_assistant(model) -> None:
    # generate() reads the draft settings from the assistant's generation_config (TRANSFORMERS-NOTES.md)
    model.generation_config.num_assistant_tokens = K
    model.generation_config.num_assistant_tokens_schedule = "constant"
    model.generation_config.assistant_confidence_threshold = 0.0


def rows(vocab: int, n: int, length: int = 48) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        base = torch.randint(0, vocab, (length // 2,), generator=gen)
        out.append(torch.cat([base, base]).view(1, -1))  # text that repeats itself, as articles do
    return out


def timed(fn, prompts, repeats):
    """Median over repeats of the total seconds for all rows; returns (seconds, outputs)."""
    times, outputs = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        outputs = [fn(p) for p in prompts]
        times.append(time.perf_counter() - t0)
    return statistics.median(times), outputs


def bench_size(name, target, drafter, prompts, new_tokens, repeats):
    oracle = copy.deepcopy(target)  # the target's weights in a separate model: acceptance 1.0
    setup_assistant(drafter)
    setup_assistant(oracle)
    settings = GenerationSettings(max_new_tokens=new_tokens)
    methods = {
        "plain": (dict(method="plain"), {}, {}),
        "draft_model (small)": (dict(method="draft_model", num_assistant_tokens=K), dict(drafter=drafter),
                                dict(assistant_model=drafter)),
        "draft_model (oracle)": (dict(method="draft_model", num_assistant_tokens=K), dict(drafter=oracle),
                                 dict(assistant_model=oracle)),
        "prompt_lookup": (dict(method="prompt_lookup", prompt_lookup_num_tokens=K), {},
                          dict(prompt_lookup_num_tokens=K, max_matching_ngram_size=2)),
    }
    results = {}
    for method, (spec, engine_kw, hf_kw) in methods.items():
        engine = SpeculativeEngine(target, SpeculationSettings(**spec), **engine_kw)

        def ours(p):
            return engine.generate(p, settings)

        def hf(p):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return target.generate(p, max_new_tokens=new_tokens, do_sample=False, **hf_kw)[0, p.shape[1]:].tolist()

        ours(prompts[0]), hf(prompts[0])  # warm-up
        t_ours, out_ours = timed(ours, prompts, repeats)
        t_hf, out_hf = timed(hf, prompts, repeats)
        same = sum(o.token_ids == h for o, h in zip(out_ours, out_hf))
        drafted = sum(o.stats.draft_tokens for o in out_ours)
        accepted = sum(o.stats.accepted_tokens for o in out_ours)
        steps = sum(o.stats.verify_steps for o in out_ours)
        tokens = sum(o.stats.new_tokens for o in out_ours)
        results[method] = dict(t_ours=t_ours, t_hf=t_hf, same=same, alpha=accepted / drafted if drafted else None,
                               mal=tokens / steps)
    plain = results["plain"]
    print(f"\n## {name}: target {sum(p.numel() for p in target.parameters()) / 1e6:.1f} M params, "
          f"drafter {sum(p.numel() for p in drafter.parameters()) / 1e6:.1f} M, k={K}, "
          f"{len(prompts)} rows x {new_tokens} new tokens, median of {repeats}")
    print(f"| method | acceptance | tokens/step | ours s | generate() s | ours/generate() | ours spec/plain | generate() spec/plain | outputs equal |")
    print("|---|---|---|---|---|---|---|---|---|")
    for method, r in results.items():
        alpha = "-" if r["alpha"] is None else f"{r['alpha']:.2f}"
        print(f"| {method} | {alpha} | {r['mal']:.2f} | {r['t_ours']:.3f} | {r['t_hf']:.3f} | "
              f"{r['t_ours'] / r['t_hf']:.2f} | {r['t_ours'] / plain['t_ours']:.2f} | {r['t_hf'] / plain['t_hf']:.2f} | "
              f"{r['same']}/{len(prompts)} |")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 is steadiest here)")
    parser.add_argument("--sizes", default="small,large")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes = {
        "small": lambda: (llama(4096, 192, 4, 0), llama(4096, 64, 1, 1)),
        "large": lambda: (llama(16000, 512, 8, 0), llama(16000, 128, 2, 1)),
    }
    for size in args.sizes.split(","):
        target, drafter = sizes[size]()
        prompts = rows(target.config.vocab_size, args.rows)
        bench_size(size, target, drafter, prompts, args.new_tokens, args.repeats)


if __name__ == "__main__":
    main()
