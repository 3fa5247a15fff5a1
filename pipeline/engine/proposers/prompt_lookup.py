"""Prompt lookup decoding: draft by copying what followed the last n-gram earlier on.

Follows Saxena 2023 ("Prompt Lookup Decoding", github.com/apoorvumang/prompt-lookup-decoding)
as used by transformers' ``prompt_lookup_num_tokens`` / ``max_matching_ngram_size``:
for ``n`` from ``max_matching_ngram_size`` down to 1, find the first earlier occurrence
of the last ``n`` tokens of the sequence (prompt and generated text) that has a
continuation, and propose up to ``k`` tokens that followed it.  No match: an empty
draft, so the step is an ordinary target step.  Deterministic: ``q`` is one-hot.
Each row is searched on its own (no model runs), so a batch costs one search per row.
"""

from __future__ import annotations

import torch

from .base import Draft, DraftRequest, NoState, empty_draft


def lookup(seq: torch.Tensor, k: int, max_ngram: int) -> torch.Tensor:
    """Up to ``k`` tokens that followed the first earlier occurrence of the longest
    matching suffix n-gram of ``seq`` ``(L,)``; ``(0,)`` when none matches."""
    length = seq.shape[0]
    for n in range(min(max_ngram, length - 1), 0, -1):
        pattern = seq[length - n :]
        # windows starting at 0 .. length-n-1: every earlier occurrence, none overlapping the end
        windows = seq[: length - 1].unfold(0, n, 1)
        hits = (windows == pattern).all(dim=1).nonzero()
        if hits.numel():
            start = int(hits[0, 0]) + n
            tokens = seq[start : min(start + k, length)]
            if tokens.numel():
                return tokens.clone()
    return seq.new_empty(0)


class PromptLookupProposer(NoState):
    adaptive = False

    def __init__(self, max_matching_ngram_size: int = 2):
        self.max_ngram = max_matching_ngram_size

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        out = []
        for r in requests:
            tokens = lookup(r.sequence[0], r.k, self.max_ngram)
            out.append(Draft(tokens=tokens) if tokens.numel() else empty_draft(r.sequence.device))
        return out


def build(inputs) -> PromptLookupProposer:
    """The method's factory (:class:`~pipeline.engine.proposers.base.ProposerInputs`)."""
    return PromptLookupProposer(inputs.spec.max_matching_ngram_size)
