"""Stage 3, generate: the Ray actor that ``map_batches`` runs as an actor pool.

Each actor loads the model pair once (on its GPU when Ray gave it one, else on the CPU) and
builds one :class:`pipeline.engine.SpeculativeEngine` (:func:`pipeline.loading.load_engine`),
then feeds each whole batch to
:meth:`~pipeline.engine.SpeculativeEngine.generate_batch`: up to ``compute.max_batch_size``
rows are decoded in lockstep, and a finished row's slot takes the next row of the batch
at once (continuous batching).  When sampling, each row draws from its own generator,
seeded from ``generation.seed`` and the row's id (:func:`pipeline.loading.row_settings`), so a
row's output does not depend on which actor, batch or batch position it lands in.

A row that fails (null/empty/non-string prompt, a prompt longer than the target's
context, bad token ids) gets its ``error`` string and null statistics; the other rows of
the batch go on.  Should the batched call itself raise (a bug, a CUDA out-of-memory),
the batch is decoded again row by row, so that only the rows that fail alone get an
error.  A row is never retried beyond that.  A row that kills the process (segfault,
OOM kill) loses the actor: Ray restarts it (``compute.max_actor_restarts``) and
resubmits the batch (``compute.max_batch_retries``); a batch that keeps killing its
actor fails the run after those retries, with the shards committed so far kept.

Warm-up: before its first batch the actor decodes synthetic rows with every engine it holds
(:meth:`pipeline.engine.SpeculativeEngine.warm_up`: the job's engine with its drafter, and the
audit's plain engine) at every number of rows in flight up to ``compute.max_batch_size``, so
that no row's time includes compiling kernels.  Its seconds go to the first row the actor
returns (``warm_up_time_s``) and the run summary, apart from the rows' decode times.

Lossless audit (``audit.fraction`` > 0): a deterministic sample of rows is decoded a
second time with plain decoding (same model, same generation settings and seed) and the
token ids are compared; the row's ``audit`` is true on a match, false on a mismatch, null
when the row was not sampled, failed, or samples its tokens (``do_sample``, job-wide or per row: the
two decoders draw from the row's generator differently, so its tokens are a draw of the same law,
not the same draw; the engine's tests check the law).  The comparison of speeds is fair: both engines
are warm, and in each batch the sampled rows are decoded by both engines as one group of
their own (the same rows, the same rows in flight), A B B A (a large group in two halves, the
engine that went first on the first going second on the second; the first alternating from batch
to batch), before the batch's other rows; ``audit_plain_time_s`` against the row's
``wall_time_s`` is then plain decoding against the job's method on the same clock.

Nightly reuse (``reuse``, :mod:`pipeline.reuse`): every decoded row gets its ``reuse_key``
and ``output_token_ids``; a row whose key a previous output holds is copied, not decoded
(:meth:`GenerateActor._reused`, :meth:`GenerateActor._fill_reused`): its output is the
previous row's, ``reused_from`` names where it came from, its decode statistics are null,
and the audit re-decodes its sampled fraction with plain decoding, as for decoded rows.  A
decoded row whose id the previous output holds (an edited row) drafts from that row's
``output_token_ids`` too (:meth:`GenerateActor._reference`; reference drafting,
:mod:`pipeline.engine.reference`): lossless, counted in ``accepted_from_reference``.

Used as::

    ds.map_batches(GenerateActor, fn_constructor_kwargs={"config": cfg.model_dump()},
                   batch_format="pyarrow", batch_size=cfg.compute.rows_per_batch,
                   compute=ActorPoolStrategy(size=cfg.compute.num_actors),
                   num_gpus=cfg.compute.gpus_per_actor)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import resource
import socket
from typing import Any

import pyarrow as pa

from pipeline.config import JobConfig
from pipeline.loading import build_engine, limit_cpu_threads, load_engine, process_cpus, row_key, row_settings
from pipeline.models import model_ref
from pipeline.ray_setup import post_load_facts
from pipeline.params import response_format_of
from pipeline.prompts import PromptBuilder, as_text
from pipeline.structured import structured_columns
from pipeline.reuse import RowReuse
from pipeline.schema import CARRIED_COLUMN, INPUT_SCHEMA, OUTPUT_SCHEMA


#: output columns the actor adds to a row of the processor (OUTPUT_SCHEMA less the row's own id
#: and origin, and the job's nightly reuse columns)
ADDED_COLUMNS = tuple(n for n in OUTPUT_SCHEMA.names
                      if n not in ("id", "source_file", "source_row", "reuse_key", "reused_from"))
_ADDED_SCHEMA = pa.schema([OUTPUT_SCHEMA.field(n) for n in ADDED_COLUMNS])
#: per-row generation fields a row may carry (Ray Data LLM's / vLLM's names) -> GenerationSettings field
ROW_SETTINGS = {"max_new_tokens": "max_new_tokens", "seed": "seed", "stop": "stop_strings"}


class GenerateActor:
    """Callable class for ``map_batches``: a batch of rows -> the same rows with their outputs.

    A row's prompt is, in this order of precedence: ``prompt_token_ids`` (token ids of the
    target tokenizer, used as they are), ``messages`` (chat messages rendered with the
    target's chat template, their contents kept as text: :func:`pipeline.prompts.encode_chat`),
    ``prompt`` (a string tokenized as it is, the tokenizer's special tokens added), else the
    ``text_column`` (filled into the task's template, then the chat template when on: what
    the job does).  Optional per-row ``max_new_tokens``, ``seed`` and ``stop`` (a string or a
    list of them) override ``generation:`` for that row.  A row whose ``input_error`` is set
    is not decoded: that becomes its ``error``.

    Args:
        config: a :class:`JobConfig` or its ``model_dump()`` (plain data crosses to the actor).
        device: force ``cpu``/``cuda``; default: ``cuda`` when visible, else ``cpu``.
        columns: ``"job"``: the output is OUTPUT_SCHEMA, then the input's columns that are
            not INPUT_SCHEMA's (Hive partition keys); ``"processor"``: every input column
            but ``input_error``, then :data:`ADDED_COLUMNS` (a column of the same name in the
            input is replaced).
        text_column, id_column: the row's text and id fields (the id keys a sampled row's seed).
        reuse: nightly reuse, :func:`pipeline.reuse.share_previous`'s ``{"fingerprint", "table",
            "copy", "pool"}``: every row gets its ``reuse_key``, and a row the table holds is
            copied; ``pool`` of its rows seed the job-wide draft pool; None: no keys.
        load_board: the driver's load board (:func:`pipeline.ray_setup.open_load_board`), where
            the actor posts what its load did for the CPU; ``None`` posts nothing.
        generation: the job's generation settings as the driver resolved them once
            (:func:`pipeline.loading.resolve_job_generation`, a ``GenerationSettings``); ``None``
            (an actor built on its own): resolved here, by the same function.
    """

    def __init__(self, config: dict[str, Any] | JobConfig, device: str | None = None, columns: str = "job",
                 text_column: str = "text", id_column: str = "id", reuse: dict[str, Any] | None = None,
                 load_board=None, carry: list[str] | None = None, generation=None):
        if columns not in ("job", "processor"):
            raise ValueError(f"columns must be 'job' or 'processor', got {columns!r}")
        self.columns, self.text_column, self.id_column = columns, text_column, id_column
        #: the input columns the read stage carried (job: written after the partition keys)
        self.carry = list(carry) if carry is not None else None
        self.cfg = config if isinstance(config, JobConfig) else JobConfig.model_validate(config)
        compute = self.cfg.compute
        limit_cpu_threads(process_cpus(self.cfg))
        loaded = load_engine(self.cfg, device, compute.max_batch_size, generation)
        self.models, self.engine, self.settings = loaded.models, loaded.engine, loaded.settings
        self.load_time_s = loaded.load_time_s
        #: what the load did for the CPU, by model role (pipeline.engine.cpu.CpuPlan.describe), posted to the driver
        self.cpu_plans = {role: plan.describe() for role, plan in self.engine.cpu_plans.items()}
        post_load_facts({"host": socket.gethostname(), "pid": os.getpid(), "plans": self.cpu_plans,
                         "lines": {role: plan.summary() for role, plan in self.engine.cpu_plans.items()}}, load_board)
        self.prompts = PromptBuilder(self.models.tokenizer, self.cfg.task, self.cfg.input.text_column)
        self.audit_fraction = self.cfg.audit.fraction
        self.audit_seed = self.cfg.audit.seed
        self.plain_engine = build_engine(self.models, None, compute.max_batch_size) if self.audit_fraction > 0 else None
        self.audits = 0  # batches audited so far: which engine goes first alternates
        self.warm_up_time_s = self._warm_up()
        self._warm_up_unreported = True
        self.meta = {
            "method": self.cfg.method.name,
            "target_model": model_ref(self.cfg.models.target, self.cfg.models.gguf_file),
            "draft_model": model_ref(self.cfg.models.drafter, self.cfg.models.drafter_gguf_file)
            if self.cfg.uses_drafter else None,
        }
        self.reuse = RowReuse.of(reuse)
        #: previous outputs this actor's job-wide draft pool was seeded with (after the warm-up's reset)
        self.pool_seeded = self.engine.seed_pool(self.reuse.pool_documents()) if self.reuse is not None else 0
        self.rows_done = 0

    def generate_rows(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Input rows -> output rows (OUTPUT_SCHEMA fields), in order.  Never raises."""
        outs: list[dict[str, Any]] = []
        todo: list[tuple[int, list[int]]] = []  # (index in rows, prompt ids)
        settings: list = []
        references: list = []  # per row of todo: the previous output of its id to draft from, or None
        reused: list[tuple[int, list[int], Any]] = []  # (index in rows, prompt ids, settings) of copied rows
        for i, row in enumerate(rows):
            out: dict[str, Any] = {
                "id": row.get(self.id_column) if self.columns == "job" else None,
                "source_file": row.get("source_file"),
                "source_row": row.get("source_row"),
                "prompt": None,
                **self.meta,
            }
            outs.append(out)
            try:
                if row.get("input_error"):
                    raise ValueError(row["input_error"])
                values = self._values(row)
                out["prompt"], ids = self._prompt(row, values)
                one = self._row_settings(row, ids, values, out)
            except Exception as e:  # noqa: BLE001 - a bad row must not fail its batch
                out["error"] = f"{type(e).__name__}: {e}"
                continue
            if self._reused(out, ids, one):
                reused.append((i, ids, one))
                continue
            todo.append((i, ids))
            settings.append(one)
            references.append(self._reference(row))
        audit = [j for j, (i, ids) in enumerate(todo) if self.plain_engine is not None and not settings[j].do_sample
                 and audit_selected(*_origin(rows[i], ids), self.audit_fraction, self.audit_seed)]
        results, plain = self._decode_audited(todo, settings, audit, references)
        audited = {j: (p.token_ids == results[j].token_ids if p.error is None else None)
                   for j, p in zip(audit, plain) if results[j].error is None}
        plain_time = {j: p.stats.wall_time_s for j, p in zip(audit, plain) if p.error is None and j in audited}
        for j, ((i, _), res) in enumerate(zip(todo, results)):
            out = outs[i]
            if res.error is not None:
                out["error"] = res.error
                continue
            out.update(res.stats.to_columns())
            out["finish_reason"] = res.finish_reason
            out["output_text"] = self.models.tokenizer.decode(res.token_ids, skip_special_tokens=True)
            out["output_token_ids"] = list(res.token_ids)
            out["error"] = None
            out["audit"] = audited.get(j)
            out["audit_plain_time_s"] = plain_time.get(j)
            out.update(structured_columns(out["output_text"], res.finish_reason, response_format_of(settings[j]),
                                          getattr(res, "grammar_complete", None)))
            out["output_logprobs"] = _logprobs(getattr(res, "logprobs", None))
        self._fill_reused(rows, outs, reused)
        if outs and self._warm_up_unreported:
            outs[0]["warm_up_time_s"] = self.warm_up_time_s
            self._warm_up_unreported = False
        self.rows_done += len(rows)
        return outs

    def _reused(self, out: dict[str, Any], ids: list[int], settings) -> bool:
        """Set the row's ``reuse_key``; when the previous output holds it, its output too
        (:meth:`_fill_reused` audits it) and return True: the row is not decoded."""
        if self.reuse is None:
            return False
        out["reuse_key"] = key = self.reuse.key(ids, settings, self.settings)
        hit = self.reuse.find(key)
        if hit is None:
            return False
        out.update(prompt_tokens=len(ids), new_tokens=len(hit.token_ids), finish_reason=hit.finish_reason,
                   output_text=self.models.tokenizer.decode(hit.token_ids, skip_special_tokens=True),
                   output_token_ids=hit.token_ids, reused_from=hit.reused_from, error=None)
        out.update(structured_columns(out["output_text"], hit.finish_reason, response_format_of(settings)))
        return True

    def _fill_reused(self, rows: list[dict[str, Any]], outs: list[dict[str, Any]],
                     reused: list[tuple[int, list[int], Any]]) -> None:
        """The audit of the copied rows: its sample of them decoded with plain decoding, whose
        token ids must be the copied ones (``audit``; ``audit_plain_time_s``).  A row whose
        decoding failed gets no ``reuse_key``."""
        for out in outs:
            if out.get("error") is not None:
                out["reuse_key"] = None
        audit = [(i, ids, s) for i, ids, s in reused if self.plain_engine is not None and not s.do_sample
                 and audit_selected(*_origin(rows[i], ids), self.audit_fraction, self.audit_seed)]
        plain = self._decode(self.plain_engine, [ids for _, ids, _ in audit], [s for _, _, s in audit]) if audit else []
        for (i, _, _), p in zip(audit, plain):
            if p.error is None:
                outs[i]["audit"] = p.token_ids == outs[i]["output_token_ids"]
                outs[i]["audit_plain_time_s"] = p.stats.wall_time_s

    def _warm_up(self) -> float:
        """Every engine's warm-up (the job's, then the audit's plain one) at every number of rows
        in flight up to ``compute.max_batch_size``, on the job's generation settings; seconds.  A
        warm-up that fails is logged and left: the rows then meet the fault and get its error."""
        seconds = 0.0
        for engine in (self.engine, self.plain_engine):
            if engine is None:
                continue
            try:
                seconds += engine.warm_up(self.cfg.compute.max_batch_size, settings=self.settings)
            except Exception as e:  # noqa: BLE001 - the batches report what fails, row by row
                logging.getLogger(__name__).warning("warm-up failed (the first rows will pay for compiling): %s", e)
        return seconds

    def _reference(self, row: dict[str, Any]) -> list[int] | None:
        """The row's reference for drafting (:mod:`pipeline.engine.reference`): the previous
        output's token ids of the row's id (:meth:`pipeline.reuse.RowReuse.reference_for`; the
        row was not copied, so its prompt or settings changed), or None: no previous output, no
        row of that id, or ids outside this target's vocabulary (a previous output of another
        tokenizer: nothing to draft from)."""
        if self.reuse is None or self.columns != "job":
            return None
        ref = self.reuse.reference_for(row.get(self.id_column))
        if not ref or max(ref) >= self.engine.target_vocab or min(ref) < 0:
            return None
        return ref

    def _decode_audited(self, todo: list[tuple[int, list[int]]], settings: list, audit: list[int],
                        references: list | None = None):
        """The job's engine's results of every row of ``todo``, and plain decoding's of the rows
        ``audit`` (indices into ``todo``), in that order.  The audited rows are decoded by both
        engines in turn, A B B A: a group of at least ``2 x compute.max_batch_size`` rows in two
        halves, the engine that went first on the first half going second on the second (a shape
        the warm-up did not run costs whichever engine meets it first: each meets half of them
        first), the first engine alternating by batch; then the batch's other rows.  The job's
        engine drafts from ``references`` (one per row of ``todo``, or None) where a row has one."""
        refs = references or [None] * len(todo)
        if not audit:
            return self._decode(self.engine, [ids for _, ids in todo], settings, refs), []
        chosen = set(audit)
        rest = [j for j in range(len(todo)) if j not in chosen]
        half = len(audit) // 2 if len(audit) >= 2 * self.cfg.compute.max_batch_size else len(audit)
        order = [self.engine, self.plain_engine][:: 1 if self.audits % 2 == 0 else -1]
        self.audits += 1
        decoded: dict[int, dict[int, object]] = {id(self.engine): {}, id(self.plain_engine): {}}
        for part, engines in ((audit[:half], order), (audit[half:], order[::-1])):
            for engine in engines if part else ():
                out = self._decode(engine, [todo[j][1] for j in part], [settings[j] for j in part],
                                   [refs[j] for j in part] if engine is self.engine else None)
                decoded[id(engine)].update(zip(part, out))
        others = self._decode(self.engine, [todo[j][1] for j in rest], [settings[j] for j in rest],
                              [refs[j] for j in rest])
        spec = {**decoded[id(self.engine)], **dict(zip(rest, others))}
        return [spec[j] for j in range(len(todo))], [decoded[id(self.plain_engine)][j] for j in audit]

    def generate_row(self, row: dict[str, Any]) -> dict[str, Any]:
        """One input row -> one output row (a batch of one)."""
        return self.generate_rows([row])[0]

    def _values(self, row: dict[str, Any]) -> dict[str, Any]:
        """The row's input columns: the read stage's carried ones (:data:`CARRIED_COLUMN`, job)
        or the row itself (processor)."""
        carried = row.get(CARRIED_COLUMN)
        if carried is not None:
            return json.loads(carried)
        return row

    def _prompt(self, row: dict[str, Any], values: dict[str, Any] | None = None) -> tuple[str, list[int]]:
        """``(prompt string, token ids)`` of a row (see the class docstring for the forms).

        Raises:
            ValueError / PromptError: the row's prompt field is of the wrong type or empty,
                a named column is null, its ``input.messages_column`` is malformed (naming the
                row and the message), or the chat template refuses its messages.
        """
        from pipeline.prompts import PromptError, encode_chat, parse_messages

        values = row if values is None else values
        tok = self.models.tokenizer
        ids = row.get("prompt_token_ids")
        if ids is not None:
            ids = list(ids)
            if not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError("prompt_token_ids must be a non-empty list of token ids")
            return tok.decode(ids, skip_special_tokens=False), ids
        messages = row.get("messages")
        if messages is not None:
            if not isinstance(messages, (list, tuple)) or not messages or not all(isinstance(m, dict) for m in messages):
                raise ValueError("messages must be a non-empty list of {role, content} objects")
            return encode_chat(tok, list(messages), special_ids=self.prompts.special_ids)
        prompt = row.get("prompt")
        if prompt is not None:
            if not isinstance(prompt, str) or not prompt.strip():
                raise ValueError(f"prompt must be a non-empty string, got {_short(prompt)}")
            return prompt, list(tok(prompt)["input_ids"])
        column = self.cfg.input.messages_column
        if column:
            try:
                messages = parse_messages(values.get(column))
                return encode_chat(tok, messages, special_ids=self.prompts.special_ids)
            except (PromptError, ValueError) as e:
                raise PromptError(f"row {self._name(row)}: column {column!r} (input.messages_column): {e}") from None
        text_key = self.cfg.input.text_column if CARRIED_COLUMN in row else self.text_column
        return self.prompts.build_values({c: values.get(text_key if c == "text" else c)
                                          for c in self.cfg.task.columns})

    def _name(self, row: dict[str, Any]) -> str:
        """How an error names a row: its id, else its shard and row."""
        rid = row.get(self.id_column)
        if rid is not None:
            return repr(rid)
        return f"{row.get('source_row')} of {row.get('source_file')}"

    def _row_settings(self, row: dict[str, Any], ids: list[int], values: dict[str, Any] | None = None,
                      out: dict[str, Any] | None = None):
        """The generation settings of one row: ``generation:`` with the row's own
        ``max_new_tokens``, ``seed`` and ``stop`` where it has them (validated: ValueError
        naming the field), then its ``input.params_column`` (:mod:`pipeline.params`: ParamsError
        naming the field; the ``max_tokens`` used goes to ``out["max_tokens_used"]``), and when
        sampling without a row seed, the row's seed of :func:`pipeline.loading.row_settings`
        keyed by its id (else its shard and position, else its token ids)."""
        from pipeline.params import apply_params, parse_params

        own = {field: row.get(key) for key, field in ROW_SETTINGS.items() if row.get(key) is not None}
        settings = self.settings
        if own:
            if isinstance(own.get("stop_strings"), (list, tuple)):
                own["stop_strings"] = list(own["stop_strings"])
            try:
                settings = dataclasses.replace(settings, **own).validate()
            except ValueError as e:
                raise ValueError(f"row setting: {e}".replace("stop_strings", "stop")) from None
        column = self.cfg.input.params_column
        if column:
            params = parse_params((row if values is None else values).get(column))
            settings, used = apply_params(params, settings, self.settings.max_new_tokens)
            if out is not None:
                out["max_tokens_used"] = used
            if params.seed is not None:
                return settings
        if "seed" in own:
            return settings
        key = row.get(self.id_column)
        if key is None:
            key = row_key(row) if row.get("source_file") is not None else "\x00".join(map(str, _origin(row, ids)))
        return row_settings(settings, key)

    @staticmethod
    def _decode(engine, prompts: list[list[int]], settings: list, references: list | None = None) -> list:
        """``engine.generate_batch`` (with the rows' ``references``, where given); if the
        batched call raises, each row alone, so that only the rows that fail by themselves
        get an error."""
        from pipeline.engine import GenerationResult

        if not prompts:
            return []
        try:
            return engine.generate_batch(prompts, settings, **_refs(references))
        except Exception:  # noqa: BLE001 - isolate the row(s) at fault
            results = []
            for ids, s, r in zip(prompts, settings, references or [None] * len(prompts)):
                try:
                    results.append(engine.generate_batch([ids], [s], **_refs([r]))[0])
                except Exception as e:  # noqa: BLE001
                    _free_cuda_if_oom(e)
                    results.append(GenerationResult.failed(f"{type(e).__name__}: {e}"))
            return results

    def __call__(self, batch: pa.Table) -> pa.Table:
        if not isinstance(batch, pa.Table):
            batch = pa.Table.from_pylist(_dict_batch_to_rows(batch))
        outs = self.generate_rows(batch.to_pylist())
        if self.columns == "job":
            table = pa.Table.from_pylist(outs, schema=OUTPUT_SCHEMA)
            skip = set(OUTPUT_SCHEMA.names) | set(INPUT_SCHEMA.names) | {CARRIED_COLUMN}
            for name in batch.column_names:
                if name not in skip:
                    table = table.append_column(batch.schema.field(name), batch.column(name))
            if self.carry is not None:  # the input's columns, after the partition keys (strings; others as JSON)
                carried = [json.loads(c) if c is not None else {} for c in
                           (batch.column(CARRIED_COLUMN).to_pylist() if CARRIED_COLUMN in batch.column_names
                            else [None] * batch.num_rows)]
                for name in self.carry:
                    vals = [None if r.get(name) is None else as_text(r[name]) for r in carried]
                    table = table.append_column(pa.field(name, pa.string()), pa.array(vals, pa.string()))
            return table
        added = pa.Table.from_pylist([{k: o.get(k) for k in ADDED_COLUMNS} for o in outs], schema=_ADDED_SCHEMA)
        table = batch.drop_columns([n for n in batch.column_names if n in ADDED_COLUMNS or n == "input_error"])
        for field, column in zip(_ADDED_SCHEMA, added.columns):
            table = table.append_column(field, column)
        return table

    def memory(self) -> dict[str, Any]:
        """This actor's memory: ``peak_rss_mb`` (max resident set of the process since start,
        MiB), ``rss_mb`` (now), ``cuda_peak_mb`` (max allocated by torch; None on CPU), ``rows``."""
        import psutil
        import torch

        cuda_peak = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None
        return {
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "rss_mb": psutil.Process(os.getpid()).memory_info().rss / 2**20,
            "cuda_peak_mb": cuda_peak,
            "rows": self.rows_done,
            "load_time_s": self.load_time_s,
            "warm_up_time_s": self.warm_up_time_s,
            "device": self.models.device,
        }


def _logprobs(logprobs: list[dict] | None) -> list[dict] | None:
    """The engine's per-token log-probabilities (``{"token_id", "logprob", "top": [[id, lp], ...]}``)
    as the ``output_logprobs`` column's structs."""
    if logprobs is None:
        return None
    return [{"token_id": int(t["token_id"]), "logprob": float(t["logprob"]),
             "top": [{"token_id": int(i), "logprob": float(lp)} for i, lp in t.get("top") or []]} for t in logprobs]


def _refs(references: list | None) -> dict[str, Any]:
    """``generate_batch``'s ``references`` argument where a row has one (an engine stand-in
    without references, such as bench_scale's stub, is called as before otherwise)."""
    return {"references": references} if references and any(r is not None for r in references) else {}


def _origin(row: dict[str, Any], ids: list[int] | None) -> tuple[Any, Any]:
    """What names a row for the audit sample: its shard and position, or, for a row of a
    dataset without them (the processor), a hash of its token ids."""
    if row.get("source_file") is not None:
        return row.get("source_file"), row.get("source_row")
    return "prompt_token_ids", hashlib.sha256(repr(list(ids or [])).encode()).hexdigest()[:16]


def _short(v: Any) -> str:
    r = ascii(v)
    return r if len(r) <= 40 else r[:37] + "..."


def audit_selected(source_file: Any, source_row: Any, fraction: float, seed: int) -> bool:
    """Whether the lossless audit re-decodes this row: a hash of (shard URL, row, seed)
    mapped to [0, 1) is below ``fraction``; the same rows are chosen on every run."""
    if fraction <= 0:
        return False
    if fraction >= 1:
        return True
    h = hashlib.sha256(f"{seed}\x00{source_file}\x00{source_row}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64 < fraction


def _dict_batch_to_rows(batch: dict[str, Any]) -> list[dict[str, Any]]:
    keys = list(batch)
    n = len(batch[keys[0]]) if keys else 0
    return [{k: _py(batch[k][i]) for k in keys} for i in range(n)]


def _py(v: Any) -> Any:
    return v.item() if hasattr(v, "item") else v


def _free_cuda_if_oom(e: Exception) -> None:
    try:
        import torch

        if isinstance(e, torch.cuda.OutOfMemoryError):
            torch.cuda.empty_cache()
    except Exception:
        pass
