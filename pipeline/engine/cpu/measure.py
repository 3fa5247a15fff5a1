"""Timing at load: how the CPU acceleration decides between kernels, and what preparing cost.

Every choice between two ways of computing the same thing (a linear layer's kernel for a row
count, the compiled layer against the eager one) is made once, when a model is prepared, by
:func:`best_of` timings over the model's own weights; the faster way must win by
:data:`MARGIN`, so that timing noise keeps the default.  :class:`Costs` adds up the seconds
preparing spent compiling and measuring, which the plan reports.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

#: another way must take less than this share of the default's time to replace it (timing noise)
MARGIN = 0.95
#: timed runs of each way (the best counts), after one warm-up run
REPEATS = 3


@dataclass
class Costs:
    """Wall-clock seconds a preparation spent compiling (inductor, its C++ compiler included)
    and timing candidates."""

    compile_s: float = 0.0
    measure_s: float = 0.0


def best_of(run: Callable[[], object], repeats: int = REPEATS, costs: Costs | None = None,
            clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds of ``run()``: the best of ``repeats`` timed calls after one warm-up call
    (on ``clock``, by default ``time.perf_counter``); the whole time spent is added to ``costs.measure_s``."""
    start = time.perf_counter()
    run()
    best = float("inf")
    for _ in range(repeats):
        t = clock()
        run()
        best = min(best, clock() - t)
    if costs is not None:
        costs.measure_s += time.perf_counter() - start
    return best


def fastest(times: dict[str, float], default: str) -> str:
    """The key of ``times`` to use: ``default`` unless another is faster by :data:`MARGIN`
    (the fastest such one)."""
    best = default
    for name, t in sorted(times.items(), key=lambda kv: kv[1]):
        if name != default and t < MARGIN * times[default]:
            best = name
            break
    return best
