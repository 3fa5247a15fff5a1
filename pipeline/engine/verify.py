"""Verification: which draft tokens the target keeps, and the token it adds.

Both functions take the target's ``n + 1`` distributions for one draft of ``n`` tokens
(position ``i`` predicts draft token ``i``; position ``n`` is the bonus position) and
return ``(accepted, next_token)``: the number of leading draft tokens kept and the one
token the target emits after them (a correction on rejection, the bonus token when all
were kept).

- Greedy: the longest draft prefix equal to the target's argmax, then the argmax
  (:func:`greedy_accept`; the loop computes every row's argmax in one call when no
  logits processor applies).
- Sampling: rejection sampling of Leviathan et al. 2023 (arXiv 2211.17192, Alg. 1) and
  Chen et al. 2023 (arXiv 2302.01318): accept draft token ``x`` with probability
  ``min(1, p(x) / q(x))``; on rejection draw from ``norm(max(0, p - q))``; when every
  token is accepted draw the bonus token from ``p``.  A deterministic proposer has a
  one-hot ``q``.  With a static ensemble weight ``w`` (lossy), ``p`` is replaced by the
  mixture ``w*p + (1-w)*q`` at draft positions; the bonus still comes from ``p``.
"""

from __future__ import annotations

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
