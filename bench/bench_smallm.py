"""The small-M kernels (``pipeline/engine/cpu/smallm.py``) against the kernels they compete with, in one
process, one thread, the CPU clock, every figure the best of ``--repeats`` timings interleaved across the
ways (a warm-up call of each first):

- **linear**: for each weight shape of SmolLM2's lean pass (30 layers of random float32 weights, so that
  they come from memory as in a pass), ms at 1-8 rows of input: ``smallm`` (the AVX-512 path where the CPU
  has it, and the AVX2 path), oneDNN on the packed weight, MKL's ``x @ W^T`` on a transposed copy,
  ``F.linear``;
- **attention**: one row's ``n``-token query (9 query heads over 3 KV heads of 64) over 30 layers'
  ``--context``-position slot buffers, read in place: the small-M kernel against SDPA as the lean pass
  runs it without it (grouped-query at one token, the query heads folded with the mask tiled after).

Not a test, not run in CI::

    python bench/bench_smallm.py            # the tables the roofline section of docs/benchmarks.md quotes
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: SmolLM2-135M's lean-pass weight shapes (out, in) and layers of each
SHAPES = {"gate/up": (3072, 576), "down": (576, 1536), "QKV": (960, 576), "o_proj": (576, 576)}
ROWS = (1, 2, 3, 4, 6, 8)


def interleaved(ways: dict, repeats: int) -> dict[str, float]:
    """CPU seconds of each way: the best of ``repeats`` rounds, each round calling every way once."""
    for run in ways.values():
        run()
    best = dict.fromkeys(ways, float("inf"))
    for _ in range(repeats):
        for name, run in ways.items():
            t = time.process_time()
            run()
            best[name] = min(best[name], time.process_time() - t)
    return best


def linear_table(lib, layers: int, repeats: int) -> list[str]:
    import torch
    import torch.nn.functional as F

    lines = ["| weight (x %d layers) | rows | smallm | smallm AVX2 path | oneDNN packed | x @ W^T copy | F.linear |"
             % layers, "|---|---|---|---|---|---|---|"]
    for label, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k) for _ in range(layers)]
        packed, onednn, wts = [lib.pack(w) for w in ws], [torch.ops.mkldnn._reorder_linear_weight(w, 4) for w in ws], \
            [w.t().contiguous() for w in ws]
        for rows in ROWS:
            x = torch.randn(rows, k)

            def small(wide):
                def run():
                    lib.wide = wide
                    for p in packed:
                        lib.linear(x, p, n)
                return run

            wide = lib.wide
            ways = {"smallm": small(wide), "avx2": small(False),
                    "onednn": lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in onednn],
                    "transposed": lambda: [torch.mm(x, wt) for wt in wts], "mkl": lambda: [F.linear(x, w) for w in ws]}
            t = interleaved(ways, repeats)
            lib.wide = wide
            mb = layers * n * k * 4 / 1e6
            cells = " | ".join(f"{1e3 * t[w]:.2f} ms ({mb / 1e3 / t[w]:.0f} GB/s)" for w in ways)
            lines.append(f"| {label} {n} x {k} ({mb:.0f} MB) | {rows} | {cells} |")
    return lines


def attention_table(lib, layers: int, context: int, repeats: int) -> list[str]:
    import torch
    import torch.nn.functional as F

    hq, hkv, d, slots = 9, 3, 64, 16
    cap = context + 128
    ks = [torch.randn(slots, hkv, cap, d) for _ in range(layers)]
    vs = [torch.randn(slots, hkv, cap, d) for _ in range(layers)]
    scale, g, low = d ** -0.5, hq // hkv, torch.finfo(torch.float32).min
    lines = [f"| query tokens | smallm kernel | SDPA (lean pass without it) | ({layers} layers, "
             f"{layers * 2 * hkv * context * d * 4 / 1e6:.1f} MB of keys and values) |", "|---|---|---|---|"]
    for n in (1, 2, 3, 4, 6, 8):
        q = torch.randn(1, hq, n, d)
        mask = torch.zeros(1, 1, n, cap)
        mask[..., context - n:context] = torch.triu(torch.full((n, n), low), 1)

        def kernel():
            for k, v in zip(ks, vs):
                lib.attention(q, k[:1, :, :context], v[:1, :, :context], mask, scale)

        def sdpa():
            for k, v in zip(ks, vs):
                if n == 1:
                    F.scaled_dot_product_attention(q, k[:1, :, :context], v[:1, :, :context],
                                                   attn_mask=mask[..., :context], scale=scale, enable_gqa=True)
                else:
                    F.scaled_dot_product_attention(q.reshape(1, hkv, g * n, d), k[:1, :, :context], v[:1, :, :context],
                                                   attn_mask=mask[..., :context].repeat(1, 1, g, 1), scale=scale)

        t = interleaved({"kernel": kernel, "sdpa": sdpa}, repeats)
        lines.append(f"| {n} | {1e3 * t['kernel']:.2f} ms | {1e3 * t['sdpa']:.2f} ms | {t['sdpa'] / t['kernel']:.2f}x |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=30, help="layers of each weight shape (SmolLM2: 30)")
    ap.add_argument("--context", type=int, default=900, help="positions in the KV cache")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved rounds (the best counts)")
    args = ap.parse_args(argv)
    import torch

    from pipeline.engine.cpu import CpuOptions, smallm

    torch.set_num_threads(1)
    lib = smallm.library_for(CpuOptions())
    if lib is None:
        print(f"no small-M kernels on this machine: {smallm.why_unavailable() or 'the build failed (see the log)'}")
        return 2
    print(f"small-M library {lib.path} ({'AVX-512' if lib.wide else 'AVX2'} path); one thread, CPU clock, "
          f"best of {args.repeats} interleaved\n")
    print("\n".join(linear_table(lib, args.layers, args.repeats)) + "\n")
    print("\n".join(attention_table(lib, args.layers, args.context, args.repeats)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
