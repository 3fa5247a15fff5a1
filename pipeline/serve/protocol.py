"""The OpenAI-style API of the online server: request models, their mapping to engine
settings, and the response / stream-chunk shapes.

Requests are pydantic models that refuse unknown fields; every refusal becomes an
:class:`APIError` (HTTP 400) whose ``param`` names the field, in OpenAI's error shape::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}

Fields (OpenAI's names): ``model``, ``prompt`` (a string, a list of token ids, or a list of
either for several prompts: sent as is, no task template) or ``messages`` (rendered with
the chat template), ``max_tokens``, ``temperature`` (0 = greedy), ``top_p``, ``seed``,
``stop``, ``response_format`` (structured output, OpenAI's and vLLM's shapes), ``n``, ``stream``, ``stream_options.include_usage``, ``user`` (and for chat
``max_completion_tokens``); OpenAI fields the server does not implement (``logprobs``,
``echo``, ``presence_penalty``, ...) are accepted only at their no-op values.  Extensions, as
vLLM accepts them: the other :class:`~pipeline.engine.GenerationSettings` fields under
their own names (``top_k``, ``min_p``, ``repetition_penalty``, ``no_repeat_ngram_size``,
``bad_words_ids``, ``min_new_tokens``, ``suppress_tokens``), ``include_stop_str_in_output``,
``add_special_tokens``, ``return_token_ids``, and the method's draft length under the
name of its SpeculationSettings field (:data:`DRAFT_LENGTH_FIELDS`, from the method table:
``num_assistant_tokens``, or ``prompt_lookup_num_tokens`` for ``prompt_lookup``; 1 ..
the server's, a request may draft less, never more).

A field a request leaves unset takes the job config's ``generation:`` value, then the
target checkpoint's ``generation_config``, then the engine's default (as ``generate()``
and vLLM's ``--generation-config auto``): with ``configs/summarize.yaml`` a request without
``temperature`` is greedy and one without ``max_tokens`` gets 64 tokens.  ``seed`` is never
taken from the job: a sampled request without one draws from a fresh generator.
"""

from __future__ import annotations

import dataclasses
import math
import time
import typing
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator

from pipeline.engine import METHODS, GenerationSettings, RowStats
from pipeline.engine.stats import COLUMNS as STAT_COLUMNS

#: GenerationSettings fields a request sets under an OpenAI name (or never)
_OPENAI_NAMES = {"max_new_tokens": "max_tokens", "stop_strings": "stop", "do_sample": "temperature"}
_NOT_PER_REQUEST = ("eos_token_id",)
#: GenerationSettings fields a request sets under an OpenAI field of its own shape (``response_format``
#: is checked here; OpenAI's ``logprobs`` is a no-op field, not vLLM's count: :data:`NOOP_FIELDS`)
_OWN_FIELDS = ("response_format", "logprobs")
#: GenerationSettings fields a request may set under their own names (vLLM-style extensions)
EXTRA_SAMPLING_FIELDS = tuple(
    f.name for f in dataclasses.fields(GenerationSettings)
    if f.name not in _OPENAI_NAMES and f.name not in _NOT_PER_REQUEST and f.name not in _OWN_FIELDS
    and f.name not in ("temperature", "top_p", "seed")
)
#: the request fields of the methods' draft lengths (their SpeculationSettings names, from the method table)
DRAFT_LENGTH_FIELDS = tuple(dict.fromkeys(m.k_param for m in METHODS.values() if m.k_param))
#: OpenAI fields the server does not implement, accepted only at values that change nothing
#: (some clients always send them); any other value is a 400 naming the field
NOOP_FIELDS = {
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "logit_bias": (None, {}),
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
    "suffix": (None, ""),
}


class APIError(Exception):
    """A request the server refuses: HTTP ``status`` with OpenAI's error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    # NaN and infinities are refused for every float field (JSON's NaN / Infinity literals)
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


#: ``seed``: what ``torch.Generator.manual_seed`` takes (a 64-bit value, signed or not)
SEED_RANGE = (-(2**63), 2**64 - 1)
#: every other integer reaching the engine is a signed 64-bit value
INT64_MAX = 2**63 - 1
#: integer fields (and lists of them) range-checked at the request
_INT_FIELDS = ("max_tokens", "max_completion_tokens", "top_k", "no_repeat_ngram_size", "min_new_tokens",
               "num_assistant_tokens", "prompt_lookup_num_tokens")
_ID_LIST_FIELDS = ("bad_words_ids", "suppress_tokens")


class StreamOptions(_Strict):
    include_usage: bool = False


def _settings_fields() -> dict[str, Any]:
    """The GenerationSettings extensions and the draft-length fields, each ``None`` when unset."""
    hints = typing.get_type_hints(GenerationSettings)
    return {**{name: (hints[name], None) for name in EXTRA_SAMPLING_FIELDS},
            **{name: (int | None, None) for name in DRAFT_LENGTH_FIELDS}}


class _SamplingBase(_Strict):
    """What both endpoints share: sampling, stopping, streaming, the draft length."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    #: structured output: OpenAI's ``{"type": "json_schema", "json_schema": {"name", "schema"}}`` /
    #: ``{"type": "json_object"}`` / ``{"type": "text"}``, vLLM's ``regex`` / ``choice``
    #: (:func:`pipeline.engine.grammar.normalize_response_format`; the output is masked by its grammar)
    response_format: dict[str, Any] | None = None
    include_stop_str_in_output: bool = False
    add_special_tokens: bool | None = None
    return_token_ids: bool = False
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None
    logprobs: Any = None
    top_logprobs: Any = None
    echo: Any = None
    best_of: Any = None
    suffix: Any = None

    @field_validator(*NOOP_FIELDS, mode="before")
    @classmethod
    def _noop(cls, v, info):
        if v not in NOOP_FIELDS[info.field_name]:
            raise ValueError(f"{info.field_name} is not supported by this server (only its no-op value "
                             f"{NOOP_FIELDS[info.field_name][1]!r})")
        return v

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is None:
            return v
        from pipeline.engine.grammar import normalize_response_format

        return normalize_response_format(v)  # GrammarError (a ValueError) names the bad field

    @field_validator("seed")
    @classmethod
    def _seed(cls, v: int | None) -> int | None:
        low, high = SEED_RANGE
        if v is not None and not low <= v <= high:
            raise ValueError(f"seed must be a 64-bit integer ({low} .. {high}), got {v}")
        return v

    @field_validator(*_INT_FIELDS, check_fields=False)
    @classmethod
    def _int64(cls, v, info):
        if v is not None and not -INT64_MAX - 1 <= v <= INT64_MAX:
            raise ValueError(f"{info.field_name} must be a 64-bit integer, got {v}")
        return v

    @field_validator(*_ID_LIST_FIELDS, check_fields=False)
    @classmethod
    def _id_lists(cls, v, info):
        flat = [i for x in (v or []) for i in (x if isinstance(x, list) else [x])]
        big = [i for i in flat if isinstance(i, int) and not 0 <= i <= INT64_MAX]
        if big:
            raise ValueError(f"{info.field_name} holds {big[:3]}, which are not token ids")
        return v

    @field_validator("n")
    @classmethod
    def _n(cls, v: int) -> int:
        if not 1 <= v <= 16:
            raise ValueError(f"n must be in 1 .. 16, got {v}")
        return v

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float | None) -> float | None:
        if v is not None and (math.isnan(v) or math.isinf(v) or v < 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {v}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if v is None:
            return v
        stops = [v] if isinstance(v, str) else v
        if not stops or not all(stops):
            raise ValueError("stop must be a non-empty string or a list of them")
        return stops

    def stop_list(self) -> list[str]:
        return list(self.stop or [])

    def generation_settings(self, defaults: GenerationSettings) -> GenerationSettings:
        """``defaults`` (the job's resolved settings) with this request's fields set, not yet
        validated.  ``temperature`` 0 is greedy, > 0 samples at that temperature."""
        s = dataclasses.replace(defaults, seed=self.seed)
        budget = self.max_tokens if self.max_tokens is not None else getattr(self, "max_completion_tokens", None)
        if budget is not None:
            s.max_new_tokens = budget
        if self.temperature is not None:
            s.do_sample = self.temperature > 0
            s.temperature = self.temperature if self.temperature > 0 else defaults.temperature
        if self.top_p is not None:
            s.top_p = self.top_p
        if self.stop is not None:
            s.stop_strings = self.stop_list()
        if self.response_format is not None:
            s.response_format = self.response_format
        for name in EXTRA_SAMPLING_FIELDS:
            value = getattr(self, name)
            if value is not None:
                setattr(s, name, value)
        return s


_Sampling = create_model("_Sampling", __base__=_SamplingBase, __module__=__name__, **_settings_fields())


class CompletionRequest(_Sampling):
    """``POST /v1/completions``."""

    prompt: Any = Field(..., description="a string, a list of token ids, or a list of either (several prompts)")

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v):
        def one(p):
            if isinstance(p, str):
                return p
            if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                return p
            return None

        if one(v) is not None:
            return [v]
        if isinstance(v, list) and v and all(one(p) is not None for p in v):
            return v
        raise ValueError("prompt must be a string, a non-empty list of token ids, or a non-empty list of either")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def plain(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        d = {"role": self.role, "content": content or ""}
        if self.name is not None:
            d["name"] = self.name
        return d


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    #: OpenAI's newer name of ``max_tokens`` for chat (``max_tokens`` wins when both are set)
    max_completion_tokens: int | None = None

    @field_validator("max_completion_tokens")
    @classmethod
    def _budget(cls, v):
        if v is not None and v <= 0:
            raise ValueError(f"max_completion_tokens must be a positive integer, got {v}")
        return v

    @field_validator("messages")
    @classmethod
    def _messages(cls, v):
        if not v:
            raise ValueError("messages must hold at least one message")
        return v


_FIELD_NAMES = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields) \
    | set(ChatMessage.model_fields) | set(TextPart.model_fields) | set(StreamOptions.model_fields)


def _param(loc: tuple, unknown: bool = False) -> str | None:
    """A pydantic error location as OpenAI's ``param``: ``messages[0].role``; union tags
    (``str``, ``list[TextPart]``) are left out.  ``unknown``: the last part is a field the
    request should not have, named as sent."""
    out = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _FIELD_NAMES or (unknown and i == len(loc) - 1):
            out += f".{part}" if out else str(part)
        else:
            break
    return out or None


def parse_request(model: type[BaseModel], body: bytes):
    """Validate a JSON body; raises :class:`APIError` (400) naming the first bad field."""
    try:
        return model.model_validate_json(body or b"")
    except ValidationError as e:
        errors = e.errors(include_url=False)
        first = errors[0]
        if first["type"] == "json_invalid" or (first["type"] == "model_type" and not first["loc"]):
            raise APIError(f"the request body is not a JSON object: {first['msg']}") from None
        messages = []
        for err in errors:
            param = _param(err["loc"], err["type"] == "extra_forbidden")
            if err["type"] == "extra_forbidden":
                messages.append(f"unknown field {param!r}")
            else:
                msg = err["msg"].removeprefix("Value error, ")
                messages.append(msg if param and msg.startswith(param.split("[")[0]) else f"{param}: {msg}")
        unique = list(dict.fromkeys(messages))
        raise APIError("; ".join(unique[:3]), param=_param(first["loc"], first["type"] == "extra_forbidden")) from None


def settings_error(e: ValueError) -> APIError:
    """A :class:`GenerationSettings` refusal as a 400 naming the request's field."""
    message = str(e)
    name = message.split(" ", 1)[0]
    param = _OPENAI_NAMES.get(name, name)
    if param != name:
        message = param + message[len(name):]
    return APIError(message, param=param if param in _FIELD_NAMES else None)


# ---------------------------------------------------------------------------- responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def openai_finish_reason(reason: str | None) -> str | None:
    """The engine's finish reason in OpenAI's words: ``context`` (the window is full) is
    ``length``; ``cancelled`` is vLLM's ``abort``."""
    return {"context": "length", "cancelled": "abort"}.get(reason, reason)


#: the statistics the OpenAI ``usage`` object carries already (left out of ``speculation``)
USAGE_COUNTS = ("prompt_tokens", "new_tokens")
#: RowStats columns of the ``speculation`` object: the Parquet's statistics, less the usage counts
SPECULATION_KEYS = tuple(c.name for c in STAT_COLUMNS if c.name not in USAGE_COUNTS)


def speculation(stats: RowStats, method: str, k: int | None) -> dict[str, Any]:
    """The ``speculation`` object: the method, the cap on draft tokens ``k`` the row started
    with (its key ``draft_length``, the API's name; null for ``plain``), and the row statistics (``docs/metrics.md``; rates null when
    nothing was drafted).  Several rows (a request's choices): their :meth:`RowStats.total`."""
    d = stats.to_columns()
    return {"method": method, "draft_length": k, **{key: d[key] for key in SPECULATION_KEYS}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def now() -> int:
    return int(time.time())
