"""Continuous batching on one engine: rows join at any time, every step advances every row
in flight, and a finished row's slot takes the next waiting row at once.

:meth:`SpeculativeEngine.generate_batch` submits a list of rows and steps until all are
done; an online server (``pipeline/serve/``) keeps one :class:`Scheduler` per replica
and submits requests as they arrive, from any thread, with a callback that receives each
committed block of tokens (streaming) and one that receives the final result.

Rows whose settings differ beyond :data:`pipeline.engine.batch.PER_ROW_FIELDS` (another
temperature, another set of logits processors) share the slots and caches but step in
separate groups, one target pass per group.  A row may draft fewer tokens than the
engine's ``k_max`` (its cap ``k`` at submission), and a row may be cancelled (a
client went away): it leaves at the next step with finish reason ``"cancelled"``.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections import deque
from typing import Callable

import torch

from .batch import PER_ROW_FIELDS, RowState
from .reference import ReferenceIndex
from .settings import GenerationSettings, resolve_generation_settings
from .stats import GenerationResult, RowStats

#: receives each committed block of a row's tokens (ids), in order
OnTokens = Callable[[list[int]], None]
#: receives a row's final result
OnDone = Callable[[GenerationResult], None]


@dataclasses.dataclass
class _Waiting:
    ticket: int
    prompt: object
    settings: GenerationSettings
    on_tokens: OnTokens | None
    on_done: OnDone | None
    k: int | None = None
    reference: ReferenceIndex | None = None


def group_key(settings: GenerationSettings) -> str:
    """Rows with the same key may verify in one target pass."""
    return repr(tuple(getattr(settings, f.name) for f in dataclasses.fields(GenerationSettings)
                      if f.name not in PER_ROW_FIELDS))


class Scheduler:
    """Rows in flight on ``engine``, at most ``max_batch_size`` at once.

    Args:
        engine: a :class:`pipeline.engine.SpeculativeEngine`.
        max_batch_size: slots (default: the engine's ``max_batch_size``).

    :meth:`submit` is thread-safe; :meth:`step` must be called from one thread at a time.
    The constructor and :meth:`step` run under ``torch.inference_mode()`` themselves, so a
    scheduler works whether or not its caller is in inference mode (the engine's caches
    may be inference tensors made by an earlier :meth:`SpeculativeEngine.generate_batch`).
    """

    @torch.inference_mode()
    def __init__(self, engine, max_batch_size: int | None = None):
        self.engine = engine
        size = max_batch_size or engine.max_batch_size
        if engine.method.max_rows is not None:
            size = min(size, engine.method.max_rows)
        self.size = size
        self.runner = engine.bind(size)
        self._free = list(range(size))[::-1]
        self._waiting: deque[_Waiting] = deque()
        self._active: list[RowState] = []
        self._callbacks: dict[int, tuple[OnTokens | None, OnDone | None]] = {}
        self._tickets = itertools.count()
        self._cancelled: set[int] = set()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ API
    def submit(self, prompt, settings: GenerationSettings | None = None, on_tokens: OnTokens | None = None,
               on_done: OnDone | None = None, resolved: bool = False, k: int | None = None,
               reference=None) -> int:
        """Queue a row; returns its ticket (results of :meth:`step` carry it).

        Args:
            prompt: ``list[int]`` or an int64 tensor of token ids.
            settings: the row's :class:`GenerationSettings` (resolved against the target's
                ``generation_config`` unless ``resolved``).
            on_tokens: called (on the stepping thread) with each committed block of ids.
            on_done: called (on the stepping thread) with the row's final result.
            k: the row's cap on draft tokens, 1 .. the engine's ``spec.k_max`` (default:
                ``k_max``); with the ``heuristic`` schedule, its starting cap.
            reference: token ids (``list[int]`` or an int tensor ``(n,)``, the target's
                vocabulary) the row's output is likely to repeat, or their
                :class:`~pipeline.engine.reference.ReferenceIndex`: the row drafts from them
                too (:mod:`pipeline.engine.reference`; lossless whatever they hold); ``None``: none.

        Raises:
            ValueError: a bad setting, draft length or reference (the row is not queued).
        """
        if not resolved:
            settings = resolve_generation_settings(settings, self.engine.target.generation_config,
                                                   self.engine.target_vocab)
        if k is not None:
            top = self.engine.spec.k_max
            if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= top:
                raise ValueError(f"k (a row's cap on draft tokens) must be an integer in 1 .. {top} (the engine's k_max), got {k!r}")
        if reference is not None and not isinstance(reference, ReferenceIndex):
            reference = ReferenceIndex(reference, self.engine.target_vocab)
        with self._lock:
            ticket = next(self._tickets)
            self._waiting.append(_Waiting(ticket, prompt, settings, on_tokens, on_done, k, reference))
        return ticket

    def cancel(self, ticket: int) -> None:
        """Stop a row (thread-safe): a waiting row is dropped, a row in flight leaves at the
        next step; either way ``on_done`` gets a result with finish reason ``"cancelled"``
        and the tokens committed so far.  Unknown or finished tickets are ignored."""
        with self._lock:
            self._cancelled.add(ticket)

    @property
    def busy(self) -> bool:
        """Rows are waiting or in flight."""
        return bool(self._waiting or self._active)

    @property
    def in_flight(self) -> int:
        return len(self._active)

    @torch.inference_mode()
    def step(self) -> list[tuple[int, GenerationResult]]:
        """Admit waiting rows into free slots, run one step for every row in flight, and
        return the ``(ticket, result)`` of the rows that finished (or could not run)."""
        done: list[tuple[int, GenerationResult]] = []
        admitted: list[RowState] = []
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
            kept = deque(w for w in self._waiting if w.ticket not in cancelled)
            dropped = [w for w in self._waiting if w.ticket in cancelled]
            self._waiting = kept
        for w in dropped:
            result = GenerationResult([], None, "cancelled", RowStats(prompt_tokens=0, finish_reason="cancelled"))
            done.append((w.ticket, result))
            if w.on_done is not None:
                w.on_done(result)
        for row in self._active:
            if row.index in cancelled:
                row.finish = "cancelled"
        while self._free:
            with self._lock:
                if not self._waiting:
                    break
                w = self._waiting.popleft()
            t0 = self.engine.clock()
            row = self.engine.new_row(w.ticket, w.prompt, w.settings, self._free[-1], self.runner.device)
            if isinstance(row, str):
                result = GenerationResult.failed(f"ValueError: {row}", self.engine.clock() - t0)
                done.append((w.ticket, result))
                if w.on_done is not None:
                    w.on_done(result)
                continue
            self._free.pop()
            row.on_tokens = w.on_tokens
            if w.k is not None:
                row.k = w.k
            if self.engine.proposer is not None:  # a reference drafts beside a method's drafts
                row.reference = w.reference
            self._callbacks[w.ticket] = (w.on_tokens, w.on_done)
            admitted.append(row)
        if admitted:
            self.engine.admit(admitted)
            self._active.extend(admitted)
        groups: dict[str, list[RowState]] = {}
        # in slot order: a full batch then reads its caches in place (SlotLayer.update)
        for row in sorted(self._active, key=lambda r: r.slot):
            if row.finish is None:
                groups.setdefault(group_key(row.settings), []).append(row)
        for rows in groups.values():
            self.engine.step(rows)
        still = []
        for row in self._active:
            if row.finish is None:
                still.append(row)
                continue
            result = self.engine.finish(row)
            self._free.append(row.slot)
            _, on_done = self._callbacks.pop(row.index, (None, None))
            done.append((row.index, result))
            if on_done is not None:
                on_done(result)
        self._active = still
        return done

    def run(self) -> dict[int, GenerationResult]:
        """Step until every submitted row is done; ``ticket -> result``."""
        results: dict[int, GenerationResult] = {}
        while self.busy:
            results.update(self.step())
        return results
