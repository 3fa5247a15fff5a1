"""How many nodes a step's token trees keep: the tree's size by expected gain.

A row's token tree (``SpeculationSettings.num_candidates > 1``) is its *first branch* (the
linear draft, whose length the draft-length controller chooses: :mod:`pipeline.engine.draft_control`)
plus side nodes, the other candidates.  A step of ``B`` rows whose trees keep at most ``N``
nodes costs one target pass over ``B`` rows of width ``N + 1`` (rows are left-padded to the
widest), and row ``i`` emits on average::

    E_i(N) = 1 + A_i1 + ... + A_if_i  +  g * (min(n_i, N) - f_i)

tokens, where ``f_i`` is its first branch's length, ``n_i`` its tree's nodes (side nodes are
numbered after the first branch, so a tree cut to ``N`` nodes keeps its first branch) and
``g`` the measured gain of a side node: the tokens the accepted paths gained beyond the
first branch, per side node verified, pooled over the engine's rows (shrunk towards
:data:`PRIOR_GAIN` with the weight of :data:`PRIOR_NODES` nodes, so trees are tried before
anything is measured).  :meth:`TreeSizer.nodes` picks the ``N`` (at least the longest
first branch) that maximises ``sum_i E_i(N) / t_verify(B, N + 1)``, with the controller's
measured cost curve (:class:`~pipeline.engine.cost_model.CostCurve`); ``t_propose`` is spent
by then.  The same expected-tokens sum as :func:`pipeline.engine.cost_model.expected_tokens`,
plus the side nodes' term.
"""

from __future__ import annotations

from typing import Callable, Sequence

from .cost_model import expected_tokens

#: the gain of a side node assumed before any is measured (tokens per node)
PRIOR_GAIN = 0.1
#: ... counted as this many measured side nodes
PRIOR_NODES = 16.0


class TreeSizer:
    """The side nodes' measured gain and the node count of each step's trees."""

    def __init__(self):
        self.side_nodes = 0.0
        self.side_tokens = 0.0

    def observe(self, side_nodes: int, side_tokens: int) -> None:
        """A tree with ``side_nodes`` nodes off its first branch gained ``side_tokens``
        accepted tokens beyond what its first branch gave."""
        self.side_nodes += side_nodes
        self.side_tokens += side_tokens

    @property
    def gain(self) -> float:
        """``g``: expected accepted tokens per side node."""
        return (self.side_tokens + PRIOR_GAIN * PRIOR_NODES) / (self.side_nodes + PRIOR_NODES)

    def nodes(self, seconds: Callable[[int, int], float], reach: Sequence[Sequence[float]], first: Sequence[int],
              sizes: Sequence[int]) -> int:
        """The most nodes any row's tree keeps this step.

        Args:
            seconds: ``(rows, width) -> seconds`` of a step's verification
                (:meth:`CostCurve.seconds <pipeline.engine.cost_model.CostCurve.seconds>`).
            reach: per row ``A_i1 ..`` (the survival of its first branch's positions).
            first: per row its first branch's length ``f_i``.
            sizes: per row its tree's nodes ``n_i`` (``>= f_i``).
        """
        low, high = max(first, default=0), max(sizes, default=0)
        if high <= low:
            return high
        b, g = len(sizes), self.gain
        base = sum(expected_tokens(r, f) for r, f in zip(reach, first))

        def rate(n: int) -> float:
            side = sum(max(0, min(s, n) - f) for s, f in zip(sizes, first))
            return (base + g * side) / seconds(b, n + 1)

        return max(range(low, high + 1), key=lambda n: (rate(n), -n))
