"""The draft-length controller: one verification width per step, shared by the rows in flight.

How many draft tokens each row verifies this step (0 included) is decided here, for all the
rows of a step together, at three points of the loop (:mod:`pipeline.engine.loop`):

1. :meth:`DraftController.lengths`, before proposing: how many tokens to ask each row's proposer
   for, returned as a :class:`StepPlan`;
2. :meth:`DraftController.cut`, after proposing: which of a row's drafts to verify (a proposer may
   offer one per source, :attr:`Draft.alternatives <pipeline.engine.proposers.base.Draft>`)
   and how many of its tokens; a token tree's node count; the plan with the drafts to verify;
3. :meth:`DraftController.observe`, after verifying: the plan, the accepted tokens and the
   step's timings.

The step is a value: the plan carries everything of a step from one call to the next, and the
controller keeps only what it learns (calibration and acceptance by position, the cost curve,
the tree sizer, the share of asked tokens the cut keeps, the probe schedule).  Names: ``k`` is a
row's cap on draft tokens (``caps``), ``k_max`` the method's ``k``; the engine's
``draft_length`` (``"auto"`` or ``"fixed"``) is the controller's ``fixed``.  The
``heuristic`` schedule of transformers (``num_assistant_tokens_schedule``) moves a row's ``k``
here too (:meth:`DraftController.next_k`).

**Admission by marginal value** (as vLLM's adaptive verification).  Draft position ``j`` of row
``i`` is worth its *survival* ``s_ij = a_i1 * ... * a_ij``, the chance that the row's first
``j`` draft tokens are all accepted, in expected accepted tokens
(:func:`~pipeline.engine.cost_model.expected_tokens` sums them).  A step of ``B`` rows whose
longest verified draft has ``W - 1`` tokens costs ``t(B, W)`` (rows are padded to the widest,
so every row pays for ``W`` positions; :class:`~pipeline.engine.cost_model.CostCurve`) plus,
before proposing, the proposer's ``p0 + p1 * max k + p2 * sum k``.  Positions are admitted
across the batch, highest survival first, while the step's expected tokens per second
``(B + sum of admitted survivals) / seconds`` grows (each width tried: the pass widens to the
longest admitted row); the step drafts nothing, a plain step, unless its best beats a plain
step by :data:`MIN_GAIN`.  After proposing the proposer's time is spent and the positions
within the pass's width cost nothing more, so the cut keeps of every row ``min(W, n_i)``
tokens for the width ``W`` of the best rate.  A proposer whose asked drafts cost under
:data:`FREE_PROPOSER` of a plain step (prompt lookup, suffix) is asked for its cap and the
cut alone decides.  :class:`Admission` records each decision: every position offered with its
survival, the width, the predicted seconds and the price of one more token of width
(``explain`` answers "why did this row draft 2 tokens this step?").

**Expected accepted tokens.**  ``a_ij`` is the proposer's own confidence in the token
(:attr:`Draft.confidence`: suffix's frequencies, prompt lookup's recurrence, a drafter's or a
head's top probability), calibrated against measured acceptance per source
(:class:`Acceptance`: a table by confidence bin, each bin starting at its own confidence with
the weight of :data:`CALIBRATION_PRIOR` tokens), else the source's measured acceptance by
position; then moved towards the row's own record (:class:`RowEvidence`: what it accepted
against what was predicted for it, shrunk with the weight of :data:`ROW_PRIOR` tokens).  Of a
row's drafts the one with the most expected accepted tokens is verified.  A greedy or
point-mass draft's tokens past the verified ones are judged for free against the tokens the
step emitted (the emitted token has the target's law, so its chance of equalling a point-mass
draft's is that draft's acceptance), and so are the drafts not chosen.

**Sampling stays exact.**  Rejection sampling (Leviathan et al. 2023) emits the target's law at
position ``j`` whether position ``j`` is verified or the target's token is drawn there, as long
as the decision to verify ``j`` does not depend on the drafted token ``x_j`` (nor on anything
drawn after it) given the tokens before it.  So: a draft that is a point mass (``probs is
None``: prompt lookup, suffix, a reference) is a function of the committed text, and any cut
of it is allowed; a draft sampled from a drafter's ``q`` is cut by a *stopping rule*
(SpecDec++, Huang et al. 2024): position ``j`` is verified iff each position up to ``j`` has
``s_ij >= lambda_ij``, where ``s_ij`` uses confidences known before the draws (the top
probability of ``q_j``, never ``q_j(x_j)``) and ``lambda_ij = (t(B, j+1) - t(B, j)) / t(B, j) *
(1 + s_i1 + ... + s_i,j-1)`` depends on costs and earlier positions only; the pass's width is
then never below such a row's length, and which draft such a row verifies is chosen from
estimates that ignore its draws.  Static ensemble verification (lossy) keeps a fixed ``k``.
Greedy outputs never depend on the controller; a sampled output keeps the target's law, but the
draws a seed gives follow the chosen lengths, which follow measured times: with
``draft_length="fixed"`` (every row its cap) a seed reproduces its output.

Until the cost curve is measured (a few steps at two widths; the engine's warm-up measures it
before the timed work) steps verify 0, 1, 0 and 2 tokens in turn (:data:`EXPLORE`).  A costly
proposer whose drafts do not pay is still asked now and then (a probe: one row, one token
more, every :data:`PROBE_EVERY` steps, doubling while it still does not pay), so acceptance
keeps being measured.  :meth:`DraftController.reset_learning` drops what was learnt of acceptance
and keeps the cost curve.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

from .cost_model import CostCurve
from .proposers.base import Draft
from .tree_size import TreeSizer

#: a step drafts only when its predicted tokens per second beat a plain step's by this share
#: (near break-even the model's errors would make a method slower than plain decoding)
MIN_GAIN = 0.05
#: a proposer whose asked drafts are predicted to cost below this share of a plain step is
#: asked for its cap, and the cut alone decides on the drafts as they came
FREE_PROPOSER = 0.02
#: confidence bins of the calibration (per source)
CALIBRATION_BINS = 10
#: a confidence bin starts at its confidence with the weight of this many measured tokens
CALIBRATION_PRIOR = 4.0
#: a position of a source without confidence starts at the position before's estimate ...
POSITION_PRIOR = 4.0
#: ... and the first at this acceptance
FIRST_POSITION = 0.5
#: a row's record starts as this many tokens accepted as predicted
ROW_PRIOR = 4.0
#: tokens verified by the steps before the cost curve is measured, in turn
EXPLORE = (0, 1, 0, 2)
#: a probe every this many steps (doubling while drafting does not pay, up to MAX_PROBE_EVERY)
PROBE_EVERY = 32
MAX_PROBE_EVERY = 1024
#: the pooled position table of every verified draft (the prior of :meth:`DraftController.lengths`)
ANY = "*"


@dataclass
class RowEvidence:
    """One row's acceptance against the controller's estimates for it (``RowState.evidence``)."""

    evaluated: float = 0.0
    accepted: float = 0.0
    expected: float = 0.0

    def adjust(self, a: float) -> float:
        """``a``, an estimate for this row, moved towards what the row measured: hits scaled
        by ``(accepted + R) / (expected + R)`` when it did worse than predicted, misses by
        ``(missed + R) / (expected missed + R)`` when better (``R`` = :data:`ROW_PRIOR`)."""
        hit = (self.accepted + ROW_PRIOR) / (self.expected + ROW_PRIOR)
        if hit <= 1.0:
            return a * hit
        miss = (self.evaluated - self.accepted + ROW_PRIOR) / (self.evaluated - self.expected + ROW_PRIOR)
        return 1.0 - (1.0 - a) * miss

    def observe(self, estimate: float, accepted: bool) -> None:
        self.evaluated += 1.0
        self.accepted += accepted
        self.expected += estimate


class Acceptance:
    """Measured acceptance, per source: against the proposer's confidence (a calibration table
    of :data:`CALIBRATION_BINS` bins) and by draft position (``[accepted, evaluated]`` counts)."""

    def __init__(self):
        self.bins: dict[tuple[str, int], list[float]] = {}
        self.positions: dict[tuple[str, int], list[float]] = {}

    def estimates(self, source: str, confidence: Sequence[float] | None, n: int) -> list[float]:
        """``a_1 .. a_n`` of a draft of ``source``: calibrated confidences, else by position."""
        if confidence is not None:
            out = []
            for c in confidence[:n]:
                hits, seen = self.bins.get((source, _bin(c)), (0.0, 0.0))
                out.append((hits + CALIBRATION_PRIOR * c) / (seen + CALIBRATION_PRIOR))
            return out
        out, prior = [], FIRST_POSITION
        for j in range(n):
            hits, seen = self.positions.get((source, j), (0.0, 0.0))
            prior = (hits + POSITION_PRIOR * prior) / (seen + POSITION_PRIOR)
            out.append(prior)
        return out

    def observe(self, source: str, confidence: float | None, position: int, accepted: bool) -> None:
        keys = [(self.positions, (source, position))]
        if confidence is not None:
            keys.append((self.bins, (source, _bin(confidence))))
        for table, key in keys:
            entry = table.setdefault(key, [0.0, 0.0])
            entry[0] += accepted
            entry[1] += 1.0


def _bin(c: float) -> int:
    return min(max(int(c * CALIBRATION_BINS), 0), CALIBRATION_BINS - 1)


@dataclass
class Admission:
    """Why a step verifies what it does (one per :meth:`DraftController.lengths` or :meth:`~DraftController.cut`).

    Attributes:
        phase: ``"lengths"`` (tokens asked of the proposer) or ``"cut"`` (tokens verified).
        way: ``"gain"`` (by marginal value), ``"free"`` (a free proposer: asked its cap),
            ``"fixed"``, ``"explore"`` (the cost curve is not measured yet) or ``"probe"``.
        lengths: per row the tokens asked or verified.
        survival: per row the survival of each position offered (the chosen draft's).
        sources: per row the chosen draft's source (``None`` before proposing).
        width: the pass's tokens per row (longest length + 1).
        seconds: predicted seconds of the step at that width (the proposer's included before proposing).
        plain_seconds: predicted seconds of a plain step.
        marginal_seconds: the price of one more token of width: ``t(B, width + 1) - t(B, width)``.
        tokens: the step's expected tokens (``B`` plus the admitted survivals).
    """

    phase: str
    way: str
    lengths: list[int]
    survival: list[list[float]] = field(default_factory=list)
    sources: list[str | None] = field(default_factory=list)
    width: int = 1
    seconds: float = 0.0
    plain_seconds: float = 0.0
    marginal_seconds: float = 0.0
    tokens: float = 0.0

    def explain(self, row: int) -> str:
        """One line: why ``row`` verifies (or asks for) what it does this step."""
        n, s = self.lengths[row], self.survival[row] if self.survival else []
        kept = ", ".join(f"{x:.2f}" for x in s[:n]) or "none"
        left = f"; next position {s[n]:.2f}" if n < len(s) else ""
        src = f" from {self.sources[row]}" if self.sources and self.sources[row] else ""
        return (f"{self.phase} ({self.way}): row {row} {n} token(s){src}, survival {kept}{left}; width {self.width}, "
                f"{self.tokens:.2f} tokens in {1e3 * self.seconds:.1f} ms against plain "
                f"{len(self.lengths)} in {1e3 * self.plain_seconds:.1f} ms; one more token of width "
                f"{1e3 * self.marginal_seconds:.2f} ms")


@dataclass(frozen=True)
class Pick:
    """A row's chosen draft (:meth:`DraftController.cut`), judged by :meth:`DraftController.observe`."""

    primary: Draft
    chosen: Draft
    prior: tuple[float, ...]  # calibrated estimates before the row's record (what its record is judged against)
    survival: tuple[float, ...]
    verified: Draft | None = None


@dataclass(frozen=True)
class StepPlan:
    """One step of the controller, as a value: :meth:`DraftController.lengths` makes it,
    :meth:`DraftController.cut` returns it with the drafts to verify, :meth:`DraftController.observe`
    reads it.  Nothing of a step is kept in the controller between the three calls; the
    controller keeps only what it learns (calibration, acceptance by position, cost curve,
    tree sizer, probe schedule).

    Attributes:
        lengths: per row the draft tokens asked of its proposer (``0 .. k``, ``k`` the row's cap).
        step: the controller's step number (1 for the first; which :data:`EXPLORE` width an
            exploring step takes).
        sampled: the rows sample (a drafter's draws are cut by the stopping rule).
        fixed: every row verifies its cap and its primary draft (the controller's ``fixed``, or
            asked for this step: :meth:`DraftController.lengths`'s ``fixed``).
        free: the proposer was asked for its cap, its drafts costing nearly nothing (:data:`FREE_PROPOSER`).
        probing: a probe step (one row one token more, or one token of width more).
        picks: after :meth:`~DraftController.cut`, per row the chosen and verified draft.
    """

    lengths: tuple[int, ...]
    step: int
    sampled: bool = False
    fixed: bool = False
    free: bool = False
    probing: bool = False
    picks: tuple[Pick, ...] = ()

    @property
    def drafts(self) -> list[Draft]:
        """The drafts to verify, one per row (after :meth:`~DraftController.cut`)."""
        return [p.verified for p in self.picks]

    @property
    def explore(self) -> int:
        """The tokens an exploring step verifies (before the cost curve is measured)."""
        return EXPLORE[(self.step - 1) % len(EXPLORE)]


class DraftController:
    """The draft-length controller of one engine (see the module docstring).

    Args:
        k_max: the method's ``k`` (the most any row drafts, unless fixed).
        fixed: every row verifies its cap and the proposer's primary draft, trees whole (a
            fixed ``k``: the engine's ``draft_length="fixed"``); the costs and acceptance are
            still measured.  One step can be asked fixed too (:meth:`lengths`).
        schedule: how a row's cap ``k`` moves after a step that drafted
            (``num_assistant_tokens_schedule``: ``"constant"`` or ``"heuristic"``;
            :meth:`next_k`); ``"constant"`` for a method that is not adaptive.
    """

    def __init__(self, k_max: int, fixed: bool = False, schedule: str = "constant"):
        self.k_max = k_max
        self.fixed = fixed
        self.schedule = schedule
        self.curve = CostCurve()
        self.record = False  # keep every Admission in history (tests, the docs' plot)
        self.history: list[Admission] = []
        self.last: Admission | None = None
        self.steps = 0
        self.reset_learning()

    def reset_learning(self) -> None:
        """Forget acceptance (calibration, positions, the tree's side-node gain, probes) and the
        recorded admissions; keep the cost curve (the engine's
        :meth:`~pipeline.engine.loop.StepEngine.reset_learning`)."""
        self.history = []
        self.last = None
        self.acceptance = Acceptance()
        self.trees = TreeSizer()
        self.kept: dict[int, list[float]] = {}  # draft position -> [verified, proposed] (what cut() keeps)
        self.probe_every = PROBE_EVERY
        self._next_probe = self.steps + PROBE_EVERY
        self._probe_turn = 0

    def _log(self, admission: Admission) -> None:
        self.last = admission
        if self.record:
            self.history.append(admission)

    # ------------------------------------------------------------------ 1. before proposing
    def lengths(self, rows: Sequence[RowEvidence], caps: Sequence[int], sampled: bool = False,
                fixed: bool = False) -> StepPlan:
        """The step's plan: per row the tokens to ask its proposer for (``plan.lengths``),
        ``0 .. caps[i]``, ``caps[i]`` the row's cap ``k`` (its schedule, token budget and
        context; at most ``k_max`` unless fixed, where a schedule may grow it).  ``fixed``:
        this step verifies every row's cap and primary draft, as a controller built with
        ``fixed=True`` does (the profiler's steps, :mod:`pipeline.engine.profile`)."""
        self.steps += 1
        fixed = fixed or self.fixed
        caps = [max(0, int(c) if fixed else min(int(c), self.k_max)) for c in caps]
        b = len(caps)
        way = "fixed" if fixed else "explore" if not self.curve.ready else None
        probing = way is None and self.steps >= self._next_probe
        if way is None and self.curve.propose_seconds(caps) <= FREE_PROPOSER * self.curve.seconds(b, 1):
            way = "free"
        plan = StepPlan((), self.steps, sampled, fixed, way == "free", probing)
        if way is not None:
            ks = caps if way != "explore" else [min(c, plan.explore) for c in caps]
            self._log(Admission("lengths", way, ks, width=max(ks, default=0) + 1))
            return replace(plan, lengths=tuple(ks))
        survival = [self._asking(r, c) for r, c in zip(rows, caps)]
        ks, adm = self._admit(survival, caps, with_proposer=True)
        open_rows = [i for i, (c, k) in enumerate(zip(caps, ks)) if k < c]
        if probing:  # one row asks one token more (rows in turn): acceptance and costs stay measured
            self._probed(any(ks))
            if open_rows:
                ks[open_rows[self._probe_turn % len(open_rows)]] += 1
                self._probe_turn += 1
                adm.way, adm.width = "probe", max(ks) + 1
        self._log(adm)
        return replace(plan, lengths=tuple(ks))

    def next_k(self, k: int, accepted: int) -> int:
        """A row's cap ``k`` after a step that drafted: under the ``heuristic`` schedule (as
        transformers' ``num_assistant_tokens_schedule``) ``k + 2`` when all ``k`` draft tokens
        were accepted, else ``max(1, k - 1)``; under ``constant``, ``k``."""
        if self.schedule != "heuristic":
            return k
        return k + 2 if accepted == k else max(1, k - 1)

    def _probed(self, paid: bool) -> None:
        """A probe step: the next comes :attr:`probe_every` steps on, an interval that doubles
        (up to :data:`MAX_PROBE_EVERY`) while drafting still does not pay and is
        :data:`PROBE_EVERY` again once it does."""
        self.probe_every = PROBE_EVERY if paid else min(2 * self.probe_every, MAX_PROBE_EVERY)
        self._next_probe = self.steps + self.probe_every

    def _asking(self, row: RowEvidence, cap: int) -> list[float]:
        """What asking a row for each position is worth before its draft is seen: the survival
        of a verified draft by position (pooled, moved by the row's record), times the share of
        proposed tokens at that position the cut has kept (a proposer whose drafts are cut
        short is asked for less); never increasing."""
        out, low = [], 1.0
        survival = _survive([row.adjust(a) for a in self.acceptance.estimates(ANY, None, cap)])
        for j, s in enumerate(survival):
            kept, proposed = self.kept.get(j, (0.0, 0.0))
            low = min(low, s * (kept + 1.0) / (proposed + 1.0))
            out.append(low)
        return out

    def _admit(self, survival: list[list[float]], caps: Sequence[int], with_proposer: bool) -> tuple[list[int], Admission]:
        """Positions admitted across the rows, highest survival first, for the width of the
        best expected tokens per second (see the module docstring)."""
        b = len(caps)
        curve = self.curve
        top = max(caps, default=0)
        verify = [curve.seconds(b, w + 1) for w in range(top + 2)]

        def seconds(longest: int, total: int) -> float:
            return verify[longest] + (curve.proposing(longest, total) if with_proposer else 0.0)

        order = sorted(((s[j], i, j) for i, s in enumerate(survival) for j in range(min(caps[i], len(s))) if s[j] > 0.0),
                       key=lambda t: (-t[0], t[2]))
        plain = b / verify[0]
        best, best_prefix = plain * (1.0 + MIN_GAIN), None  # the best (width, positions admitted) so far
        for w in range(1, top + 1):
            tokens, longest, total = float(b), 0, 0
            for n, (s, _, j) in enumerate(o for o in order if o[2] < w):
                tokens, total = tokens + s, total + 1
                if j >= longest:
                    longest = j + 1
                rate = tokens / seconds(longest, total)
                if rate > best:
                    best, best_prefix = rate, (w, n + 1)
        best_ks, best_tokens = [0] * b, float(b)
        if best_prefix is not None:
            w, n = best_prefix
            for s, i, j in [o for o in order if o[2] < w][:n]:
                best_ks[i], best_tokens = max(best_ks[i], j + 1), best_tokens + s
        width = max(best_ks, default=0)
        adm = Admission("lengths" if with_proposer else "cut", "gain", best_ks, survival, width=width + 1,
                        seconds=seconds(width, sum(best_ks)), plain_seconds=verify[0],
                        marginal_seconds=verify[min(width + 1, top + 1)] - verify[width], tokens=best_tokens)
        return best_ks, adm

    # ------------------------------------------------------------------ 2. after proposing
    def cut(self, plan: StepPlan, drafts: Sequence[Draft], rows: Sequence[RowEvidence]) -> StepPlan:
        """``plan`` with the drafts to verify (``.drafts``, ``.picks``): per row the draft (of
        the primary and its alternatives) with the most expected accepted tokens, cut to the
        step's width; a tree's first branch cut so, then the trees cut to the node count
        (:class:`~pipeline.engine.tree_size.TreeSizer`).  Fixed: the primary drafts as they came."""
        picks = [self._pick(plan, d, r) for d, r in zip(drafts, rows)]
        if plan.fixed or not any(len(p.chosen) for p in picks):
            self._log(Admission("cut", "fixed" if plan.fixed else "gain", [len(p.chosen) for p in picks],
                                [list(p.survival) for p in picks], [p.chosen.source for p in picks],
                                width=max((len(p.chosen) for p in picks), default=0) + 1))
            return replace(plan, picks=tuple(replace(p, verified=p.chosen) for p in picks))
        firsts = [len(p.survival) for p in picks]
        stops = [self._stopping_length(plan, p, len(picks)) for p in picks]
        if not self.curve.ready:
            w = plan.explore
            width, adm = w, Admission("cut", "explore", [min(f, w) for f in firsts], width=w + 1)
        else:
            width, adm = self._width(picks, firsts, stops)
            if plan.probing and plan.free:  # a free proposer's probe: one token of width more than pays
                self._probed(width > 0)
                if width < max(firsts):
                    width, adm.way = width + 1, "probe"
            elif plan.probing:  # a probe asked one row one token more: verify what was asked
                width, adm.way = max(firsts), "probe"
        width = max([width] + [s for s in stops if s is not None])  # a stopping rule's length is never cut
        out = []
        for p, f, s in zip(picks, firsts, stops):
            n = s if s is not None else min(f, width)
            out.append(p.chosen.pruned(n, len(p.chosen)) if p.chosen.parents is not None else p.chosen.truncated(n))
        adm.lengths, adm.sources = [min(len(p.survival), len(v.first_branch())) for p, v in zip(picks, out)], \
            [p.chosen.source for p in picks]
        if any(v.is_tree for v in out) and adm.way == "gain":
            first = [len(v.first_branch()) for v in out]
            nodes = self.trees.nodes(self.curve.seconds, [list(p.survival) for p in picks], first, [len(v) for v in out])
            out = [v.truncated(nodes) if len(v) > nodes else v for v in out]
        self._log(adm)
        return replace(plan, picks=tuple(replace(p, verified=v) for p, v in zip(picks, out)))

    def _pick(self, plan: StepPlan, draft: Draft, row: RowEvidence) -> Pick:
        """The row's draft with the most expected accepted tokens (fixed: the primary).  A
        draft sampled from a drafter's ``q`` is valued, for this choice, without its
        confidences (they follow its draws); a tree is valued by its first branch, by position."""
        best = None
        for cand in (draft,) + tuple(draft.alternatives if draft.parents is None and not plan.fixed else ()):
            n = len(cand.first_branch()) if cand.parents is not None else len(cand)
            conf = None if cand.confidence is None or cand.parents is not None else cand.confidence.tolist()
            prior = self.acceptance.estimates(cand.source, conf, n)
            survival = _survive([row.adjust(a) for a in prior])
            drawn = plan.sampled and cand.probs is not None
            value = sum(_survive([row.adjust(a) for a in self.acceptance.estimates(cand.source, None, n)])) \
                if drawn and conf is not None else sum(survival)
            if best is None or value > best[0]:
                best = (value, Pick(draft, cand, tuple(prior), tuple(survival)))
        return best[1]

    def _stopping_length(self, plan: StepPlan, pick: Pick, b: int) -> int | None:
        """The stopping rule's length of a draft sampled from ``q`` in a sampled step of ``b``
        rows (see the module docstring); ``None`` for any other draft."""
        if not plan.sampled or pick.chosen.probs is None:
            return None
        total = 1.0
        if not self.curve.ready:
            return min(len(pick.survival), plan.explore)
        for j, s in enumerate(pick.survival):
            narrow, wide = self.curve.seconds(b, j + 1), self.curve.seconds(b, j + 2)
            if s < (wide - narrow) / narrow * total * (1.0 + MIN_GAIN):
                return j
            total += s
        return len(pick.survival)

    def _width(self, picks: list[Pick], firsts: list[int], stops: list[int | None]) -> tuple[int, Admission]:
        """The width of the best expected tokens per second, the proposer's time spent: every
        row keeps ``min(W, its length)`` (a stopping rule's rows their own length)."""
        b = len(picks)
        low = max([s for s in stops if s is not None], default=0)
        caps = [f if s is None else s for f, s in zip(firsts, stops)]
        ks, adm = self._admit([list(p.survival) for p in picks], caps, with_proposer=False)
        width = max([low] + ks)  # every row keeps its positions within the width: they cost nothing more
        adm.tokens = b + sum(sum(p.survival[:min(width, c)]) for p, c in zip(picks, caps))
        adm.seconds, adm.width = self.curve.seconds(b, width + 1), width + 1
        adm.marginal_seconds = self.curve.seconds(b, width + 2) - adm.seconds
        return width, adm

    # ------------------------------------------------------------------ 3. after verifying
    def observe(self, plan: StepPlan, rows: Sequence[RowEvidence], paths: Sequence[Sequence[int]],
                emitted: Sequence[Sequence[int]], propose_s: float, verify_s: float) -> None:
        """The outcome of the step ``plan`` (as :meth:`cut` returned it): per row the accepted
        nodes of its verified draft (``paths``, the verdict's) and the tokens it emitted
        (``emitted``: accepted tokens and the target's, cut by a stop); the seconds of
        proposing (``lengths`` to ``cut``) and of verifying (the pass and the settling)."""
        picks, asked = plan.picks, list(plan.lengths)
        if not picks:
            return
        width = max(len(p.verified) for p in picks) + 1
        self.curve.observe(len(picks), width, verify_s)
        if any(asked):
            self.curve.observe_propose(asked, propose_s)
        for p, k in zip(picks, asked):
            n = len(p.verified.first_branch()) if p.verified.parents is not None else len(p.verified)
            for j in range(min(k, len(p.chosen))):
                entry = self.kept.setdefault(j, [0.0, 0.0])
                entry[0] += j < n
                entry[1] += 1.0
        for p, row, path, block in zip(picks, rows, paths, emitted):
            v = p.verified
            if v.is_tree:
                first = v.first_branch()
                on_first = next((i for i, (a, b) in enumerate(zip(path, first)) if a != b), min(len(path), len(first)))
                self.trees.observe(len(v) - len(first), len(path) - on_first)
            for cand in (p.primary,) + tuple(p.primary.alternatives):
                if cand is not p.chosen and plan.sampled and cand.probs is not None:
                    continue  # a sampled draft that was not verified: its fate is unknown
                self._judge(plan, cand, p, row, path, block)

    def _judge(self, plan: StepPlan, cand: Draft, pick: Pick, row: RowEvidence, path: Sequence[int], block: Sequence[int]) -> None:
        """Count the evaluated positions of ``cand``: against the emitted tokens (greedy, or a
        point mass), else the verdict of its verified tokens (a sampled draft)."""
        tokens = cand.tokens[cand.first_branch()].tolist() if cand.parents is not None else cand.tokens.tolist()
        conf = None if cand.confidence is None or cand.parents is not None else cand.confidence.tolist()
        prior = pick.prior if cand is pick.chosen else self.acceptance.estimates(cand.source, conf, len(tokens))
        if plan.sampled and cand.probs is not None:  # only its verified positions are known
            n = len(pick.verified)
            outcome = [j < len(path) for j in range(min(len(path) + 1, n))]
        else:
            outcome = []
            for j, t in enumerate(tokens):
                if j >= len(block):
                    break
                outcome.append(t == block[j])
                if not outcome[-1]:
                    break
        for j, hit in enumerate(outcome):
            c = conf[j] if conf is not None else None
            self.acceptance.observe(cand.source, c, j, hit)
            if cand is pick.chosen:
                self.acceptance.observe(ANY, None, j, hit)
            row.observe(prior[j], hit)


def _survive(acceptance: Sequence[float]) -> list[float]:
    """Survival by position: the running product of per-position acceptance, in [0, 1]."""
    out, s = [], 1.0
    for a in acceptance:
        s *= min(max(a, 0.0), 1.0)
        out.append(s)
    return out
