"""The engine loop of a server replica: one :class:`~pipeline.engine.scheduler.Scheduler`
stepped by one background thread, and the asyncio side of a request's rows.

Requests are submitted from the replica's asyncio loop; the thread (:class:`EngineLoop`)
steps the scheduler while rows are waiting or in flight, so concurrent requests share
every target pass, and hands each committed block and each final result back to the
request's loop with ``loop.call_soon_threadsafe`` (:class:`RequestRun`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import secrets
import threading
from typing import Any, AsyncIterator, Callable

from pipeline.engine import GenerationResult, GenerationSettings
from pipeline.engine.scheduler import Scheduler
from pipeline.serve.streaming import TextStream

log = logging.getLogger("specbatch.serve")


@dataclasses.dataclass
class _Entry:
    """One submitted row: what it was submitted with, and what it delivered so far (so a
    replay after a failed step can continue it without sending a token twice)."""

    prompt: list[int]
    settings: GenerationSettings
    k: int | None  # the row's cap on draft tokens (None: the engine's k_max)
    on_tokens: Callable | None
    on_done: Callable | None
    scheduler: Scheduler | None = None
    ticket: int | None = None
    delivered: list[int] = dataclasses.field(default_factory=list)
    cursor: int = 0  # tokens of the current run reproduced or delivered
    diverged: bool = False
    cancelled: bool = False  # cancel() was called


class EngineLoop:
    """One :class:`Scheduler` on ``engine``, stepped by one background thread while rows
    are waiting or in flight; :meth:`submit` and :meth:`cancel` may be called from any thread.

    Callbacks run on the stepping thread.  A step that raises fails only the row it fails
    on: the rows of that step are run again, each alone, from their start, in a fresh
    scheduler (the engine's caches need no clearing: a new row overwrites its slot's
    positions before it reads them); a row that fails alone gets a failed result
    (``error`` = ``"EngineError: ..."``), the others go on and end as they would have.
    The tokens a row had streamed are not sent again: its replay must reproduce them
    (greedy rows and seeded rows do; a sampled row without a seed gets a random seed at
    submission for this), else the row fails, saying so.  Then the loop goes back to
    batching.
    """

    def __init__(self, engine, max_batch_size: int | None = None):
        self.engine = engine
        self.max_batch_size = max_batch_size
        self.scheduler = Scheduler(engine, max_batch_size)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._ids = itertools.count()
        self._rows: dict[int, _Entry] = {}
        self._stop = False
        self.steps = 0
        self.failures = 0  # steps that raised
        self.failed_rows = 0  # rows that failed alone after a step raised
        self.peak_in_flight = 0  # most rows one step advanced together
        self.cancelled = 0  # rows stopped by cancel() before their end
        self._thread = threading.Thread(target=self._run, name="specbatch-engine-loop", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, prompt: list[int], settings: GenerationSettings, on_tokens=None, on_done=None,
               k: int | None = None) -> int:
        """Queue a row (settings already resolved); returns its id for :meth:`cancel`.

        Raises:
            ValueError: a bad draft length.
        """
        if settings.do_sample and settings.seed is None:  # a fresh generator, but one a replay can repeat
            settings = dataclasses.replace(settings, seed=secrets.randbits(63))
        entry = _Entry(list(prompt), settings, k, on_tokens, on_done)
        with self._lock:
            row_id = next(self._ids)
            self._queue(row_id, entry, self.scheduler)
        self._wake.set()
        return row_id

    def _queue(self, row_id: int, entry: _Entry, scheduler: Scheduler) -> None:
        """Submit ``entry`` (again) to ``scheduler`` (under the lock)."""
        entry.cursor = 0
        entry.scheduler = scheduler
        self._rows[row_id] = entry
        entry.ticket = scheduler.submit(entry.prompt, entry.settings, on_tokens=lambda ids: self._deliver(entry, ids),
                                        on_done=lambda result: self._done(row_id, result), resolved=True,
                                        k=entry.k)
        if entry.cancelled:
            scheduler.cancel(entry.ticket)

    def _deliver(self, entry: _Entry, ids) -> None:
        ids = list(ids)
        overlap = min(len(ids), len(entry.delivered) - entry.cursor)
        if overlap > 0:  # a replay: these were sent already, and must be the same
            if ids[:overlap] != entry.delivered[entry.cursor:entry.cursor + overlap]:
                entry.diverged = True
                entry.scheduler.cancel(entry.ticket)
                return
            entry.cursor += overlap
            ids = ids[overlap:]
        if ids and not entry.diverged:
            entry.delivered.extend(ids)
            entry.cursor += len(ids)
            if entry.on_tokens is not None:
                entry.on_tokens(ids)

    def _done(self, row_id: int, result: GenerationResult) -> None:
        with self._lock:
            entry = self._rows.pop(row_id, None)
        if entry is None:
            return
        if entry.diverged:
            self.failed_rows += 1
            result = GenerationResult.failed("EngineError: an engine step failed while this row was in flight, and "
                                             "its replay did not reproduce the tokens already sent")
        else:
            self.cancelled += result.finish_reason == "cancelled"
        if entry.on_done is not None:
            entry.on_done(result)

    def cancel(self, row_id: int) -> None:
        with self._lock:
            entry = self._rows.get(row_id)
            if entry is not None:
                entry.cancelled = True
                entry.scheduler.cancel(entry.ticket)
        self._wake.set()

    @property
    def rows(self) -> int:
        """Rows waiting or in flight."""
        return len(self._rows)

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        import torch

        while not self._stop:
            self._wake.wait()
            self._wake.clear()
            while not self._stop and self.scheduler.busy:
                try:
                    with torch.inference_mode():
                        done = self.scheduler.step()
                    self.steps += 1
                    self.peak_in_flight = max(self.peak_in_flight, self.scheduler.in_flight + len(done))
                except Exception as e:  # noqa: BLE001 - the replica must outlive a failed step
                    log.warning("engine step failed (%s: %s); running its rows again one by one", type(e).__name__, e)
                    self._isolate()

    def _isolate(self) -> None:
        """After a failed step: every row of the failed scheduler runs again alone, to its
        end or to the error it fails with by itself; new rows wait in a fresh scheduler."""
        import torch

        self.failures += 1
        with self._lock:
            failed = self.scheduler
            victims = [(rid, e) for rid, e in self._rows.items() if e.scheduler is failed]
            self.scheduler = Scheduler(self.engine, self.max_batch_size)
        for rid, entry in victims:
            alone = Scheduler(self.engine, self.max_batch_size)
            with self._lock:
                if rid not in self._rows:
                    continue
                self._queue(rid, entry, alone)
            try:
                with torch.inference_mode():
                    while alone.busy and not self._stop:
                        alone.step()
                        self.steps += 1
            except Exception as e:  # noqa: BLE001 - this row fails by itself
                log.exception("engine step failed on one row alone: failing that row")
                with self._lock:
                    entry = self._rows.pop(rid, None)
                if entry is not None:
                    self.failed_rows += 1
                    if entry.on_done is not None:
                        entry.on_done(GenerationResult.failed(f"EngineError: {type(e).__name__}: {e}"))


@dataclasses.dataclass
class RequestRow:
    """One choice of a request: its prompt, settings and (once done) result."""

    index: int
    prompt: list[int]
    settings: GenerationSettings
    stream: TextStream  # the choice's text, detokenized as it streams
    row_id: int | None = None
    result: GenerationResult | None = None


class RequestRun:
    """The rows of one request in the engine loop, with an asyncio queue of their events:
    ``(index, "tokens", ids)`` and ``(index, "done", result)``."""

    def __init__(self, loop: EngineLoop, rows: list[RequestRow], k: int | None):
        self.engine_loop = loop
        self.rows = rows
        self.queue: asyncio.Queue = asyncio.Queue()
        aio = asyncio.get_running_loop()
        put = self.queue.put_nowait

        def post(event) -> None:  # on the stepping thread
            try:
                aio.call_soon_threadsafe(put, event)
            except RuntimeError:  # the request's loop is closed: nobody is listening
                pass

        try:
            for row in rows:
                row.row_id = loop.submit(
                    row.prompt, row.settings,
                    on_tokens=lambda ids, i=row.index: post((i, "tokens", list(ids))),
                    on_done=lambda r, i=row.index: post((i, "done", r)),
                    k=k,
                )
        except BaseException:
            self.cancel()
            raise

    async def events(self) -> AsyncIterator[tuple[int, str, Any]]:
        pending = len(self.rows)
        try:
            while pending:
                event = await self.queue.get()
                if event[1] == "done":
                    self.rows[event[0]].result = event[2]
                    pending -= 1
                yield event
        finally:
            if pending:
                self.cancel()

    async def results(self) -> list[GenerationResult]:
        async for _ in self.events():
            pass
        return [row.result for row in self.rows]

    def cancel(self) -> None:
        for row in self.rows:
            if row.row_id is not None and row.result is None:
                self.engine_loop.cancel(row.row_id)
