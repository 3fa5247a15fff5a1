"""Predicted tokens/s of every candidate (method, draft length k, batch size B) from the
pilot's acceptance and the measured costs.

The step model is Leviathan et al. (2023, §3) generalised with measured costs, in one
place (:mod:`pipeline.engine.cost_model`, shared with the engine's draft-length controller):
a step of ``b`` rows drafting ``k`` tokens each emits ``E(k) = 1 + A_1 + … + A_k`` tokens
per row and takes::

    T(b, k) = t_verify(b, n) + t_draft_step(b) + k · t_draft_token(b) + t_overhead(b)

with ``A_i`` the pilot's chance, per verify step, that the first ``i`` draft tokens are all
accepted; ``t_verify(b, n)`` the measured target pass over ``n = k + 1`` tokens per row
(``n = 1`` when no row of the step has a draft: with a per-row draft rate ``h``, the chance
that some row drafts is ``1 − (1 − h)^b``); the proposer's measured cost as a line in
``k``; and the loop's measured bookkeeping per step.  Costs measured at a few ``b`` and
``n`` are interpolated linearly between them.

A job is more than steady steps, so the prediction replays the pilot rows through the
actor's schedule: rows arrive in batches of ``rows_per_batch``; up to ``B`` are in flight,
each needing ``⌈N_r / E(k)⌉`` steps (``N_r`` its new tokens: greedy outputs are the same
for every method), a finished row's slot takes the next row at once and the last rows of
a batch drain with fewer rows in flight; each row also pays its target prefill (measured
on the pilot), its proposer admission (a drafter's prefill, per prompt token) and its
share of the per-row work outside the steps (tokenizing, results).  Predicted tokens/s =
Σ N_r / Σ seconds.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from pipeline.engine import cost_model
from pipeline.engine.methods import PLAIN


@dataclass
class PilotRow:
    """One pilot row as the prediction sees it.

    Attributes:
        prompt_tokens: prompt length (tokens).
        new_tokens: tokens it generates (mean over the pilot runs; the same in each when greedy).
        prefill_s: the target's prefill of its prompt (seconds).
        outside_s: per-row work outside the engine's steps: building the prompt, the
            engine's row set-up and results (seconds).
    """

    prompt_tokens: int
    new_tokens: float
    prefill_s: float
    outside_s: float = 0.0


def interpolate(table: dict[float, float], x: float) -> float:
    """Piecewise-linear ``table[x]``: clamped below the smallest key, extended along the last
    segment above the largest (costs keep growing with rows and tokens)."""
    keys = sorted(table)
    if len(keys) == 1 or x <= keys[0]:
        return table[keys[0]]
    for lo, hi in zip(keys, keys[1:]):
        if x <= hi:
            break
    return table[lo] + (table[hi] - table[lo]) * (x - lo) / (hi - lo)


def line_fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``y = a + c·x`` through ``(x, y)`` points, with ``a, c >= 0`` (a cost
    never falls with more drafting); one point gives ``a = 0, c = y / x``."""
    if len(points) == 1 or len({x for x, _ in points}) == 1:
        x = sum(p[0] for p in points) / len(points)
        y = sum(p[1] for p in points) / len(points)
        return (0.0, y / x) if x else (y, 0.0)
    n = len(points)
    sx = sum(x for x, _ in points)
    sy = sum(y for _, y in points)
    sxx = sum(x * x for x, _ in points)
    sxy = sum(x * y for x, y in points)
    c = (n * sxy - sx * sy) / (n * sxx - sx * sx)
    a = (sy - c * sx) / n
    if c < 0:
        return sy / n, 0.0
    if a < 0:
        return 0.0, sxy / sxx
    return a, c


@dataclass
class MethodModel:
    """What the prediction knows of one method.

    Attributes:
        method: its name; ``params``: its other SpeculationSettings fields (e.g.
            ``max_matching_ngram_size``, ``assistant_early_exit``).
        k_max: the longest draft measured (``K``; 0 for plain).
        reach: ``A_1 … A_K`` per verify step (pilot).
        draft_rate: verify steps with a draft / verify steps (pilot; 1 for a drafter,
            below 1 for prompt lookup).
        verify: ``{B: {n: seconds}}`` target passes (the target's ``t(n, B)``, or the
            method's own verification through its hook, at the widths measured).
        propose: ``{B: (seconds per step, seconds per draft token)}``.
        overhead: ``{B: seconds per step}`` of bookkeeping.
        admit_s_per_token: the proposer's admission of a row (a drafter's prefill), per prompt token.
        max_rows: the most rows it drafts for at once (``None``: any).
    """

    method: str
    k_max: int = 0
    reach: list[float] = field(default_factory=list)
    draft_rate: float = 0.0
    verify: dict[int, dict[int, float]] = field(default_factory=dict)
    propose: dict[int, tuple[float, float]] = field(default_factory=dict)
    overhead: dict[int, float] = field(default_factory=dict)
    admit_s_per_token: float = 0.0
    max_rows: int | None = None
    params: dict = field(default_factory=dict)

    def verify_time(self, rows: int, tokens: int) -> float:
        """``t_verify(rows, tokens per row)``, interpolated over the measured grid."""
        return interpolate({b: interpolate(row, tokens) for b, row in self.verify.items()}, rows)

    def step_time(self, rows: int, k: int) -> float:
        """``T(rows, k)`` (seconds): see the module docstring."""
        if k == 0 or not self.propose:
            return cost_model.step_time(self.verify_time(rows, 1), 0, overhead_s=self._overhead(rows))
        some = 1.0 - (1.0 - self.draft_rate) ** rows
        verify = some * self.verify_time(rows, k + 1) + (1.0 - some) * self.verify_time(rows, 1)
        per_step = interpolate({b: v[0] for b, v in self.propose.items()}, rows)
        per_token = interpolate({b: v[1] for b, v in self.propose.items()}, rows)
        return cost_model.step_time(verify, k, per_token, per_step, self._overhead(rows))

    def _overhead(self, rows: int) -> float:
        return interpolate(self.overhead, rows) if self.overhead else 0.0

    def expected_tokens(self, k: int) -> float:
        """``E(k)`` tokens per row per step."""
        return cost_model.expected_tokens(self.reach, k)

    def steady_tokens_per_second(self, rows: int, k: int) -> float:
        """``b · E(k) / T(b, k)``: tokens/s of ``rows`` rows in flight, prefill and drain left out."""
        t = self.step_time(rows, k)
        return rows * self.expected_tokens(k) / t


@dataclass
class Candidate:
    """One setting of the job: method, draft length ``k``, batch size, rows per batch.

    ``predicted_*`` come from :func:`predict_seconds` over the pilot rows, times the
    calibration against the pilot runs (``model_tokens_per_s``: without it);
    ``measured_*`` from the confirmation runs on the first pilot rows (``None`` until
    confirmed; the median of its interleaved rounds, ``round_s``), whose own prediction is
    ``confirm_predicted_tokens_per_s``."""

    method: str
    k: int
    batch_size: int
    rows_per_batch: int
    predicted_s: float = 0.0
    predicted_tokens_per_s: float = 0.0
    model_tokens_per_s: float = 0.0
    confirm_predicted_tokens_per_s: float | None = None
    measured_s: float | None = None
    measured_tokens_per_s: float | None = None
    #: seconds of each confirmation round, the prompts' build time included (``measured_s``: their median)
    round_s: list[float] = field(default_factory=list)
    same_output: int | None = None
    compared_rows: int | None = None
    params: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        """``method k=K[ extras] B=B``: ``k`` is the draft length the prediction assumes and the
        cap of the draft-length controller in the confirmation runs and the tuned config."""
        k = f" k={self.k}" if self.method != PLAIN else ""
        extra = ""
        if self.params.get("num_assistant_tokens_schedule", "constant") != "constant":
            extra += f" schedule={self.params['num_assistant_tokens_schedule']}"
        if self.params.get("assistant_confidence_threshold"):
            extra += f" threshold={self.params['assistant_confidence_threshold']}"
        if (self.params.get("num_candidates") or 1) > 1:
            extra += f" trees={self.params['num_candidates']}"
        return f"{self.method}{k}{extra} B={self.batch_size}"


def predict_seconds(model: MethodModel, rows: list[PilotRow], k: int, batch_size: int, rows_per_batch: int) -> float:
    """Seconds to decode ``rows`` with ``model``'s method, draft length ``k``, ``batch_size``
    rows in flight and ``rows_per_batch`` rows per actor call (module docstring)."""
    e = model.expected_tokens(k)
    step = [0.0] + [model.step_time(b, k) for b in range(1, batch_size + 1)]
    total = 0.0
    for start in range(0, len(rows), rows_per_batch):
        waiting = deque(rows[start:start + rows_per_batch])
        active: list[int] = []  # steps each row in flight still needs
        while waiting or active:
            while waiting and len(active) < batch_size:
                r = waiting.popleft()
                total += r.prefill_s + r.outside_s + model.admit_s_per_token * r.prompt_tokens
                active.append(max(1, math.ceil(r.new_tokens / e - 1e-9)))
            # step until the next row finishes (no admission can happen before)
            n = min(active)
            total += n * step[len(active)]
            active = [s - n for s in active if s > n]
    return total


def default_rows_per_batch(batch_size: int, configured: int) -> int:
    """Rows per actor call for a batch size: at least 4 batches' worth, so the drain at the
    end of each call (rows in flight falling below ``B``) stays a small share."""
    return max(configured, 4 * batch_size)


def rank_candidates(models: list[MethodModel], rows: list[PilotRow], batch_sizes: list[int],
                    configured_rows_per_batch: int) -> list[Candidate]:
    """Every (method, k in 0 or 1..K, B) predicted over the pilot ``rows``, best first."""
    total_tokens = sum(r.new_tokens for r in rows)
    out = []
    for m in models:
        sizes = [b for b in batch_sizes if m.max_rows is None or b <= m.max_rows] or [1]
        for b in sizes:
            per_batch = default_rows_per_batch(b, configured_rows_per_batch)
            for k in (range(1, m.k_max + 1) if m.method != PLAIN else [0]):
                s = predict_seconds(m, rows, k, b, per_batch)
                rate = total_tokens / s if s else 0.0
                out.append(Candidate(m.method, k, b, per_batch, predicted_s=s, predicted_tokens_per_s=rate,
                                     model_tokens_per_s=rate, params=dict(m.params)))
    out.sort(key=lambda c: (-c.predicted_tokens_per_s, c.k, c.batch_size))
    return out


def calibrate(candidates: list[Candidate], predicted_s: float, measured_s: float) -> float:
    """Scale every candidate's prediction by ``measured_s / predicted_s`` (the pilot runs'
    measured seconds over their predicted ones: what the model leaves out, such as the
    skew of step times that medians hide, measured on the same rows at the same time).
    The ranking does not change.  Returns the factor."""
    factor = measured_s / predicted_s if predicted_s > 0 and measured_s > 0 else 1.0
    for c in candidates:
        c.predicted_s *= factor
        c.predicted_tokens_per_s /= factor
    return factor
