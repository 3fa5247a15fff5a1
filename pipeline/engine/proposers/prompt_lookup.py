"""Prompt lookup decoding: draft by copying what followed the last n-gram earlier on.

Follows Saxena 2023 ("Prompt Lookup Decoding", github.com/apoorvumang/prompt-lookup-decoding)
as used by transformers' ``prompt_lookup_num_tokens`` / ``max_matching_ngram_size``:
for ``n`` from ``max_matching_ngram_size`` down to 1, find the first earlier occurrence
of the last ``n`` tokens of the sequence (prompt and generated text) that has a
continuation, and propose up to ``k`` tokens that followed it.  No match: an empty
draft, so the step is an ordinary target step.  Deterministic: ``q`` is one-hot.
"""

from __future__ import annotations

from .base import Draft, DraftRequest, empty_draft


class PromptLookupProposer:
    adaptive = False

    def __init__(self, max_matching_ngram_size: int = 2):
        self.max_ngram = max_matching_ngram_size

    def reset(self, target_cache=None) -> None:
        pass

    def rollback(self, valid_length: int) -> None:
        pass

    def propose(self, request: DraftRequest) -> Draft:
        seq = request.sequence[0]
        length = seq.shape[0]
        k = request.k
        for n in range(min(self.max_ngram, length - 1), 0, -1):
            pattern = seq[length - n :]
            # windows starting at 0 .. length-n-1: every earlier occurrence, none overlapping the end
            windows = seq[: length - 1].unfold(0, n, 1)
            hits = (windows == pattern).all(dim=1).nonzero()
            if hits.numel():
                start = int(hits[0, 0]) + n
                tokens = seq[start : min(start + k, length)]
                if tokens.numel():
                    return Draft(tokens=tokens.clone())
        return empty_draft(seq.device)
