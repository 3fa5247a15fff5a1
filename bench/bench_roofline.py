"""The roofline of a target pass: each part's bytes and FLOPs, the time it takes in the loop, and
the time it would take at the machine's limits.

What it prints (one thread, the process CPU clock, every figure the best of ``--repeats`` timings
taken interleaved across the shapes after a warm-up of each, so that a shared machine's noise
lands on every shape alike):

- **the machine's limits**: the fp32 GEMM rate (a 1024^3 ``torch.mm``, GFLOP/s) and the read
  bandwidth (``torch.sum`` over a 256 MiB float32 tensor, GB/s);
- **decode passes** of ``n`` = ``--widths`` tokens at ``B`` = ``--rows`` rows over a
  ``--context``-token KV cache, each as the loop runs it (``engine.target_pass`` with the
  pass's ``n`` positions' logits kept, then their argmax read back, as greedy acceptance reads
  it): per part, the bytes it must read and the FLOPs it must do, the CPU time measured and the
  time at the limit ``max(bytes / bandwidth, FLOPs / GEMM rate)``.  The parts:

  - ``linear``: every decoder layer outside attention (QKV, RoPE, o_proj, the MLP, their norms
    and residuals): the weights of the decoder layers' linear layers, once per pass;
  - ``attention``: attention over the KV cache (the cache's write included): every row's keys
    and values, once per pass;
  - ``lm_head``: the output layer over the kept positions: its weight, once per pass;
  - ``logits and sampling``: reading the ``B x n x V`` logits back (argmax);
  - ``rest``: the pass less its parts (embedding, final norm, RoPE tables, the runner's mask
    and positions, Python), whose bytes and FLOPs are negligible: its limit is 0.

  The parts are timed by wrapping the lean pass's part functions
  (:mod:`pipeline.engine.cpu.lean`); a target the lean pass does not serve gets the pass's
  total only.  The pass's limit is the sum of its parts' limits.  Each pass's cost is also
  given over the one-token pass at the same rows (the issue-54 goal: <= 1.15x for ``n <= 8``
  at one row) and over its limit (<= 1.3x for the one-row step);
- **the prefill** of ``--context`` tokens at one row, with the same parts (attention then reads
  the causal half of the ``context^2`` scores: its FLOPs are counted, its bytes are the keys
  and values written and read once).

**The peer** (``--peer PATH``, a ``llama-batched-bench`` binary: llama.cpp's own batched bench,
built from its source as a benchmark peer, not a dependency): after our measurements, in the same
run, it runs on the target as an F32 GGUF (``--peer-gguf``, by default ``out/gguf/<target>-f32.gguf``,
which ``bench/bench_llamacpp.py --llama-cpp-src`` converts) with one thread, a prompt of
``--context`` random tokens (shared: its cache copied to every sequence, as ours are) and
``--peer-new-tokens`` generated
tokens, at ``--rows`` sequences.  Its table gives prompt and generation tokens/s, which are printed
beside ours: our prompt tokens/s is the prefill's (``context`` / its time, one row), our generation
tokens/s at ``B`` rows is ``B`` over our one-token pass at ``B`` rows (the table's ``n = 1``); with
their ratio, each side's step time against the step's limit, and the weights' bytes over each
side's step time (the read bandwidth each achieves).  The peer's times are its own wall clock
(``ggml_time_us``); the process's CPU time over its wall time is printed beside them.  Its
generation reads a KV cache growing from ``context`` to ``context + new tokens`` positions, in
float16 (llama.cpp's default): the limit printed is ours (float32, ``context`` positions).

The KV cache: one row's prompt (``--context`` random token ids, fixed seed: a pass's cost does
not depend on the ids) is prefilled in slot 0 and copied to the other rows' slots; ``B`` rows sit in slots
``0 .. B-1``, as a full batch of the loop does (its scheduler steps rows in slot order, and
they read their caches in place).  Not a test, not run in CI (``tests/bench`` runs it on
the tiny demo model)::

    python bench/bench_roofline.py --output reports/bench_roofline     # SmolLM2-135M, float32
    python bench/bench_roofline.py --peer PATH/llama-batched-bench --output reports/bench_roofline
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TITLE = "bench/bench_roofline.py: a target pass's parts against the machine's GEMM rate and read bandwidth"
#: the parts of a pass, in the order they are printed
PARTS = ("linear", "attention", "lm_head", "logits and sampling", "rest")
#: the lean pass's part functions, and the part each one's time goes to
LEAN_PARTS = {"attention_in_of": "linear", "attention_out_of": "linear", "mlp_of": "linear", "attend": "attention",
              "output_layer": "lm_head"}
#: llama-batched-bench's table, column by column (PP, TG, B, N_KV, T_PP s, S_PP t/s, T_TG s, S_TG t/s, T s, S t/s)
PEER_COLUMNS = ("prompt_tokens", "new_tokens", "rows", "kv_positions", "prompt_s", "prompt_tokens_per_s",
                "generation_s", "generation_tokens_per_s", "total_s", "tokens_per_s")


def best_of(run, repeats: int) -> float:
    """CPU seconds of ``run()``: the best of ``repeats`` calls after one warm-up (the engine's
    :func:`pipeline.engine.cpu.measure.best_of` on the CPU clock)."""
    from pipeline.engine.cpu.measure import best_of as measured

    return measured(run, repeats, clock=time.process_time)


def machine_limits(repeats: int = 5, gemm_size: int = 1024, read_mib: int = 256) -> dict:
    """The fp32 GEMM rate (GFLOP/s: ``gemm_size``^3 ``torch.mm``) and the read bandwidth (GB/s:
    ``torch.sum`` over ``read_mib`` MiB, larger than any cache), one thread, best of ``repeats``."""
    import torch

    a = torch.randn(gemm_size, gemm_size)
    gemm_s = best_of(lambda: torch.mm(a, a), repeats)
    x = torch.randn(read_mib << 18)
    read_s = best_of(lambda: x.sum(), repeats)
    return {"gemm_gflops": 2 * gemm_size ** 3 / gemm_s / 1e9, "read_gbs": x.numel() * 4 / read_s / 1e9}


def model_facts(model) -> dict:
    """The sizes a pass's bytes and FLOPs follow from: layers, heads, head size, vocabulary,
    bytes per element, the decoder layers' linear parameters and the output layer's."""
    import torch

    config = model.config
    body = model.model
    attn = body.layers[0].self_attn
    linear_params = sum(m.weight.numel() for layer in body.layers for m in layer.modules()
                        if isinstance(m, torch.nn.Linear))
    w = model.lm_head.weight
    return {"layers": len(body.layers), "hidden": config.hidden_size, "q_heads": config.num_attention_heads,
            "kv_heads": config.num_key_value_heads, "head_dim": attn.head_dim, "vocab": w.shape[0],
            "bytes_per_element": w.element_size(), "linear_params": linear_params, "lm_head_params": w.numel()}


def part_costs(facts: dict, rows: int, tokens: int, context: int, prefill: bool = False) -> dict[str, tuple[float, float]]:
    """``part -> (bytes, FLOPs)`` of a pass of ``tokens`` tokens in each of ``rows`` rows over a
    ``context``-position KV cache (for a prefill: ``tokens == context``, the causal half of the
    scores; the logits of the last position only).  Bytes are what must come from memory at
    least once: the weights, the keys and values, the logits."""
    f = facts
    e, n = f["bytes_per_element"], rows * tokens
    kv_bytes = rows * f["layers"] * 2 * f["kv_heads"] * f["head_dim"] * context * e
    pairs = rows * tokens * (tokens + 1) / 2 if prefill else rows * tokens * context  # (query, key) pairs scored
    kept = rows if prefill else n  # positions whose logits are computed
    return {
        "linear": (f["linear_params"] * e, 2.0 * f["linear_params"] * n),
        "attention": (kv_bytes, 4.0 * f["layers"] * f["q_heads"] * f["head_dim"] * pairs),
        "lm_head": (f["lm_head_params"] * e, 2.0 * f["lm_head_params"] * kept),
        "logits and sampling": (kept * f["vocab"] * e, float(kept * f["vocab"])),
        "rest": (0.0, 0.0),
    }


def limit_s(cost: tuple[float, float], limits: dict) -> float:
    """Seconds at the machine's limits: ``max(bytes / bandwidth, FLOPs / GEMM rate)``."""
    nbytes, flops = cost
    return max(nbytes / (limits["read_gbs"] * 1e9), flops / (limits["gemm_gflops"] * 1e9))


class PartTimer:
    """CPU seconds of the lean pass's part functions, wrapped until :meth:`close`."""

    def __init__(self, engine):
        from pipeline.engine.cpu import lean

        self.t: dict[str, float] = defaultdict(float)
        self._undo = []
        self.on = engine.cpu_plans["target"].lean is not None
        if not self.on:
            return
        for name, part in LEAN_PARTS.items():
            fn = getattr(lean, name)

            def timed(*a, _fn=fn, _part=part, **kw):
                c = time.process_time()
                try:
                    return _fn(*a, **kw)
                finally:
                    self.t[_part] += time.process_time() - c

            setattr(lean, name, timed)
            self._undo.append(lambda n=name, f=fn: setattr(lean, n, f))

    def close(self) -> None:
        for undo in reversed(self._undo):
            undo()


def timed_pass(engine, timer: PartTimer, slots: list[int], tokens: list, starts: list[int], keep: int) -> dict:
    """One target pass as the loop runs it, CPU seconds by part (``total``: the pass and its argmax)."""
    timer.t.clear()
    c = time.process_time()
    logits = engine.target_pass(slots, tokens, starts, keep)
    c1 = time.process_time()
    logits.argmax(-1).tolist()
    c2 = time.process_time()
    out = {p: timer.t.get(p, 0.0) for p in PARTS[:3]}
    out["logits and sampling"] = c2 - c1
    out["rest"] = max(0.0, (c1 - c) - sum(out[p] for p in PARTS[:3])) if timer.on else c1 - c
    out["total"] = c2 - c
    return out


def parse_peer(text: str) -> dict:
    """llama-batched-bench's output (markdown, its default) as data.

    Returns ``{"runs": [...], "settings": {...}, "build": str | None}``: ``runs``, one dict per
    line of its table, keyed by :data:`PEER_COLUMNS` (ints for the counts, floats for seconds and
    tokens/s, which are its wall clock); ``settings``, its ``key = value`` line (``n_kv_max``,
    ``n_batch``, ``flash_attn``, ``n_threads``, ...; ints where they parse); ``build``, its
    ``build: ...`` line.  Raises ``ValueError`` when the text holds no table line."""
    runs, settings, build = [], {}, None
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.lstrip().startswith("|") and len(cells) == len(PEER_COLUMNS) and cells[0].isdigit():
            runs.append({k: (int(v) if i < 4 else float(v)) for i, (k, v) in enumerate(zip(PEER_COLUMNS, cells))})
        elif "n_kv_max =" in line:
            for key, value in re.findall(r"(\w+) = ([^,\s]+)", line):
                settings[key] = int(value) if value.lstrip("-").isdigit() else value
        elif build is None and line.startswith("build:"):
            build = line[len("build:"):].strip()
    if not runs:
        raise ValueError("no table in llama-batched-bench's output: " + text[-2000:])
    return {"runs": runs, "settings": settings, "build": build}


def peer_command(binary: str, gguf: str, context: int, new_tokens: int, rows: list[int]) -> list[str]:
    """llama-batched-bench's command line: one thread, ``rows`` sequences sharing one ``context``-token
    prompt (``-pps``: its cache copied to every sequence, as our rows' caches are copies of one row's)
    and ``new_tokens`` generated in each; a context that holds them all."""
    return [binary, "-m", gguf, "-t", "1", "-tb", "1", "-c", str(max(rows) * (context + new_tokens)), "-b", "2048",
            "-ub", "512", "-npp", str(context), "-ntg", str(new_tokens), "-npl", ",".join(map(str, rows)), "-pps"]


def run_peer(command: list[str]) -> dict:
    """Run the peer; :func:`parse_peer`'s data plus ``command``, ``wall_s`` and ``cpu_s`` (the
    process's user + system seconds).  Raises ``RuntimeError`` when it fails."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"{command[0]} exited {done.returncode}: {done.stdout[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {**parse_peer(done.stdout), "command": command, "wall_s": wall, "cpu_s": cpu}


def peer_report(data: dict, peer: dict) -> tuple[str, list[dict]]:
    """The peer beside us (markdown table, and its figures), row count by row count of ``data["rows"]``:
    prompt and generation tokens/s, their ratio (ours / the peer's), each side's step time, the
    step's limit, and the weights' bytes over each step time (GB/s)."""
    facts, limits, context = data["facts"], data["limits"], data["context"]
    weights = (facts["linear_params"] + facts["lm_head_params"]) * facts["bytes_per_element"]
    ours_prompt = context / data["prefill"]["total"]
    lines = ["| rows | prompt tok/s: peer (wall) | ours (CPU) | ours / peer | generation tok/s: peer (wall) "
             "| ours (CPU) | ours / peer | step ms: peer | ours | limit | weights read, GB/s: peer | ours |",
             "|---:" * 12 + "|"]
    figures = []
    by_rows = {r["rows"]: r for r in peer["runs"]}
    for b in data["rows"]:
        p = by_rows.get(b)
        if p is None:
            continue
        step = data["passes"][(b, 1)]["total"]
        lim = sum(limit_s(c, limits) for c in part_costs(facts, b, 1, context).values())
        peer_step = p["generation_s"] / p["new_tokens"]
        fig = {"rows": b, "peer_prompt_tokens_per_s": p["prompt_tokens_per_s"],
               "ours_prompt_tokens_per_s": ours_prompt if b == 1 else None,
               "peer_generation_tokens_per_s": p["generation_tokens_per_s"], "ours_generation_tokens_per_s": b / step,
               "peer_step_ms": 1e3 * peer_step, "ours_step_ms": 1e3 * step, "limit_ms": 1e3 * lim,
               "peer_weights_gbs": weights / peer_step / 1e9, "ours_weights_gbs": weights / step / 1e9}
        fig["prompt_ours_over_peer"] = ours_prompt / p["prompt_tokens_per_s"] if b == 1 else None
        fig["generation_ours_over_peer"] = fig["ours_generation_tokens_per_s"] / p["generation_tokens_per_s"]
        figures.append(fig)
        prompt = (f"{ours_prompt:.1f} | {fig['prompt_ours_over_peer']:.2f}x" if b == 1 else "| ")
        lines.append(f"| {b} | {p['prompt_tokens_per_s']:.1f} | {prompt} | {p['generation_tokens_per_s']:.2f} | "
                     f"{b / step:.2f} | {fig['generation_ours_over_peer']:.2f}x | {1e3 * peer_step:.1f} | "
                     f"{1e3 * step:.1f} | {1e3 * lim:.1f} | {fig['peer_weights_gbs']:.1f} | "
                     f"{fig['ours_weights_gbs']:.1f} |")
    return "\n".join(lines), figures


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "summarize.yaml"), help="the job config (its target)")
    ap.add_argument("--set", action="append", default=[], help="config overrides key=value (repeatable)")
    ap.add_argument("--context", type=int, default=900, help="tokens in each row's KV cache")
    ap.add_argument("--widths", default="1,2,3,4,6,8", help="tokens per row of a pass, n")
    ap.add_argument("--rows", default="1,4,16", help="rows of a pass, B")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved timings per figure (the best counts)")
    ap.add_argument("--output", default=None, help="write report.json and report.md here")
    ap.add_argument("--peer", default=None, help="a llama-batched-bench binary: run it beside us (see the docstring)")
    ap.add_argument("--peer-gguf", default=None, help="the peer's model, an F32 GGUF of the target "
                    "(default: out/gguf/<target>-f32.gguf)")
    ap.add_argument("--peer-new-tokens", type=int, default=32, help="tokens the peer generates per sequence")
    ap.add_argument("--peer-version", default=None, help="the peer's version, for the report "
                    "(default: its own 'build:' line)")
    return ap.parse_args(argv)


def peer_setup(args) -> tuple[list[str] | None, str | None]:
    """``(the peer's command line, None)``, ``(None, None)`` without ``--peer``, or ``(None, why)``
    when its inputs are wrong (checked before any work: the binary, the GGUF, a float32 target,
    ``n = 1`` among the widths, the tokens to generate)."""
    if not args.peer:
        return None, None
    from bench_llamacpp import f32_gguf

    from pipeline.config import load_config

    peer = Path(args.peer)
    if not (peer.is_file() and os.access(peer, os.X_OK)):
        return None, f"--peer: {peer} is not an executable file"
    cfg = load_config(args.config, ["method.name=plain", *args.set])
    gguf = Path(args.peer_gguf) if args.peer_gguf else f32_gguf(Path(cfg.models.target))
    if not gguf.is_file():
        return None, (f"--peer-gguf: {gguf} is not there (bench/bench_llamacpp.py --llama-cpp-src converts the "
                      "target to it)")
    if cfg.models.dtype not in ("auto", "float32"):
        return None, f"models.dtype: {cfg.models.dtype}; the peer runs an F32 GGUF, so the target must be float32"
    if 1 not in [int(x) for x in args.widths.split(",")]:
        return None, "--widths: the peer's generation is compared with our one-token pass, so n = 1 must be in it"
    if args.peer_new_tokens < 1:
        return None, f"--peer-new-tokens: {args.peer_new_tokens}, must be >= 1"
    rows = [int(x) for x in args.rows.split(",")]
    return peer_command(str(peer), str(gguf), args.context, args.peer_new_tokens, rows), None


def _row(label: str, costs: dict, times: dict, limits: dict) -> tuple[str, float, float]:
    cells, lim_total = [], 0.0
    for p in PARTS:
        nbytes, flops = costs[p]
        lim = limit_s(costs[p], limits)
        lim_total += lim
        cells.append(f"{nbytes / 1e6:.1f} MB, {flops / 1e9:.3f} GF: {1e3 * times[p]:.2f} / {1e3 * lim:.2f}")
    return f"| {label} | " + " | ".join(cells), times["total"], lim_total


def measure(args) -> dict:
    """Load the target, measure the machine, time every pass and the prefill; the report's data."""
    import torch

    from pipeline.config import load_config
    from pipeline.loading import build_engine, load_job_models

    torch.set_num_threads(1)
    widths = [int(x) for x in args.widths.split(",")]
    rows = [int(x) for x in args.rows.split(",")]
    cfg = load_config(args.config, ["method.name=plain", *args.set])
    models = load_job_models(cfg, "cpu")
    target = models.target
    facts = model_facts(target)
    limits = machine_limits()
    capacity = max(rows)
    t0 = time.perf_counter()
    engine = build_engine(models, None, capacity, "fixed", time.process_time, cfg.cpu.cpu_options())
    load_s = time.perf_counter() - t0
    runner = engine.bind(capacity)
    context = args.context
    g = torch.Generator().manual_seed(0)
    vocab = facts["vocab"]
    prompt = torch.randint(min(100, vocab // 2), vocab, (context,), generator=g)
    slots = list(range(capacity))  # a full batch: the scheduler steps rows in slot order, caches read in place
    timer = PartTimer(engine)
    try:
        with torch.inference_mode():
            runner.cache.reserve(context + max(widths) + 1)
            pre = []
            for _ in range(max(1, min(args.repeats, 3))):  # the prefill, slot 0 (its last pass leaves the cache)
                pre.append(timed_pass(engine, timer, [0], [prompt], [0], 1))
            prefill = {p: min(x[p] for x in pre) for p in pre[0]}
            for layer in runner.cache.layers:  # every other slot holds the same row
                for s in slots[1:]:
                    layer.keys[s].copy_(layer.keys[0])
                    layer.values[s].copy_(layer.values[0])
            shapes = [(b, n) for b in rows for n in widths]
            samples: dict[tuple, list] = {s: [] for s in shapes}
            for rep in range(args.repeats + 1):
                for b, n in shapes:
                    toks = [prompt[-n:].clone() for _ in range(b)]
                    t = timed_pass(engine, timer, slots[:b], toks, [context] * b, n)
                    if rep:  # the first round warms every shape up
                        samples[(b, n)].append(t)
    finally:
        timer.close()
    passes = {}
    for (b, n), ts in samples.items():
        best = min(ts, key=lambda x: x["total"])
        passes[(b, n)] = best
    return {"facts": facts, "limits": limits, "load_s": load_s, "context": context, "widths": widths, "rows": rows,
            "prefill": prefill, "passes": passes, "plan": engine.cpu_plans["target"].summary(),
            "lean": timer.on, "target": str(cfg.models.target)}


def report(data: dict) -> tuple[str, dict]:
    """The tables (markdown) and the figures (plain data) of :func:`measure`'s data."""
    facts, limits, context = data["facts"], data["limits"], data["context"]
    head = ("| pass | " + " | ".join(f"{p}: bytes, FLOPs: ms measured / at limit" for p in PARTS)
            + " | pass ms | limit ms | pass / limit | pass / 1-token pass |")
    sep = "|---" * (len(PARTS) + 5) + "|"
    lines = [head, sep]
    figures = {"passes": [], "prefill": None}
    one = {b: data["passes"][(b, data["widths"][0])]["total"] for b in data["rows"]}
    for b in data["rows"]:
        for n in data["widths"]:
            t = data["passes"][(b, n)]
            row, total, lim = _row(f"B={b}, n={n}", part_costs(facts, b, n, context), t, limits)
            ratio_one = total / one[b]
            lines.append(f"{row} | {1e3 * total:.2f} | {1e3 * lim:.2f} | {total / lim:.2f}x | {ratio_one:.2f}x |")
            figures["passes"].append({"rows": b, "tokens": n, "ms": {p: 1e3 * t[p] for p in (*PARTS, "total")},
                                      "limit_ms": 1e3 * lim, "over_limit": total / lim,
                                      "over_one_token_pass": ratio_one, "per_row_ms": 1e3 * total / b,
                                      "per_row_limit_ms": 1e3 * lim / b})
    pre = data["prefill"]
    row, total, lim = _row(f"prefill, {context} tokens, B=1", part_costs(facts, 1, context, context, prefill=True),
                           pre, limits)
    lines.append(f"{row} | {1e3 * total:.2f} | {1e3 * lim:.2f} | {total / lim:.2f}x | |")
    figures["prefill"] = {"tokens": context, "ms": {p: 1e3 * pre[p] for p in (*PARTS, "total")}, "limit_ms": 1e3 * lim,
                          "over_limit": total / lim, "tokens_per_s": context / total}
    return "\n".join(lines), figures


def main(argv=None) -> int:
    args = parse_args(argv)
    peer_cmd, why = peer_setup(args)
    if why:
        print(f"bench_roofline: {why}", file=sys.stderr)
        return 2
    data = measure(args)
    table, figures = report(data)
    lim = data["limits"]
    load = os.getloadavg()
    intro = (f"{data['target']}: {data['facts']['layers']} layers, {data['facts']['linear_params'] / 1e6:.1f} M linear "
             f"+ {data['facts']['lm_head_params'] / 1e6:.1f} M output-layer parameters, "
             f"{8 * data['facts']['bytes_per_element']}-bit; KV cache {data['context']} tokens a row; one thread, "
             f"CPU clock, best of {args.repeats} interleaved\n"
             f"machine: fp32 GEMM {lim['gemm_gflops']:.1f} GFLOP/s, read {lim['read_gbs']:.1f} GB/s; "
             f"load average {', '.join(f'{x:.1f}' for x in load)} (at the end)\n"
             f"plan: {data['plan']} (engine built in {data['load_s']:.1f} s)")
    worst = max((p for p in figures["passes"] if p["rows"] == 1), key=lambda p: p["over_one_token_pass"], default=None)
    step1 = next((p for p in figures["passes"] if p["rows"] == 1 and p["tokens"] == 1), None)
    tail = []
    if worst is not None:
        tail.append(f"worst one-row pass / one-token pass: n={worst['tokens']} {worst['over_one_token_pass']:.2f}x "
                    "(goal <= 1.15x)")
    if step1 is not None:
        tail.append(f"one-row one-token step / its limit: {step1['over_limit']:.2f}x (goal <= 1.3x)")
    for p in figures["passes"]:
        if p["tokens"] == 1 and p["rows"] > 1:
            tail.append(f"{p['rows']} rows, one token: {p['per_row_ms']:.2f} ms a row, {p['over_limit']:.2f}x its limit")
    peer_md, peer = "", None
    if peer_cmd:
        peer = run_peer(peer_cmd)
        peer_table, figures["peer"] = peer_report(data, peer)
        version = args.peer_version or peer["build"] or "version unknown"
        s = peer["settings"]
        peer_md = (f"The peer: llama.cpp's llama-batched-bench ({version}), {Path(peer_cmd[2]).name}, "
                   f"{s.get('n_threads', '?')} thread(s), flash_attn {s.get('flash_attn', '?')}, prompts of "
                   f"{args.context} tokens, {args.peer_new_tokens} generated; its times are its own wall clock "
                   f"(the process: {peer['cpu_s']:.1f} s CPU over {peer['wall_s']:.1f} s wall), ours the CPU clock; "
                   "our prompt tokens/s is the one-row prefill's, our generation tokens/s rows / our one-token "
                   "pass\n\n"
                   + peer_table)
        share = peer["cpu_s"] / peer["wall_s"]  # below 1: the peer waited for a core (a loaded machine)
        for f in figures["peer"]:
            tail.append(f"{f['rows']} rows, generation, ours / llama.cpp's: {f['generation_ours_over_peer']:.2f}x "
                        f"(step {f['ours_step_ms']:.1f} against {f['peer_step_ms']:.1f} ms, "
                        f"limit {f['limit_ms']:.1f} ms; "
                        f"{f['generation_ours_over_peer'] * share:.2f}x if the peer's wall time had all been its CPU "
                        f"time, {share:.2f} of it)")
            if f["prompt_ours_over_peer"] is not None:
                tail.append(f"prompt ({args.context} tokens, one row), ours / llama.cpp's: "
                            f"{f['prompt_ours_over_peer']:.2f}x "
                            f"({f['prompt_ours_over_peer'] * share:.2f}x scaled alike)")
    print(intro + "\n\n" + table + ("\n\n" + peer_md if peer_md else "") + "\n\n"
          + "\n".join(f"- {t}" for t in tail))
    if args.output:
        from bench_real import _commit, _machine

        out = Path(args.output)
        out.mkdir(parents=True, exist_ok=True)
        meta = {"command": "python bench/bench_roofline.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                "commit": _commit(), "machine": _machine(), "load_average": load}
        if peer is not None:
            meta["peer"] = {"command": " ".join(peer["command"]), "version": args.peer_version or peer["build"],
                            "settings": peer["settings"], "runs": peer["runs"], "cpu_s": peer["cpu_s"],
                            "wall_s": peer["wall_s"]}
        (out / "report.json").write_text(json.dumps({"title": TITLE, "meta": meta, "facts": data["facts"],
                                                     "limits": lim, "plan": data["plan"], **figures,
                                                     "summary": tail}, indent=1))
        (out / "report.md").write_text(f"# bench_roofline\n\n`{meta['command']}` at {meta['commit']} on "
                                       f"{meta['machine']}\n\n{intro}\n\n{table}\n\n"
                                       + (peer_md + "\n\n" if peer_md else "")
                                       + "\n".join(f"- {t}" for t in tail) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
