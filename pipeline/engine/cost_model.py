"""Expected tokens per step and tokens per second of speculative decoding, from measured
acceptance and measured costs: the one formula that both the engine's draft-length
controller (:mod:`pipeline.engine.draft_control`) and the tuner (:mod:`pipeline.tune`) use,
and the engine's measured cost curve ``t(tokens, rows)`` (:class:`CostCurve`).

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

from collections import deque
from typing import Sequence

#: a cost is the lower median of the last this many observations of its shape (it follows the machine)
WINDOW = 9
#: observations of one shape after which its own median replaces the fit
TABLE_AFTER = 2
#: observations, at two widths or more, before the curve is trusted
MIN_OBSERVATIONS = 6
#: weight of a new proposer call in its decayed fit
DECAY = 0.05

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


class _DecayedFit:
    """Decayed least squares ``y ~ x @ w`` over 3 features, in plain Python (it is solved once
    per step: a tensor library's call costs more than the sums); the solution is the ridge one
    with a vanishing ridge, the minimum-norm one where the features observed so far do not
    determine every weight (e.g. a single batch size)."""

    def __init__(self, n: int = 3):
        self.n = n
        self.xtx = [[0.0] * n for _ in range(n)]
        self.xty = [0.0] * n
        self.count = 0
        self._w: list[float] | None = None

    def observe(self, x: Sequence[float], y: float, decay: float = DECAY) -> None:
        keep = 1.0 - decay
        for i in range(self.n):
            self.xty[i] = self.xty[i] * keep + x[i] * y
            for j in range(self.n):
                self.xtx[i][j] = self.xtx[i][j] * keep + x[i] * x[j]
        self.count += 1
        self._w = None

    def predict(self, x: Sequence[float]) -> float:
        if self._w is None:
            self._w = _solve(self.xtx, self.xty)
        return sum(a * b for a, b in zip(self._w, x))


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """``(a + r I) w = b`` by Gaussian elimination with partial pivoting, ``r`` a vanishing
    ridge (``1e-9`` of the trace): ``a`` is a normal matrix, symmetric positive semi-definite."""
    n = len(b)
    ridge = 1e-9 * sum(a[i][i] for i in range(n)) + 1e-30
    m = [[a[i][j] + (ridge if i == j else 0.0) for j in range(n)] + [b[i]] for i in range(n)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        m[c], m[p] = m[p], m[c]
        if m[c][c] == 0.0:
            continue
        for r in range(n):
            if r != c and m[r][c]:
                f = m[r][c] / m[c][c]
                m[r] = [x - f * y for x, y in zip(m[r], m[c])]
    return [m[i][n] / m[i][i] if m[i][i] else 0.0 for i in range(n)]


class CostCurve:
    """The measured cost of a speculative step on this machine, ``t(tokens, rows)``.

    - :meth:`seconds` ``(rows, width)``: a step's verification, one target pass over ``rows``
      rows of ``width`` tokens each (rows are padded to the widest: the last committed token
      and the longest draft) plus the step's settling (acceptance, commit, rollback): the lower
      median of the last :data:`WINDOW` steps measured at that shape once there are
      :data:`TABLE_AFTER`, else ``a + b*rows + c*rows*width``, a least-squares fit of every
      measured shape's median (weighted by its observations); never less than a narrower
      pass's (a median below a narrower one's is noise).  The first step of each shape is not
      counted: it pays one-time costs (a kernel measured or compiled for that shape, caches
      grown), as does a whole pass now and then on a shared machine, which the median ignores.
    - :meth:`propose_seconds`: a proposer call, ``p0 + p1*max k + p2*sum k`` (a drafter's pass
      per draft position, its per-row work), a decayed fit of the measured calls.

    Filled from every step's timings (:meth:`observe`, :meth:`observe_propose`) so that it
    follows the machine; the engine's warm-up fills it before the timed work, at the job's
    batch sizes.  Seconds of the engine's clock.
    """

    def __init__(self):
        self.propose = _DecayedFit(3)
        self.table: dict[tuple[int, int], deque[float]] = {}  # (rows, width) -> the last WINDOW steps
        self._fit: list[float] | None = None

    def observe(self, rows: int, width: int, seconds: float) -> None:
        """A step of ``rows`` rows whose pass had ``width`` tokens per row verified in ``seconds``."""
        window = self.table.get((rows, width))
        if window is None:  # the shape's first step: one-time costs, not counted
            self.table[(rows, width)] = deque(maxlen=WINDOW)
            return
        window.append(seconds)
        self._fit = None

    def observe_propose(self, asked: Sequence[int], seconds: float) -> None:
        """A proposer call asking each row for ``asked[i]`` tokens took ``seconds``."""
        asked = [k for k in asked if k > 0]
        if asked:
            self.propose.observe((1.0, max(asked), sum(asked)), seconds)

    @property
    def ready(self) -> bool:
        """Whether enough steps, at more than one width, were measured to predict any shape."""
        counted = {w: len(v) for (_, w), v in self.table.items() if len(v) >= TABLE_AFTER}
        return len(counted) > 1 and sum(len(v) for v in self.table.values()) >= MIN_OBSERVATIONS

    def seconds(self, rows: int, width: int) -> float:
        """Predicted seconds of a step's verification at ``(rows, width)`` (see the class)."""
        return max(self._seconds(rows, w) for w in range(1, width + 1))

    def _seconds(self, rows: int, width: int) -> float:
        window = self.table.get((rows, width))
        if window is not None and len(window) >= TABLE_AFTER:
            return _lower_median(window)
        if self._fit is None:
            fit = _DecayedFit(3)
            for (b, w), v in self.table.items():
                if v:  # weighted by the shape's observations
                    r = len(v) ** 0.5
                    fit.observe((r, b * r, b * w * r), _lower_median(v) * r, decay=0.0)
            fit.predict((0.0, 0.0, 0.0))
            self._fit = fit._w
        a, b, c = self._fit
        return max(a + b * rows + c * rows * width, 1e-9)
    def propose_seconds(self, asked: Sequence[int]) -> float:
        """Predicted seconds of a proposer call asking for ``asked`` tokens per row (0 when
        none asks, or before any call was measured)."""
        asked = [k for k in asked if k > 0]
        return self.proposing(max(asked), sum(asked)) if asked else 0.0

    def proposing(self, longest: int, total: int) -> float:
        """Predicted seconds of a proposer call whose longest ask is ``longest`` tokens and
        whose asks sum to ``total`` (0 when ``total`` is 0 or before any call was measured)."""
        p0, p1, p2 = self.propose_weights()
        return max(p0 + p1 * longest + p2 * total, 0.0) if total else 0.0

    def propose_weights(self) -> tuple[float, float, float]:
        """``(p0, p1, p2)`` of the proposer's cost ``p0 + p1*max k + p2*sum k`` (zeros before
        any call was measured)."""
        if not self.propose.count:
            return 0.0, 0.0, 0.0
        self.propose.predict((0.0, 0.0, 0.0))
        return tuple(self.propose._w)


def _lower_median(values) -> float:
    """The lower median (of an even count, the smaller middle value)."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]
