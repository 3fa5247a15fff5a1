"""Engine benchmark: our loop against transformers ``generate()``, method by method.

Runs the same rows through our engine and through ``generate()`` with the same method,
models and settings (greedy; outputs checked equal), and prints per method the wall-time
ratios ``ours / generate()`` and ``speculative / plain`` measured in this one run.

Two random Llama targets on CPU: a small one (a few million parameters), where per-step
overhead shows, and a large one (tens of millions), where the forward pass dominates;
each with a small random drafter (acceptance ~0: pure overhead) and the oracle drafter
(a copy of the target: acceptance 1.0, so the controlled upper bound).

Also: self-speculative early exit (the target's first quarter of layers drafts; with KV
reuse, and as a separate shallow draft model without it, which is how ``generate(
assistant_early_exit=L)`` runs it); static ensemble verification (w = 0.7, lossy: the
"= plain" column counts rows equal to plain decoding); universal assisted decoding with a
random drafter that has its own byte-level BPE tokenizer (trained on tinyshakespeare; the
target's vocabulary is a second such tokenizer, so every id the target emits decodes).
Random models: early-exit and universal acceptance say nothing about real checkpoints.

Not a test: timings are noisy on shared machines.  Usage::

    python bench/bench_engine.py [--rows 4] [--new-tokens 64] [--repeats 3] [--threads 1] [--layerskip-scale 0.1]
"""

from __future__ import annotations

import argparse
from pathlib import Path
import copy
import statistics
import time
import warnings

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline.engine import GenerationSettings, RowStats, SpeculationSettings, SpeculativeEngine

K = 4


def llama(vocab: int, hidden: int, layers: int, seed: int) -> LlamaForCausalLM:
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 8 / 3), num_hidden_layers=layers,
        num_attention_heads=max(2, hidden // 64), num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=2048, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


def bpe_tokenizer(vocab_size: int, bos: str, eos: str, path: str = str(Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare" / "input.txt")):
    """A byte-level BPE tokenizer (any id sequence decodes, any text round-trips)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[bos, eos], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    with open(path) as f:
        tok.train_from_iterator(f.read().splitlines(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos)


def shallow_copy(target, layers: int) -> LlamaForCausalLM:
    """The target's first ``layers`` layers + final norm + LM head as a separate model
    (shared weights, its own KV cache): early exit without KV reuse."""
    cfg = copy.deepcopy(target.config)
    cfg.num_hidden_layers = layers
    with torch.device("meta"):
        shallow = LlamaForCausalLM(cfg)
    shallow.model.embed_tokens = target.model.embed_tokens
    shallow.model.layers = torch.nn.ModuleList(target.model.layers[:layers])
    shallow.model.norm, shallow.model.rotary_emb = target.model.norm, target.model.rotary_emb
    shallow.lm_head = target.lm_head
    return shallow.eval()


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


def measure_methods(target, methods, prompts, new_tokens, repeats) -> dict[str, dict]:
    """Time each method against ``generate()`` with the matching arguments (greedy).

    ``methods``: ``{name: (SpeculationSettings kwargs, SpeculativeEngine kwargs, generate() kwargs)}``,
    ``plain`` first.  Returns per method: ``t_ours``, ``t_hf`` (median seconds over all prompts),
    ``same`` (rows equal to ``generate()``), ``lossless`` (rows equal to our plain run),
    ``acceptance_rate`` (accepted / drafted), ``tokens_per_step`` (new tokens / verify steps),
    ``k`` (longest draft): :class:`~pipeline.engine.RowStats` of all rows summed.
    """
    settings = GenerationSettings(max_new_tokens=new_tokens)
    results, plain_out = {}, None
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
        if plain_out is None:
            plain_out = [o.token_ids for o in out_ours]
        total = RowStats.total(o.stats for o in out_ours)
        results[method] = dict(
            t_ours=t_ours, t_hf=t_hf,
            same=sum(o.token_ids == h for o, h in zip(out_ours, out_hf)),
            lossless=sum(o.token_ids == p for o, p in zip(out_ours, plain_out)),
            acceptance_rate=total.acceptance_rate,
            tokens_per_step=total.tokens_per_step,
            k=len(total.drafted_per_position),
        )
    return results


def bench_size(name, target, drafter, prompts, new_tokens, repeats, uad=None, only=None):
    oracle = copy.deepcopy(target)  # the target's weights in a separate model: acceptance 1.0
    exit_layer = max(1, target.config.num_hidden_layers // 4)
    shallow = shallow_copy(target, exit_layer)
    for model in (drafter, oracle, shallow, target):  # the target's own config drives generate(assistant_early_exit=)
        setup_assistant(model)
    w = 0.7
    methods = {
        "plain": (dict(method="plain"), {}, {}),
        "draft_model (small)": (dict(method="draft_model", num_assistant_tokens=K), dict(drafter=drafter),
                                dict(assistant_model=drafter)),
        "draft_model (oracle)": (dict(method="draft_model", num_assistant_tokens=K), dict(drafter=oracle),
                                 dict(assistant_model=oracle)),
        "prompt_lookup": (dict(method="prompt_lookup", prompt_lookup_num_tokens=K), {},
                          dict(prompt_lookup_num_tokens=K, max_matching_ngram_size=2)),
        f"early_exit L={exit_layer} (KV reuse)": (
            dict(method="early_exit", assistant_early_exit=exit_layer, num_assistant_tokens=K), {},
            dict(assistant_early_exit=exit_layer)),
        f"early_exit L={exit_layer} (separate cache)": (
            dict(method="draft_model", num_assistant_tokens=K), dict(drafter=shallow),
            dict(assistant_early_exit=exit_layer)),
        f"draft_model (small) ensemble w={w}": (
            dict(method="draft_model", num_assistant_tokens=K, assistant_ensemble_weight=w), dict(drafter=drafter),
            dict(assistant_model=drafter, assistant_ensemble_weight=w)),
        f"early_exit L={exit_layer} ensemble w={w}": (
            dict(method="early_exit", assistant_early_exit=exit_layer, num_assistant_tokens=K,
                 assistant_ensemble_weight=w), {},
            dict(assistant_early_exit=exit_layer, assistant_ensemble_weight=w)),
    }
    if uad is not None:
        tok_t, u_drafter, tok_d = uad
        setup_assistant(u_drafter)
        methods["universal (random drafter)"] = (
            dict(method="universal", num_assistant_tokens=K),
            dict(drafter=u_drafter, tokenizer=tok_t, drafter_tokenizer=tok_d),
            dict(assistant_model=u_drafter, tokenizer=tok_t, assistant_tokenizer=tok_d))
    if only is not None:
        methods = {m: v for m, v in methods.items() if m.startswith(only)}
    results = measure_methods(target, methods, prompts, new_tokens, repeats)
    plain = results["plain"]
    print(f"\n## {name}: target {sum(p.numel() for p in target.parameters()) / 1e6:.1f} M params, "
          f"drafter {sum(p.numel() for p in drafter.parameters()) / 1e6:.1f} M, k={K}, "
          f"{len(prompts)} rows x {new_tokens} new tokens, median of {repeats}")
    print("| method | acceptance | tokens/step | ours s | generate() s | ours/generate() | ours spec/plain | generate() spec/plain | outputs equal | = plain |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for method, r in results.items():
        acceptance = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        print(f"| {method} | {acceptance} | {r['tokens_per_step']:.2f} | {r['t_ours']:.3f} | {r['t_hf']:.3f} | "
              f"{r['t_ours'] / r['t_hf']:.2f} | {r['t_ours'] / plain['t_ours']:.2f} | {r['t_hf'] / plain['t_hf']:.2f} | "
              f"{r['same']}/{len(prompts)} | {r['lossless']}/{len(prompts)} |")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 is steadiest here)")
    parser.add_argument("--sizes", default="small,large")
    parser.add_argument("--layerskip-scale", type=float, default=0.1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes = {  # vocabularies: the target's byte-level tokenizer, the universal drafter's
        "small": lambda v, u: (llama(v, 192, 4, 0), llama(v, 64, 1, 1), llama(u, 64, 1, 2)),
        "large": lambda v, u: (llama(v, 512, 8, 0), llama(v, 128, 2, 1), llama(u, 128, 2, 2)),
    }
    vocabs = {"small": (4096, 3000), "large": (16000, 12000)}
    for size in args.sizes.split(","):
        tok_t = bpe_tokenizer(vocabs[size][0], "<bos>", "<eos>")
        tok_d = bpe_tokenizer(vocabs[size][1], "<s>", "</s>")
        target, drafter, u_drafter = sizes[size](len(tok_t), len(tok_d))
        prompts = rows(target.config.vocab_size, args.rows)
        bench_size(size, target, drafter, prompts, args.new_tokens, args.repeats, uad=(tok_t, u_drafter, tok_d))
        # LayerSkip-style: the later layers' residual contributions scaled down, so the early exit
        # agrees with the full model often (a stand-in for a checkpoint trained with early-exit loss)
        layerskip = copy.deepcopy(target)
        with torch.no_grad():
            for layer in layerskip.model.layers[max(1, layerskip.config.num_hidden_layers // 4):]:
                layer.self_attn.o_proj.weight.mul_(args.layerskip_scale)
                layer.mlp.down_proj.weight.mul_(args.layerskip_scale)
        bench_size(f"{size}, LayerSkip-style target (later layers x{args.layerskip_scale})", layerskip, drafter,
                   prompts, args.new_tokens, args.repeats, only=("plain", "early_exit"))


if __name__ == "__main__":
    main()
