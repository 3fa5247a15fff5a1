"""Speculative decoding as one stage of your own Ray Data pipeline.

Modelled on Ray Data LLM's ``build_llm_processor``::

    from pipeline.processor import build_processor

    processor = build_processor("configs/summarize.yaml",
                                preprocess=lambda row: {"messages": [{"role": "user", "content": row["body"]}]},
                                postprocess=lambda row: {"doc": row["doc"], "summary": row["output_text"]})
    ds = processor(ray.data.read_parquet("s3://lake/articles/"))  # lazy, like any Dataset
    ds.write_parquet("s3://lake/summaries/")

The config is a job config (a :class:`~pipeline.config.JobConfig`, a YAML path or a dict);
its ``input:`` and ``output:`` sections are not used (the dataset is the input, the caller
writes the output).  ``models``, ``method``, ``generation``, ``task``, ``compute`` and
``audit`` mean what they mean for the job: ``compute.num_actors`` is Ray Data LLM's
``concurrency``, ``compute.rows_per_batch`` its ``batch_size``, ``compute.gpus_per_actor``
the GPUs of each actor.

Rows in.  Each row (after ``preprocess``, whose returned dict is merged into the row, as in
Ray Data LLM) gives its prompt as one of, in this order of precedence:

- ``prompt_token_ids``: ``list[int]``, token ids of the target tokenizer, used as they are;
- ``messages``: ``[{"role": ..., "content": ...}, ...]``, rendered with the target's chat
  template (``add_generation_prompt=True``);
- ``prompt``: ``str``, tokenized as it is (the tokenizer's special tokens added);
- the text column (``input.text_column``, default ``text``): filled into the task's prompt
  template, then the chat template when on, exactly as the job does.

A dataset that has none of these columns at all is named, not decoded into "prompt is
null" on every row: refused (:class:`~pipeline.config.ConfigError`) before any actor
starts when its schema is known without running it (``read_parquet``, ``from_items``...)
and there is no ``preprocess``; otherwise each row of a batch lacking them gets that
message as its ``error``.

and optionally ``max_new_tokens`` (int > 0), ``seed`` (int: the row's sampling seed) and
``stop`` (a string or a list: stop strings), which override ``generation:`` for that row.

Rows out.  Every column of the row is kept, and these are added (a column of the same name
is replaced): ``prompt`` (as the model saw it), ``output_text``, ``finish_reason``, the
statistics record (``prompt_tokens``, ``new_tokens``, ``verify_steps``, ``draft_tokens``,
``accepted_tokens``, ``acceptance_rate``, ``mean_accepted_length``, ``drafted_per_position``,
``accepted_per_position``, ``draft_time_s``, ``prefill_time_s``, ``verify_time_s``,
``wall_time_s``, ``draft_steps``, ``tokens_per_step``, ``tree_steps``, ``tree_nodes``, ``tree_off_steps``), ``method``, ``target_model``,
``draft_model``, ``error``, ``audit`` and ``output_token_ids`` (see pipeline.schema's OUTPUT_SCHEMA for types).
A bad row (no usable prompt, a prompt longer than the context, a bad per-row setting, a
``preprocess`` that raised on it) is not dropped: its ``error`` says why and its statistics
are null.  ``postprocess`` is then called on every row, error rows included (check
``row["error"]``), and its dict is the output row.

Scheduling.  The actor pool is the job's: ``compute.num_actors`` actors, each with
``compute.cpus_per_actor`` CPUs (its torch threads) and ``compute.gpus_per_actor`` GPUs,
loading the model pair once, dead actors restarted (``compute.max_actor_restarts``) and
their batches retried (``compute.max_batch_retries``).  The processor's own stages
(preprocess, rebatching, postprocess) ask Ray for no CPU.  A pool that would hold every
CPU of the cluster would starve the stages before it (a ``read_parquet`` task needs a CPU
and would never get one): then each actor reserves ``(cluster CPUs - 1) / num_actors``
CPUs from Ray instead, so one CPU stays free for them, and still runs
``compute.cpus_per_actor`` threads.  A ``[min, max]`` pool reserves the real
``compute.cpus_per_actor`` per actor and grows only as that much is free (Ray Data's
autoscaling pool, within its budget; :func:`pipeline.ray_setup.pool_plan`).  A pool larger
than the cluster is refused (:class:`pipeline.ray_setup.PlanError`) on a local Ray, logged on
a cluster that may grow.

The job (``jobs/summarize.py``) is this processor between its reader and its committer:
read units -> :class:`Processor` (``rebatch=False``) -> write on the workers -> commit unit by unit (pipeline.run).
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa

from pipeline.config import ConfigError, JobConfig, load_config
from pipeline.loading import resolve_job_generation

log = logging.getLogger("specbatch")

RowFn = Callable[[dict[str, Any]], dict[str, Any]]
#: the fields a row's prompt comes from, besides the text column (the module docstring)
PROMPT_FIELDS = ("prompt_token_ids", "messages", "prompt")


def missing_prompt(names: list[str], text_column: str) -> str | None:
    """Why rows with the columns ``names`` can give no prompt at all (none of
    :data:`PROMPT_FIELDS` nor ``text_column``), naming them; None when one is there."""
    if any(n in names for n in (*PROMPT_FIELDS, text_column)):
        return None
    return (f"the dataset has no column {text_column!r} (input.text_column), nor {', '.join(PROMPT_FIELDS)}: its "
            f"columns are {list(names)}; set input.text_column, or give a preprocess that makes one")


def as_job_config(config: JobConfig | str | os.PathLike | dict[str, Any]) -> JobConfig:
    """A :class:`JobConfig` from itself, a YAML file or a dict (validated as a file is;
    relative paths in a dict resolve against the working directory).

    Raises:
        ConfigError: unreadable file, unknown key or bad value (the message names the key).
    """
    if isinstance(config, JobConfig):
        return config
    if isinstance(config, (str, os.PathLike)):
        return load_config(Path(config))
    if isinstance(config, dict):
        from pydantic import ValidationError

        from pipeline.config.job import _format_error

        try:
            return JobConfig.model_validate(config)
        except ValidationError as e:
            raise ConfigError(_format_error(e)) from None
    raise ConfigError(f"a processor config is a JobConfig, a YAML path or a dict, got {type(config).__name__}")


def check_generation(cfg: JobConfig):
    """The checks of the model pair and the prompt that need no weights (pipeline.run's
    preflight makes the same ones): paths, architectures, vocabularies, the prompt template
    rendered once, the generation settings with the checkpoint's defaults.

    Returns:
        The resolved :class:`pipeline.engine.GenerationSettings`.

    Raises:
        ModelError, ConfigError (:class:`pipeline.config.JobRefused`), naming the key.
    """
    return check_generation_and_vocabulary(cfg)[0]


def check_generation_and_vocabulary(cfg: JobConfig):
    """:func:`check_generation`, and the target's vocabulary size (None: its config gives
    none), which bounds the token ids a nightly run copies (:mod:`pipeline.reuse`)."""
    from pipeline.models import check_models
    from pipeline.prompts import check_prompt

    checked = check_models(cfg.models, cfg.uses_drafter, method=cfg.method.name)
    check_prompt(checked["tokenizer"], cfg.task)
    target = checked["target_config"]
    text = target.get_text_config() if hasattr(target, "get_text_config") else target
    generation = resolve_job_generation(cfg, target)
    check_response_format(generation, checked["tokenizer"], target)
    return generation, getattr(text, "vocab_size", None)


def check_response_format(generation, tokenizer, target_config) -> None:
    """Compile the job-wide ``generation.response_format`` with the target's tokenizer, in
    the driver, bounded in time (:func:`pipeline.engine.grammar.compile_grammar`), so that a
    schema or regex the grammar library refuses, or cannot compile in time, refuses the job.

    Raises:
        ConfigError: naming ``generation.response_format`` and the library's reason.
    """
    rf = getattr(generation, "response_format", None)
    if rf is None:
        return
    from pipeline.engine.grammar import GrammarError, compile_grammar

    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    vocab = getattr(text, "vocab_size", None) or len(tokenizer)
    try:
        compile_grammar(rf, tokenizer, vocab)
    except GrammarError as e:
        raise ConfigError(f"generation.response_format: {e}") from None


def build_processor(config: JobConfig | str | os.PathLike | dict[str, Any], preprocess: RowFn | None = None,
                    postprocess: RowFn | None = None) -> "Processor":
    """A :class:`Processor` for ``config`` (see the module docstring for rows in and out).

    The model pair, prompt template and generation settings are checked here, in the
    driver, before any actor starts.

    Args:
        config: a :class:`JobConfig`, the path of a YAML job config, or a dict of one.
        preprocess: ``row -> dict`` merged into the row before decoding (e.g. ``{"messages": [...]}``).
        postprocess: ``output row -> dict``, the row written out.

    Raises:
        ConfigError, ModelError: a bad config or model (exit status 2 in a job).
    """
    cfg = as_job_config(config)
    return Processor(cfg, preprocess, postprocess, generation=check_generation(cfg))


class Processor:
    """``Processor(ds) -> ds``: a lazy Ray Data stage that decodes every row of ``ds``.

    Build it with :func:`build_processor`.  Calling it needs a running Ray (``ray.init()``,
    or a cluster) and returns a new lazy Dataset: nothing runs until it is consumed
    (``write_parquet``, ``iter_batches``, ``take``...).

    Args:
        config: the job config.
        preprocess, postprocess: see :func:`build_processor`.
        generation: the resolved generation settings (``None``: resolved here).
        text_column, id_column: the fields of a row's text and id (default
            ``input.text_column`` / ``input.id_column``).
        columns: ``"processor"`` (every input column kept) or ``"job"`` (the job's
            OUTPUT_SCHEMA; see :class:`actors.generate.GenerateActor`).
        embedded: whether Ray's resources are all there will be (a pool larger than the
            cluster is then refused, else only logged); ``None``: a one-node cluster not
            named by ``RAY_ADDRESS``.
        rebatch: cut the dataset into blocks of ``compute.rows_per_batch`` rows before the
            pool (balanced work, rows of one block spread over actors); ``False`` keeps the
            blocks as they come, each decoded by one actor task in order (the job: one
            block per work unit, so a unit's rows come back together and in order).
        reuse: the job's nightly reuse for the actors (:func:`pipeline.reuse.share_previous`);
            None: rows get no reuse key and nothing is copied.
        carry: the job's carried input columns (:func:`pipeline.input.carried_columns`): each
            row's :data:`pipeline.schema.CARRIED_COLUMN` feeds its prompt and parameters and the
            columns are written after the partition keys; None: none.
        load_board: where the pool's actors post what their loads chose
            (:func:`pipeline.ray_setup.open_load_board`, read by the caller with
            :func:`pipeline.ray_setup.read_load_board`); ``None``: the processor opens one,
            kept as :attr:`load_board` once it has been called.
    """

    def __init__(self, config: JobConfig, preprocess: RowFn | None = None, postprocess: RowFn | None = None, *,
                 generation=None, text_column: str | None = None, id_column: str | None = None,
                 columns: str = "processor", embedded: bool | None = None, rebatch: bool = True,
                 reuse: dict[str, Any] | None = None, load_board=None, carry: list[str] | None = None):
        self.config = config
        self.carry = carry
        self.load_board = load_board
        self.preprocess = preprocess
        self.postprocess = postprocess
        self.generation = generation if generation is not None else check_generation(config)
        self.text_column = text_column or config.input.text_column
        self.id_column = id_column or config.input.id_column
        self.columns = columns
        self.embedded = embedded
        self.rebatch = rebatch
        self.reuse = reuse

    def __call__(self, ds):
        import ray

        from actors.generate import GenerateActor
        from pipeline.ray_setup import check_resource_plan, is_local_cluster, open_load_board, pool_plan, zero_cpu

        cfg, c = self.config, self.config.compute
        if not ray.is_initialized():
            raise RuntimeError("the processor needs a running Ray: call ray.init() (or build the Dataset) first")
        embedded = is_local_cluster() if self.embedded is None else self.embedded
        check_resource_plan(cfg, embedded=embedded)
        pool = pool_plan(cfg, embedded)
        if self.load_board is None:  # where each actor posts what its load chose (pipeline.ray_setup)
            self.load_board = open_load_board()
        board = self.load_board
        ray.data.DataContext.get_current().wait_for_min_actors_s = c.actor_start_timeout_s
        if self.preprocess is not None:
            ds = ds.map_batches(_RowMap(self.preprocess, errors=True), batch_format="pyarrow", batch_size=None,
                                num_cpus=0)
        if self.columns != "job":  # the job's rows are INPUT_SCHEMA, checked in the driver (pipeline.input)
            ds = self._check_prompt_columns(ds)
        if self.rebatch:
            ds = zero_cpu(ds.repartition(target_num_rows_per_block=c.rows_per_batch))
        with warnings.catch_warnings():
            # max_restarts / max_task_retries have no named parameter in map_batches (Ray 2.60)
            warnings.filterwarnings("ignore", message=".*ray_remote_args.*deprecated")
            ds = ds.map_batches(
                GenerateActor,
                fn_constructor_kwargs={"config": cfg.model_dump(), "generation": self.generation, "columns": self.columns,
                                       "text_column": self.text_column, "id_column": self.id_column,
                                       "load_board": board, "carry": self.carry,
                                       **({"reuse": self.reuse} if self.reuse is not None else {})},
                batch_size=c.rows_per_batch,
                batch_format="pyarrow",
                compute=pool.strategy(),
                num_gpus=pool.gpus or None,
                num_cpus=pool.cpus,
                # bounded fault tolerance (Ray Data's default is unbounded: a batch that kills its
                # actor every time would be retried forever)
                max_restarts=c.max_actor_restarts,
                max_task_retries=c.max_batch_retries,
            )
        if self.postprocess is not None:
            ds = ds.map_batches(_RowMap(self.postprocess, errors=False), batch_format="pyarrow", batch_size=None,
                                num_cpus=0)
        return ds


    def _check_prompt_columns(self, ds):
        """Refuse a dataset whose known schema gives no prompt (see the module docstring);
        when the schema is not known without running, or a ``preprocess`` may add one, name
        the missing column on the rows of each batch that lacks it."""
        schema = None if self.preprocess is not None else ds.schema(fetch_if_missing=False)
        if schema is not None:
            why = missing_prompt(list(schema.names), self.text_column)
            if why:
                raise ConfigError(why)
            return ds
        return ds.map_batches(_NameMissingPrompt(self.text_column), batch_format="pyarrow", batch_size=None,
                              num_cpus=0)


class _NameMissingPrompt:
    """``map_batches`` function: a batch with no prompt column at all gets, on every row
    without an ``input_error`` of its own, the message naming the missing column (the actor
    makes it the row's ``error``); any other batch passes as it is."""

    def __init__(self, text_column: str):
        self.text_column = text_column

    def __call__(self, batch: pa.Table) -> pa.Table:
        why = missing_prompt(batch.column_names, self.text_column)
        if why is None:
            return batch
        old = batch.column("input_error").to_pylist() if "input_error" in batch.column_names else [None] * len(batch)
        errors = pa.array([e or why for e in old], pa.string())
        if "input_error" in batch.column_names:
            return batch.set_column(batch.column_names.index("input_error"), "input_error", errors)
        return batch.append_column("input_error", errors)


class _RowMap:
    """``map_batches`` function applying a row function to every row of a batch.

    With ``errors``, a row whose function raises (or returns no dict) is kept with its
    ``input_error`` set (so the actor makes it an error row); without, the error
    propagates.  Rows may gain different keys; missing ones are null.
    """

    def __init__(self, fn: RowFn, errors: bool):
        self.fn, self.errors = fn, errors

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = []
        for row in batch.to_pylist():
            try:
                got = self.fn(row)
                if not isinstance(got, dict):
                    raise TypeError(f"returned a {type(got).__name__}, not a dict")
            except Exception as e:  # noqa: BLE001 - one bad row must not fail the dataset
                if not self.errors:
                    raise
                rows.append({**row, "input_error": f"preprocess: {type(e).__name__}: {e}"})
                continue
            rows.append({**row, **got} if self.errors else got)
        names = list(dict.fromkeys(k for r in rows for k in r))
        return pa.Table.from_pylist([{k: r.get(k) for k in names} for r in rows])


__all__ = ["build_processor", "Processor", "as_job_config", "check_generation", "check_generation_and_vocabulary", "missing_prompt"]
