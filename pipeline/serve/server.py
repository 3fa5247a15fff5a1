"""The OpenAI-style server on one engine, independent of Ray: requests checked and mapped
to engine rows, responses and server-sent-event streams in OpenAI's shapes with the
``speculation`` object (:mod:`pipeline.serve.protocol`).  A Serve replica holds one
(:mod:`pipeline.serve.app`); tests run it under uvicorn too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import sys
from typing import Any, AsyncIterator

from pipeline.config import JobConfig, ServeConfig
from pipeline.engine import METHODS, GenerationResult, GenerationSettings, RowStats
from pipeline.engine.settings import resolve_generation_settings
from pipeline.loading import limit_cpu_threads, load_engine, process_cpus, row_settings
from pipeline.paths import looks_local
from pipeline.prompts import PromptError, encode_chat, special_token_ids
from pipeline.serve.engine_loop import EngineLoop, RequestRow, RequestRun
from pipeline.serve.protocol import (
    DRAFT_LENGTH_FIELDS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    new_id,
    now,
    openai_finish_reason,
    parse_request,
    settings_error,
    speculation,
    usage,
)
from pipeline.serve.streaming import TextStream

log = logging.getLogger("specbatch")


#: the ``serve:`` caps of one request's lists (see :class:`pipeline.config.ServeConfig`)
REQUEST_LIMITS = ("max_stop_strings", "max_stop_string_chars", "max_bad_words", "max_bad_word_tokens")


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
        max_tokens_cap: the most new tokens one choice may ask for (None: the context bounds it).
        max_rows_per_request: the most rows (prompts x ``n``) one request may ask for.
        limits: the caps of ``stop`` and ``bad_words_ids`` (:data:`REQUEST_LIMITS`, the
            ``serve:`` keys of the same names; default: their config defaults).

    Every value a request sends that reaches the engine is checked at the request
    (:mod:`pipeline.serve.protocol`, :meth:`_settings`, :meth:`_check_prompt`), and text is
    tokenized off the asyncio loop, so one request cannot stall or fail the others.
    """

    def __init__(self, engine, model_name: str, defaults: GenerationSettings | None = None,
                 chat_template: str | None = None, max_batch_size: int | None = None,
                 info: dict[str, Any] | None = None, max_tokens_cap: int | None = None,
                 max_rows_per_request: int = 64, limits: dict[str, int] | None = None):
        if engine.tokenizer is None:
            raise ValueError("the server needs the engine's tokenizer")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = model_name
        self.defaults = resolve_generation_settings(defaults, engine.target.generation_config, engine.target_vocab)
        self.chat_template = chat_template
        self.method = engine.spec.method
        self.k_max = engine.spec.k_max if engine.proposer is not None else None
        self.loop = EngineLoop(engine, max_batch_size)
        self.max_tokens_cap = max_tokens_cap
        self.max_rows_per_request = max_rows_per_request
        unknown = set(limits or {}) - set(REQUEST_LIMITS)
        if unknown:
            raise ValueError(f"unknown request limits {sorted(unknown)}; known: {', '.join(REQUEST_LIMITS)}")
        self.limits = {k: ServeConfig.model_fields[k].default for k in REQUEST_LIMITS} | dict(limits or {})
        self.special_ids = special_token_ids(self.tokenizer)
        self.info = dict(info or {})
        self.started = now()
        self.requests = 0
        self.replica = _replica_id()

    @classmethod
    def from_config(cls, cfg: JobConfig, device: str | None = None) -> "OpenAIServer":
        """Load the config's model pair and method as the batch job's actors do
        (:func:`pipeline.loading.load_engine`), with the replica's CPU threads and rows in flight,
        and warm the engine up before the first request (:meth:`SpeculativeEngine.warm_up` at
        every number of rows in flight up to the replica's, on the config's generation
        settings: the first requests then pay no compiling; ``warm_up_time_s`` on the model
        card).  A warm-up that fails is logged and left: the requests meet the fault."""
        limit_cpu_threads(process_cpus(cfg, serving=True))
        max_batch = cfg.serve.max_batch_size or cfg.compute.max_batch_size
        loaded = load_engine(cfg, device, max_batch)
        try:
            warm_up_s = loaded.engine.warm_up(max_batch, settings=loaded.settings)
        except Exception as e:  # noqa: BLE001 - the requests report what fails
            log.warning("warm-up failed (the first requests will pay for compiling): %s", e)
            warm_up_s = None
        info = {"target_model": cfg.models.target, "draft_model": cfg.models.drafter if cfg.uses_drafter else None,
                "device": loaded.models.device, "load_time_s": round(loaded.load_time_s, 3),
                "warm_up_time_s": None if warm_up_s is None else round(warm_up_s, 3)}
        return cls(loaded.engine, served_model_name(cfg), loaded.settings,
                   cfg.serve.chat_template_text(), max_batch, info, max_tokens_cap=cfg.serve.max_tokens_cap,
                   max_rows_per_request=cfg.serve.max_rows_per_request,
                   limits={k: getattr(cfg.serve, k) for k in REQUEST_LIMITS})

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

    def _k(self, req) -> int | None:
        """The request's cap on draft tokens ``k`` (``None``: the server's ``k_max``)."""
        given = {f: getattr(req, f) for f in DRAFT_LENGTH_FIELDS if getattr(req, f) is not None}
        if not given:
            return None
        own = METHODS[self.method].k_param
        for field, value in given.items():
            if self.k_max is None:
                raise APIError(f"{field}: this server runs method {self.method!r}, which drafts nothing", param=field)
            if field != own:
                raise APIError(f"{field} is not a parameter of method {self.method!r} (this server's); "
                               f"its draft length is {own}", param=field)
            if not 1 <= value <= self.k_max:
                raise APIError(f"{field} must be in 1 .. {self.k_max} (the server's method.{own}), "
                               f"got {value}", param=field)
        return given[own]

    def _settings(self, req) -> GenerationSettings:
        asked = req.max_tokens if req.max_tokens is not None else getattr(req, "max_completion_tokens", None)
        cap = self.max_tokens_cap
        if cap is not None and asked is not None and asked > cap:
            param = "max_tokens" if req.max_tokens is not None else "max_completion_tokens"
            raise APIError(f"{param} is {asked}, more than this server allows per choice (serve.max_tokens_cap={cap})",
                           param=param)
        self._check_lists(req)
        try:
            settings = resolve_generation_settings(req.generation_settings(self.defaults),
                                                   self.engine.target.generation_config, self.engine.target_vocab)
        except ValueError as e:
            raise settings_error(e) from None
        self._check_vocabulary_left(req, settings)
        self._check_response_format(settings)
        if cap is not None and settings.max_new_tokens > cap:  # the server's own default, above its cap
            settings = dataclasses.replace(settings, max_new_tokens=cap)
        return settings

    def _check_response_format(self, settings: GenerationSettings) -> None:
        """Compile the request's ``response_format`` against the target's tokenizer (cached by
        content: a format seen before costs nothing); one the grammar library refuses, or cannot
        compile in time, is a 400 naming ``response_format``."""
        rf = getattr(settings, "response_format", None)
        if rf is None:
            return
        from pipeline.engine.grammar import GrammarError, compile_grammar

        if self.tokenizer is None:
            raise APIError("response_format needs the target's tokenizer, which this server does not have",
                           param="response_format")
        try:
            compile_grammar(rf, self.tokenizer, self.engine.target_vocab)
        except GrammarError as e:
            raise APIError(f"response_format: {e}", param="response_format") from None

    def _check_lists(self, req) -> None:
        """``stop`` and ``bad_words_ids`` within the server's caps (each is matched at every
        step of the row, so one request could slow every row in flight)."""
        lim = self.limits
        stops = req.stop_list()
        if len(stops) > lim["max_stop_strings"]:
            raise APIError(f"stop has {len(stops)} strings, more than this server accepts "
                           f"(serve.max_stop_strings={lim['max_stop_strings']})", param="stop")
        longest = max((len(s) for s in stops), default=0)
        if longest > lim["max_stop_string_chars"]:
            raise APIError(f"stop has a string of {longest} characters, more than this server accepts "
                           f"(serve.max_stop_string_chars={lim['max_stop_string_chars']})", param="stop")
        bad = req.bad_words_ids or []
        if len(bad) > lim["max_bad_words"]:
            raise APIError(f"bad_words_ids has {len(bad)} sequences, more than this server accepts "
                           f"(serve.max_bad_words={lim['max_bad_words']})", param="bad_words_ids")
        longest = max((len(b) for b in bad if isinstance(b, list)), default=0)
        if longest > lim["max_bad_word_tokens"]:
            raise APIError(f"bad_words_ids has a sequence of {longest} tokens, more than this server accepts "
                           f"(serve.max_bad_word_tokens={lim['max_bad_word_tokens']})", param="bad_words_ids")

    def _check_vocabulary_left(self, req, settings: GenerationSettings) -> None:
        """Refuse settings that ban every token of the vocabulary at a step (400 naming the
        field): ``suppress_tokens`` and one-token ``bad_words_ids`` together, and EOS while
        ``min_new_tokens`` bans it.  (Nothing could be sampled, and greedy decoding would
        pick a banned token.)"""
        vocab = self.engine.target_vocab
        eos = settings.eos_token_id
        eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        suppressed = set(settings.suppress_tokens or [])
        banned = suppressed | {b[0] for b in settings.bad_words_ids or [] if len(b) == 1 and b[0] not in eos}
        if settings.min_new_tokens:
            banned_first = banned | eos
        else:
            banned_first = banned
        if len(banned_first) < vocab:
            return
        if len(banned) >= vocab:
            fields = [f for f in ("suppress_tokens", "bad_words_ids") if getattr(req, f, None)]
            param = fields[0] if fields else "suppress_tokens"
            what = " and ".join(fields) or "the server's suppress_tokens / bad_words_ids"
        else:
            param, what = "min_new_tokens", "min_new_tokens (which bans EOS) with suppress_tokens / bad_words_ids"
        raise APIError(f"{what} ban every one of the vocabulary's {vocab} tokens: nothing is left to generate",
                       param=param)

    def _check_rows(self, prompts: int, n: int) -> None:
        if prompts * n > self.max_rows_per_request:
            raise APIError(f"this request asks for {prompts} prompt(s) x n={n} = {prompts * n} choices, more than "
                           f"this server decodes for one request (serve.max_rows_per_request={self.max_rows_per_request})",
                           param="n" if n > 1 else "prompt")

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

    def _rows(self, prompts: list[list[int]], req, settings: GenerationSettings) -> list[RequestRow]:
        """``n`` rows per prompt (choice ``i * n + j``); with sampling and a seed, choice j > 0
        of a prompt draws from a seed derived from the request's seed and j
        (:func:`pipeline.loading.row_settings`)."""
        rows = []
        for p in prompts:
            for j in range(req.n):
                s = row_settings(settings, j) if j else settings
                rows.append(RequestRow(len(rows), p, s, TextStream(self.tokenizer, req.stop_list(), req.include_stop_str_in_output)))
        return rows

    async def completions(self, body: bytes):
        """``POST /v1/completions``: the prompt is the model's input as sent (a string is
        tokenized with its special-token strings as control tokens, as OpenAI's and vLLM's
        completions API do; a list of ids is used as is)."""
        req = parse_request(CompletionRequest, body)
        self._check_model(req.model)
        self._check_rows(len(req.prompt), req.n)
        self._settings(req)  # refuse bad settings before tokenizing
        add_special = True if req.add_special_tokens is None else req.add_special_tokens

        def encode() -> list[list[int]]:
            return [self._check_prompt(p if isinstance(p, list) else self._encode(p, add_special), "prompt")
                    for p in req.prompt]

        prompts = await asyncio.to_thread(encode)  # a large prompt must not stall the loop
        return await self._respond(req, prompts, "prompt", chat=False)

    async def chat_completions(self, body: bytes):
        """``POST /v1/chat/completions``: messages rendered with the chat template; every
        message's content stays text (a special-token string in it is ordinary tokens:
        :func:`pipeline.prompts.encode_chat`), the template's own special tokens are real."""
        req = parse_request(ChatCompletionRequest, body)
        self._check_model(req.model)
        self._check_rows(1, req.n)
        self._settings(req)
        add_special = False if req.add_special_tokens is None else req.add_special_tokens

        def encode() -> list[int]:
            try:
                _, ids = encode_chat(self.tokenizer, [m.plain() for m in req.messages], self.chat_template,
                                     add_special, self.special_ids)
            except PromptError as e:
                raise APIError(f"messages: {e}", param="messages") from None
            except ValueError as e:
                hint = "" if self.chat_template else " (set serve.chat_template in the job config)"
                raise APIError(f"messages: {e}{hint}", param="messages") from None
            return self._check_prompt(ids, "messages")

        prompts = [await asyncio.to_thread(encode)]
        return await self._respond(req, prompts, "messages", chat=True)

    async def _respond(self, req, prompts: list[list[int]], param: str, chat: bool):
        settings = self._settings(req)
        k = self._k(req)
        rows = self._rows(prompts, req, settings)
        self.requests += 1
        run = RequestRun(self.loop, rows, k)
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
            choice["speculation"] = speculation(r.stats, self.method, k or self.k_max)
            choices.append(choice)
        return {
            "id": rid, "object": "chat.completion" if chat else "text_completion", "created": now(),
            "model": self.model_name, "choices": choices,
            "usage": usage(sum(len(row.prompt) for row in rows), sum(len(r.token_ids) for r in results)),
            "speculation": speculation(RowStats.total(r.stats for r in results), self.method, k or self.k_max),
        }

    async def _stream(self, run: RequestRun, req, rid: str, param: str, chat: bool, k: int | None) -> AsyncIterator[str]:
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
                                    speculation=speculation(result.stats, self.method, k or self.k_max))])
            if req.stream_options is not None and req.stream_options.include_usage:
                done = [row.result for row in run.rows if row.result is not None and row.result.error is None]
                yield chunk([], usage=usage(sum(len(row.prompt) for row in run.rows), sum(len(r.token_ids) for r in done)),
                            speculation=speculation(RowStats.total(r.stats for r in done), self.method,
                                                    k or self.k_max))
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
