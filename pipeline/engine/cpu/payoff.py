"""Whether compiling pays, decided once at load, before any graph is compiled: :func:`decide`.

Why.  A graph compiled by inductor saves a few milliseconds a token, and compiling it costs a
second or more of a fresh node's CPU time (SmolLM2's 36 graphs: 51 s at the quick start's load on
the 2-core machine), once per node: the compiled code stays in the node's cache
(:func:`.options.use_compile_cache`) and a later load takes it from there in a fraction of that.
A job of 20 rows decodes about 2,500 tokens and cannot earn those seconds back; a server or a job
of thousands of rows earns them in minutes.

The rule.  A part's graphs (the compiled layer for passes of ``n`` tokens in all, the row-dot
linear kernels) are compiled when::

    expected tokens x share of them the graphs serve x per-token saving  >  seconds to compile them

- **expected tokens**: what the model is expected to decode (:attr:`.options.CpuOptions.expected_tokens`:
  the job sets it from its rows, ``max_new_tokens`` and audit; ``None``, unknown, as for a server,
  a bench or an engine built directly: every offered part is compiled, as a long-lived process
  repays it).
- **share**: a graph for passes of ``n`` tokens in all serves every token when the engine keeps at most
  ``n`` rows in flight, else the passes of a batch's drain only, taken as ``n / rows`` of the tokens
  (:func:`served_share`: an overestimate, which errs toward compiling).
- **per-token saving**: the eager per-token time measured at load on the CPU clock times
  ``1 - ratio``, the ratio compiled / eager measured on this node before (:class:`Ledger`) or else
  :data:`PRIOR_RATIO`.
- **seconds to compile**, CPU seconds (the process's and its C++ compiler's, so that a loaded
  machine inflates neither side): :data:`GRAPH_S` a graph, plus :data:`PROCESS_START_S` for a
  process's first compile and :data:`FRESH_CACHE_S` for the first into an empty cache folder;
  :data:`CACHED_GRAPH_S` a graph for graphs the node's cache holds (the ledger says which).

Every input is injected, so the rule is tested without timing; :class:`Decision` is what the plan
records and the actor's load line prints.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass

import torch

#: CPU seconds of compiling one graph (the process's and its C++ compiler's), once inductor is
#: running: 0.9-1.5 s for SmolLM2's row-dot kernels, one thread of the 2-core machine
GRAPH_S = 1.3
#: CPU seconds a process's first compile costs besides its graph (inductor's start: 3.5-3.9 s)
PROCESS_START_S = 4.0
#: CPU seconds the first compile into an empty cache folder costs besides (the C++ compiler's
#: once-per-folder work: 11.5 s against 1.0-2.3 s into a folder used before)
FRESH_CACHE_S = 10.0
#: CPU seconds of loading one graph the node's cache holds (0.1 s measured: 0.4 s of wall clock
#: on the loaded machine)
CACHED_GRAPH_S = 0.1
#: compiled / eager per-token time assumed where this node never measured it (docs/benchmarks.md:
#: the compiled layer measured 0.85x the eager one over a whole one-row pass, the row-dot kernels'
#: gain on a busy node 1.7 ms of a ~70 ms token, 0.98x; both taken as an upper estimate of the saving)
PRIOR_RATIO = {"compiled_layer": 0.8, "rowdot": 0.9}
#: the file of the ledger, in the compile cache folder (deleting the folder forgets both)
LEDGER_FILE = "specbatch-compiled.json"


@dataclass(frozen=True)
class Decision:
    """Whether one part's graphs are compiled, and the figures that decided it.

    Attributes:
        part: what the graphs are (``"compiled layer, 1 token"``, ``"row-dot kernels"``).
        graphs: how many graphs the part compiles.
        expected_tokens: tokens the model is expected to decode (``None``: unknown).
        saving_s: expected seconds saved over those tokens (``inf`` when unknown).
        compile_s: expected seconds to compile the graphs (cached ones: to load them).
        cached: the node's cache holds the graphs (the ledger recorded them).
        pays: compile them: ``saving_s > compile_s``.
    """

    part: str
    graphs: int
    expected_tokens: int | None
    saving_s: float
    compile_s: float
    cached: bool
    pays: bool

    def line(self) -> str:
        """One line for the load line: ``"compiled layer, 1 token: compiled (3 graphs, ~4.5 s
        against ~12 s saved over 2,560 tokens)"`` or ``"... not compiled (...)"``."""
        what = "compiled" if self.pays else "not compiled"
        cost = f"{self.graphs} graphs, ~{self.compile_s:.1f} s{' from the cache' if self.cached else ''}"
        if self.expected_tokens is None:
            return f"{self.part}: {what} ({cost}; expected tokens unknown)"
        return (f"{self.part}: {what} ({cost} against ~{self.saving_s:.1f} s saved over "
                f"{self.expected_tokens:,} tokens)")

    def to_dict(self) -> dict:
        """Plain data for the plan's record."""
        return {"part": self.part, "graphs": self.graphs, "expected_tokens": self.expected_tokens,
                "saving_s": None if math.isinf(self.saving_s) else round(self.saving_s, 3),
                "compile_s": round(self.compile_s, 3), "cached": self.cached, "pays": self.pays}


def served_share(tokens: int, rows_in_flight: int | None) -> float:
    """The share of an engine's tokens decoded in passes of ``tokens`` tokens in all, estimated:
    1 when the engine keeps at most ``tokens`` rows in flight (``None``: unknown, 1), else
    ``tokens / rows_in_flight`` (passes that small come at a batch's drain only)."""
    if rows_in_flight is None or rows_in_flight <= tokens:
        return 1.0
    return tokens / rows_in_flight


def decide(part: str, *, graphs: int, expected_tokens: int | None, token_saving_s: float, compile_s: float,
           cached: bool = False, share: float = 1.0) -> Decision:
    """Whether ``part``'s ``graphs`` pay for compiling (the module docstring's rule).

    Args:
        part: what the graphs are, for the record.
        graphs: how many graphs compiling the part makes.
        expected_tokens: tokens the model is expected to decode; ``None``: unknown (compiled).
        token_saving_s: seconds the graphs save per token they serve (measured eager time x
            ``1 - ratio``); zero or less never pays.
        compile_s: seconds compiling them is expected to cost (:meth:`Ledger.cost`).
        cached: the node's cache holds them (for the record).
        share: the share of the expected tokens the graphs serve (:func:`served_share`).

    Returns:
        The :class:`Decision`.
    """
    if expected_tokens is None:
        return Decision(part, graphs, None, math.inf, compile_s, cached, True)
    saving = expected_tokens * share * max(token_saving_s, 0.0)
    return Decision(part, graphs, expected_tokens, saving, compile_s, cached, saving > compile_s)


def graph_key(part: str, *shape) -> str:
    """The ledger's key of a part's graphs: the part, the sizes and dtype that shape them, and
    the torch version and CPU capability that inductor's code depends on."""
    cpu = torch.backends.cpu.get_cpu_capability()
    return "|".join(map(str, (part, *shape, torch.__version__, cpu)))


class Ledger:
    """What this node compiled into its cache folder: ``{key: {"graphs", "seconds", "ratio"}}``
    in :data:`LEDGER_FILE` (JSON, written whole by an atomic
    rename; two processes writing at once lose one record, which costs an estimate, never an
    output).  ``None`` folder: an empty ledger that records nothing."""

    def __init__(self, folder: str | None):
        self.path = os.path.join(folder, LEDGER_FILE) if folder else None
        self.entries: dict[str, dict] = self._read()

    def _read(self) -> dict:
        if self.path is None:
            return {}
        try:
            with open(self.path, encoding="utf-8") as f:
                data = json.load(f)
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def cached(self, key: str) -> bool:
        """Whether the node's cache holds the graphs of ``key`` (they were compiled into it)."""
        return key in self.entries

    def cost(self, key: str, graphs: int) -> float:
        """Expected CPU seconds to make ``graphs`` graphs of ``key``: :data:`CACHED_GRAPH_S` each
        when cached, else :data:`GRAPH_S` each, plus :data:`PROCESS_START_S` when this process
        has compiled nothing yet and :data:`FRESH_CACHE_S` when the ledger is empty (a fresh
        cache folder)."""
        if key in self.entries:
            return CACHED_GRAPH_S * graphs
        return (GRAPH_S * graphs + (0.0 if _COMPILED_IN_PROCESS[0] else PROCESS_START_S)
                + (0.0 if self.entries else FRESH_CACHE_S))

    def ratio(self, key: str, part: str) -> float:
        """compiled / eager per-token time of ``key`` measured on this node, else :data:`PRIOR_RATIO`."""
        r = self.entries.get(key, {}).get("ratio")
        return float(r) if isinstance(r, (int, float)) else PRIOR_RATIO[part]

    def record(self, key: str, graphs: int, seconds: float, ratio: float | None = None) -> None:
        """Record that ``graphs`` graphs of ``key`` were made (compiled, or loaded from the
        cache) in ``seconds`` (wall clock, for the record), and their measured compiled / eager
        ``ratio`` when given; written at once."""
        _COMPILED_IN_PROCESS[0] = True
        if self.path is None:
            return
        self.entries = self._read()  # what other processes recorded since
        entry = self.entries.setdefault(key, {"graphs": graphs})
        entry["seconds"] = round(seconds, 3)
        if ratio is not None:
            entry["ratio"] = round(ratio, 4)
        try:
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self.path), prefix=".ledger-")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(self.entries, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except OSError:  # a read-only cache: the estimates stay the defaults
            pass


#: whether this process compiled (or loaded) a graph yet: inductor has started (a list, set in place)
_COMPILED_IN_PROCESS = [False]

