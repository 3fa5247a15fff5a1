"""The whole job config (:class:`JobConfig`: every section, the ``serve:`` one defined here),
and loading it: YAML files (YAML 1.2 floats) with relative paths resolved against the file,
``section.key=value`` overrides, and one error naming each offending key.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from pipeline.config.sections import (AuditConfig, ComputeConfig, ConfigError, CpuConfig, GenerationConfig, InputConfig,
                                      MethodConfig, ModelsConfig, OutputConfig, RayConfig, RetryConfig, TaskConfig,
                                      _Section, ray_resource)
from pipeline.engine import METHODS
from pipeline.paths import resolve_config_paths


class ServeConfig(_Section):
    """The online server (``jobs/serve.py``, ``serve run pipeline.serve:app_builder``): a Ray
    Serve application with an OpenAI-style API on the job's model pair and method.  Each
    replica loads the pair once and decodes its requests in one continuous batch.  The
    limits of one request are refused with a 4xx in OpenAI's error shape before any
    tokenizing or decoding."""

    #: where Serve's HTTP proxy listens (another host than 127.0.0.1 without ``api_key`` is
    #: warned about)
    host: str = "127.0.0.1"
    #: the HTTP proxy's port
    port: int = Field(8000, ge=1, le=65535)
    #: replicas, each loading the model pair once; Serve's proxy spreads requests over them
    num_replicas: int = Field(1, ge=1)
    #: GPUs per replica (``None``: ``compute.gpus_per_actor``, as the batch job's actors)
    gpus_per_replica: float | None = Field(None, ge=0)
    #: CPUs per replica, and its torch threads (``None``: ``compute.cpus_per_actor``)
    cpus_per_replica: float | None = Field(None, gt=0)
    #: rows decoded in one batch per replica; more wait for a free slot (``None``:
    #: ``compute.max_batch_size``)
    max_batch_size: int | None = Field(None, ge=1)
    #: Ray Serve's limit of requests a replica holds (in flight plus queued) before Serve
    #: queues them at the proxy
    max_ongoing_requests: int = Field(64, ge=1)
    #: the ``model`` clients send and ``/v1/models`` lists (``None``: the target's folder name
    #: for a local model, e.g. ``SmolLM2-135M-Instruct``; the hub id for a hub model)
    model_name: str | None = None
    #: a Jinja chat template, or the path of a file holding one, for ``/v1/chat/completions``
    #: when the target's tokenizer has none (``None``: the tokenizer's)
    chat_template: str | None = None
    #: a request body larger than this many bytes is refused (413) before it is parsed
    max_request_bytes: int = Field(2**20, ge=1)
    #: the most new tokens one choice may ask for (``max_tokens``; ``None``: the model's
    #: context bounds it)
    max_tokens_cap: int | None = Field(None, ge=1)
    #: the most rows (prompts x ``n``) one request may ask for
    max_rows_per_request: int = Field(64, ge=1)
    #: the most stop strings (``stop``) one request may send (each is searched for after
    #: every committed token, so one request could slow every row in flight)
    max_stop_strings: int = Field(16, ge=1)
    #: the most characters in one stop string
    max_stop_string_chars: int = Field(256, ge=1)
    #: the most token sequences in one request's ``bad_words_ids`` (each is matched at every step)
    max_bad_words: int = Field(256, ge=1)
    #: the most tokens in one ``bad_words_ids`` sequence
    max_bad_word_tokens: int = Field(16, ge=1)
    #: when set (or ``SPECBATCH_API_KEY`` in the environment, or ``jobs/serve.py --api-key``),
    #: every ``/v1/`` request must send ``Authorization: Bearer <key>`` (401 in OpenAI's shape
    #: otherwise, as vLLM's ``--api-key``); ``/health`` stays open; printed configs show ``***``
    api_key: str | None = None

    @field_validator("cpus_per_replica", "gpus_per_replica")
    @classmethod
    def _ray_unit(cls, v: float | None) -> float | None:
        return ray_resource(v)

    @field_validator("api_key")
    @classmethod
    def _key(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("serve.api_key must be a non-empty string, or null (no authentication)")
        return v

    def effective_api_key(self) -> str | None:
        """``api_key``, else the ``SPECBATCH_API_KEY`` environment variable, else None."""
        import os

        return self.api_key or os.environ.get("SPECBATCH_API_KEY") or None

    @field_validator("chat_template")
    @classmethod
    def _template(cls, v: str | None) -> str | None:
        if v is None or "{{" in v or "{%" in v:
            return v
        path = Path(v).expanduser()
        if not path.is_file():
            raise ValueError(f"serve.chat_template {v!r} is neither a Jinja template nor a file")
        return v

    def chat_template_text(self, base: Path | None = None) -> str | None:
        """The template itself (read from its file, relative to ``base`` or the working
        directory, when the key names one)."""
        v = self.chat_template
        if v is None or "{{" in v or "{%" in v:
            return v
        return ((base or Path.cwd()) / Path(v).expanduser()).read_text()


class JobConfig(_Section):
    input: InputConfig = Field(default_factory=InputConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    models: ModelsConfig = Field(default_factory=ModelsConfig)
    method: MethodConfig = Field(default_factory=MethodConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    compute: ComputeConfig = Field(default_factory=ComputeConfig)
    cpu: CpuConfig = Field(default_factory=CpuConfig)
    output: OutputConfig = Field(default_factory=OutputConfig)
    retry: RetryConfig = Field(default_factory=RetryConfig)
    audit: AuditConfig = Field(default_factory=AuditConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    serve: ServeConfig = Field(default_factory=ServeConfig)

    @model_validator(mode="after")
    def _drafter(self) -> "JobConfig":
        if METHODS[self.method.name].needs_drafter and not self.models.drafter:
            raise ValueError(f"models.drafter is required by method {self.method.name!r}")
        return self

    @model_validator(mode="after")
    def _messages(self) -> "JobConfig":
        if self.input.messages_column and self.task.name != "generate":
            raise ValueError("input.messages_column is read by the generate job (task.name: generate) only")
        return self

    def prompt_columns(self) -> list[str]:
        """The input columns a row's prompt and parameters come from, which every shard must
        hold: ``input.messages_column`` (else the template's ``{column}`` placeholders,
        ``{text}`` being ``input.text_column``), then ``input.params_column``."""
        i = self.input
        cols = [i.messages_column] if i.messages_column else [i.text_column if c == "text" else c
                                                               for c in self.task.columns]
        if i.params_column:
            cols.append(i.params_column)
        return list(dict.fromkeys(cols))

    @property
    def uses_drafter(self) -> bool:
        """Whether the actors load ``models.drafter``: it is set and the method drafts with it
        (:attr:`pipeline.engine.methods.MethodSpec.needs_drafter`; the other methods never
        load it, even when one is configured)."""
        return bool(self.models.drafter) and METHODS[self.method.name].needs_drafter

    def resolved(self) -> dict[str, Any]:
        """The config as plain data, defaults filled in (goes into the run summary)."""
        d = self.model_dump(mode="json")
        d["task"]["prompt_template"] = self.task.template
        d["output"]["storage_options"] = _redact(d["output"]["storage_options"])
        d["input"]["storage_options"] = _redact(d["input"]["storage_options"])
        if d["serve"].get("api_key"):
            d["serve"]["api_key"] = "***"
        return d


def _redact(opts: Any) -> Any:
    if isinstance(opts, dict):
        return {
            k: ("***" if any(s in k.lower() for s in ("secret", "key", "token", "password")) and isinstance(v, str) else _redact(v))
            for k, v in opts.items()
        }
    return opts


def _format_error(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = f"unknown key {loc}"
        elif err["type"] in ("int_type", "float_type") and isinstance(err.get("input"), bool):
            msg = f"{str(err['input']).lower()} is a boolean, not a number"
        elif msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        lines.append(f"{loc}: {msg}" if loc and not msg.startswith(("unknown key", loc)) else msg)
    return "invalid job config: " + "; ".join(lines)


class _Yaml12Floats(yaml.SafeLoader):
    """PyYAML follows YAML 1.1, where ``1e-5`` (no dot) is a string; YAML 1.2 and every user
    read it as a number.  This loader adds the 1.2 float forms."""


_Yaml12Floats.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)?(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def read_yaml(text: str) -> Any:
    """Parse YAML text as a config value (safe, with YAML 1.2 floats such as ``1e-5``).

    Raises:
        yaml.YAMLError: the text is not YAML.
    """
    return yaml.load(text, Loader=_Yaml12Floats)


def parse_override(item: str) -> tuple[list[str], Any]:
    """``"generation.max_new_tokens=32"`` -> ``(["generation", "max_new_tokens"], 32)``.

    Raises:
        ConfigError: no ``=`` or an empty key.
    """
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.key=value")
    key, value = item.split("=", 1)
    path = [p for p in key.strip().split(".")]
    if not all(path):
        raise ConfigError(f"override {item!r} has an empty key")
    try:
        parsed = read_yaml(value) if value.strip() else ""
    except yaml.YAMLError:
        parsed = value
    return path, parsed


def apply_overrides(data: dict[str, Any], overrides: list[str] | None) -> dict[str, Any]:
    """Set dotted keys in a raw config dict (creating sections); validation happens later."""
    for item in overrides or []:
        path, value = parse_override(item)
        node = data
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part} is not a section")
            node = child
        node[path[-1]] = value
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> JobConfig:
    """Read a YAML job config, apply ``section.key=value`` overrides, validate.

    Relative local paths in the file (input and output URIs, model folders, the serve chat
    template file) resolve against the file's folder; paths in ``overrides`` and the
    defaults resolve against the working directory (:mod:`pipeline.paths`).

    Args:
        path: a YAML file; ``None`` starts from the defaults.
        overrides: dotted ``key=value`` strings applied after the file.

    Returns:
        The validated :class:`JobConfig`.

    Raises:
        ConfigError: the file is missing or not a YAML mapping, a key is unknown, a value is
            bad (the message names each offending key), or the method is unknown.
    """
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            what = "not a regular file (a named pipe, a device or a folder)" if p.exists() else "not found"
            raise ConfigError(f"config file {what}: {p}")
        try:
            loaded = read_yaml(p.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p} is not valid YAML: {e}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {p} must hold a mapping of sections, got {type(loaded).__name__}")
        data = resolve_config_paths(loaded, p.parent)
    data = apply_overrides(data, overrides)
    try:
        return JobConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_error(e)) from None
