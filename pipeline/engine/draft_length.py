"""Draft length by expected gain: how many tokens each row drafts, from costs and acceptance
measured on this machine, at every batch size (one row included).

A step of ``B`` rows in which row ``i`` drafts ``k_i`` tokens costs one target pass over
``B`` rows of width ``W = max_i k_i + 1`` (rows are left-padded to the widest, so every
row pays for ``W`` positions) plus the proposer's work, and row ``i`` emits ``E_i(k_i) =
1 + A_i1 + ... + A_ik_i`` tokens on average, where ``A_ij`` is the chance that the row's
first ``j`` draft tokens are all accepted.  The policy picks the ``k_i`` that maximise
the expected tokens per second of the step (Leviathan et al. 2023, §3, with measured
costs; :func:`pipeline.engine.cost_model.tokens_per_second` is the same formula for one
common ``k``, which the tuner uses)::

    tokens/s = sum_i E_i(k_i) / (t_verify(B, W) + t_propose(k))

and drafts nothing (a plain step) when no draft pays by at least :data:`MIN_GAIN` (10 %).
The inputs:

- ``A_ij``: the row's own acceptance by draft position (``RowStats.drafted_per_position``
  / ``accepted_per_position``), shrunk towards the engine's pooled acceptance by position
  with the weight of :data:`PRIOR_DRAFTS` drafts, so a new row starts from what the
  engine has seen and a row whose drafts keep failing (or keep succeeding) moves away
  from it as its own evidence grows.  Positions never measured continue the last
  measured per-token acceptance.
- ``t_verify(B, W)``: the decayed mean of the measured passes of ``B`` rows and width ``W``
  once there are a few, else ``a + b*B + c*B*W``, a decayed least-squares fit of every
  measured pass (fixed cost, per-row cost such as the KV cache read, per-token cost).
- ``t_propose = p0 + p1*max_i k_i + p2*sum_i k_i``: a decayed least-squares fit of the
  measured proposer calls (a drafter pass per draft position, per-row work).

Two decisions per step: :meth:`DraftLengthPolicy.plan` before proposing (how many tokens
each row asks for: this is what saves a model drafter's passes), and
:meth:`DraftLengthPolicy.trim` after it (how many of the proposed tokens to verify, now
that the proposer's cost is spent and each draft's real length is known: this is what
decides for prompt lookup, whose drafts are free but often short or missing).

A measured check keeps the model honest (:class:`WayCheck`).  The cost model can be wrong
(a shared CPU's passes vary by 10 % from minute to minute; a drafting step costs more
than its pass and draft), and then the plan loses to what it replaces.  So once measured
the policy runs blocks of :data:`CHECK_BLOCK` steps three ways in turn -- by expected gain
(``"gain"``), every row its whole draft length as a fixed ``k`` would (``"fixed"``), and
plain steps (``"plain"``) -- and keeps the tokens per second each way has measured at each
number of rows in flight.  Once each way has run :data:`CHECK_MIN_BLOCKS` blocks (or one,
for a way that measured well below another's, :data:`CHECK_CLEAR_LOSS`) the fastest runs,
and one block in :data:`CHECK_EXPLORE` goes to another way (in turn) so that a change is
seen: the plan costs at most about that share of the gap to the best of the
three, and never stays slower than plain decoding or a fixed ``k``.  Measured on SmolLM2
(``bench/bench_real.py``, one thread): with costs from the plan alone, suffix decoding at 8
rows ran at 0.86x plain and a drafter at 2 rows at 0.82x (drafting on 2 % of its steps).

Until the costs are measured (:data:`MIN_OBSERVATIONS` passes) steps draft 0, 1, 0 and 2
tokens in turn (:data:`EXPLORE`), so that the fit sees three widths at little cost; every :data:`PROBE_EVERY` steps
one row (rows in turn) asks one token more than the plan, so acceptance keeps being measured when the plan is
to draft nothing, and longer drafts get measured when they pay.  Greedy outputs never depend on the draft
length; sampled outputs keep the target's law whatever it is, but the draws a seed gives
depend on it (see the engine's ``adaptive_draft_length``).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .cost_model import expected_tokens

#: weight of a new observation in the decayed cost fits
DECAY = 0.05
#: target passes to see before the policy acts
MIN_OBSERVATIONS = 6
#: what the first passes draft, in turn, until then: plain steps and drafts of one and two
#: tokens give the cost fit three widths and the acceptance its first positions at little cost
EXPLORE = (0, 1, 0, 2)
#: every this many steps, one row asks one token more than planned (acceptance keeps being measured);
#: the interval doubles after each probe after which drafting still does not pay, whatever the
#: probe accepted (up to MAX_PROBE_EVERY), and comes back to this when drafting pays again
PROBE_EVERY = 32
MAX_PROBE_EVERY = 1024
#: the engine's pooled acceptance counts as this many drafts of a row's own evidence
PRIOR_DRAFTS = 4.0
#: a draft is made only when its predicted tokens per second beat a plain step's by this
#: share: near break-even the cost model's errors would otherwise make a method slower than
#: plain decoding.  Measured on SmolLM2-135M (bench/bench_real.py, XSum, CPU): drafts predicted
#: to gain 3-5 % lost 4-9 % (a row's acceptance regresses to the engine's once it is drafted on,
#: and a drafting step costs more than its target pass and draft: masks, cache writes, rollback)
MIN_GAIN = 0.10
#: passes of one (rows, width) after which their own measured mean replaces the fit
TABLE_AFTER = 3
#: a proposer whose predicted cost for the longest drafts is below this share of a plain step
#: is *free* (prompt lookup, suffix: a search per row): every row asks for its longest draft,
#: and :meth:`DraftLengthPolicy.trim` alone decides, from the drafts as they came, how much of
#: them to verify.  Planning shorter drafts for it saves nothing and loses the drafts that
#: would have paid: a row whose estimate fell below break-even stopped drafting until a probe
#: (prompt lookup on SmolLM2 at one row: 1.26x plain against 1.36x at a fixed k = 3)
FREE_PROPOSER = 0.02


#: steps per block of the measured check (:class:`WayCheck`): one way decides a block's steps
CHECK_BLOCK = 8
#: blocks each way runs, at a number of rows in flight, before the fastest takes over there
CHECK_MIN_BLOCKS = 3
#: once the fastest runs, every this many blocks another way runs one (in turn)
CHECK_EXPLORE = 12
#: a way measured below this share of another's rate after one block is not run again until the
#: fastest takes over (its other warm-up blocks would cost far more than they tell: whole token
#: trees at 8 rows run at about half of plain's speed on this project's CPU)
CHECK_CLEAR_LOSS = 0.85
#: weight of a new step in a way's decayed tokens and seconds (about the last 1 / this steps count)
CHECK_DECAY = 1.0 / 64


class WayCheck:
    """Which way a step's draft lengths are chosen, from the tokens per second each way has
    measured (see the module docstring): ``"gain"`` (:meth:`DraftLengthPolicy.plan`'s
    choice), ``"fixed"`` (every row its cap: a fixed ``k``) or ``"plain"`` (no drafts).

    Rates are kept per number of rows in flight, as decayed sums of the tokens each step
    emitted and its seconds (the whole step: propose, verify, commit), so a way is judged by
    what its steps really cost."""

    WAYS = ("gain", "fixed", "plain")

    def __init__(self):
        self.tokens: dict[tuple[int, str], float] = {}
        self.seconds: dict[tuple[int, str], float] = {}
        self.steps: dict[tuple[int, str], int] = {}
        self.way = self.WAYS[0]
        self._left = 0  # steps left in the current block
        self._blocks = 0  # blocks begun
        self._turn = 0  # which other way the next exploring block runs

    def rate(self, rows: int, way: str) -> float | None:
        """Measured tokens per second of ``way`` at ``rows`` rows in flight (None: not yet)."""
        s = self.seconds.get((rows, way), 0.0)
        return self.tokens[(rows, way)] / s if s > 0 else None

    def _unsettled(self, rows: int) -> list[str]:
        """The ways still to warm up at ``rows`` rows: fewer than :data:`CHECK_MIN_BLOCKS`
        blocks, unless one block put them below :data:`CHECK_CLEAR_LOSS` of another way."""
        rates = {w: self.rate(rows, w) for w in self.WAYS if self.steps.get((rows, w), 0) >= CHECK_BLOCK}
        best = max(rates.values(), default=None)
        return [w for w in self.WAYS if self.steps.get((rows, w), 0) < CHECK_MIN_BLOCKS * CHECK_BLOCK
                and not (w in rates and rates[w] < CHECK_CLEAR_LOSS * best)]

    def leader(self, rows: int) -> str | None:
        """The fastest way at ``rows`` rows once every way has warmed up there, else None."""
        if self._unsettled(rows):
            return None
        return max(self.WAYS, key=lambda w: self.rate(rows, w))  # a settled way has run a block: it has a rate

    def next_step(self, rows: int) -> str:
        """The way of the next step of ``rows`` rows (a new block begins every :data:`CHECK_BLOCK` steps)."""
        if self._left <= 0:
            self._left = CHECK_BLOCK
            self._blocks += 1
            lead = self.leader(rows)
            if lead is None:  # the least measured way still warming up here (ties: in WAYS' order)
                self.way = min(self._unsettled(rows), key=lambda w: self.steps.get((rows, w), 0))
            elif self._blocks % CHECK_EXPLORE == 0:
                others = [w for w in self.WAYS if w != lead]
                self.way = others[self._turn % len(others)]
                self._turn += 1
            else:
                self.way = lead
        self._left -= 1
        return self.way

    def observe(self, rows: int, tokens: int, seconds: float) -> None:
        """The step just run (of :attr:`way`) emitted ``tokens`` over its ``rows`` rows in ``seconds``."""
        key = (rows, self.way)
        keep = 1.0 - CHECK_DECAY
        self.tokens[key] = self.tokens.get(key, 0.0) * keep + tokens
        self.seconds[key] = self.seconds.get(key, 0.0) * keep + seconds
        self.steps[key] = self.steps.get(key, 0) + 1


class _DecayedFit:
    """Decayed least squares ``y ~ x @ w`` (the minimum-norm solution where the features
    observed so far do not determine every weight, e.g. a single batch size)."""

    def __init__(self, n: int):
        self.xtx = torch.zeros(n, n, dtype=torch.float64)
        self.xty = torch.zeros(n, dtype=torch.float64)
        self.count = 0
        self._w: list[float] | None = None

    def observe(self, x: Sequence[float], y: float) -> None:
        v = torch.tensor(x, dtype=torch.float64)
        keep = 1.0 - DECAY
        self.xtx.mul_(keep).add_(torch.outer(v, v))
        self.xty.mul_(keep).add_(v * y)
        self.count += 1
        self._w = None

    def weights(self) -> list[float]:
        if self._w is None:
            self._w = (torch.linalg.pinv(self.xtx, hermitian=True) @ self.xty).tolist()
        return self._w

    def predict(self, x: Sequence[float]) -> float:
        return sum(a * b for a, b in zip(self.weights(), x))


class DraftLengthPolicy:
    """Args:
        k_max: the method's draft length ``K`` (the most any row drafts).
    """

    def __init__(self, k_max: int):
        self.k_max = k_max
        self.drafted = [0.0] * k_max  # pooled: drafts that reached position j
        self.accepted = [0.0] * k_max  # pooled: ... and were accepted there
        self.verify = _DecayedFit(3)  # t = a + b*B + c*B*W
        self.propose = _DecayedFit(3)  # t = p0 + p1*max k + p2*sum k
        self._table: dict[tuple[int, int], list[float]] = {}  # (rows, width) -> [decayed mean, passes]
        self.verify_passes = 0
        self.steps = 0
        self.probing = False  # this step asks one token more than the plan
        self.probe_every = PROBE_EVERY
        self._next_probe = PROBE_EVERY
        self._probe_turn = 0  # which row the next probe asks
        self.check = WayCheck()
        self.way: str | None = None  # this step's way (WayCheck.WAYS); None before the costs are measured

    # ------------------------------------------------------------------ measurements
    def observe_verify(self, rows: int, width: int, seconds: float) -> None:
        """A target pass over ``rows`` rows of ``width`` tokens each (padded) took ``seconds``."""
        self.verify.observe((1.0, rows, rows * width), seconds)
        entry = self._table.setdefault((rows, width), [seconds, 0])
        entry[0] += (seconds - entry[0]) * max(DECAY, 1.0 / (entry[1] + 1))
        entry[1] += 1
        self.verify_passes += 1

    def observe_propose(self, draft_lengths: Sequence[int], seconds: float) -> None:
        """A proposer call asking each row for ``draft_lengths[i]`` tokens took ``seconds``."""
        asked = [k for k in draft_lengths if k > 0]
        if asked:
            self.propose.observe((1.0, max(asked), sum(asked)), seconds)

    def observe_draft(self, drafted: int, accepted: int) -> None:
        """One row's draft of ``drafted`` tokens had its first ``accepted`` kept."""
        for i in range(min(drafted, self.k_max)):
            self.drafted[i] += 1
            if i < accepted:
                self.accepted[i] += 1

    def observe_position(self, position: int, accepted: bool) -> None:
        """A draft reached ``position`` (0-based) and was (``accepted``) or was not kept
        there: one observation of that position alone (a trimmed draft's cut token judged
        against the target's)."""
        if position < self.k_max:
            self.drafted[position] += 1
            self.accepted[position] += int(accepted)

    # ------------------------------------------------------------------ model
    @property
    def measured(self) -> bool:
        """Whether the cost fits can be trusted (enough passes, at more than one width)."""
        return self.verify_passes >= MIN_OBSERVATIONS and len({w for _, w in self._table}) > 1

    def verify_time(self, rows: int, width: int) -> float:
        """Predicted seconds of a target pass over ``rows`` rows of ``width`` tokens: the measured
        mean of such passes once there are :data:`TABLE_AFTER` of them, else the fit; never less
        than a narrower pass's (a wider pass does more work: a measured mean below a narrower
        one's is noise, and would make the policy verify longer drafts for nothing)."""
        return max(self._verify_time(rows, w) for w in range(1, width + 1))

    def _verify_time(self, rows: int, width: int) -> float:
        entry = self._table.get((rows, width))
        if entry is not None and entry[1] >= TABLE_AFTER:
            return entry[0]
        return max(self.verify.predict((1.0, rows, rows * width)), 1e-9)

    def propose_time(self, draft_lengths: Sequence[int]) -> float:
        """Predicted seconds of a proposer call asking for ``draft_lengths`` (0 when none ask)."""
        asked = [k for k in draft_lengths if k > 0]
        if not asked or not self.propose.count:
            return 0.0
        return max(self.propose.predict((1.0, max(asked), sum(asked))), 0.0)

    def pooled_reach(self) -> list[float]:
        """``A_j`` of the engine's drafts so far, ``j = 1 .. K`` (positions never reached continue
        the last measured per-token acceptance; 0 before any draft)."""
        out: list[float] = []
        for j in range(self.k_max):
            if self.drafted[j]:
                out.append(self.accepted[j] / self.drafted[j])
            elif out:
                prev = out[-2] if len(out) > 1 else 1.0
                out.append(out[-1] * (out[-1] / prev if prev > 0 else 0.0))
            else:
                out.append(0.0)
        return out

    def row_reach(self, drafted: Sequence[int], accepted: Sequence[int], pooled: Sequence[float] | None = None) -> list[float]:
        """``A_ij`` of one row from its own counts by position, shrunk towards ``pooled``
        (default: :meth:`pooled_reach`) with the weight of :data:`PRIOR_DRAFTS` drafts; never
        increasing with ``j``."""
        pooled = self.pooled_reach() if pooled is None else pooled
        out: list[float] = []
        for j in range(self.k_max):
            d = drafted[j] if j < len(drafted) else 0
            a = accepted[j] if j < len(accepted) else 0
            r = (a + PRIOR_DRAFTS * pooled[j]) / (d + PRIOR_DRAFTS)
            out.append(min(r, out[-1]) if out else r)
        return out

    def rate(self, reach: Sequence[Sequence[float]], ks: Sequence[int]) -> float:
        """Expected tokens per second of a step in which row ``i`` drafts ``ks[i]`` tokens."""
        tokens = sum(expected_tokens(r, k) for r, k in zip(reach, ks))
        t = self.verify_time(len(ks), max(ks) + 1) + self.propose_time(ks)
        return tokens / t

    # ------------------------------------------------------------------ decisions
    def plan(self, reach: Sequence[Sequence[float]], caps: Sequence[int]) -> list[int]:
        """How many tokens each row asks the proposer for this step.

        Args:
            reach: per row ``A_i1 .. A_iK`` (:meth:`row_reach`).
            caps: per row the most it may draft (its schedule, budget and context; 0 = none).

        Returns:
            Per row ``0 <= k_i <= caps[i]``: the choice with the best :meth:`rate` (for each
            widest draft ``w``, draft positions added in order of their acceptance; ``A_ij``
            never grows with ``j``, so the order respects positions); all 0 when no draft pays.  Before the
            costs are measured: the caps (with some shorter passes); on a probe step, one
            row (rows in turn) asks one token more than the plan.  Once measured, the
            step's way (:attr:`way`, from :class:`WayCheck`) may instead be ``"fixed"``
            (the caps) or ``"plain"`` (all 0).
        """
        self.steps += 1
        after_probe = self.probing
        if after_probe:  # the last step probed: the next probe comes an interval after it
            self._next_probe = self.steps - 1 + self.probe_every
        self.probing = False
        caps = [max(0, min(int(c), self.k_max)) for c in caps]
        if not self.measured:
            # cheap passes first: plain steps and drafts of one and two tokens give the cost fit
            # three widths and the acceptance its first positions; longer drafts come when the
            # plan (extrapolating them) says they pay (a first pass of the full K at 8 rows
            # costs several plain steps); probes come only once measured
            self.way = None
            return [min(c, EXPLORE[(self.steps - 1) % len(EXPLORE)]) for c in caps]
        b = len(caps)
        self.way = self.check.next_step(b)
        if self.way == "plain":
            return [0] * b
        if self.way == "fixed":
            return caps
        if self.propose.count and self.propose_time(caps) <= FREE_PROPOSER * self.verify_time(b, 1):
            return caps  # a free proposer: trim() decides on the drafts themselves
        pa, pb, pc = self.propose.weights() if self.propose.count else (0.0, 0.0, 0.0)
        verify = [self.verify_time(b, w + 1) for w in range(max(caps, default=0) + 1)]

        def seconds(longest: int, total: int) -> float:
            return verify[longest] + (max(pa + pb * longest + pc * total, 0.0) if total else 0.0)

        # For each widest draft w, the best choice takes, across rows, the draft positions of
        # highest acceptance first (each costs the same): a prefix of them, in that order.
        plain = b / seconds(0, 0)
        best, best_ks = plain, [0] * b
        for w in range(1, max(caps, default=0) + 1):
            order = sorted(((reach[i][j], i, j) for i, c in enumerate(caps) for j in range(min(c, w))),
                           key=lambda t: (-t[0], t[2]))
            ks = [0] * b
            tokens, longest, total = float(b), 0, 0
            for a, i, j in order:
                if a <= 0.0:
                    break
                ks[i] = j + 1
                tokens += a
                longest, total = max(longest, j + 1), total + 1
                r = tokens / seconds(longest, total)
                if r > best:
                    best, best_ks = r, list(ks)
        if best < plain * (1.0 + MIN_GAIN):
            best_ks = [0] * b
        if any(best_ks):
            self.probe_every = PROBE_EVERY  # drafting pays: keep measuring at the usual rate
        elif after_probe:  # what the probe measured still says drafting does not pay: probe less often
            self._back_off()
        if self.steps >= self._next_probe:
            # one row asks one token more (rows in turn): the probe measures acceptance and the
            # pass's width for every row's price, and a proposer that must catch up on a row it
            # has not drafted for (a draft head, a drafter with another tokenizer) does it for one
            open_rows = [i for i, (c, k) in enumerate(zip(caps, best_ks)) if k < c]
            if open_rows:
                self._next_probe = self.steps + self.probe_every  # until its outcome moves it
                self.probing = True
                i = open_rows[self._probe_turn % len(open_rows)]
                self._probe_turn += 1
                best_ks = list(best_ks)
                best_ks[i] += 1
        return best_ks

    @property
    def by_gain(self) -> bool:
        """Whether this step's drafts are the plan's to cut (:meth:`trim`, the tree's size): not
        on a step of the check's ``"fixed"`` or ``"plain"`` way."""
        return self.way in (None, "gain")

    def observe_step(self, rows: int, tokens: int, seconds: float) -> None:
        """A whole step of ``rows`` rows (propose, verify, commit) emitted ``tokens`` in
        ``seconds``: the measured check's evidence for this step's way (:class:`WayCheck`)."""
        if self.way is not None:
            self.check.observe(rows, tokens, seconds)

    def _back_off(self) -> None:
        """Double the probe interval (up to :data:`MAX_PROBE_EVERY`) from the last probe: a
        method that does not pay costs a bounded, shrinking share of steps (a draft head's
        catch-up over the positions since its last draft is paid at every probe)."""
        self.probe_every = min(2 * self.probe_every, MAX_PROBE_EVERY)
        self._next_probe = self.steps - 1 + self.probe_every

    def trim(self, reach: Sequence[Sequence[float]], lengths: Sequence[int]) -> int:
        """How many tokens of each draft to verify, once drafted (``lengths[i]`` tokens for
        row ``i``): the width ``W - 1`` with the best tokens per second of the target pass
        alone (the proposer's time is spent).  Drafts longer than it are cut to it."""
        longest = max(lengths, default=0)
        if not longest or not self.measured or self.probing or not self.by_gain:
            return longest
        b = len(lengths)

        def gain(w: int) -> float:
            return sum(expected_tokens(r, min(w, n)) for r, n in zip(reach, lengths)) / self.verify_time(b, w + 1)

        best = max(range(longest + 1), key=lambda w: (gain(w), -w))
        return best if gain(best) >= gain(0) * (1.0 + MIN_GAIN) else 0
