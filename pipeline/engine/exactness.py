"""Checking a batched or speculative run against single-row plain greedy decoding.

In float64 every row must be identical.  In float32 or bf16 a batched pass computes the
same logits with other kernel shapes, so a row may take the other branch where the
target's top two logits are within rounding of each other (a near-tie); anywhere else a
difference is a bug.  :func:`compare_rows` finds, for each row that differs from its
reference, the first differing position and the target's top-2 logit gap there
(computed by one uncached pass over the common prefix).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: the largest top-2 logit gap that counts as a near-tie in float32 (logits, not probabilities)
NEAR_TIE = 1e-3
#: in bfloat16 / float16 a near-tie is a gap of at most this many units in the last place of
#: the top logit (bfloat16 keeps 8 significant bits: logits near 20 come in steps of 0.125)
NEAR_TIE_ULPS = 4


def near_tie_bound(dtype: torch.dtype, top_logit: float) -> float:
    """The largest top-2 logit gap that counts as a near-tie for logits of ``dtype`` around
    ``top_logit``: :data:`NEAR_TIE` in float32 (and float64, where nothing should differ),
    :data:`NEAR_TIE_ULPS` units in the last place in half precision."""
    if dtype in (torch.bfloat16, torch.float16):
        ulp = 2.0 ** (math.frexp(abs(top_logit) or 1.0)[1] - 1 - (7 if dtype == torch.bfloat16 else 10))
        return NEAR_TIE_ULPS * ulp
    return NEAR_TIE


@dataclass
class RowCheck:
    """One row against its reference: ``identical``, else the first differing ``position``
    (0-based, in generated tokens) and the target's top-2 logit ``gap`` there."""

    identical: bool
    position: int | None = None
    gap: float | None = None
    bound: float = NEAR_TIE  # the near-tie bound for the target's dtype there (near_tie_bound)

    @property
    def near_tie(self) -> bool:
        return self.identical or (self.gap is not None and self.gap < self.bound)


@torch.inference_mode()
def compare_rows(target, prompts: list[list[int]], outputs: list[list[int]], references: list[list[int]]) -> list[RowCheck]:
    """Compare each output with its reference (both generated ids, prompt excluded).

    A row that is a strict prefix of the other (one stopped earlier) differs at the first
    missing position.
    """
    checks = []
    for prompt, out, ref in zip(prompts, outputs, references):
        if out == ref:
            checks.append(RowCheck(True))
            continue
        i = next((j for j in range(min(len(out), len(ref))) if out[j] != ref[j]), min(len(out), len(ref)))
        ids = torch.tensor([list(prompt) + ref[:i]], device=target.device)
        logits = target(input_ids=ids, logits_to_keep=1).logits[0, -1]
        top = logits.float().topk(2).values
        checks.append(RowCheck(False, i, float(top[0] - top[1]), near_tie_bound(logits.dtype, float(top[0]))))
    return checks


def summarize(checks: list[RowCheck]) -> dict:
    """``{"rows", "identical", "differ", "differ_at_near_tie", "largest_gap"}``."""
    differ = [c for c in checks if not c.identical]
    return {
        "rows": len(checks),
        "identical": len(checks) - len(differ),
        "differ": len(differ),
        "differ_at_near_tie": sum(c.near_tie for c in differ),
        "largest_gap": max((c.gap for c in differ), default=None),
    }


def first_difference_is_near_tie(target, prompt: list[int], out: list[int], ref: list[int]) -> bool:
    """Whether ``out`` equals ``ref`` or first differs from it at a near-tie."""
    return compare_rows(target, [prompt], [out], [ref])[0].near_tie
