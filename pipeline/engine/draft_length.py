"""Draft length by load: how many tokens a step drafts, from costs measured on this machine.

Verifying ``B x (k + 1)`` tokens in one target pass costs about one decode step while the
target is memory-bound (a GPU at small ``B``), but on a CPU, or at a large ``B``, the pass
becomes compute-bound and its cost grows with the tokens: speculation then costs more
than it saves.  vLLM switches speculation off above a fixed batch size
(``speculative_disable_by_batch_size``); here the engine measures instead and picks, at
every step, the draft length ``k`` in ``0 .. K`` that maximises the expected tokens per
second of the batch (Leviathan et al. 2023, §3, with the measured costs; the formula is
:func:`pipeline.engine.cost_model.tokens_per_second`, which the tuner shares)::

    tokens/s(k) = B * E(k) / (t_verify(B * (k + 1)) + k * t_draft(B))
    E(k)        = 1 + A_1 + ... + A_k

where ``A_i`` is the measured chance that a draft's first ``i`` tokens are all
accepted (accepted / drafted at draft position ``i``), ``t_verify(n)`` the time of a
target pass over ``n`` tokens (a least-squares line through recent passes) and
``t_draft(B)`` the time of one drafting position for ``B`` rows (a running mean).  Until
both are measured the full ``K`` is used.  Greedy outputs never depend on ``k``; sampled
outputs keep the target's distribution whatever ``k`` is.
"""

from __future__ import annotations

from .cost_model import expected_tokens, reach_from_counts, tokens_per_second

#: weight of a new observation in the running estimates
DECAY = 0.05
#: verification passes to see before the policy acts
MIN_OBSERVATIONS = 12
#: every this many steps the full ``K`` is drafted, so the cost line and the acceptance by
#: position keep being measured at the long end even when shorter drafts win
PROBE_EVERY = 32


class DraftLengthPolicy:
    """Args:
        k_max: the method's draft length ``K`` (the largest ``k`` chosen).
    """

    def __init__(self, k_max: int):
        self.k_max = k_max
        self.drafted = [0.0] * k_max
        self.accepted = [0.0] * k_max
        # decayed sums for the least-squares line t = a + c * tokens
        self._n = self._sx = self._sy = self._sxx = self._sxy = 0.0
        self._tokens_seen: set[int] = set()
        self.verify_passes = 0
        self.draft_pass_s: dict[int, float] = {}  # rows -> seconds per drafting position
        self.steps = 0

    # ------------------------------------------------------------------ measurements
    def observe_verify(self, rows: int, tokens: int, seconds: float) -> None:
        """A target pass over ``tokens`` tokens (``rows`` rows) took ``seconds``."""
        keep = 1.0 - DECAY
        self._n = self._n * keep + 1
        self._sx = self._sx * keep + tokens
        self._sy = self._sy * keep + seconds
        self._sxx = self._sxx * keep + tokens * tokens
        self._sxy = self._sxy * keep + tokens * seconds
        self._tokens_seen.add(tokens)
        self.verify_passes += 1

    def observe_propose(self, rows: int, positions: int, seconds: float) -> None:
        """Drafting ``positions`` tokens for ``rows`` rows took ``seconds``."""
        if positions <= 0:
            return
        per = seconds / positions
        old = self.draft_pass_s.get(rows)
        self.draft_pass_s[rows] = per if old is None else old + DECAY * (per - old)

    def observe_draft(self, drafted: int, accepted: int) -> None:
        """One row's draft of ``drafted`` tokens had its first ``accepted`` kept."""
        for i in range(min(drafted, self.k_max)):
            self.drafted[i] += 1
            if i < accepted:
                self.accepted[i] += 1

    # ------------------------------------------------------------------ model
    def verify_time(self, tokens: int) -> float | None:
        """Predicted seconds of a target pass over ``tokens`` tokens (``None``: not known yet)."""
        n, sx, sy, sxx, sxy = self._n, self._sx, self._sy, self._sxx, self._sxy
        det = n * sxx - sx * sx
        if n < 2 or len(self._tokens_seen) < 2 or det <= 1e-12 * max(1.0, n * sxx):
            return None
        c = (n * sxy - sx * sy) / det
        a = (sy - c * sx) / n
        return max(a + c * tokens, 1e-9)

    def draft_time(self, rows: int) -> float | None:
        if not self.draft_pass_s:
            return None
        if rows in self.draft_pass_s:
            return self.draft_pass_s[rows]
        nearest = min(self.draft_pass_s, key=lambda r: abs(r - rows))
        return self.draft_pass_s[nearest]

    def expected_tokens(self, k: int) -> float:
        """``E(k)``: expected tokens a row emits in a step that drafts ``k``."""
        return expected_tokens(reach_from_counts(self.accepted, self.drafted), k)

    def throughput(self, rows: int, k: int) -> float | None:
        """Predicted tokens/s of ``rows`` rows drafting ``k`` (``None``: costs not known yet)."""
        t_v = self.verify_time(rows * (k + 1))
        t_d = self.draft_time(rows) if k else 0.0
        if t_v is None or t_d is None:
            return None
        return tokens_per_second(rows, k, reach_from_counts(self.accepted, self.drafted), t_v, t_d)

    # ------------------------------------------------------------------ decision
    def limit(self, rows: int) -> int:
        """The largest draft length this step may use with ``rows`` rows in flight."""
        self.steps += 1
        if self.verify_passes < MIN_OBSERVATIONS or self.verify_time(1) is None:
            # explore: a few cheaper passes give the cost line its second point
            return self.k_max if self.steps % 4 else max(0, self.k_max // 2 - 1)
        if self.steps % PROBE_EVERY == 0:
            return self.k_max
        scores = {k: self.throughput(rows, k) for k in range(self.k_max + 1)}
        if any(v is None for v in scores.values()):
            return self.k_max
        return max(scores, key=lambda k: (scores[k], -k))
