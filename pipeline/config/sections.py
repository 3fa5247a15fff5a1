"""The sections of a job config, one pydantic model each with a doc on every key (the ``#:``
comment above it, which ``scripts/reference_docs.py`` publishes), and the errors of a refused
config.  The whole config (:class:`pipeline.config.job.JobConfig`), the ``serve:`` section and
loading from YAML are in :mod:`pipeline.config.job`; :mod:`pipeline.config` says what every
section holds.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from pipeline.engine import METHODS, GenerationSettings, SpeculationSettings
from pipeline.engine.methods import foreign_params
from pipeline.engine.cpu import CpuOptions

DEFAULT_TEMPLATES = {
    "summarize": "Summarize the following article in a few sentences.\n\nArticle:\n{text}\n\nSummary:",
    "translate": "Translate the following text from {source_lang} to {target_lang}.\n\n"
    "{source_lang}: {text}\n{target_lang}:",
    "generate": "{text}",
}
#: the placeholders of a translate template that are task settings, not input columns
TASK_PLACEHOLDERS = {"translate": ("source_lang", "target_lang")}


def template_fields(template: str) -> list[str]:
    """The placeholders of a prompt template (``{column}``), unique, in order of first use.
    Only plain names: a template is filled by concatenation (:func:`pipeline.prompts.fill`),
    never by ``str.format``, so nothing in it or in a value is evaluated.

    Raises:
        ValueError: a malformed template (an unmatched brace), an empty ``{}``, or a
            placeholder with an attribute, an index, a conversion or a format spec
            (``{a.b}``, ``{a[0]}``, ``{a!r}``, ``{a:>9}``), naming it.
    """
    import string

    fields: dict[str, None] = {}
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise ValueError(f"malformed template ({e}); double the braces of literal ones: {{{{ }}}}") from None
    for _, name, spec, conversion in parsed:
        if name is None:
            continue
        if not name.strip():
            raise ValueError("an empty placeholder {}: name a column, e.g. {text}")
        if spec or conversion or any(c in name for c in ".["):
            shown = name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "")
            raise ValueError(f"placeholder {{{shown}}} is not a plain column name: templates fill column values "
                             "as text (no attributes, indices, conversions or format specs)")
        fields[name] = None
    return list(fields)


#: Ray counts CPUs and GPUs in steps of this: a smaller amount but 0 fails when Ray schedules it
RAY_RESOURCE_UNIT = 0.0001


def ray_resource(value: float | None) -> float | None:
    """``value`` (CPUs or GPUs of a process) if Ray can represent it (0, or at least the unit); else ValueError."""
    if value is not None and 0 < value < RAY_RESOURCE_UNIT:
        raise ValueError(f"{value:g} is less than {RAY_RESOURCE_UNIT:g}, the smallest amount of a resource Ray "
                         "can represent (it counts CPUs and GPUs in steps of 0.0001)")
    return value


#: the longest ``output.lease_timeout_s`` (seconds, a day): a killed run locks its output for
#: at most this long, and a lease file claiming a longer bound counts as this (pipeline.output.lease)
MAX_LEASE_TIMEOUT_S = 86400.0


class JobRefused(ValueError):
    """Base of every refusal of a job before any work starts: a bad config, input, model
    or output location.  The command line reports it in one line and exits with status 2."""


class ConfigError(JobRefused):
    """A job config is unreadable, has an unknown key, or a bad value (message names the key)."""


class _Section(BaseModel):
    """A config section.  Its values are validated strictly (pydantic ``strict``): a count
    or a number must be one, never a boolean (``input.split_rows: true`` is not 1) nor a
    string; a ``--set`` value is read as YAML, so ``--set input.split_rows=500`` is a number."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True)


class InputConfig(_Section):
    """Where prompts come from: files on any fsspec filesystem (local path, ``s3://``,
    ``gs://``, ``memory://``...), one input *shard* per file.  Every file of an input folder
    is read, or named with the reason in one warning; the job's own output and any folder
    holding a ``_manifest/`` are left out of the listing."""

    #: a file, a directory (every file under it; Hive partition folders ``key=value/``
    #: become string columns kept on output) or a glob (``s3://bucket/prefix/*.parquet``)
    uri: str = "data/demo_prompts.jsonl"
    #: ``auto`` picks by extension: ``.parquet`` / ``.pq`` are Parquet; ``.jsonl``, ``.json``
    #: and ``.ndjson`` (each optionally compressed) are JSON lines
    format: Literal["auto", "parquet", "jsonl"] = "auto"
    #: of JSONL files: ``infer`` (fsspec's ``compression="infer"``) takes it from the ending
    #: (``.gz`` gzip, ``.bz2``, ``.zst`` zstandard, ``.xz``); ``none`` or a name applies to every file
    compression: Literal["infer", "none", "gzip", "bz2", "zstd", "xz"] = "infer"
    #: the field (JSONL) or column (Parquet) of each row's id: strings or integers (an integer
    #: becomes its decimal string); a row without one gets ``<shard name>:<row>``
    id_column: str = "id"
    #: the field or column holding each row's text, filled into the task's prompt template
    #: where it says ``{text}`` (any other ``{column}`` reads the column of that name)
    text_column: str = "text"
    #: ``generate``: the field or column holding each row's chat messages in OpenAI's format
    #: (a list of ``{role, content}``, or a JSON string of one), rendered with the target's
    #: chat template instead of ``task.prompt_template``; a malformed row gets a per-row error
    messages_column: str | None = None
    #: the field or column holding each row's own parameters (a struct / object, or a JSON
    #: string of one) with OpenAI / vLLM names: ``max_tokens``, ``temperature``, ``top_p``,
    #: ``top_k``, ``seed``, ``stop``, ``response_format``; they override ``generation:`` for that
    #: row (``max_tokens`` is held to ``generation.max_new_tokens``); an unknown name or a bad
    #: value gets a per-row error naming the field (:mod:`pipeline.params`)
    params_column: str | None = None
    #: a Parquet file of at most this many bytes is read in full (its id and text columns)
    #: before any work, so a damaged data page refuses the job (exit 2) naming the file; a
    #: larger file is only opened there, and a damaged page fails the run when its shard is read
    preflight_read_max_bytes: int = Field(2**30, ge=0)
    #: rows per work unit: a file is read, decoded, committed and resumed in units of at
    #: most this many rows (Parquet: row groups merged up to it, a larger row group is a
    #: unit of its own; JSONL: line ranges).  5,000 rows is minutes of work per actor
    #: (the demo pair on one CPU core: about 23 rows/s at one new token, so 3.6 min); an
    #: interrupt loses at most the units in flight
    split_rows: int = Field(5_000, ge=1)
    #: passed to fsspec, e.g. ``{client_kwargs: {endpoint_url: http://127.0.0.1:9000}}``;
    #: without them s3fs uses the standard AWS chain (environment, ``~/.aws``, instance role)
    storage_options: dict[str, Any] = Field(default_factory=dict)


class TaskConfig(_Section):
    """What to ask the model: the prompt each row's text is filled into.  Special-token
    strings in a row's text stay text (:func:`pipeline.prompts.encode_protected`)."""

    #: ``summarize``, ``translate`` or ``generate``: picks the default template (and the job
    #: that runs it); ``generate`` keeps every input column on output and may take its prompt
    #: from ``input.messages_column`` instead of the template
    name: Literal["summarize", "translate", "generate"] = "summarize"
    #: the language of the input text (required for ``translate``)
    source_lang: str | None = None
    #: the language to translate into (required for ``translate``)
    target_lang: str | None = None
    #: the prompt: ``{column}`` placeholders name input columns (``{text}``: ``input.text_column``;
    #: for translate ``{source_lang}`` and ``{target_lang}`` are the settings below), double
    #: braces for literal ones.  Values are filled as text, nothing in them evaluated (a value
    #: holding ``{other}`` stays literal); a column the input lacks refuses the job before work
    #: starts, a null value is a per-row error.  ``None``: the task's default
    prompt_template: str | None = None
    #: a system message before the prompt when the chat template is on (``None``: none, or
    #: the chat template's own default)
    system_prompt: str | None = None
    #: ``auto`` wraps the filled template as one user message with the tokenizer's chat
    #: template when it has one; ``true`` requires one; ``false`` never
    chat_template: Literal["auto", True, False] = "auto"

    @model_validator(mode="after")
    def _check(self) -> "TaskConfig":
        if self.name == "translate":
            for key in ("source_lang", "target_lang"):
                if not getattr(self, key):
                    raise ValueError(f"task.{key} is required when task.name is 'translate'")
        try:
            template_fields(self.template)
        except ValueError as e:
            raise ValueError(f"task.prompt_template: {e}") from None
        if not self.columns:
            raise ValueError("task.prompt_template names no input column: put one in as {column} (e.g. {text})")
        return self

    @property
    def template(self) -> str:
        return self.prompt_template if self.prompt_template is not None else DEFAULT_TEMPLATES[self.name]

    @property
    def columns(self) -> list[str]:
        """The template's placeholders that are input columns (``text`` standing for
        ``input.text_column``), in order of first use."""
        own = TASK_PLACEHOLDERS.get(self.name, ())
        return [f for f in template_fields(self.template) if f not in own]

    def task_values(self) -> dict[str, str]:
        """The placeholders the task itself fills (translate's languages)."""
        return {k: getattr(self, k) or "" for k in TASK_PLACEHOLDERS.get(self.name, ())}


class ModelsConfig(_Section):
    """The model pair.  Paths are local directories (``save_pretrained`` output) or hub ids;
    the driver checks them (config, architecture, tokenizer, the drafter against the target)
    before Ray starts, without loading weights."""

    #: the target: a causal LM whose output every row gets
    target: str = "models/demo-target"
    #: the drafter of the methods that need one (``draft_model``, ``universal``,
    #: ``mtp_assistant``, ``eagle``: see each method's ``needs_drafter``); never loaded by the others
    drafter: str | None = "models/demo-drafter"
    #: load the target from this GGUF file (a llama.cpp checkpoint) inside the folder or hub
    #: repo ``target``, as ``from_pretrained(target, gguf_file=...)`` does: weights dequantized
    #: to ``dtype``, the tokenizer read from the same file; ``None``: a ``config.json`` checkpoint
    gguf_file: str | None = None
    #: the same for the drafter: a GGUF file inside ``drafter``
    drafter_gguf_file: str | None = None
    #: ``auto``: the checkpoint's dtype on a GPU, float32 on the CPU
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    #: ``None``: ``cuda`` when the actor has a GPU, else ``cpu``; any other value is passed to
    #: ``from_pretrained`` (e.g. ``auto`` to shard one model over the actor's GPUs)
    device_map: str | None = None
    #: passed to ``from_pretrained`` (a checkpoint with its own modelling code)
    trust_remote_code: bool = False

    @field_validator("gguf_file", "drafter_gguf_file")
    @classmethod
    def _file_name(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("must be a GGUF file name inside the model folder, or null")
        return v

    @model_validator(mode="after")
    def _drafter_gguf(self) -> "ModelsConfig":
        if self.drafter_gguf_file and not self.drafter:
            raise ValueError("models.drafter_gguf_file is set but models.drafter (the folder holding it) is not")
        return self


class MethodConfig(BaseModel):
    """How to speculate: ``name`` (a method of the table :data:`pipeline.engine.METHODS`)
    plus any :class:`pipeline.engine.SpeculationSettings` field (named as in transformers).
    A config may keep the settings of other methods (``draft_vocab_size`` of ``eagle`` under
    ``--method plain``): they are checked, but the engine gets only the method's own
    (:meth:`speculation_settings`), and they are no part of the resume fingerprint."""

    model_config = ConfigDict(extra="allow")

    #: the decoding method: ``plain`` (no speculation) or a method of the table
    name: str = "draft_model"

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in METHODS:
            raise ValueError(f"unknown method {v!r}; known methods: {', '.join(METHODS)}")
        return v

    @model_validator(mode="after")
    def _params(self) -> "MethodConfig":
        allowed = {f.name for f in dataclasses.fields(SpeculationSettings)} - {"method"}
        for key in self.model_extra or {}:
            if key not in allowed:
                raise ValueError(f"unknown key method.{key}; method parameters are: {', '.join(sorted(allowed))}")
        hints = typing.get_type_hints(SpeculationSettings)
        for key, value in (self.model_extra or {}).items():  # the section is not strict: its values go to the engine
            kinds = set(typing.get_args(hints[key])) | {hints[key]}
            if isinstance(value, bool) and bool not in kinds and kinds & {int, float}:
                raise ValueError(f"method.{key}: {str(value).lower()} is a boolean, not a number")
        try:
            self.speculation_settings()
            foreign = foreign_params(METHODS, self.name)
            for name in METHODS:  # another method's settings kept here: their values still checked
                theirs = {k: v for k, v in self.params.items() if name in foreign.get(k, ())}
                if theirs:
                    try:
                        SpeculationSettings(method=name, **theirs).validate()
                    except ValueError as e:
                        if "must be set for method" not in str(e):
                            raise
        except ValueError as e:
            raise ValueError(f"bad method parameter: {e}") from None
        return self

    @property
    def params(self) -> dict[str, Any]:
        return dict(self.model_extra or {})

    def speculation_settings(self) -> SpeculationSettings:
        """The engine's settings: the method's own parameters (a parameter only other
        methods take, :func:`~pipeline.engine.methods.foreign_params`, is left out); raises
        ValueError naming a bad value."""
        return SpeculationSettings(method=self.name, **self.own_params()).validate()

    def own_params(self) -> dict[str, Any]:
        """:attr:`params` less those that only other methods of the table take."""
        return {k: v for k, v in self.params.items() if k not in foreign_method_params(self.name)}


def foreign_method_params(method: str) -> frozenset[str]:
    """SpeculationSettings fields that belong to other methods of the table and not to
    ``method`` (:func:`pipeline.engine.methods.foreign_params` of the table)."""
    return frozenset(foreign_params(METHODS, method))


def _dataclass_fields(cls) -> dict[str, Any]:
    """``{name: (type, default)}`` of a dataclass, for :func:`pydantic.create_model`."""
    hints = typing.get_type_hints(cls)
    return {f.name: (hints[f.name], f.default) for f in dataclasses.fields(cls)}


class _GenerationSection(_Section):
    """Sampling, logits processors and stopping, as in transformers' ``generate()``: the
    fields of :class:`pipeline.engine.GenerationSettings` (names, types and meanings are
    its own), all unset (``null``) by default.

    A key left unset takes the target checkpoint's ``generation_config.json`` value, as
    ``generate()`` does, else the engine's default (greedy, 128 new tokens); a key set
    here overrides the checkpoint.  The driver resolves them before the run (a bad value
    from either source fails the job) and logs which checkpoint defaults were taken; the
    run summary's ``generation`` holds the resolved settings.

    With ``do_sample`` and a ``seed``, each row samples from its own generator, seeded by
    the job's seed and the row's id (:func:`pipeline.loading.row_seed`), never shared with
    the rows of its batch.  Under ``compute.draft_length: fixed`` a row's output is then its
    seed's, whichever actor or batch it lands in; under ``auto`` (the default) the seed fixes
    the law the output is drawn from, not the draw (``generation.seed``; a row copied by
    ``output.previous`` is a valid draw of that law, not the draw tonight's run would make).
    """

    @model_validator(mode="after")
    def _check(self):
        try:
            self.generation_settings()
        except ValueError as e:
            raise ValueError(f"bad generation setting: {e}") from None
        return self

    def generation_settings(self) -> GenerationSettings:
        """The explicit settings (unset ones ``None``), validated."""
        return GenerationSettings(**self.model_dump()).validate()


#: The ``generation:`` section: one field per GenerationSettings field (derived, so a new
#: engine setting is a config key without a change here).
GenerationConfig = create_model(
    "GenerationConfig", __base__=_GenerationSection, __module__=__name__, **_dataclass_fields(GenerationSettings)
)
GenerationConfig.__doc__ = _GenerationSection.__doc__


class ComputeConfig(_Section):
    """The actor pool that decodes: each actor loads the model pair once and feeds every
    batch of rows to the batched engine.  A pool larger than an embedded Ray is refused with
    the numbers; one that would hold every CPU leaves one to the stages before it."""

    #: actors in the pool (Ray Data LLM's ``concurrency``): ``N``, a pool of N, or ``[min, max]``,
    #: a pool that grows from ``min`` to ``max`` actors as the cluster gives it resources (Ray
    #: Data's ``ActorPoolStrategy(min_size=, max_size=)``; on an autoscaling cluster, new GPU
    #: nodes get actors: docs/scheduling.md)
    num_actors: int | tuple[int, int] = 1
    #: GPUs per actor (0: the CPU; else at least 0.0001, Ray's unit); the actor loads the pair on its GPU
    gpus_per_actor: float = Field(0, ge=0)
    #: CPUs per actor (at least 0.0001, Ray's unit), and its torch threads; a ``[min, max]`` pool grows
    #: only while this many CPUs are free for another actor
    cpus_per_actor: float = Field(1, gt=0)
    #: rows per ``map_batches`` call (Ray Data LLM's ``batch_size``); the actor decodes them
    #: ``max_batch_size`` at a time
    rows_per_batch: int = Field(32, ge=1)
    #: rows in flight per actor (continuous batching within each batch of rows); 8 was the
    #: fastest of 1, 4, 8, 16 and 32 in bench/bench_batch.py on the 2-core CPU, for plain and
    #: speculative decoding alike (reports/bench_batch, before the CPU kernels); on a GPU
    #: more rows pay: jobs/tune.py
    max_batch_size: int = Field(8, ge=1)
    #: how many draft tokens each row verifies per step: ``auto``, the engine's draft-length
    #: controller (:mod:`pipeline.engine.draft_control`: 0 .. the method's ``k`` per row and
    #: step, from the proposer's confidence, the measured acceptance and the measured cost of
    #: one more token in the pass; a step where no draft pays is a plain step), greedy and
    #: sampled rows alike; ``fixed``: every row its ``k``, as the method's settings say.
    #: Greedy outputs and the law of sampled ones never depend on it; a seed reproduces a
    #: sampled row's output only with ``fixed`` (the controller's lengths follow measured
    #: times).  Static ensemble verification is always ``fixed``.  (Replaces
    #: ``adaptive_draft_length``: ``true`` or ``null`` is ``auto``, ``false`` is ``fixed``.)
    draft_length: Literal["auto", "fixed"] = "auto"
    #: Ray restarts a dead actor (process killed, node lost) up to this many times in all.
    max_actor_restarts: int = Field(4, ge=0)
    #: A batch whose actor died is resubmitted up to this many times; a batch that keeps
    #: killing its actor then fails the run (shards committed so far stay committed).
    max_batch_retries: int = Field(3, ge=0)
    #: fail (instead of waiting forever) when the pool's actors cannot start in this time,
    #: e.g. no node has the GPUs they ask for
    actor_start_timeout_s: int = Field(600, ge=1)
    #: fail when no unit's rows come back written for this long (seconds), whatever the cause
    #: (a resource plan that cannot be scheduled, a hung storage read, a stuck actor); must be
    #: longer than model loading plus the slowest unit (``input.split_rows`` rows on one actor)
    stall_timeout_s: float = Field(1800, gt=0, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "adaptive_draft_length" in data:
            raise ValueError("compute.adaptive_draft_length was replaced by compute.draft_length: auto (the "
                             "draft-length controller, on by default; was true or null) or fixed (every row its k; "
                             "was false)")
        return data

    @field_validator("cpus_per_actor", "gpus_per_actor")
    @classmethod
    def _ray_unit(cls, v: float) -> float:
        return ray_resource(v)

    @field_validator("num_actors", mode="before")
    @classmethod
    def _pool_size(cls, v: Any) -> Any:
        if isinstance(v, bool):
            raise ValueError("must be a number of actors or [min, max]")
        if isinstance(v, (list, tuple)):
            if len(v) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
                raise ValueError(f"a pool of [min, max] actors takes two integers, got {v!r}")
            lo, hi = v
            if lo < 1 or hi < lo:
                raise ValueError(f"[min, max] needs 1 <= min <= max, got [{lo}, {hi}]")
            return (lo, hi) if lo != hi else lo
        if isinstance(v, int) and v < 1:
            raise ValueError("must be at least 1")
        return v

    @property
    def min_actors(self) -> int:
        """The pool's smallest size (``num_actors`` or its ``min``)."""
        return self.num_actors[0] if isinstance(self.num_actors, tuple) else self.num_actors

    @property
    def max_actors(self) -> int:
        """The pool's largest size (``num_actors`` or its ``max``)."""
        return self.num_actors[1] if isinstance(self.num_actors, tuple) else self.num_actors


class _CpuSection(_Section):
    """The engine's CPU acceleration, part by part: the fields of
    :class:`pipeline.engine.cpu.CpuOptions`.  Each actor prepares its models with them once at
    load; the run summary's ``cpu`` says what each chose and what it cost.  ``SPECBATCH_CPU_<KEY>``
    in the actor's environment overrides a key.  The parts change float32 rounding only: no key
    here is part of the resume fingerprint."""

    @model_validator(mode="after")
    def _check(self):
        self.cpu_options()
        return self

    def cpu_options(self) -> CpuOptions:
        """The engine's options (before the environment's overrides), validated."""
        return CpuOptions(**self.model_dump()).validate()


#: The ``cpu:`` section: one field per CpuOptions field (derived, like ``generation:``).
CpuConfig = create_model("CpuConfig", __base__=_CpuSection, __module__=__name__, **_dataclass_fields(CpuOptions))
CpuConfig.__doc__ = _CpuSection.__doc__


class OutputConfig(_Section):
    """Where Parquet goes, committed shard by shard (layout: :mod:`pipeline.output`).  The
    job never deletes or overwrites a file it did not write."""

    #: a directory on any fsspec filesystem (local path, ``s3://bucket/prefix/``, ...)
    uri: str = "out/summarize/"
    #: ``false``: resume: shards already committed in the output (a ``_manifest/part-NNNNN.json``
    #: entry for the same source file and size + mtime/ETag, under the same config fingerprint)
    #: are skipped; ``true``: delete the files the manifest names and start afresh
    overwrite: bool = False
    #: a folder holding files this job did not write is refused; ``true``: write beside them
    #: (they are never deleted or overwritten, even by ``overwrite``)
    allow_foreign_files: bool = False
    #: write under ``<uri>/date=<run_date>/``
    partition_by_date: bool = False
    #: ``YYYY-MM-DD`` of the ``date=`` partition; ``None``: today in UTC
    run_date: str | None = None
    #: an earlier output of this job whose unchanged rows are copied, not decoded (:mod:`pipeline.reuse`):
    #: a row is reused when a committed row there has its reuse key (the same prompt token ids, model
    #: and tokenizer files, task and generation settings, and when sampling the same seed and row id);
    #: ``auto``: the latest earlier complete ``date=`` partition of ``uri`` (needs ``partition_by_date``;
    #: none: every row is decoded, said in the log); a folder (local or any fsspec URL, read with
    #: ``storage_options``) must be a job output, else the run is refused; ``None``: decode every row
    previous: str | None = None
    #: a shard's rows are written as Parquet files of at most this many rows, so the driver
    #: holds at most about this many rows per shard, whatever the shard's size
    max_rows_per_file: int = Field(10_000, ge=1)
    #: a run holds a lease on the folder it writes (``_lease.json``, :mod:`pipeline.output.lease`),
    #: renewed every sixth of this (at most every 30 s); another run is refused while the
    #: lease's last heartbeat is younger than this many seconds, and takes an older lease over
    #: with a warning (its holder presumed dead); finite, at most :data:`MAX_LEASE_TIMEOUT_S`
    #: (a day), so a killed run never locks its output for longer
    lease_timeout_s: float = Field(120.0, gt=0, le=MAX_LEASE_TIMEOUT_S, allow_inf_nan=False)
    #: passed to fsspec, e.g. for an S3-compatible server ``{key: ..., secret: ...,
    #: client_kwargs: {endpoint_url: http://127.0.0.1:9000}}``; without them s3fs uses the
    #: standard AWS chain (environment, ``~/.aws``, instance role)
    storage_options: dict[str, Any] = Field(default_factory=dict)

    @field_validator("run_date", mode="before")
    @classmethod
    def _date(cls, v: str | None) -> str | None:
        if v is None:
            return v
        import datetime as _dt

        try:
            return _dt.date.fromisoformat(str(v)).isoformat()
        except ValueError:
            raise ValueError(f"output.run_date must be YYYY-MM-DD, got {v!r}") from None

    @field_validator("previous")
    @classmethod
    def _previous(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("output.previous must be auto, an output folder, or null; got an empty string")
        return v

    @model_validator(mode="after")
    def _previous_auto(self) -> "OutputConfig":
        if self.previous == "auto" and not self.partition_by_date:
            raise ValueError("output.previous: auto picks the latest earlier date= partition of output.uri, so it "
                             "needs output.partition_by_date (--run-date sets it); or name the previous output folder")
        return self

    def effective_run_date(self) -> str:
        import datetime as _dt

        return self.run_date or _dt.datetime.now(_dt.timezone.utc).date().isoformat()

    def location(self) -> str:
        """The directory this run writes: ``uri`` or ``uri/date=YYYY-MM-DD``."""
        if not self.partition_by_date:
            return self.uri
        return self.uri.rstrip("/") + f"/date={self.effective_run_date()}"


class RetryConfig(_Section):
    """Storage calls (listing, reading shards, writing parts, the manifest and the lease):
    retries, timeouts and a deadline.  Transient errors (connection refused/reset, timeouts,
    5xx, throttling) are retried; missing files and denied access are not.  botocore's and
    s3fs's own retries are turned off: this loop is the only one.  So a call to an endpoint
    that accepts connections but never answers fails after at most ``deadline_s +
    connect_timeout_s + read_timeout_s`` seconds (100 with the defaults); a transfer that
    keeps receiving data is never cut by the deadline."""

    #: attempts of one call in all
    attempts: int = Field(6, ge=1)
    #: the wait before the first retry, doubled at each one
    initial_backoff_s: float = Field(0.5, ge=0, allow_inf_nan=False)
    #: the longest wait between two attempts
    max_backoff_s: float = Field(30.0, ge=0, allow_inf_nan=False)
    #: an S3 request gives up connecting after this long (passed to botocore)
    connect_timeout_s: float = Field(10.0, gt=0, allow_inf_nan=False)
    #: an S3 request gives up waiting for the next bytes of an answer after this long (botocore)
    read_timeout_s: float = Field(30.0, gt=0, allow_inf_nan=False)
    #: no attempt starts later than this many seconds after the call's first one
    deadline_s: float = Field(60.0, gt=0, allow_inf_nan=False)


class AuditConfig(_Section):
    """Lossless audit: a deterministic sample of rows is decoded again with plain decoding
    and the same generation settings; the row's ``audit`` is true when the token ids match.
    The summary counts ``audit_rows`` and ``audit_mismatches`` (0 for a lossless method).  Rows
    that sample (``do_sample``, job-wide or a row's own parameters) are not audited: the two
    decoders use the random stream differently, so their outputs are draws of one law, not one draw."""

    #: the share of rows audited (chosen by a hash of the row's shard, position and ``seed``);
    #: 0 disables
    fraction: float = Field(0.0, ge=0, le=1)
    #: the hash's seed: another seed audits another sample
    seed: int = 0


class RayConfig(_Section):
    """Which Ray the job runs on."""

    #: ``None``: the cluster named by ``RAY_ADDRESS`` (as under ``ray job submit``), else an
    #: embedded Ray; ``auto`` or ``ray://...``: join that cluster
    address: str | None = None
