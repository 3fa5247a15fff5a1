"""Verification: which draft tokens the target keeps, and the token it adds.

Both functions take the target's ``n + 1`` distributions for one draft of ``n`` tokens
(position ``i`` predicts draft token ``i``; position ``n`` is the bonus position) and
return ``(accepted, next_token)``: the number of leading draft tokens kept and the one
token the target emits after them (a correction on rejection, the bonus token when all
were kept).

- Greedy: the longest draft prefix equal to the target's argmax, then the argmax
  (:func:`greedy_accept`; the loop computes every row's argmax in one call when no
  logits processor applies).
- Token trees, greedy (SpecInfer, Miao et al. 2023, arXiv 2305.09781; Medusa, Cai et al.
  2024): from the root, follow the child whose token is the target's argmax at the node
  reached, as long as there is one; the longest verified path is accepted, then the
  argmax after it (:func:`tree_accept`).  Each accepted token is the target's argmax given
  the committed text and the path before it, so the output is plain greedy's.
- Sampling: rejection sampling of Leviathan et al. 2023 (arXiv 2211.17192, Alg. 1) and
  Chen et al. 2023 (arXiv 2302.01318): accept draft token ``x`` with probability
  ``min(1, p(x) / q(x))``; on rejection draw from ``norm(max(0, p - q))``; when every
  token is accepted draw the bonus token from ``p``.  A deterministic proposer has a
  one-hot ``q``.  With a static ensemble weight ``w`` (lossy), ``p`` is replaced by the
  mixture ``w*p + (1-w)*q`` at draft positions; the bonus still comes from ``p``.

How a step verifies is one object chosen per step by the loop (:class:`Verification`):
:class:`ArgmaxVerification` (greedy rows without logits processors: one argmax call for
the pass, linear drafts and token trees) and :class:`ShapedVerification` (logits processors,
sampling, static ensemble).  Each runs the
step's target pass and returns a :class:`Verdict` per row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import torch


def _mix(p: torch.Tensor, q: torch.Tensor, weight: float | None) -> torch.Tensor:
    return p if weight is None else weight * p + (1.0 - weight) * q


def verify_greedy(
    draft_tokens: torch.Tensor,
    target_scores: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    ensemble_weight: float | None = None,
) -> tuple[int, int]:
    """Greedy verification.

    Args:
        draft_tokens: ``(n,)`` int64.
        target_scores: ``(n + 1, V)`` target logits (processed where processors apply).
        draft_probs: ``(n, V)`` drafter probabilities, needed only with ``ensemble_weight``.
        ensemble_weight: ``w`` of static ensemble verification, or ``None`` (lossless).

    Returns:
        ``(accepted, next_token)``.
    """
    n = draft_tokens.shape[0]
    if ensemble_weight is not None and n > 0:
        p = torch.softmax(target_scores[:n].to(draft_probs.dtype), dim=-1)
        choice = torch.cat([_mix(p, draft_probs, ensemble_weight).argmax(-1), target_scores[n:].argmax(-1)])
    else:
        choice = target_scores.argmax(-1)
    return greedy_accept(draft_tokens.tolist(), choice.tolist())


def greedy_accept(draft: list[int], choice: list[int]) -> tuple[int, int]:
    """Greedy verification from the target's choices: ``choice[i]`` is its argmax at draft
    position ``i`` (``len(choice) == len(draft) + 1``; the last is the bonus position).

    Returns:
        ``(accepted, next_token)``: the longest draft prefix equal to the choices, and the
        target's token after it.
    """
    n = len(draft)
    accepted = next((i for i in range(n) if draft[i] != choice[i]), n)
    return accepted, int(choice[accepted])


def verify_sampling(
    draft_tokens: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None,
    ensemble_weight: float | None = None,
) -> tuple[int, int]:
    """Rejection-sampling verification.

    Args:
        draft_tokens: ``(n,)`` int64.
        target_probs: ``(n + 1, V)`` processed target probabilities ``p``.
        draft_probs: ``(n, V)`` the distributions ``q`` the draft tokens were drawn
            from, or ``None`` for a deterministic proposer (one-hot ``q``).
        generator: the row's ``torch.Generator`` on ``target_probs.device``.
        ensemble_weight: ``w`` of static ensemble verification, or ``None`` (lossless).

    Returns:
        ``(accepted, next_token)``.
    """
    n = draft_tokens.shape[0]
    if n > 0:
        idx = torch.arange(n, device=target_probs.device)
        p_x = target_probs[idx, draft_tokens]
        q_x = draft_probs[idx, draft_tokens] if draft_probs is not None else torch.ones_like(p_x)
        if ensemble_weight is not None:
            p_x = ensemble_weight * p_x + (1.0 - ensemble_weight) * q_x
        u = torch.rand(n, generator=generator, device=target_probs.device, dtype=p_x.dtype)
        rejected = (u * q_x >= p_x).nonzero()  # u < p/q  <=>  accept (q_x > 0 for drawn tokens)
        if rejected.numel():
            i = int(rejected[0, 0])
            if draft_probs is not None:
                q_i = draft_probs[i]
            else:
                q_i = torch.zeros_like(target_probs[i])
                q_i[draft_tokens[i]] = 1.0
            target_i = _mix(target_probs[i], q_i, ensemble_weight)
            residual = (target_i - q_i).clamp_min(0)
            total = residual.sum()
            if not bool(total > 0):  # p == q up to rounding: the residual is empty
                residual, total = target_i, target_i.sum()
            token = torch.multinomial(residual / total, 1, generator=generator)
            return i, int(token)
    token = torch.multinomial(target_probs[n], 1, generator=generator)
    return n, int(token)


def tree_accept(tokens: Sequence[int], parents: Sequence[int], choice: Sequence[int]) -> tuple[list[int], int]:
    """Greedy verification of a token tree from the target's choices.

    Args:
        tokens: the nodes' token ids (``m``).
        parents: per node its parent's index (``-1``: the root), parents first.
        choice: ``m + 1`` argmax ids: ``choice[0]`` at the root (the row's last committed
            token), ``choice[j + 1]`` at node ``j``.

    Returns:
        ``(path, next_token)``: the accepted nodes, root to leaf (the longest path whose every
        token is the target's choice at its parent), and the target's token after the path.
    """
    children: dict[int, list[int]] = {}
    for j, par in enumerate(parents):
        children.setdefault(par, []).append(j)
    path: list[int] = []
    cur = -1
    while True:
        want = int(choice[cur + 1])
        nxt = next((j for j in children.get(cur, ()) if tokens[j] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        cur = nxt


@dataclass
class Verdict:
    """One row's verification.

    Attributes:
        path: the accepted draft nodes in order (a linear draft's ``0 .. a - 1``; a tree's
            accepted path); their tokens are accepted.
        token: the target's token after them (correction or bonus).
        logprobs: with the row's ``settings.logprobs = N``: one entry per emitted token (the
            accepted ones, then ``token``), ``{"token_id", "logprob", "top"}`` from the
            distribution verification used (:func:`token_logprobs`); ``None`` when off.
    """

    path: list[int]
    token: int
    logprobs: list[dict] | None = None

    @property
    def accepted(self) -> int:
        return len(self.path)


@dataclass
class VerifyPass:
    """The step's target pass: per row its slot, its tokens ``[last, d_1 .. d_n]`` from
    position ``starts[i]``, and the token tree over them (``None``: linear); ``keep`` the
    positions of logits kept (the widest row)."""

    slots: list[int]
    tokens: list[torch.Tensor]
    starts: list[int]
    keep: int
    trees: list[list[int] | None] | None = None


class Verification(Protocol):
    """How one step verifies its rows' drafts (chosen per step by the loop)."""

    def run(self, rows: Sequence[Any], drafts: Sequence[Any], step: VerifyPass) -> list[Verdict]:
        """Run the step's target pass and verify every row's draft (``rows[i]`` a
        :class:`~pipeline.engine.batch.RowState`, ``drafts[i]`` its
        :class:`~pipeline.engine.proposers.base.Draft`)."""


TargetPass = Callable[..., torch.Tensor]


class ArgmaxVerification:
    """Greedy rows without logits processors: one argmax over the pass's logits, then
    :func:`greedy_accept` for a linear draft and :func:`tree_accept` for a token tree.

    Args:
        target_pass: ``(slots, tokens, starts, logits_to_keep, trees=None) -> (b, keep, V)``.
    """

    def __init__(self, target_pass: TargetPass):
        self.target_pass = target_pass

    def run(self, rows, drafts, step: VerifyPass) -> list[Verdict]:
        trees = step.trees if step.trees is not None and any(t is not None for t in step.trees) else None
        if trees is None:
            logits = self.target_pass(step.slots, step.tokens, step.starts, step.keep)
        else:
            logits = self.target_pass(step.slots, step.tokens, step.starts, step.keep, trees=trees)
        choices = logits.argmax(-1).tolist()
        out = []
        for b, d in enumerate(drafts):
            n = len(d)
            choice = choices[b][step.keep - n - 1:]
            if d.parents is not None:
                path, token = tree_accept(d.tokens.tolist(), d.parents, choice)
                out.append(Verdict(path, token))
            else:
                accepted, token = greedy_accept(d.tokens.tolist(), choice)
                out.append(Verdict(list(range(accepted)), token))
        return out


class ShapedVerification:
    """Rows with logits processors, sampled rows, static ensemble verification: each row's
    logits are shaped with its own prefix per position, then :func:`verify_greedy` or
    :func:`verify_sampling` (linear drafts only).

    Args:
        target_pass: as for :class:`ArgmaxVerification`.
        ensemble_weight: ``w`` of static ensemble verification, or ``None`` (lossless).
    """

    def __init__(self, target_pass: TargetPass, ensemble_weight: float | None = None):
        self.target_pass = target_pass
        self.ensemble = ensemble_weight

    def run(self, rows, drafts, step: VerifyPass) -> list[Verdict]:
        logits = self.target_pass(step.slots, step.tokens, step.starts, step.keep)
        out = []
        for b, (row, draft) in enumerate(zip(rows, drafts)):
            n = len(draft)
            out.append(self._one(row, draft, logits[b, step.keep - n - 1:]))
        return out

    def _one(self, row, draft, logits: torch.Tensor) -> Verdict:
        d_tokens = draft.tokens.to(logits.device)
        d_probs = draft.probs.to(logits.device) if draft.probs is not None else None
        if row.settings.do_sample:
            p = row.shaper.probs(row.sequence, logits, d_tokens)
            if d_probs is not None:
                d_probs = d_probs.to(p.dtype)
            accepted, token = verify_sampling(d_tokens, p, d_probs, row.generator, self.ensemble)
            scores = None
        else:
            scores = row.shaper.shape(row.sequence, logits, d_tokens)
            accepted, token = verify_greedy(d_tokens, scores, d_probs, self.ensemble)
        top = row.settings.logprobs
        if top is None:
            return Verdict(list(range(accepted)), token)
        chosen = d_tokens[:accepted].tolist() + [token]
        lp = torch.log_softmax(scores[: accepted + 1], -1) if scores is not None else p[: accepted + 1].log()
        return Verdict(list(range(accepted)), token, token_logprobs(lp, chosen, top))


def token_logprobs(logprobs: torch.Tensor, chosen: Sequence[int], top: int) -> list[dict]:
    """vLLM's per-token log-probabilities: ``logprobs`` ``(m, V)`` natural-log distributions of
    ``m`` positions, ``chosen`` the token emitted at each; per position
    ``{"token_id", "logprob", "top": [[token_id, logprob], ...]}`` with the ``top`` most likely
    tokens that have a chance (ties by lower id; tokens that a grammar or a warper masked out
    are left out, so ``top`` may be shorter)."""
    out = []
    top = min(top, logprobs.shape[-1])
    values, ids = (logprobs.topk(top, -1) if top else (None, None))
    for i, tok in enumerate(chosen):
        entry = {"token_id": int(tok), "logprob": float(logprobs[i, tok])}
        entry["top"] = [[int(t), float(v)] for t, v in zip(ids[i].tolist(), values[i].tolist())
                        if v != float("-inf")] if top else []
        out.append(entry)
    return out
