"""Online use of the batch job's engine: a Ray Serve application with an OpenAI-style API.

    python jobs/serve.py --config configs/summarize.yaml [--host 127.0.0.1] [--port 8000]
    serve run pipeline.serve:app_builder config=configs/summarize.yaml [section.key=value ...]

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health`` (request fields: :mod:`pipeline.openai_protocol`).  Responses are OpenAI's
shapes plus a ``speculation`` object (the row statistics the batch job's Parquet holds:
acceptance rate, mean accepted length, draft / accepted tokens, verify steps, ...), on the
response and on each choice; ``"stream": true`` sends one server-sent event per block of
tokens the verifier commits, then ``data: [DONE]``.

Batching.  Each replica (``serve.num_replicas`` of them, ``serve.gpus_per_replica`` GPUs
each) loads the job config's model pair and method once (:func:`actors.generate.load_engine`,
as the batch job's actors do) and keeps one
:class:`~pipeline.engine.scheduler.Scheduler` (continuous batching: up to
``serve.max_batch_size`` rows in flight, a finished row's slot taken by the next request
at once).  Requests are submitted from the replica's asyncio loop; one background thread
(:class:`EngineLoop`) steps the scheduler while rows are in flight, so concurrent requests
share every target pass, and hands each committed block and each final result back to the
loop with ``loop.call_soon_threadsafe``.  Rows whose sampling settings differ step in
their own group.  A greedy request's output is what the batch job writes for the same
prompt and settings (the engine is lossless and a row's output never depends on its batch).

Errors.  A bad request is refused before any decoding with a 400 whose JSON ``error.param``
names the field (unknown field, ``max_tokens`` <= 0, a prompt longer than the context, a
sampling value or draft length out of range, ...); an unknown ``model`` is a 404.  Should
an engine step raise (a bug, out of memory), the rows in flight get a 500 and the replica
goes on with a fresh scheduler; Serve's health check restarts a replica only if its
stepping thread died.  A client that disconnects cancels its rows.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pipeline.config import ConfigError, JobConfig, load_config
from pipeline.engine import GenerationResult, GenerationSettings
from pipeline.engine.scheduler import Scheduler
from pipeline.engine.settings import resolve_generation_settings
from pipeline.paths import looks_local
from pipeline.openai_protocol import (
    DRAFT_LENGTH_FIELDS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    combine_stats,
    new_id,
    now,
    openai_finish_reason,
    parse_request,
    settings_error,
    speculation,
    usage,
)
from pipeline.prompts import render_chat

log = logging.getLogger("specbatch.serve")
REPO_ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------- batching
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


# ---------------------------------------------------------------------------- text
class TextStream:
    """Incremental detokenization of one row for streaming, with OpenAI's stop semantics.

    Each :meth:`push` of committed ids returns the new text that is safe to send: text
    that ends in an incomplete character, or that could still turn out to begin a stop
    string, is held back.  :meth:`finish` returns the rest of :meth:`final_text`.
    """

    def __init__(self, tokenizer, stops: list[str], include_stop: bool):
        self.tokenizer, self.stops, self.include_stop = tokenizer, stops, include_stop
        self.ids: list[int] = []
        self.sent = ""
        self._hold = max((len(s) for s in stops), default=1) - 1 if not include_stop else 0

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def final_text(self, text: str, finish_reason: str | None) -> str:
        """The row's text as OpenAI returns it: cut before the stop string that ended it,
        unless ``include_stop_str_in_output``."""
        if finish_reason == "stop" and self.stops and not self.include_stop:
            hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
            if hits:
                return text[:min(hits)]
        return text

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        text = self.decode(self.ids)
        safe = len(text) - self._hold
        while safe > 0 and text[safe - 1] == "\ufffd":
            safe -= 1
        if self.stops and not self.include_stop:
            hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
            if hits:
                safe = min(safe, min(hits))
        if safe <= len(self.sent) or not text.startswith(self.sent):
            return ""
        delta = text[len(self.sent):safe]
        self.sent += delta
        return delta

    def finish(self, text: str, finish_reason: str | None) -> str:
        final = self.final_text(text, finish_reason)
        rest = final[len(self.sent):] if final.startswith(self.sent) else ""
        self.sent += rest
        return rest


@dataclasses.dataclass
class _Row:
    """One choice of a request: its prompt, settings and (once done) result."""

    index: int
    prompt: list[int]
    settings: GenerationSettings
    stream: TextStream
    row_id: int | None = None
    result: GenerationResult | None = None


class _Run:
    """The rows of one request in the engine loop, with an asyncio queue of their events:
    ``(index, "tokens", ids)`` and ``(index, "done", result)``."""

    def __init__(self, loop: EngineLoop, rows: list[_Row], draft_length: int | None):
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


def _row_error(result: GenerationResult, param: str) -> APIError:
    """A failed row: the engine refused the prompt (400) or a step failed (500)."""
    if result.error.startswith("ValueError: "):
        return APIError(result.error.removeprefix("ValueError: "), param=param)
    return APIError(f"the engine failed on this request: {result.error}", status=500, type="internal_error")


# ---------------------------------------------------------------------------- the server
class OpenAIServer:
    """The API on one engine, independent of Ray (a Serve replica holds one; tests run it
    under uvicorn too).

    Args:
        engine: a :class:`pipeline.engine.SpeculativeEngine` (with its tokenizer).
        model_name: the ``model`` the server answers to.
        defaults: generation settings a request's unset fields take (the job's ``generation:``,
            resolved against the target's ``generation_config``).
        chat_template: a Jinja template for chat requests when the tokenizer has none.
        max_batch_size: rows in flight (default: the engine's).
        info: extra fields for ``/v1/models`` (paths of the models, ...).
    """

    def __init__(self, engine, model_name: str, defaults: GenerationSettings | None = None,
                 chat_template: str | None = None, max_batch_size: int | None = None,
                 info: dict[str, Any] | None = None):
        if engine.tokenizer is None:
            raise ValueError("the server needs the engine's tokenizer")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = model_name
        self.defaults = resolve_generation_settings(defaults, engine.target.generation_config, engine.target_vocab)
        self.chat_template = chat_template
        self.method = engine.spec.method
        self.draft_length = engine.spec.draft_length if engine.proposer is not None else None
        self.loop = EngineLoop(engine, max_batch_size)
        self.info = dict(info or {})
        self.started = now()
        self.requests = 0
        self.replica = _replica_id()

    @classmethod
    def from_config(cls, cfg: JobConfig, device: str | None = None) -> "OpenAIServer":
        """Load the config's model pair and method (as the batch job's actors do)."""
        from actors.generate import limit_cpu_threads, load_engine

        cpus = cfg.serve.cpus_per_replica or cfg.compute.cpus_per_actor
        limit_cpu_threads(cpus)
        max_batch = cfg.serve.max_batch_size or cfg.compute.max_batch_size
        loaded = load_engine(cfg, device, max_batch)
        info = {"target_model": cfg.models.target, "draft_model": cfg.models.drafter if cfg.uses_drafter else None,
                "device": loaded.models.device, "load_time_s": round(loaded.load_time_s, 3)}
        return cls(loaded.engine, served_model_name(cfg), loaded.settings,
                   cfg.serve.chat_template_text(), max_batch, info)

    def close(self) -> None:
        self.loop.close()

    # ------------------------------------------------------------------ plain endpoints
    def models(self) -> dict[str, Any]:
        spec = {f.name: getattr(self.engine.spec, f.name) for f in dataclasses.fields(self.engine.spec)}
        card = {"id": self.model_name, "object": "model", "created": self.started, "owned_by": "specbatch",
                "root": self.info.get("target_model", self.model_name), "max_model_len": self.engine.context,
                "speculation": spec, **self.info}
        return {"object": "list", "data": [card]}

    def health(self) -> dict[str, Any]:
        scheduler = self.loop.scheduler
        return {"status": "ok" if self.loop.alive else "engine loop stopped", "model": self.model_name,
                "method": self.method, "replica": self.replica, "pid": os.getpid(), "started": self.started,
                "requests": self.requests, "rows": self.loop.rows, "rows_in_flight": scheduler.in_flight,
                "max_batch_size": scheduler.size, "peak_rows_in_flight": self.loop.peak_in_flight,
                "steps": self.loop.steps, "failed_steps": self.loop.failures, "cancelled_rows": self.loop.cancelled}

    def check_health(self) -> None:
        """Raise when the replica cannot serve (its stepping thread died): Serve restarts it."""
        if not self.loop.alive:
            raise RuntimeError("the engine loop thread stopped")

    # ------------------------------------------------------------------ requests
    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", status=404, code="model_not_found")

    def _draft_length(self, req) -> int | None:
        """The request's draft length ``k`` (``None``: the server's)."""
        given = {f: getattr(req, f) for f in DRAFT_LENGTH_FIELDS if getattr(req, f) is not None}
        if not given:
            return None
        own = "prompt_lookup_num_tokens" if self.method == "prompt_lookup" else "num_assistant_tokens"
        for field, value in given.items():
            if self.draft_length is None:
                raise APIError(f"{field}: this server runs method {self.method!r}, which drafts nothing", param=field)
            if field != own:
                raise APIError(f"{field} is not a parameter of method {self.method!r} (this server's); "
                               f"its draft length is {own}", param=field)
            if not 1 <= value <= self.draft_length:
                raise APIError(f"{field} must be in 1 .. {self.draft_length} (the server's method.{own}), "
                               f"got {value}", param=field)
        return given[own]

    def _settings(self, req) -> GenerationSettings:
        try:
            return resolve_generation_settings(req.generation_settings(self.defaults),
                                               self.engine.target.generation_config, self.engine.target_vocab)
        except ValueError as e:
            raise settings_error(e) from None

    def _check_prompt(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise APIError(f"{param} is empty (no tokens)", param=param)
        vocab = self.engine.target_vocab
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(f"{param} has token ids outside the vocabulary (0 .. {vocab - 1}): {bad[:5]}", param=param)
        context = self.engine.context
        if context is not None and len(ids) >= context:
            raise APIError(f"{param} has {len(ids)} tokens; the model's context is {context} tokens "
                           "(the prompt must leave room for at least one new token)", param=param)
        return ids

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def _rows(self, prompts: list[list[int]], req, settings: GenerationSettings) -> list[_Row]:
        """``n`` rows per prompt (choice ``i * n + j``); with sampling and a seed, choice j > 0
        of a prompt draws from a seed derived from the request's seed and j."""
        from actors.generate import row_seed

        rows = []
        for p in prompts:
            for j in range(req.n):
                s = settings
                if j and settings.do_sample and settings.seed is not None:
                    s = dataclasses.replace(settings, seed=row_seed(settings.seed, j))
                rows.append(_Row(len(rows), p, s, TextStream(self.tokenizer, req.stop_list(), req.include_stop_str_in_output)))
        return rows

    async def completions(self, body: bytes):
        req = parse_request(CompletionRequest, body)
        self._check_model(req.model)
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        prompts = [self._check_prompt(p if isinstance(p, list) else self._encode(p, add_special), "prompt")
                   for p in req.prompt]
        return await self._respond(req, prompts, "prompt", chat=False)

    async def chat_completions(self, body: bytes):
        req = parse_request(ChatCompletionRequest, body)
        self._check_model(req.model)
        try:
            text = render_chat(self.tokenizer, [m.plain() for m in req.messages], self.chat_template)
        except ValueError as e:
            hint = "" if self.chat_template else " (set serve.chat_template in the job config)"
            raise APIError(f"messages: {e}{hint}", param="messages") from None
        add_special = False if req.add_special_tokens is None else req.add_special_tokens
        prompts = [self._check_prompt(self._encode(text, add_special), "messages")]
        return await self._respond(req, prompts, "messages", chat=True)

    async def _respond(self, req, prompts: list[list[int]], param: str, chat: bool):
        settings = self._settings(req)
        k = self._draft_length(req)
        rows = self._rows(prompts, req, settings)
        self.requests += 1
        run = _Run(self.loop, rows, k)
        rid = new_id("chatcmpl" if chat else "cmpl")
        if req.stream:
            return self._stream(run, req, rid, param, chat, k)
        results = await run.results()
        for r in results:
            if r.error is not None:
                raise _row_error(r, param)
        choices = []
        for row, r in zip(rows, results):
            text = row.stream.final_text(r.text or "", r.finish_reason)
            choice: dict[str, Any] = {"index": row.index}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice.update(text=text, logprobs=None)
            choice["finish_reason"] = openai_finish_reason(r.finish_reason)
            if req.return_token_ids:
                choice["token_ids"] = r.token_ids
            choice["speculation"] = speculation(r.stats, self.method, k or self.draft_length)
            choices.append(choice)
        return {
            "id": rid, "object": "chat.completion" if chat else "text_completion", "created": now(),
            "model": self.model_name, "choices": choices,
            "usage": usage(sum(len(row.prompt) for row in rows), sum(len(r.token_ids) for r in results)),
            "speculation": speculation(combine_stats([r.stats for r in results]), self.method, k or self.draft_length),
        }

    async def _stream(self, run: _Run, req, rid: str, param: str, chat: bool, k: int | None) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        created = now()

        def chunk(choices, **extra) -> str:
            body = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": choices, **extra}
            return f"data: {json.dumps(body)}\n\n"

        def choice(index, text, finish=None, ids=None, first=False, **extra):
            c: dict[str, Any] = {"index": index}
            if chat:
                c["delta"] = ({"role": "assistant"} if first else {}) | ({"content": text} if text or not first else {})
            else:
                c.update(text=text, logprobs=None)
            c["finish_reason"] = finish
            if ids is not None and req.return_token_ids:
                c["token_ids"] = ids
            c.update(extra)
            return c

        if chat:
            yield chunk([choice(row.index, "", first=True) for row in run.rows])
        try:
            async for index, kind, payload in run.events():
                row = run.rows[index]
                if kind == "tokens":
                    delta = row.stream.push(payload)
                    yield chunk([choice(index, delta, ids=payload)])
                    continue
                result: GenerationResult = payload
                if result.error is not None:
                    err = _row_error(result, param)
                    yield f"data: {json.dumps(err.body())}\n\n"
                    continue
                rest = row.stream.finish(result.text or "", result.finish_reason)
                yield chunk([choice(index, rest, openai_finish_reason(result.finish_reason), ids=[],
                                    speculation=speculation(result.stats, self.method, k or self.draft_length))])
            if req.stream_options is not None and req.stream_options.include_usage:
                done = [row.result for row in run.rows if row.result is not None and row.result.error is None]
                yield chunk([], usage=usage(sum(len(row.prompt) for row in run.rows), sum(len(r.token_ids) for r in done)),
                            speculation=speculation(combine_stats([r.stats for r in done]), self.method,
                                                    k or self.draft_length))
            yield "data: [DONE]\n\n"
        finally:
            run.cancel()


def _replica_id() -> str | None:
    serve = sys.modules.get("ray.serve")  # imported in a Serve replica; not imported here otherwise
    if serve is None:
        return None
    try:
        ctx = serve.get_replica_context()
        rid = getattr(ctx, "replica_id", None)
        return getattr(rid, "unique_id", None) or str(rid or getattr(ctx, "replica_tag", ""))
    except Exception:  # noqa: BLE001 - not in a Serve replica
        return None


# ---------------------------------------------------------------------------- HTTP
def build_app(server: OpenAIServer):
    """The FastAPI app of ``server``: the four endpoints, OpenAI-shaped errors."""
    app = FastAPI(title="specbatch", description="OpenAI-style completions on a speculative-decoding engine")

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception):
        log.exception("request failed")
        body = APIError(f"internal error: {type(e).__name__}: {e}", status=500, type="internal_error").body()
        return JSONResponse(body, status_code=500)

    async def respond(handler, request: Request):
        out = await handler(await request.body())
        if isinstance(out, dict):
            return JSONResponse(out)
        return StreamingResponse(out, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await respond(server.completions, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await respond(server.chat_completions, request)

    @app.get("/v1/models")
    async def models():
        return server.models()

    @app.get("/health")
    async def health():
        info = server.health()
        return JSONResponse(info, status_code=200 if info["status"] == "ok" else 503)

    return app


# ---------------------------------------------------------------------------- Ray Serve
def _deployment():
    from ray import serve

    @serve.deployment(name="specbatch")
    @serve.ingress()
    class OpenAIDeployment:
        """One replica: the job config's model pair and method, one engine loop."""

        def __init__(self, config: dict[str, Any]):
            self.server = OpenAIServer.from_config(JobConfig.model_validate(config))

        def __serve_build_asgi_app__(self):
            return build_app(self.server)

        def check_health(self) -> None:
            self.server.check_health()

    return OpenAIDeployment


def served_model_name(cfg: JobConfig) -> str:
    """The ``model`` the server answers to: ``serve.model_name``, else the target's folder name
    for a local model (``SmolLM2-135M-Instruct``: config paths are absolute once loaded), else
    its hub id."""
    if cfg.serve.model_name:
        return cfg.serve.model_name
    target = cfg.models.target
    if looks_local(target):
        return os.path.basename(os.path.normpath(os.path.expanduser(target)))
    return target


def absolute_paths(cfg: JobConfig, base: Path | None = None) -> JobConfig:
    """``cfg`` with local model and template paths made absolute (replicas may start in
    another directory); hub ids are left as they are."""
    base = base or Path.cwd()
    cfg = cfg.model_copy(deep=True)
    if cfg.serve.model_name is None:
        cfg.serve.model_name = served_model_name(cfg)
    for key in ("target", "drafter"):
        value = getattr(cfg.models, key)
        if value and (base / Path(value).expanduser()).is_dir():
            setattr(cfg.models, key, str((base / Path(value).expanduser()).resolve()))
    template = cfg.serve.chat_template_text(base)
    if template is not None:
        cfg.serve.chat_template = template
    return cfg


def preflight(cfg: JobConfig) -> None:
    """The checks that need no weights: model paths, tokenizer, chat template.

    Raises:
        ModelError, ConfigError (``ValueError``): naming the key.
    """
    from pipeline.models import check_models

    checked = check_models(cfg.models, cfg.uses_drafter)
    tok = checked["tokenizer"]
    if cfg.serve.chat_template is None and not getattr(tok, "chat_template", None):
        log.warning("the target's tokenizer has no chat template and serve.chat_template is unset: "
                    "/v1/chat/completions will refuse requests")


def build_application(cfg: JobConfig):
    """The Serve application of a job config: ``serve.num_replicas`` replicas, each with
    ``serve.gpus_per_replica`` GPUs and ``serve.cpus_per_replica`` CPUs (unset: the batch
    job's ``compute.gpus_per_actor`` / ``compute.cpus_per_actor``)."""
    cfg = absolute_paths(cfg)
    return _deployment().options(**deployment_options(cfg)).bind(cfg.model_dump())


def deployment_options(cfg: JobConfig) -> dict[str, Any]:
    """Ray Serve's deployment options from ``serve:`` (GPUs and CPUs per replica default to
    the batch job's ``compute.gpus_per_actor`` / ``compute.cpus_per_actor``)."""
    gpus = cfg.serve.gpus_per_replica if cfg.serve.gpus_per_replica is not None else cfg.compute.gpus_per_actor
    cpus = cfg.serve.cpus_per_replica or cfg.compute.cpus_per_actor
    return {"num_replicas": cfg.serve.num_replicas, "max_ongoing_requests": cfg.serve.max_ongoing_requests,
            "ray_actor_options": {"num_cpus": cpus, "num_gpus": gpus}}


def app_builder(args: dict[str, str]):
    """``serve run pipeline.serve:app_builder config=configs/summarize.yaml [section.key=value ...]``:
    the job config plus dotted overrides.  (Serve's own config chooses host and port there.)"""
    args = dict(args)
    path = args.pop("config", None)
    cfg = load_config(path, [f"{k}={v}" for k, v in args.items()])
    preflight(cfg)
    return build_application(cfg)


# ---------------------------------------------------------------------------- command line
_FLAGS = {
    "host": "serve.host", "port": "serve.port", "method": "method.name", "target": "models.target",
    "drafter": "models.drafter", "num_replicas": "serve.num_replicas", "gpus_per_replica": "serve.gpus_per_replica",
    "max_batch_size": "serve.max_batch_size", "model_name": "serve.model_name",
}


def main(argv: list[str] | None = None) -> int:
    """``jobs/serve.py``: load and check the config, start Serve (embedded Ray unless
    ``ray.address`` / ``RAY_ADDRESS``), deploy, and serve until interrupted.

    Exit status: 0 after Ctrl-C, 2 for a bad config or model path (before Ray starts).
    """
    p = argparse.ArgumentParser(prog="jobs/serve.py", description="OpenAI-style server on the job's engine (Ray Serve).")
    p.add_argument("--config", default=str(REPO_ROOT / "configs" / "summarize.yaml"), help="YAML job config")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set method.name=plain (repeatable)")
    p.add_argument("--host", help="serve.host (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="serve.port (default 8000)")
    p.add_argument("--method", help="method.name")
    p.add_argument("--target", help="models.target")
    p.add_argument("--drafter", help="models.drafter")
    p.add_argument("--num-replicas", type=int, help="serve.num_replicas")
    p.add_argument("--gpus-per-replica", type=float, help="serve.gpus_per_replica")
    p.add_argument("--max-batch-size", type=int, help="serve.max_batch_size")
    p.add_argument("--model-name", help="serve.model_name")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    overrides = list(args.overrides)
    for flag, key in _FLAGS.items():
        value = getattr(args, flag)
        if value is not None:
            overrides.append(f"{key}={json.dumps(value)}")

    from pipeline.models import ModelError

    try:
        cfg = load_config(args.config, overrides)
        if args.print_config:
            print(json.dumps(cfg.resolved(), indent=2))
            return 0
        preflight(cfg)
    except (ConfigError, ModelError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    from ray import serve

    from pipeline.run import init_ray

    init_ray(cfg)
    serve.start(http_options={"host": cfg.serve.host, "port": cfg.serve.port})
    serve.run(build_application(cfg), name="specbatch", route_prefix="/")
    print(f"serving {cfg.serve.model_name or cfg.models.target} ({cfg.method.name}) on "
          f"http://{cfg.serve.host}:{cfg.serve.port}/v1 (Ctrl-C stops)", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # a plain kill shuts down as Ctrl-C does
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
    return 0
