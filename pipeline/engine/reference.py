"""Reference drafting: draft a row from a text the model does not see, its *reference*.

A row may come with a reference: token ids (the target's vocabulary) that its output is
likely to repeat in long runs, such as the previous night's output of a lightly edited row
(issue 48; :meth:`pipeline.reuse.RowReuse.reference_for`).  As prompt lookup (Saxena 2023;
transformers' ``prompt_lookup_num_tokens``) copies what followed the text's last n-gram in
the prompt, :class:`ReferenceIndex` copies what followed it in the reference: the row's last
``n`` generated tokens, for ``n`` from :data:`REFERENCE_NGRAM` down to 1, are looked up in an
index of the reference's n-grams built once per row, and up to ``k`` tokens that followed the
match are the draft (source ``"reference"``).  The reference and the output are both read
with a start marker before their first token, so the output's first tokens match the
reference's first tokens (an output that starts as its reference did drafts from its first
step).  Of several sites of the n-gram the one at or after the previous match wins (the two
texts run in the same order), else the first.  The search is a dictionary look-up per ``n``:
no model runs.

Its confidence in draft token ``j`` (:attr:`~pipeline.engine.proposers.base.Draft.confidence`,
uncalibrated) is the share of the n-gram's sites whose continuation agrees with the draft up to
``j`` (as prompt lookup's, 1.0 for an n-gram seen once), times ``n / REFERENCE_NGRAM`` (a match
of one token says less than a match of four); the draft-length controller calibrates it
against the acceptance it measures of source ``"reference"``
(:mod:`pipeline.engine.draft_control`).

Lossless: the draft is a function of the committed tokens and the reference, a point mass
(``probs`` ``None``): greedy output equals plain greedy output, and a sampled row keeps the
target's law by the usual rejection rule with ``q`` one-hot (Leviathan et al. 2023), whatever
the reference holds.  The loop offers the draft to the controller beside the method's own
(:meth:`pipeline.engine.loop.StepEngine.step`).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .proposers.base import Draft

#: the longest n-gram of the row's output matched in its reference
REFERENCE_NGRAM = 4
#: the start marker before the output's and the reference's first tokens (never a token id)
_START = -1


class ReferenceIndex:
    """The n-gram index of one row's reference.

    Args:
        tokens: the reference's token ids (a list of ints, or an int tensor ``(n,)``), each in
            ``0 .. vocab_size - 1``; may be empty (nothing is ever drafted).
        vocab_size: the target's vocabulary size (``None``: not checked).
        max_ngram: the longest n-gram matched (>= 1).

    Raises:
        ValueError: a token id that is not an integer in ``0 .. vocab_size - 1``.
    """

    def __init__(self, tokens: Sequence[int] | torch.Tensor, vocab_size: int | None = None,
                 max_ngram: int = REFERENCE_NGRAM):
        ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("a reference must be a list of token ids (integers)")
        if ids and (min(ids) < 0 or (vocab_size is not None and max(ids) >= vocab_size)):
            raise ValueError(f"the reference has token ids outside the target's vocabulary (0 .. {vocab_size - 1})"
                             if vocab_size is not None else "the reference has negative token ids")
        self.max_ngram = max(1, int(max_ngram))
        self.text = [_START] + ids
        #: n-gram -> the positions (in :attr:`text`) that follow its occurrences, in order
        self.sites: dict[tuple[int, ...], list[int]] = {}
        for n in range(1, self.max_ngram + 1):
            for i in range(len(self.text) - n):
                self.sites.setdefault(tuple(self.text[i:i + n]), []).append(i + n)
        self.last = 0  # where the previous match's continuation started

    def __len__(self) -> int:
        return len(self.text) - 1

    def draft(self, generated: Sequence[int], k: int, device=None) -> Draft | None:
        """Up to ``k`` tokens continuing ``generated`` (the row's output so far) as the
        reference did, with their confidence; ``None`` when no n-gram of it matches or ``k < 1``."""
        if k < 1:
            return None
        tail = [_START] + list(generated[-self.max_ngram:]) if len(generated) < self.max_ngram \
            else list(generated[-self.max_ngram:])
        for n in range(min(self.max_ngram, len(tail)), 0, -1):
            sites = self.sites.get(tuple(tail[len(tail) - n:]))
            if not sites:
                continue
            start = next((s for s in sites if s >= self.last), sites[0])
            self.last = start
            tokens = self.text[start:start + k]
            confidence = _agreement(self.text, sites, tokens, start) * (n / self.max_ngram)
            return Draft(torch.tensor(tokens, dtype=torch.long, device=device), confidence=confidence,
                         source="reference")
        return None


def _agreement(text: list[int], sites: list[int], tokens: list[int], chosen: int) -> torch.Tensor:
    """Per draft position ``j``: of the sites whose continuation matches ``tokens[:j]`` and goes
    on, the share whose next token is ``tokens[j]`` (the chosen site always counts);
    ``(n,)`` float64."""
    out, alive = [], [s for s in sites]
    for j, tok in enumerate(tokens):
        going = [s for s in alive if s + j < len(text)]
        agree = [s for s in going if text[s + j] == tok]
        out.append(len(agree) / max(1, len(going)))
        alive = agree or [chosen]
    return torch.tensor(out, dtype=torch.float64)


def offer_reference(draft: Draft, reference: Draft | None) -> Draft:
    """The method's draft with a reference draft offered beside it: as an alternative of a
    linear draft (the controller verifies whichever has the more expected accepted tokens), in
    its place when the method drafted nothing (its other sources still beside it); a token
    tree is left as it is."""
    if reference is None or draft.parents is not None:
        return draft
    if len(draft) == 0:  # the reference first (what a fixed draft length verifies), the method's others beside
        return Draft(reference.tokens, None, None, reference.confidence, reference.source, draft.alternatives)
    return Draft(draft.tokens, draft.probs, draft.parents, draft.confidence, draft.source,
                 draft.alternatives + (reference,))
