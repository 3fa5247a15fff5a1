"""The proposer protocol: what every drafting method implements.

A proposer sees the committed sequence (prompt + generated tokens), drafts up to ``k``
tokens, and is told after verification how much of what it saw is still valid so it can
roll back its own caches.  It never verifies: acceptance lives in
:mod:`pipeline.engine.verify`, the loop in :mod:`pipeline.engine.loop`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from ..sampling import LogitsShaper


@dataclass
class Draft:
    """Tokens proposed for one verification step.

    Attributes:
        tokens: ``(n,)`` int64 draft token ids in the target's vocabulary, ``n <= k``
            (``n == 0``: nothing to propose, the step is an ordinary target step).
        probs: ``(n, V_target)`` the exact distribution each draft token was drawn from
            (after the same logits processors as the target), or ``None`` for a
            deterministic proposer, whose distribution is one-hot on the token.
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


@dataclass
class DraftRequest:
    """What the loop asks of a proposer for one step.

    Attributes:
        sequence: ``(1, seq_len)`` int64 committed tokens (prompt + generated), on the
            target's device.
        k: the most tokens to draft (already capped to the remaining budget minus one).
        shaper: the row's logits processors (shared with the target).
        generator: the row's seeded ``torch.Generator`` (used only when sampling).
        want_probs: whether the verifier needs ``Draft.probs`` (sampling or ensemble).
    """

    sequence: torch.Tensor
    k: int
    shaper: LogitsShaper
    generator: torch.Generator | None
    want_probs: bool


@runtime_checkable
class Proposer(Protocol):
    """Protocol of a drafting method (one implementation per file in this package)."""

    #: True when the draft length adapts per row (transformers' "heuristic" schedule applies).
    adaptive: bool

    def reset(self, target_cache) -> None:
        """Forget all per-row state (caches); called before every row with the target's
        fresh KV cache for this row (a proposer that drafts with the target's own layers
        may share it)."""

    def propose(self, request: DraftRequest) -> Draft:
        """Draft up to ``request.k`` tokens continuing ``request.sequence``."""

    def rollback(self, valid_length: int) -> None:
        """Only the first ``valid_length`` tokens the proposer has seen (committed
        sequence + its draft) are still valid; crop any cache beyond them."""


class TargetForward(Protocol):
    """Optional hook of a proposer that needs more from the target than its logits
    (hidden states for MTP layers, a shared cache for early exit).  When a proposer has
    ``target_forward``, the loop runs every target pass (prefill and verification)
    through it instead of ``target(input_ids=..., cache=..., logits_to_keep=...)``.
    """

    def target_forward(self, target, input_ids: torch.Tensor, cache, logits_to_keep: int) -> torch.Tensor:
        """Run the target on ``input_ids`` ``(1, n)`` appending to ``cache``; return the
        logits of the last ``logits_to_keep`` positions, ``(logits_to_keep, V)``."""


def draft_token(
    logits: torch.Tensor, prefix: torch.Tensor, request: DraftRequest, need_q: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pick a drafter's next token the way the target would: the row's logits processors
    shape ``logits`` ``(1, V_target)`` (``prefix`` ``(1, L)`` is the text before it), then the
    token is sampled from ``q = softmax`` when sampling, else the argmax.

    Returns ``(token (1, 1) int64, q (1, V_target) or None)``; ``q`` (float32 or wider) is
    returned when sampling, when ``request.want_probs`` or when ``need_q``.
    """
    shaper = request.shaper
    if shaper.active:
        logits = shaper.shape(prefix, logits)
    q = None
    if shaper.do_sample or request.want_probs or need_q:
        q = torch.softmax(logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits, -1)
    if shaper.do_sample:
        token = torch.multinomial(q, 1, generator=request.generator).view(1, 1)
    else:
        token = logits.argmax(-1, keepdim=True)
    return token, q


def empty_draft(device: torch.device | str) -> Draft:
    return Draft(tokens=torch.empty(0, dtype=torch.long, device=device))
