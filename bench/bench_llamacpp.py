"""Our decode against llama.cpp's on the default job's model, with our decode step's time broken down.

The same model (SmolLM2-135M-Instruct, float32 on both sides: an F32 GGUF for llama.cpp),
the same token ids (the default job's prompts, chat template included, for XSum articles
200-215), one thread, greedy, 64 new tokens, one row at a time.  It prints tokens/s on the
process CPU clock and the wall clock:

- **llama.cpp plain** and **llama.cpp prompt lookup** (``LlamaPromptLookupDecoding``, its
  ``num_pred_tokens`` 10 by default and 3, ``max_ngram_size`` 2), each through
  ``Llama.generate`` (its own loop, greedy: ``temp=0``): end to end (the prompt's pass
  included) and decode only (the tokens after the first over the time after the first);
- **ours**: plain decoding (the lean Llama pass, ``pipeline.engine.cpu.lean``, and right after it
  through transformers' forward, the target prepared with ``lean_pass`` off: what the lean pass buys), and the
  speculative methods of ``--methods`` (by default the prompt lookup and suffix decoding with
  the config's settings), through the engine as the job runs it
  (``pipeline.loading``), end to end and decode only (the engine's steps);
- **the plain decode step's breakdown** (ours): the step's CPU time split into the
  attention kernel (SDPA over the KV cache), the attention layers' projections and RoPE, the
  MLPs, the output layer (``lm_head``), the rest of the model's forward (embedding, norms,
  residuals, transformers' Python), the runner's batch metadata (positions, mask, cache
  bookkeeping) and the engine outside the pass (sampling, acceptance, statistics, Python),
  measured on a second plain run by timing the lean pass's part functions (wrapped here, when the
  target takes it; its attention part includes the KV cache's write) or forward hooks on the
  model's modules (the timers' own cost: the second run's step time over the first's);
- the weights a one-row step reads (every linear layer's, once) over each side's step time:
  the memory bandwidth each achieves, the physical bound of a one-row decode step;
- the ratios: our plain decode / llama.cpp's (goal ≥ 0.9×), our plain end to end /
  llama.cpp's (goal ≥ 1.0×), our best speculative method / llama.cpp's prompt lookup (goal
  > 1), and the rows whose greedy tokens are identical to llama.cpp's.

Not a test, and not run in CI (it needs llama.cpp, built from source).  Set-up, once::

    pip install llama-cpp-python==0.3.36 sentencepiece  # builds llama.cpp from source: ~25 min on 2 cores;
                                                        # sentencepiece: its converter imports it
    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d out/llama  # its source, for
    tar xzf out/llama/llama_cpp_python-0.3.36.tar.gz -C out/llama                    # convert_hf_to_gguf.py
    python bench/bench_llamacpp.py --llama-cpp-src out/llama/llama_cpp_python-0.3.36/vendor/llama.cpp \\
        --output reports/bench_llamacpp

``--llama-cpp-src`` converts the target to ``out/gguf/<name>-f32.gguf`` once (with
llama.cpp's ``convert_hf_to_gguf.py --outtype f32``); ``--gguf`` names an existing one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

os.environ.setdefault("OMP_NUM_THREADS", "1")  # llama.cpp's OpenMP pool: the one thread we compare

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_real import XSUM, _commit, _machine, prompts_of, run_one  # noqa: E402

TITLE = "bench/bench_llamacpp.py: our decode against llama.cpp's (SmolLM2-135M-Instruct, F32, one thread, greedy)"
#: the run of our plain decoding through transformers' forward (``cpu.lean_pass`` off), beside the lean pass's
MODEL_FORWARD = "ours plain, transformers' forward"
#: the parts of our decode step, in the order the breakdown prints them
PARTS = ("attention kernel (SDPA over the KV cache)", "attention projections + RoPE", "MLP", "output layer (lm_head)",
         "rest of the model's forward", "runner: batch metadata, cache bookkeeping", "engine outside the pass")


def f32_gguf(hf_dir: Path) -> Path:
    """Where the F32 GGUF of the Hugging Face model folder ``hf_dir`` lives: ``out/gguf/<name>-f32.gguf``
    (:func:`convert` writes it there; ``bench_roofline --peer`` reads it)."""
    return ROOT / "out" / "gguf" / f"{Path(hf_dir).name}-f32.gguf"


def convert(src: Path, hf_dir: Path, out: Path) -> Path:
    """``out``: ``hf_dir`` as an F32 GGUF, written by llama.cpp's converter in ``src``."""
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src / "gguf-py"), os.environ.get("PYTHONPATH", "")]))
    tmp = out.with_suffix(".partial")
    subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(hf_dir), "--outtype", "f32",
                    "--outfile", str(tmp)], check=True, env=env)
    tmp.rename(out)
    return out


def llama_cpp_run(llm, prompts: list[list[int]], new_tokens: int, eos: set[int]) -> dict:
    """Greedy ``Llama.generate`` over each prompt: timings of the first token and the rest, and the ids."""
    first_cpu = first_wall = rest_cpu = rest_wall = 0.0
    n_new = n_rest = 0
    ids = []
    for p in prompts:
        llm.reset()  # no prefix reuse across rows (generate() would reuse the shared chat-template prefix)
        c0, w0 = time.process_time(), time.perf_counter()
        out: list[int] = []
        c1 = w1 = None
        for tok in llm.generate(p, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=False):
            if c1 is None:
                c1, w1 = time.process_time(), time.perf_counter()
            out.append(int(tok))
            if tok in eos or len(out) >= new_tokens:
                break
        c2, w2 = time.process_time(), time.perf_counter()
        first_cpu, first_wall = first_cpu + (c1 - c0), first_wall + (w1 - w0)
        rest_cpu, rest_wall = rest_cpu + (c2 - c1), rest_wall + (w2 - w1)
        n_new += len(out)
        n_rest += len(out) - 1
        ids.append(out)
    return {"new_tokens": n_new, "cpu_s": first_cpu + rest_cpu, "wall_s": first_wall + rest_wall,
            "tokens_per_s_cpu": n_new / (first_cpu + rest_cpu), "tokens_per_s_wall": n_new / (first_wall + rest_wall),
            "decode_tokens_per_s_cpu": n_rest / rest_cpu, "decode_tokens_per_s_wall": n_rest / rest_wall,
            "prompt_tokens_per_s_cpu": sum(map(len, prompts)) / first_cpu, "token_ids": ids}


class Breakdown:
    """CPU seconds of a plain run's decode steps, split by part: the lean pass's part functions
    wrapped (``pipeline.engine.cpu.lean``), or forward hooks on the target's modules."""

    #: the lean pass's part functions, and the part each one's time goes to
    LEAN_PARTS = {"attend": PARTS[0], "attention_in_of": PARTS[1], "attention_out_of": PARTS[1], "mlp_of": PARTS[2],
                  "output_layer": PARTS[3]}

    def __init__(self, engine):
        from transformers import AttentionInterface

        from pipeline.engine.cpu import attention

        self.t = defaultdict(float)
        self.steps = 0
        self._undo = []
        target = engine.target
        body = target.model
        clock = time.process_time
        #: the target takes the lean pass: its part functions are timed (hooks would send it to
        #: the model's forward); else forward hooks on the model's modules
        self.lean = engine.cpu_plans["target"].lean is not None
        if self.lean:
            from pipeline.engine.cpu import lean

            self._wrap(lean.LeanPass, "__call__", "lean pass", clock)
            for name, part in self.LEAN_PARTS.items():
                self._wrap(lean, name, part, clock)
            self._wrap_runner_and_engine(engine, clock)
            return

        def timed_module(module, part):
            start = []
            h1 = module.register_forward_pre_hook(lambda m, a: start.append(clock()))
            h2 = module.register_forward_hook(lambda m, a, o: self._add(part, clock() - start.pop()))
            self._undo += [h1.remove, h2.remove]

        for layer in body.layers:
            timed_module(layer.self_attn, "self_attn")
            timed_module(layer.mlp, "mlp")
        timed_module(target.lm_head, "lm_head")
        timed_module(target, "model")
        attention.register()
        for name in (attention.ATTENTION_NAME, "sdpa"):
            fn = AttentionInterface._global_mapping[name]

            def wrapped(*a, _fn=fn, **kw):
                c = clock()
                try:
                    return _fn(*a, **kw)
                finally:
                    self._add("attention", clock() - c)

            AttentionInterface._global_mapping[name] = wrapped
            self._undo.append(lambda n=name, f=fn: AttentionInterface._global_mapping.__setitem__(n, f))
        self._wrap_runner_and_engine(engine, clock)

    def _wrap(self, owner, name, part, clock):
        """``owner.name`` timed into ``part`` until :meth:`close`."""
        fn = getattr(owner, name)

        def timed(*a, **kw):
            c = clock()
            try:
                return fn(*a, **kw)
            finally:
                self._add(part, clock() - c)

        setattr(owner, name, timed)
        self._undo.append(lambda: setattr(owner, name, fn))

    def _wrap_runner_and_engine(self, engine, clock):
        from pipeline.engine.runner import ModelRunner

        self._wrap(ModelRunner, "forward", "runner", clock)
        step = engine.step

        def timed_step(rows):
            c = clock()
            try:
                return step(rows)
            finally:
                self.steps += 1
                self._add("step", clock() - c)

        engine.step = timed_step
        admit = engine.admit

        def timed_admit(rows):  # the prefill's passes are not the decode step's: kept apart
            saved = dict(self.t)
            try:
                return admit(rows)
            finally:
                self.t = defaultdict(float, saved)

        engine.admit = timed_admit

    def _add(self, part, seconds):
        self.t[part] += seconds

    def close(self):
        for undo in reversed(self._undo):
            undo()

    def parts(self) -> dict[str, float]:
        """Seconds per decode step of each part; the parts sum to the step."""
        t, n = self.t, max(1, self.steps)
        if self.lean:  # the lean pass's parts; its rest is the pass less them, the runner's is the runner less the pass
            inside = sum(t[p] for p in PARTS[:4])
            split = (t[PARTS[0]], t[PARTS[1]], t[PARTS[2]], t[PARTS[3]], t["lean pass"] - inside,
                     t["runner"] - t["lean pass"], t["step"] - t["runner"])
            return {part: v / n for part, v in zip(PARTS, split)}
        split = (t["attention"], t["self_attn"] - t["attention"], t["mlp"], t["lm_head"],
                 t["model"] - t["self_attn"] - t["mlp"] - t["lm_head"], t["runner"] - t["model"], t["step"] - t["runner"])
        return {part: v / n for part, v in zip(PARTS, split)}


def ours_with_breakdown(models, prompts, new_tokens: int) -> tuple[dict, float]:
    """A plain run at one row with :class:`Breakdown`'s timers: seconds per step by part, and the step."""
    from pipeline.engine import GenerationSettings
    from pipeline.loading import build_engine

    engine = build_engine(models, None, 1, "fixed", time.process_time)
    engine.generate_batch([prompts[0][:32]], GenerationSettings(max_new_tokens=4, do_sample=False))  # warm-up
    probe = Breakdown(engine)
    try:
        engine.generate_batch(prompts, GenerationSettings(max_new_tokens=new_tokens, do_sample=False), max_batch_size=1)
    finally:
        probe.close()
    return probe.parts(), probe.t["step"] / max(1, probe.steps)


def parse_args(argv=None) -> argparse.Namespace:
    """The command line's flags."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "summarize.yaml"))
    ap.add_argument("--gguf", default=None, help="the target as an F32 GGUF (default: out/gguf/<target>-f32.gguf)")
    ap.add_argument("--llama-cpp-src", default=None, help="a llama.cpp source tree: convert the target with its "
                    "convert_hf_to_gguf.py when the GGUF is not there yet")
    ap.add_argument("--methods", default="prompt_lookup,suffix", help="our speculative methods (bench_real's syntax)")
    ap.add_argument("--lookup-k", default="10,3", help="llama.cpp prompt lookup's num_pred_tokens values")
    ap.add_argument("--rows", default="200:216", help="XSum rows a:b")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--xsum", default=str(XSUM))
    ap.add_argument("--output", default=None, help="write report.json / report.md here (e.g. reports/bench_llamacpp)")
    return ap.parse_args(argv)


class Setup(NamedTuple):
    """What every run shares: the config, the loaded models (the target prepared once), the CPU
    options, the prompts' token ids, the EOS ids, the GGUF and the XSum rows ``a:b``."""

    cfg: object
    models: object
    options: object
    prompts: list
    eos: set
    gguf: Path
    rows: tuple


def load(args) -> Setup | None:
    """The config, the GGUF (converted when missing and ``--llama-cpp-src`` is given), the models
    and the prompts; prints the run's line.  None, after saying why on stderr, when there is no GGUF."""
    import torch

    from pipeline.config import load_config
    from pipeline.engine.cpu import prepare
    from pipeline.loading import load_job_models

    torch.set_num_threads(1)
    a, b = (int(x) for x in args.rows.split(":"))
    cfg = load_config(args.config, ["method.name=plain", "models.dtype=float32"])
    hf_dir = Path(cfg.models.target)
    gguf = Path(args.gguf) if args.gguf else f32_gguf(hf_dir)
    if not gguf.exists():
        if not args.llama_cpp_src:
            print(f"bench_llamacpp: {gguf} is not there; --llama-cpp-src names llama.cpp's source to convert it",
                  file=sys.stderr)
            return None
        convert(Path(args.llama_cpp_src), hf_dir, gguf)
    models = load_job_models(cfg, "cpu")
    options = cfg.cpu.cpu_options()
    prepare(models.target, options, "target")  # once, outside every timed run (engines keep this plan)
    prompts = prompts_of(cfg, models.tokenizer, range(a, b), Path(args.xsum))
    eos = models.target.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    print(f"{len(prompts)} XSum articles ({a}-{b - 1}), prompt tokens {min(map(len, prompts))}-{max(map(len, prompts))}, "
          f"{args.new_tokens} new tokens, greedy, float32, one thread, one row at a time", flush=True)
    return Setup(cfg, models, options, prompts, eos, gguf, (a, b))


def measure(args, setup: Setup, Llama, LlamaPromptLookupDecoding) -> dict[str, dict]:
    """Every run, printed as it ends: ours plain (lean pass, then transformers' forward),
    llama.cpp plain, llama.cpp prompt lookup per ``--lookup-k``, ours per ``--methods``;
    ``Llama`` and ``LlamaPromptLookupDecoding`` are llama-cpp-python's classes."""
    from pipeline.config import load_config
    from pipeline.engine.cpu import prepare

    cfg, models, options, prompts, eos, gguf = (setup.cfg, setup.models, setup.options, setup.prompts, setup.eos,
                                                setup.gguf)
    n_ctx = 4096  # the longest prompt + 64 new tokens + a draft, with room: Llama keeps a logits row per position

    runs: dict[str, dict] = {}

    def show(label, r):
        runs[label] = r
        print(f"  {label:34s} {r['tokens_per_s_cpu']:6.1f} tokens/s CPU, decode {r['decode_tokens_per_s_cpu']:6.1f}",
              flush=True)

    def ours(label, method_cfg):
        show(label, run_one(method_cfg, models, prompts, 1, args.new_tokens, True))

    ours("ours plain", cfg)
    prepare(models.target, dataclasses.replace(options, lean_pass=False), "target")  # what the lean pass buys
    try:
        ours(MODEL_FORWARD, cfg)
    finally:
        prepare(models.target, options, "target")
    llm = Llama(str(gguf), n_ctx=n_ctx, n_batch=512, n_threads=1, n_threads_batch=1, verbose=False)
    llm.generate(prompts[0][:32], temp=0.0, top_k=1).__next__()  # warm-up
    show("llama.cpp plain", llama_cpp_run(llm, prompts, args.new_tokens, eos))
    del llm
    for k in (int(x) for x in args.lookup_k.split(",")):
        # logits_all=True: with a draft model Llama keeps every position's logits, but sizes that
        # array by logits_all as passed (n_batch rows otherwise: prompts over 512 tokens fail)
        llm = Llama(str(gguf), n_ctx=n_ctx, n_batch=512, n_threads=1, n_threads_batch=1, verbose=False,
                    logits_all=True, draft_model=LlamaPromptLookupDecoding(max_ngram_size=2, num_pred_tokens=k))
        show(f"llama.cpp prompt lookup k={k}", llama_cpp_run(llm, prompts, args.new_tokens, eos))
        del llm
    for label in [m.strip() for m in args.methods.split(",") if m.strip()]:
        method, *variant = label.split("@")
        ours(f"ours {label}", load_config(args.config, [f"method.name={method}", "models.dtype=float32"] + variant))
    return runs


def report(runs: dict[str, dict], parts: dict[str, float], step_s: float, setup: Setup) -> tuple[str, str, list[str]]:
    """The runs' table, the step's breakdown (with the weights' bandwidth) and the ratios' lines."""
    import torch

    prompts = setup.prompts
    plain_step_s = runs["ours plain"]["decode_cpu_s"] / runs["ours plain"]["step_calls"]
    ref = runs["llama.cpp plain"]
    same = sum(x == y for x, y in zip(runs["ours plain"]["token_ids"], ref["token_ids"]))
    lines = ["| run | tokens/s CPU | decode tokens/s CPU | tokens/s wall | decode tokens/s wall | greedy ids = llama.cpp plain |",
             "|---|---:|---:|---:|---:|---:|"]
    for label, r in runs.items():
        n_same = sum(x == y for x, y in zip(r["token_ids"], ref["token_ids"]))
        lines.append(f"| {label} | {r['tokens_per_s_cpu']:.1f} | {r['decode_tokens_per_s_cpu']:.1f} | "
                     f"{r['tokens_per_s_wall']:.1f} | {r['decode_tokens_per_s_wall']:.1f} | {n_same}/{len(prompts)} |")
    table = "\n".join(lines)
    total = sum(parts.values())
    blines = ["| part of our plain decode step (one row) | ms per step | share |", "|---|---:|---:|"]
    blines += [f"| {k} | {1e3 * v:.2f} | {v / total:.0%} |" for k, v in parts.items()]
    blines.append(f"| the step, with the timers (without: {1e3 * plain_step_s:.2f}) | {1e3 * step_s:.2f} | 100% |")
    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in setup.models.target.modules()
                       if isinstance(m, torch.nn.Linear))
    llama_step_s = 1 / ref["decode_tokens_per_s_cpu"]
    blines.append(f"| the weights a step reads ({weight_bytes / 1e6:.0f} MB of linear layers): ours "
                  f"{weight_bytes / plain_step_s / 1e9:.1f} GB/s, llama.cpp's {weight_bytes / llama_step_s / 1e9:.1f} GB/s | "
                  f"{1e3 * llama_step_s:.2f} (llama.cpp's step) | |")
    breakdown = "\n".join(blines)
    lookups = [label for label in runs if label.startswith("llama.cpp prompt lookup")]
    best_ours = max((label for label in runs if label.startswith("ours ") and label not in ("ours plain", MODEL_FORWARD)),
                    key=lambda label: runs[label]["tokens_per_s_cpu"], default=None)
    best_lookup = max(lookups, key=lambda label: runs[label]["tokens_per_s_cpu"])
    o = runs["ours plain"]
    tail = [(f"our plain decode / llama.cpp's: {o['decode_tokens_per_s_cpu'] / ref['decode_tokens_per_s_cpu']:.2f}× "
             "(goal ≥ 0.9×)"),
            f"our plain end to end / llama.cpp's: {o['tokens_per_s_cpu'] / ref['tokens_per_s_cpu']:.2f}× (goal ≥ 1.0×)",
            (f"lean pass / transformers' forward (our plain decode): "
             f"{o['decode_tokens_per_s_cpu'] / runs[MODEL_FORWARD]['decode_tokens_per_s_cpu']:.2f}×"),
            ("prompt tokens/s (ours: the time outside the decode steps; llama.cpp: up to its first token): "
             f"{sum(map(len, prompts)) / (o['cpu_s'] - o['decode_cpu_s']):.0f} against {ref['prompt_tokens_per_s_cpu']:.0f}"),
            f"greedy ids identical to llama.cpp's (our plain): {same}/{len(prompts)}"]
    if best_ours:
        tail.insert(2, f"our best speculative ({best_ours[5:]}) / llama.cpp's best prompt lookup ({best_lookup[10:]}), "
                       f"end to end: {runs[best_ours]['tokens_per_s_cpu'] / runs[best_lookup]['tokens_per_s_cpu']:.2f}× "
                       "(goal > 1)")
    return table, breakdown, tail


def write(out: Path, argv, args, setup: Setup, runs: dict[str, dict], parts: dict[str, float],
          table: str, breakdown: str, tail: list[str]) -> None:
    """``report.json`` (the runs without their token ids, the breakdown, the ratios) and ``report.md`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": "python bench/bench_llamacpp.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "rows": list(setup.rows), "new_tokens": args.new_tokens, "gguf": setup.gguf.name, "commit": _commit(),
            "machine": _machine(), "load_average": os.getloadavg()}
    slim = {k: {k2: v for k2, v in r.items() if k2 != "token_ids"} for k, r in runs.items()}
    (out / "report.json").write_text(json.dumps({"title": TITLE, "meta": meta, "runs": slim, "breakdown_s_per_step": parts,
                                                 "summary": tail}, indent=1))
    (out / "report.md").write_text(f"# bench_llamacpp\n\n`{meta['command']}` at {meta['commit']} on "
                                   f"{meta['machine']}, llama-cpp-python 0.3.36, {setup.gguf.name}, load average "
                                   f"{', '.join(f'{x:.1f}' for x in meta['load_average'])} at the end\n\n{table}\n\n"
                                   f"{breakdown}\n\n" + "\n".join(f"- {t}" for t in tail) + "\n")


def main(argv=None) -> int:
    """Parse the flags, load, run every side, print the tables and ratios, and write them with ``--output``."""
    args = parse_args(argv)
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        print("bench_llamacpp: llama-cpp-python is not installed (pip install llama-cpp-python==0.3.36)", file=sys.stderr)
        return 2
    setup = load(args)
    if setup is None:
        return 2
    runs = measure(args, setup, Llama, LlamaPromptLookupDecoding)
    parts, step_s = ours_with_breakdown(setup.models, setup.prompts, args.new_tokens)
    table, breakdown, tail = report(runs, parts, step_s, setup)
    print(table + "\n\n" + breakdown + "\n\n" + "\n".join(tail))
    if args.output:
        write(Path(args.output), argv, args, setup, runs, parts, table, breakdown, tail)
    return 0

if __name__ == "__main__":
    sys.exit(main())
