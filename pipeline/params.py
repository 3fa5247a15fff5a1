"""Per-row parameters (``input.params_column``): OpenAI / vLLM names over the job's ``generation:``.

A row's parameters are a struct (Parquet), an object (JSONL) or a JSON string of one, with
the names of OpenAI's and vLLM's sampling parameters:

==================  =====================================================================
``max_tokens``      the row's budget of new tokens (> 0), held to the job's
                    ``generation.max_new_tokens``: a larger value is cut to it, and the row's
                    ``max_tokens_used`` output column records the value used
``temperature``     ``0``: greedy; ``> 0``: sample at this temperature (``do_sample``)
``top_p``           nucleus sampling, in (0, 1]
``top_k``           top-k sampling; ``0`` or ``-1`` (vLLM's "off") disable it
``seed``            the row's sampling seed (an integer)
``stop``            a stop string or a list of them
``response_format`` OpenAI's / vLLM's structured-output shape (``json_schema``,
                    ``json_object``, ``regex``, ``choice``, ``text``); see docs/generation.md
==================  =====================================================================

An unknown name or a bad value is the row's error (:class:`ParamsError`, naming the
field); the run goes on.  The model is pydantic's (:class:`RowParams`), strict: ``"5"`` is
not a number, ``true`` is not 1.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


class ParamsError(ValueError):
    """A row's parameters are malformed: not an object, an unknown name, a bad value (the
    message names the field)."""


class RowParams(BaseModel):
    """One row's parameters (OpenAI / vLLM names; see the module docstring)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    max_tokens: int | None = Field(None, gt=0)
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    response_format: dict[str, Any] | str | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return v
        stops = [v] if isinstance(v, str) else v
        if not stops or not all(s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stops

    @field_validator("response_format")
    @classmethod
    def _format(cls, v: Any) -> dict[str, Any] | None:
        if v is None:
            return v
        return normalize_format(v)


def normalize_format(rf: Any) -> dict[str, Any] | None:
    """:func:`pipeline.engine.grammar.normalize_response_format` (the shape only; raises
    ValueError naming the bad field)."""
    try:
        from pipeline.engine.grammar import normalize_response_format
    except ImportError:  # pragma: no cover - an engine without structured output
        raise ValueError("structured output is not available in this engine") from None
    return normalize_response_format(rf)


def parse_params(raw: Any) -> RowParams:
    """A row's parameters from its column's value (``None``: none set).

    Raises:
        ParamsError: not an object (nor a JSON string of one), an unknown name or a bad
            value, naming the field (``params.top_p: ...``).
    """
    if raw is None:
        return RowParams()
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ParamsError(f"params: not JSON ({e})") from None
        if raw is None:
            return RowParams()
    if not isinstance(raw, dict):
        raise ParamsError(f"params: must be an object of parameters, got {type(raw).__name__}")
    raw = {k: v for k, v in raw.items() if v is not None}  # a Parquet struct's unset fields are nulls
    try:
        return RowParams.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"] if not isinstance(p, int)) or "params"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = f"unknown parameter; known: {', '.join(RowParams.model_fields)}"
        raise ParamsError(f"params.{field}: {msg}") from None


def apply_params(params: RowParams, settings: Any, job_max_new_tokens: int | None) -> tuple[Any, int | None]:
    """``settings`` (a :class:`pipeline.engine.GenerationSettings`, the job's or the row's)
    with the row's parameters applied.

    Args:
        params: the row's :class:`RowParams`.
        settings: the settings they override.
        job_max_new_tokens: the job's ``generation.max_new_tokens`` (resolved): a row's
            ``max_tokens`` above it is held to it.

    Returns:
        ``(settings, max_tokens_used)``: ``max_tokens_used`` is the row's budget when it set
        ``max_tokens`` (after holding), else None.

    Raises:
        ParamsError: the settings refuse a value (naming the field by its OpenAI name).
    """
    own: dict[str, Any] = {}
    used = None
    if params.max_tokens is not None:
        used = min(params.max_tokens, job_max_new_tokens) if job_max_new_tokens else params.max_tokens
        own["max_new_tokens"] = used
    if params.temperature is not None:
        own["do_sample"] = params.temperature > 0
        if params.temperature > 0:
            own["temperature"] = params.temperature
    if params.top_p is not None:
        own["top_p"] = params.top_p
    if params.top_k is not None:
        own["top_k"] = max(params.top_k, 0)
    if params.seed is not None:
        own["seed"] = params.seed
    if params.stop is not None:
        own["stop_strings"] = list(params.stop)
    if params.response_format is not None:
        own["response_format"] = params.response_format
    if not own:
        return settings, used
    try:
        return dataclasses.replace(settings, **own).validate(), used
    except (TypeError, ValueError) as e:
        msg = str(e)
        for ours, theirs in (("max_new_tokens", "max_tokens"), ("stop_strings", "stop")):
            msg = msg.replace(ours, theirs)
        raise ParamsError(f"params: {msg}") from None


def response_format_of(settings: Any) -> dict[str, Any] | None:
    """The row's canonical response format, or None (also for an engine without the field)."""
    return getattr(settings, "response_format", None)
