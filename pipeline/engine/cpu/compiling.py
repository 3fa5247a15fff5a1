"""Compiling with PyTorch's inductor, and what to do when it cannot: the one helper both
compiled parts use (:mod:`.linear`'s row-dot kernel, :mod:`.layer`'s compiled layer).

Graphs are traced with ``make_fx`` and compiled with ``compile_fx``, without TorchDynamo: a
call then costs about 10 us of Python instead of a ``torch.compile``'d function's ~30 us of
guards.  Inductor keeps the compiled code on disk (:func:`.options.use_compile_cache`), so a
graph another process of the node compiled is loaded, not compiled again.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

import torch

from .measure import Costs

log = logging.getLogger(__name__)

#: float32 weights of at least this many elements are offered the compiled parts: a weight that
#: does not stay in the L2 cache between passes, where streaming it at memory speed is what
#: counts (a smaller one would pay a compile, and its ~10 us call, for little)
INDUCTOR_MIN_ELEMENTS = 1 << 18


def compile_graph(fn: Callable, examples: Sequence[torch.Tensor], what: str, costs: Costs | None = None):
    """``fn`` compiled by inductor for inputs shaped and typed as ``examples``, or ``None``
    where it cannot be (no C++ compiler, say: logged at INFO with ``what``, and the caller
    keeps its eager path).  The seconds spent are added to ``costs.compile_s``."""
    start = time.perf_counter()
    try:
        from torch._inductor.compile_fx import compile_fx
        from torch.fx.experimental.proxy_tensor import make_fx

        with torch.inference_mode(False), torch.no_grad():
            return compile_fx(make_fx(fn)(*examples), list(examples))
    except Exception as exc:  # noqa: BLE001 - any failure to compile leaves the eager path
        log.info("no compiled %s: %s", what, exc, exc_info=True)
        return None
    finally:
        if costs is not None:
            costs.compile_s += time.perf_counter() - start


def products(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x @ w^T`` for ``(n, in)`` ``x`` and ``(out, in)`` ``w``, written as ``n`` dot products
    per row of ``w``, ``(n, out)``: inductor fuses them into one loop over the rows of ``w``
    that reads each row once for all ``n`` rows of input and sums in vector registers.  Of
    the forms measured, the fastest: ``(w[:, None] * x).sum(-1)`` took 1.1-1.9x as long for
    2-5 rows and as long for one (``docs/benchmarks.md``)."""
    return torch.stack([(w * x[j]).sum(-1) for j in range(x.shape[0])])
