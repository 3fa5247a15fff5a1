"""Expected tokens per step and tokens per second of speculative decoding, from measured
acceptance and measured costs: the one formula that both the engine's draft length by
load (:mod:`pipeline.engine.draft_length`) and the tuner (:mod:`pipeline.tune`) use.

Leviathan et al. (2023, arXiv 2211.17192, §3) assume one per-token acceptance rate
``α``, a verification pass that costs one target step ``t`` whatever it verifies, and a
drafter step of ``c·t``.  Generalised to what is measured here:

- ``reach[i-1]`` = ``A_i``: the chance that a verify step gets the first ``i`` draft
  tokens all accepted (the product of the per-position acceptances ``α_1 … α_i``).  It
  is counted, per draft position, as accepted at position ``i`` / steps counted: per
  draft (the engine) or per verify step, steps without a draft included (the tuner, so a
  prompt-lookup miss counts as a step that drafted nothing);
- ``E(k) = 1 + A_1 + … + A_k``: expected tokens one row emits in a step that drafts up
  to ``k`` (the target's token always comes).  With a constant ``α`` (``A_i = α^i``) it is
  Leviathan's ``(1 − α^(k+1)) / (1 − α)``;
- ``T(k) = t_verify + t_draft_step + k · t_draft_token + t_overhead`` (seconds): a step's
  time, with ``t_verify`` the target pass over ``k + 1`` tokens per row *as measured*
  (on a CPU, or at a large batch, it grows with the tokens verified), the drafter's cost
  per draft position and per step, and the loop's own bookkeeping;
- tokens/s of ``B`` rows in flight = ``B · E(k) / T(k)``.

With ``B = 1``, ``t_verify = t`` for every ``k``, ``t_draft_token = c·t`` and no other
cost, ``tokens/s · t`` is Leviathan's expected speedup
``S = (1 − α^(k+1)) / ((1 − α)(1 + k·c))`` (see ``docs/metrics.md``).
"""

from __future__ import annotations

from typing import Sequence


def expected_tokens(reach: Sequence[float], k: int) -> float:
    """``E(k) = 1 + Σ_{i=1..k} A_i``: expected tokens a row emits in a step drafting up to ``k``.

    Args:
        reach: ``A_1, A_2, …`` (probabilities in [0, 1]); positions beyond its length
            count as never accepted.
        k: draft length (tokens, ``>= 0``).

    Raises:
        ValueError: a negative ``k``.
    """
    if k < 0:
        raise ValueError(f"draft length k must be >= 0, got {k}")
    return 1.0 + sum(reach[:k])


def leviathan_expected_tokens(alpha: float, k: float) -> float:
    """:func:`expected_tokens` with one per-token acceptance ``α`` (``A_i = α^i``): Leviathan's
    ``(1 − α^(k+1)) / (1 − α)``, and ``k + 1`` at ``α = 1``.  ``k`` may be fractional (a mean
    draft length); ``α`` in [0, 1]."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def leviathan_speedup(alpha: float, k: float, c: float) -> float:
    """Leviathan et al.'s expected speedup ``S = (1 − α^(k+1)) / ((1 − α)(1 + k·c))``: a
    verification pass costs one target step whatever it verifies and a drafting position
    ``c`` of one (see the module docstring)."""
    return leviathan_expected_tokens(alpha, k) / (1.0 + k * c)


def step_time(verify_s: float, k: int, draft_token_s: float = 0.0, draft_step_s: float = 0.0,
              overhead_s: float = 0.0) -> float:
    """``T(k)`` in seconds: one verification pass (``verify_s``, over ``k + 1`` tokens per
    row), ``k`` draft positions at ``draft_token_s`` each, a per-step drafting cost
    ``draft_step_s`` (e.g. an n-gram search; charged only when ``k > 0``) and the loop's
    bookkeeping ``overhead_s``."""
    draft = draft_step_s + k * draft_token_s if k > 0 else 0.0
    return verify_s + draft + overhead_s


def tokens_per_second(rows: int, k: int, reach: Sequence[float], verify_s: float, draft_token_s: float = 0.0,
                      draft_step_s: float = 0.0, overhead_s: float = 0.0) -> float:
    """``B · E(k) / T(k)``: tokens per second of ``rows`` rows in flight that each draft up
    to ``k`` tokens per step (see the module docstring; times in seconds per step of the
    whole batch)."""
    t = step_time(verify_s, k, draft_token_s, draft_step_s, overhead_s)
    return rows * expected_tokens(reach, k) / max(t, 1e-12)


def reach_from_counts(accepted_per_position: Sequence[int], steps: Sequence[int] | int) -> list[float]:
    """``A_i`` from per-position counts: ``accepted_per_position[i-1] / steps`` (``steps`` one
    number for every position, or one per position such as ``drafted_per_position``); a
    position with no step counted gives 0."""
    if isinstance(steps, int):
        steps = [steps] * len(accepted_per_position)
    return [a / s if s else 0.0 for a, s in zip(accepted_per_position, steps)]


def per_token_acceptance(drafted_per_position: Sequence[int], accepted_per_position: Sequence[int]) -> list[float | None]:
    """Leviathan's per-token ``α_i`` by draft position: the chance that the token at position
    ``i`` is accepted given that every token before it was: accepted at ``i`` / evaluated at
    ``i``, where evaluated at 1 is ``drafted[0]`` and at ``i > 1`` is
    ``min(accepted[i-2], drafted[i-1])`` (exact unless a draft was cut short by the budget;
    the same estimate as :func:`pipeline.report.Stats.token_acceptance`, per position).
    ``None`` where nothing was evaluated."""
    out: list[float | None] = []
    for i, (d, a) in enumerate(zip(drafted_per_position, accepted_per_position)):
        evaluated = d if i == 0 else min(accepted_per_position[i - 1], d)
        out.append(a / evaluated if evaluated else None)
    return out
