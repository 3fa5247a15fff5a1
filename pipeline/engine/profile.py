"""Measured costs of one engine on this machine, for the tuner's prediction
(:mod:`pipeline.tune`).

:func:`profile_engine` makes two measurements at each batch size ``B``, on real prompts
(their context lengths set the attention cost):

- :func:`verification_costs` -- ``t(n, B)``: seconds of one target pass that verifies
  ``n`` tokens in each of ``B`` rows (what a step with a draft of ``n - 1`` tokens
  costs the target; ``n = 1`` is a plain decoding step), for every ``n`` asked;
- :func:`step_costs` -- real engine steps (propose -> verify -> accept -> commit) of
  ``B`` rows drafting ``k`` tokens each, split into the proposer's time, the
  verification pass and the loop's bookkeeping (acceptance, commit, stop checks).

Every figure is the median of ``repeats`` timings after one warm-up; times are seconds
of the engine's clock (wall time unless it was built with another; on a GPU each timed
pass of :func:`verification_costs` is synchronised).  Rows are admitted as the batch
sizes grow (target prefill, and the proposer's own admission such as a drafter's
prefill, timed per prompt token); each batch size uses the first ``B`` of them.
Steps really decode (the rows grow by what they accept), without EOS or stop strings so
that no row ends while it is measured.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field

import torch

from .batch import RowState
from .settings import GenerationSettings, resolve_generation_settings


@dataclass
class StepCost:
    """Median costs of one engine step of ``rows`` rows asked to draft ``k`` tokens each.

    Attributes:
        rows: rows in flight (``B``).
        k: draft length asked (0: plain steps).
        width: tokens per row in the verification pass (the longest draft + 1).
        drafted: draft tokens per row (mean; below ``k`` when a proposer finds nothing).
        propose_s: seconds the proposer took for all rows.
        verify_s: seconds of the target pass.
        overhead_s: the rest of the step: acceptance, commit, stop checks, rollback.
    """

    rows: int
    k: int
    width: float
    drafted: float
    propose_s: float
    verify_s: float
    overhead_s: float

    @property
    def total_s(self) -> float:
        return self.propose_s + self.verify_s + self.overhead_s


@dataclass
class EngineProfile:
    """What :func:`profile_engine` measured for one engine.

    Attributes:
        method: the engine's method.
        verify_s: ``{B: {n: seconds}}``, ``t(n, B)`` of the target pass (empty unless asked).
        steps: one :class:`StepCost` per ``(B, k)`` measured.
        admit_s_per_token: the proposer's admission of a row (a drafter's prefill) per
            prompt token, seconds (0 for proposers without one).
        prefill_s_per_token: the target's prefill per prompt token, seconds.
        seconds: how long the profiling took (engine clock).
    """

    method: str
    verify_s: dict[int, dict[int, float]] = field(default_factory=dict)
    steps: list[StepCost] = field(default_factory=list)
    admit_s_per_token: float = 0.0
    prefill_s_per_token: float = 0.0
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _sync(device) -> None:
    if getattr(device, "type", str(device)) == "cuda":
        torch.cuda.synchronize(device)


class _Rows:
    """Rows admitted on demand, in one runner of ``capacity`` slots: :meth:`first` admits
    the missing ones (target prefill, the proposer's admission), timed per prompt token."""

    def __init__(self, engine, prompts: list[list[int]], capacity: int, settings: GenerationSettings):
        self.engine, self.prompts, self.capacity, self.settings = engine, prompts, capacity, settings
        self.runner = engine.bind(capacity)
        self.rows: list[RowState] = []
        self.tokens = 0
        self.admit_s = self.prefill_s = 0.0

    def first(self, b: int) -> list[RowState]:
        new = []
        for i in range(len(self.rows), b):
            # Row i in slot i: B rows are slots 0 .. B-1, as a full batch of the loop is (the
            # scheduler steps its rows in slot order, so they read their caches in place, see
            # SlotLayer.update).  Rows in scattered slots would gather every row's keys and
            # values in every layer, a copy the loop pays only in a batch's ragged tail: that
            # put t(1, 16) at 3-4x the loop's step (issue 54).
            slot = i
            row = self.engine.new_row(i, self.prompts[i % len(self.prompts)], self.settings, slot, self.runner.device)
            if isinstance(row, str):
                raise ValueError(f"cannot profile with prompt {i % len(self.prompts)}: {row}")
            new.append(row)
        if new:
            self.engine.admit(new)
            self.tokens += sum(r.prompt_len for r in new)
            if self.engine.proposer is not None:
                self.admit_s += sum(r.stats.draft_time_s for r in new)
            self.prefill_s += sum(r.stats.prefill_time_s for r in new)
            self.rows += new
        return self.rows[:b]


def _settings(engine, settings: GenerationSettings | None, budget: int) -> GenerationSettings:
    """The job's settings without anything that ends a row (EOS, stop strings) and with
    room for every measured step."""
    s = resolve_generation_settings(settings, engine.target.generation_config, engine.target_vocab)
    return dataclasses.replace(s, max_new_tokens=budget, eos_token_id=[], stop_strings=None)


def verification_costs(engine, rows: list[RowState], widths: list[int], repeats: int = 3) -> dict[int, float]:
    """``t(n, B)`` for ``B = len(rows)``: median seconds of one target pass over ``n`` tokens
    in each row (its last committed token repeated ``n`` times, at its own positions), the
    logits' argmax read back as the loop does.  The rows' committed state is unchanged (the
    positions written are written again by the next pass)."""
    device = engine.runner.device
    slots = [r.slot for r in rows]
    starts = [r.length - 1 for r in rows]
    out: dict[int, float] = {}
    for n in widths:
        tokens = [r.sequence[0, -1:].repeat(n) for r in rows]
        samples = []
        for rep in range(repeats + 1):
            _sync(device)
            t0 = engine.clock()
            logits = engine.target_pass(slots, tokens, starts, n)
            logits.argmax(-1).tolist()
            _sync(device)
            if rep:  # the first is a warm-up
                samples.append(engine.clock() - t0)
        out[n] = statistics.median(samples)
    return out


def step_costs(engine, rows: list[RowState], ks: list[int], repeats: int = 3) -> list[StepCost]:
    """Median costs of real engine steps of ``rows`` for every ``k`` in ``ks``
    (every row asked to draft and verify ``k``: fixed steps, whatever the engine's
    ``draft_length``, :meth:`~pipeline.engine.loop.StepEngine.step`)."""
    out = []
    b = len(rows)
    for k in ks:
        samples = []
        for rep in range(repeats + 1):
            before = [(r.stats.draft_time_s, r.stats.verify_time_s, r.stats.wall_time_s, r.stats.draft_tokens)
                      for r in rows]
            for r in rows:
                r.k = k  # a heuristic schedule moves it; every step asks for k
            engine.step(rows, fixed=True)
            if not rep:
                continue
            d = [(r.stats.draft_time_s - x[0], r.stats.verify_time_s - x[1], r.stats.wall_time_s - x[2],
                  r.stats.draft_tokens - x[3]) for r, x in zip(rows, before)]
            propose, verify, total = (sum(x[i] for x in d) for i in range(3))
            drafted = [x[3] for x in d]
            samples.append((max(drafted) + 1, sum(drafted) / b, propose, verify, max(0.0, total - propose - verify)))
        med = [statistics.median(s[i] for s in samples) for i in range(5)]
        out.append(StepCost(rows=b, k=k, width=med[0], drafted=med[1], propose_s=med[2], verify_s=med[3],
                            overhead_s=med[4]))
    return out


@torch.inference_mode()
def profile_engine(engine, prompts: list[list[int]], batch_sizes: list[int], *, widths: list[int] | None = None,
                   ks: list[int] | None = None, repeats: int = 3,
                   settings: GenerationSettings | None = None, stop_ratio: float | None = None) -> EngineProfile:
    """Measure ``engine`` on ``prompts`` (token id lists; reused in turn when there are
    fewer than ``max(batch_sizes)``).

    Args:
        engine: a :class:`~pipeline.engine.SpeculativeEngine` (its method is profiled;
            its steps are fixed steps, every row drafting the ``k`` measured).
        prompts: real prompts of the corpus (their lengths set the attention cost); a
            prompt that leaves no room in the target's context for the steps measured
            is cut to fit.
        batch_sizes: ``B`` values (rows in flight); capped at what the proposer can batch.
        widths: ``n`` values of :func:`verification_costs` (``None``: not measured).
        ks: ``k`` values of :func:`step_costs` (``None``: ``[0]``, plain steps).
        repeats: timings per figure (their median is kept), after one warm-up.
        settings: the job's generation settings (sampling and logits processors cost time).
        stop_ratio: with ``widths``, batch sizes are measured in increasing order and the
            sweep stops after the first ``B`` whose plain pass costs more per row,
            ``t(1, B) / B``, than ``stop_ratio`` times the cheapest per-row cost of a
            smaller ``B``: batching no longer pays there (the profile then has only the
            ``B`` measured).

    Returns:
        An :class:`EngineProfile`.

    Raises:
        ValueError: a prompt the engine cannot run (empty, too long for the context).
    """
    t0 = engine.clock()
    limit = engine.method.max_rows
    sizes = sorted({b for b in batch_sizes if limit is None or b <= limit}) or [1]
    ks = list(ks) if ks else [0]
    # the first rows take part at every batch size: room for all their steps and the widest pass
    budget = len(sizes) * (repeats + 1) * sum(k + 1 for k in ks) + 1
    if engine.context is not None:
        room = engine.context - max(budget, max(widths or [1])) - 1
        if room < 2:
            raise ValueError(f"the target's context ({engine.context} positions) leaves no room to profile "
                             f"{len(ks)} draft lengths with {repeats} repeats")
        prompts = [list(p)[:room] for p in prompts]
    rows = _Rows(engine, prompts, max(sizes), _settings(engine, settings, budget))
    profile = EngineProfile(method=engine.spec.method)
    cheapest = None  # the lowest per-row cost of a plain pass so far
    for b in sizes:
        batch = rows.first(b)
        if widths:
            profile.verify_s[b] = verification_costs(engine, batch, list(widths), repeats)
        profile.steps += step_costs(engine, batch, ks, repeats)
        if widths and stop_ratio is not None:
            per_row = profile.verify_s[b][widths[0]] / b
            if cheapest is not None and per_row > stop_ratio * cheapest:
                break
            cheapest = per_row if cheapest is None else min(cheapest, per_row)
    profile.admit_s_per_token = rows.admit_s / rows.tokens
    profile.prefill_s_per_token = rows.prefill_s / rows.tokens
    profile.seconds = engine.clock() - t0
    return profile
