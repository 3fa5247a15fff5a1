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
import threading
from typing import Any, AsyncIterator, Callable

from pipeline.engine import GenerationResult, GenerationSettings
from pipeline.engine.scheduler import Scheduler
from pipeline.serve.streaming import TextStream

log = logging.getLogger("specbatch.serve")


class EngineLoop:
    """One :class:`Scheduler` on ``engine``, stepped by one background thread while rows
    are waiting or in flight; :meth:`submit` and :meth:`cancel` may be called from any thread.

    Callbacks run on the stepping thread.  Should a step raise, every row of that
    scheduler gets a failed result (``error`` = ``"EngineError: ..."``) and a fresh
    scheduler takes the next rows (the engine's caches need no clearing: a new row
    overwrites its slot's positions before it reads them).
    """

    def __init__(self, engine, max_batch_size: int | None = None):
        self.engine = engine
        self.max_batch_size = max_batch_size
        self.scheduler = Scheduler(engine, max_batch_size)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._ids = itertools.count()
        self._rows: dict[int, tuple[Scheduler, int, Callable | None]] = {}  # id -> (scheduler, ticket, on_done)
        self._stop = False
        self.steps = 0
        self.failures = 0
        self.peak_in_flight = 0  # most rows one step advanced together
        self.cancelled = 0  # rows stopped by cancel() before their end
        self._thread = threading.Thread(target=self._run, name="specbatch-engine-loop", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, prompt: list[int], settings: GenerationSettings, on_tokens=None, on_done=None,
               draft_length: int | None = None) -> int:
        """Queue a row (settings already resolved); returns its id for :meth:`cancel`.

        Raises:
            ValueError: a bad draft length.
        """
        with self._lock:
            row_id = next(self._ids)

            def done(result, row_id=row_id):
                with self._lock:
                    entry = self._rows.pop(row_id, None)
                    self.cancelled += result.finish_reason == "cancelled"
                if entry is not None and on_done is not None:
                    on_done(result)

            ticket = self.scheduler.submit(prompt, settings, on_tokens=on_tokens, on_done=done, resolved=True,
                                           draft_length=draft_length)
            self._rows[row_id] = (self.scheduler, ticket, on_done)
        self._wake.set()
        return row_id

    def cancel(self, row_id: int) -> None:
        with self._lock:
            entry = self._rows.get(row_id)
        if entry is not None:
            entry[0].cancel(entry[1])
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
                    log.exception("engine step failed; failing its rows and starting a fresh scheduler")
                    self._fail_all(f"EngineError: {type(e).__name__}: {e}")

    def _fail_all(self, error: str) -> None:
        self.failures += 1
        with self._lock:
            failed = self.scheduler
            victims = [(rid, cb) for rid, (sch, _, cb) in self._rows.items() if sch is failed]
            for rid, _ in victims:
                del self._rows[rid]
            self.scheduler = Scheduler(self.engine, self.max_batch_size)
        for _, on_done in victims:
            if on_done is not None:
                on_done(GenerationResult.failed(error))


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

    def __init__(self, loop: EngineLoop, rows: list[RequestRow], draft_length: int | None):
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
                    draft_length=draft_length,
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
