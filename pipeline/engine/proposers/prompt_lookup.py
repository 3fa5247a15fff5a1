"""Prompt lookup decoding: draft by copying what followed the last n-gram earlier on.

Follows Saxena 2023 ("Prompt Lookup Decoding", github.com/apoorvumang/prompt-lookup-decoding)
as used by transformers' ``prompt_lookup_num_tokens`` / ``max_matching_ngram_size``:
for ``n`` from ``max_matching_ngram_size`` down to 1, find the first earlier occurrence
of the last ``n`` tokens of the sequence (prompt and generated text) that has a
continuation, and propose up to ``k`` tokens that followed it.  No match: an empty
draft, so the step is an ordinary target step.  Deterministic: ``q`` is one-hot.  Its
confidence in each draft token (:func:`lookup_with_confidence`) is how often the matched
n-gram was followed that way in the row's text (source ``"prompt"``).
Each row is searched on its own (no model runs), so a batch costs one search per row.

Token trees (``num_candidates > 1``, greedy rows): the n-gram may occur at several earlier
sites, followed by different continuations.  :func:`lookup_candidates` gathers up to
``num_candidates`` distinct continuations: the linear draft first (the first site of the
longest n-gram, as above), then the other sites of that n-gram, the latest first, then
those of shorter n-grams; they are merged into one tree (shared prefixes become one node),
which the target verifies in one pass.  The tree holds the linear draft as its first
branch, so it never accepts less than the linear draft.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..methods import MethodParams, param, POSITIVE_INT
from .base import Draft, DraftRequest, NoState, empty_draft, tree_from_branches


@dataclass
class Params(MethodParams):
    """Method ``prompt_lookup``'s parameters, named as transformers' ``generate()`` names them."""

    prompt_lookup_num_tokens: int = param(10, "tokens copied after an n-gram match.", POSITIVE_INT)
    max_matching_ngram_size: int = param(2, "longest n-gram searched for (tried from longest to 1).", POSITIVE_INT)


def lookup(seq: torch.Tensor, k: int, max_ngram: int) -> torch.Tensor:
    """Up to ``k`` tokens that followed the first earlier occurrence of the longest
    matching suffix n-gram of ``seq`` ``(L,)``; ``(0,)`` when none matches."""
    return lookup_with_confidence(seq, k, max_ngram)[0]


def lookup_with_confidence(seq: torch.Tensor, k: int, max_ngram: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`lookup`'s draft and its confidence (:attr:`Draft.confidence`): for draft token
    ``j``, the share of the n-gram's earlier occurrences followed by the draft's first ``j``
    tokens that are also followed by token ``j`` (how often the text continued this way
    after the same n-gram; 1.0 for an n-gram seen once).  ``((0,), None)`` when nothing matches."""
    length = seq.shape[0]
    for n in range(min(max_ngram, length - 1), 0, -1):
        pattern = seq[length - n :]
        # windows starting at 0 .. length-n-1: every earlier occurrence, none overlapping the end
        windows = seq[: length - 1].unfold(0, n, 1)
        hits = (windows == pattern).all(dim=1).nonzero()[:, 0]
        if hits.numel():
            start = int(hits[0]) + n
            tokens = seq[start : min(start + k, length)]
            if tokens.numel():
                return tokens.clone(), _agreement(seq, hits + n, tokens)
    return seq.new_empty(0), None


def _agreement(seq: torch.Tensor, starts: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Per draft position ``j``: of the continuations at ``starts`` that match ``tokens[:j]``
    and go on, the share whose next token is ``tokens[j]``; ``(n,)`` float64 on the CPU."""
    n, length = tokens.shape[0], seq.shape[0]
    idx = starts.view(-1, 1) + torch.arange(n, device=seq.device)
    inside = idx < length
    cont = torch.where(inside, seq[idx.clamp_max(length - 1)], torch.full_like(idx, -1))
    agree = (cont == tokens).to(torch.float64).cumprod(1)  # (hits, n): matches tokens[: j + 1]
    reach = torch.cat([torch.ones_like(agree[:, :1]), agree[:, :-1]], 1) * inside  # matched tokens[:j], goes on
    return (agree.sum(0) / reach.sum(0).clamp_min(1)).cpu()


def lookup_candidates(seq: torch.Tensor, k: int, max_ngram: int, candidates: int) -> list[list[int]]:
    """Up to ``candidates`` distinct continuations of up to ``k`` tokens after earlier
    occurrences of the sequence's suffix n-grams (see the module docstring): the first is
    :func:`lookup`'s; none is a prefix of one found before it.  ``[]`` when nothing matches."""
    length = seq.shape[0]
    found: list[list[int]] = []
    values = seq.tolist()
    for n in range(min(max_ngram, length - 1), 0, -1):
        pattern = seq[length - n :]
        windows = seq[: length - 1].unfold(0, n, 1)
        hits = [int(h) for h in (windows == pattern).all(dim=1).nonzero()[:, 0]]
        if not hits:
            continue
        order = hits[:1] + hits[1:][::-1] if not found else hits[::-1]  # the linear draft's site first
        for h in order:
            start = h + n
            cont = values[start : min(start + k, length)]
            if not cont or any(f[: len(cont)] == cont for f in found):
                continue
            found.append(cont)
            if len(found) >= candidates:
                return found
    return found


class PromptLookupProposer(NoState):
    def __init__(self, max_matching_ngram_size: int = 2):
        self.max_ngram = max_matching_ngram_size

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        out = []
        for r in requests:
            if r.candidates > 1:
                branches = lookup_candidates(r.sequence[0], r.k, self.max_ngram, r.candidates)
                out.append(tree_from_branches(branches, r.sequence.device, "prompt") if branches else
                           empty_draft(r.sequence.device))
                continue
            tokens, confidence = lookup_with_confidence(r.sequence[0], r.k, self.max_ngram)
            out.append(Draft(tokens, confidence=confidence, source="prompt") if tokens.numel() else
                       empty_draft(r.sequence.device))
        return out


def build(inputs) -> PromptLookupProposer:
    """The method's factory (:class:`~pipeline.engine.proposers.base.ProposerInputs`)."""
    return PromptLookupProposer(Params.of(inputs.spec).max_matching_ngram_size)
