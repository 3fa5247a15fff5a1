"""MTP benchmark: our ``mtp`` and ``mtp_assistant`` methods against transformers ``generate()``.

Same rows through our engine and ``generate()`` with the matching argument (greedy;
outputs checked equal), wall-time ratios ``ours / generate()`` and ``speculative /
plain`` measured in this one run, as in bench/bench_engine.py:

- ``mtp`` vs ``generate(use_mtp=True)``: random DeepSeek-V3 and GLM-4.5 (Glm4Moe)
  checkpoints with one MTP layer, written in the released layout
  (tests/engine/mtp_models.py) so both load the layer through transformers' MTP loader.
  Note: ``generate(use_mtp=True)`` reloads the MTP weights from the checkpoint files on
  every call (its candidate generator is built per call); that is part of its time.
- ``mtp_assistant`` vs ``generate(assistant_model=...)``: a random text-only Gemma 4
  target (``Gemma4ForConditionalGeneration``, as Gemma-4-E4B-it) with a random Gemma 4
  assistant.

Two sizes on CPU, float32.  Random weights: acceptance ~0, so those speculative rows
measure pure overhead (draft cost + a verification of k+1 positions per step), not
speed-ups a trained MTP head or assistant would give.  For MTP a second table uses a
least-squares-fitted MTP layer (see ``fit_mtp_layer``): some acceptance, so the
accepted path runs at scale too -- still far from a trained head's.

Not a test: timings are noisy on shared machines.  Usage::

    python bench/bench_mtp.py [--rows 4] [--new-tokens 64] [--repeats 3] [--threads 1] [--sizes small,large]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "engine"))

from bench_engine import measure_methods  # noqa: E402  (same folder)
from mtp_models import load_target, write_mtp_checkpoint  # noqa: E402
from pipeline.engine.proposers.mtp import load_mtp  # noqa: E402

K = 4
SIZES = {  # vocab, hidden, layers
    "small": (4096, 128, 4),
    "large": (16000, 512, 8),
}


def gemma4_pair(vocab, hidden, layers, seed=0):
    from transformers import (
        Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4Config, Gemma4ForConditionalGeneration,
        Gemma4TextConfig,
    )

    common = dict(vocab_size=vocab, num_attention_heads=4, num_key_value_heads=1, head_dim=hidden // 4,
                  global_head_dim=hidden // 2, sliding_window=128, max_position_embeddings=2048,
                  bos_token_id=None, eos_token_id=None)
    types = ["sliding_attention", "full_attention"] * (layers // 2)
    text = Gemma4TextConfig(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers, layer_types=types,
                            hidden_size_per_layer_input=32, vocab_size_per_layer_input=vocab,
                            num_kv_shared_layers=layers // 2, pad_token_id=0, **common)
    assistant_text = Gemma4TextConfig(hidden_size=hidden // 2, intermediate_size=2 * hidden, num_hidden_layers=2,
                                      layer_types=types[:2], hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
                                      pad_token_id=None, **common)
    torch.manual_seed(seed)
    target = Gemma4ForConditionalGeneration(Gemma4Config(text_config=text, vision_config=None, audio_config=None)).eval()
    assistant = Gemma4AssistantForCausalLM(
        Gemma4AssistantConfig(text_config=assistant_text, backbone_hidden_size=hidden, use_ordered_embeddings=False)
    ).eval()
    assistant.generation_config.num_assistant_tokens = K  # generate() reads it there
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    return target, assistant


def rows(vocab: int, n: int, length: int = 48) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(1, vocab, (1, length), generator=gen) for _ in range(n)]


def run_methods(title, target, methods, prompts, new_tokens, repeats, extra=""):
    results = measure_methods(target, methods, prompts, new_tokens, repeats)
    plain = results["plain"]
    print(f"\n## {title}: target {sum(p.numel() for p in target.parameters()) / 1e6:.1f} M params{extra}, "
          f"{len(prompts)} rows x {new_tokens} new tokens, median of {repeats}")
    print("| method | k | acceptance | tokens/step | ours s | generate() s | ours/generate() | ours spec/plain "
          "| generate() spec/plain | outputs equal |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for method, r in results.items():
        acceptance = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        print(f"| {method} | {r['k']} | {acceptance} | {r['tokens_per_step']:.2f} | {r['t_ours']:.3f} | {r['t_hf']:.3f} | "
              f"{r['t_ours'] / r['t_hf']:.2f} | {r['t_ours'] / plain['t_ours']:.2f} | {r['t_hf'] / plain['t_hf']:.2f} | "
              f"{r['same']}/{len(prompts)} |")
    sys.stdout.flush()
    return results


def fit_mtp_layer(path, n_prompts=16, length=48, new_tokens=64, seed=7):
    """Give the random MTP layer of checkpoint ``path`` some skill, in place, so that the
    accepted path is exercised: its decoder block becomes the identity (``o_proj`` and
    the down projections zeroed) and ``eh_proj`` is the least-squares map from
    ``[rmsnorm(embed(x[t+1])); rmsnorm(h[t])]`` to the target's own final hidden state at
    ``t + 1`` (before the final norm's weight, which ``shared_head.norm`` takes over),
    fitted on the target's greedy continuations of prompts other than the benchmark's."""
    from safetensors.torch import load_file, save_file

    target = load_target(path, dtype=torch.float32)
    cfg = target.config
    gen = torch.Generator().manual_seed(seed)
    w_final = target.model.norm.weight.detach()

    def rms(x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)

    feats, goals = [], []
    with torch.inference_mode():
        for _ in range(n_prompts):
            seq = target.generate(torch.randint(1, cfg.vocab_size, (1, length), generator=gen),
                                  max_new_tokens=new_tokens, do_sample=False)
            h = target(seq, output_hidden_states=-1).hidden_states[-1][0]
            e = target.model.embed_tokens(seq)[0]
            feats.append(torch.cat([rms(e[1:-1]), rms(h[:-2])], -1))
            goals.append(h[1:-1] / w_final)
    W = torch.linalg.lstsq(torch.cat(feats), torch.cat(goals)).solution.T.contiguous()
    shard = os.path.join(path, "model-00002-of-00002.safetensors")  # the MTP layer's shard (mtp_models.py)
    tensors = load_file(shard)
    prefix = f"model.layers.{cfg.num_hidden_layers}."
    for key in tensors:
        if key.startswith(prefix) and key.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[key] = torch.zeros_like(tensors[key])
    tensors[prefix + "eh_proj.weight"] = W
    tensors[prefix + "enorm.weight"] = torch.ones_like(tensors[prefix + "enorm.weight"])
    tensors[prefix + "hnorm.weight"] = torch.ones_like(tensors[prefix + "hnorm.weight"])
    tensors[prefix + "shared_head.norm.weight"] = w_final.clone()
    save_file(tensors, shard, metadata={"format": "pt"})


def bench_mtp(arch, size, args, tmp):
    vocab, hidden, layers = SIZES[size]
    path = write_mtp_checkpoint(os.path.join(tmp, f"{arch}-{size}"), arch, vocab=vocab, hidden=hidden, layers=layers,
                                num_mtp=1, max_position_embeddings=2048)
    fitted = os.path.join(tmp, f"{arch}-{size}-fitted")
    shutil.copytree(path, fitted)
    fit_mtp_layer(fitted)
    target = load_target(path, dtype=torch.float32)
    target_fit = load_target(fitted, dtype=torch.float32)  # the same target weights
    mtp, mtp_fit = load_mtp(target), load_mtp(target_fit)
    methods = {
        "plain": (dict(method="plain"), {}, {}),
        "mtp (random layer)": (dict(method="mtp"), dict(drafter=mtp), dict(use_mtp=True)),
    }
    n_mtp = sum(p.numel() for p in mtp.layers.parameters()) / 1e6
    prompts = rows(vocab, args.rows)
    run_methods(f"{arch} {size}", target, methods, prompts, args.new_tokens, args.repeats,
                extra=f", MTP layer {n_mtp:.1f} M")
    methods = {
        "plain": (dict(method="plain"), {}, {}),
        "mtp (fitted layer)": (dict(method="mtp"), dict(drafter=mtp_fit), dict(use_mtp=True)),
    }
    run_methods(f"{arch} {size}, least-squares MTP layer", target_fit, methods, prompts, args.new_tokens, args.repeats,
                extra=f", MTP layer {n_mtp:.1f} M")


def bench_assistant(size, args):
    vocab, hidden, layers = SIZES[size]
    target, assistant = gemma4_pair(vocab, hidden, layers)
    methods = {
        "plain": (dict(method="plain"), {}, {}),
        "mtp_assistant": (dict(method="mtp_assistant", num_assistant_tokens=K), dict(drafter=assistant),
                          dict(assistant_model=assistant)),
    }
    n_a = sum(p.numel() for p in assistant.parameters()) / 1e6
    run_methods(f"gemma4 + assistant {size}", target, methods, rows(vocab, args.rows), args.new_tokens, args.repeats,
                extra=f", assistant {n_a:.1f} M")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 is steadiest here)")
    parser.add_argument("--sizes", default="small,large")
    parser.add_argument("--archs", default="deepseek_v3,glm4_moe,gemma4")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers.utils import logging

    logging.set_verbosity_error()  # the MTP keys are "unexpected" for the target's own load report
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes.split(","):
            for arch in args.archs.split(","):
                if arch == "gemma4":
                    bench_assistant(size, args)
                else:
                    bench_mtp(arch, size, args, tmp)


if __name__ == "__main__":
    main()
