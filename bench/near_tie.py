"""The batched engine's near-tie rule for float32 models: a row decoded in a batch may
differ from the same row decoded alone only where the target's top two logits are closer
than ``threshold`` (other rows change the shapes of the matrix products, hence the
rounding; an exact tie-break cannot survive that).  Used by bench_batch.py and the server
tests."""

from __future__ import annotations


def first_difference(out: list[int], ref: list[int]) -> int | None:
    """The first position where two outputs differ (``None`` when equal; the shorter
    length when one is a prefix of the other)."""
    if out == ref:
        return None
    return next((j for j in range(min(len(out), len(ref))) if out[j] != ref[j]), min(len(out), len(ref)))


def first_difference_is_near_tie(target, prompt: list[int], out: list[int], ref: list[int],
                                 threshold: float = 1e-3) -> bool:
    """Whether ``out`` and ``ref`` (generated ids after ``prompt``) first differ where the
    target's top-2 logit gap (float32) after ``prompt + ref[:i]`` is below ``threshold``."""
    import torch

    i = first_difference(out, ref)
    if i is None:
        return True
    with torch.no_grad():
        logits = target(torch.tensor([prompt + ref[:i]], device=target.device)).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1]) < threshold
