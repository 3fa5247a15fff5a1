"""The schemas of a job's rows: :data:`INPUT_SCHEMA` (what the read stage gives the actors)
and :data:`OUTPUT_SCHEMA` (one Parquet row of output).  The statistics columns of the
output are :data:`pipeline.engine.stats.COLUMNS`, derived from
:class:`~pipeline.engine.stats.RowStats`; columns added after the first schema are written
at its end, so that every output's columns keep their order.
"""

from __future__ import annotations

import pyarrow as pa

from pipeline.engine.stats import COLUMNS

#: One row of input, as the actors receive it (see pipeline.input.rows for the id rules).
INPUT_SCHEMA = pa.schema(
    [
        ("source_file", pa.string()),  # the shard's URL
        ("source_row", pa.int64()),  # 0-based row (Parquet) or non-blank line (JSONL) in the shard
        ("id", pa.string()),  # the id as a string, or the derived <shard name>:<row> (see the rules above)
        ("text", pa.string()),  # the text column (null when missing or not a string)
        ("input_error", pa.string()),  # why this row cannot be used, else null
    ]
)

#: the read stage's column carrying a row's input columns (:func:`pipeline.input.discovery.carried_columns`)
#: to the actors: a JSON object of their values (Parquet values as Python gives them, JSON-encoded)
CARRIED_COLUMN = "_input_columns"

#: ``output_logprobs``: per generated token, its id, log-probability and the top N alternatives
LOGPROBS_TYPE = pa.list_(pa.struct([("token_id", pa.int32()), ("logprob", pa.float64()),
                                   ("top", pa.list_(pa.struct([("token_id", pa.int32()), ("logprob", pa.float64())])))]))

_ARROW = {"int": pa.int64(), "float": pa.float64(), "list[int]": pa.list_(pa.int64())}


def _stat_fields(appended: bool) -> list[pa.Field]:
    return [pa.field(c.name, _ARROW[c.type]) for c in COLUMNS if c.appended == appended]


#: One row of output.  ``error`` is null when the row succeeded; statistics are null when
#: it failed.  Counts are tokens of the target tokenizer; times are seconds; what each
#: statistics column holds: its :class:`~pipeline.engine.stats.StatColumn` ``doc``.
OUTPUT_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("prompt", pa.string()),  # the prompt as the model saw it (template and chat template applied)
        ("output_text", pa.string()),  # generated text, special tokens skipped
        # "stop" (EOS or stop string) | "length" (max_new_tokens) | "context" (the context is full); null when failed
        ("finish_reason", pa.string()),
        *_stat_fields(appended=False),
        ("method", pa.string()),
        ("target_model", pa.string()),
        ("draft_model", pa.string()),  # null when the method uses no drafter
        ("error", pa.string()),  # "ExceptionType: message" when the row failed, else null
        ("source_file", pa.string()),  # input shard URL
        ("source_row", pa.int64()),  # row (Parquet) or non-blank line (JSONL) in that shard, 0-based
        ("audit", pa.bool_()),  # lossless audit: null = not audited, true = plain decoding gave the same ids
        *_stat_fields(appended=True),
        # lossless audit: seconds (engine clock) plain decoding of the row took; null = not audited
        ("audit_plain_time_s", pa.float64()),
        # seconds (engine clock) the row's actor spent warming up its engines before its first batch:
        # on the first row each actor returned, null on the others
        ("warm_up_time_s", pa.float64()),
        # the generated token ids (target tokenizer), EOS included when generated; null when failed
        ("output_token_ids", pa.list_(pa.int32())),
        # 32 hex digits: what the row's output depends on (pipeline.reuse.row_reuse_key); a later run
        # copies this row instead of decoding it when its own row has the same key; null when failed
        ("reuse_key", pa.string()),
        # "<output folder>#<run id>": the previous output this row was copied from (not decoded in this
        # run; its decode statistics are null); null for a row this run decoded
        ("reused_from", pa.string()),
        # the row's own max_tokens (input.params_column) as used: held to generation.max_new_tokens; null when unset
        ("max_tokens_used", pa.int64()),
        # structured output (a response_format): the parsed value as compact JSON, null when not valid or no format
        ("output_json", pa.string()),
        # the grammar completed and the text parses (and validates against a json_schema); null: no format
        ("output_valid", pa.bool_()),
        # generation.logprobs: N: per generated token {token_id, logprob, top: [{token_id, logprob}] * N}; else null
        ("output_logprobs", LOGPROBS_TYPE),
    ]
)


def output_schema(extra_columns: list[str] | tuple[str, ...] = ()) -> pa.Schema:
    """:data:`OUTPUT_SCHEMA` followed by one string column per name in ``extra_columns``
    (the input's Hive partition keys, then the carried input columns, kept on output: a string
    value as it is, any other as JSON)."""
    return pa.schema(list(OUTPUT_SCHEMA) + [pa.field(k, pa.string()) for k in extra_columns])


def conform(table: pa.Table, extra_columns: list[str] | tuple[str, ...] = ()) -> pa.Table:
    """``table``'s columns of :func:`output_schema`, in its order and types (other columns
    dropped: the processor passes every input column through).

    Raises:
        KeyError: ``table`` lacks one of them.
    """
    schema = output_schema(extra_columns)
    return table.select(schema.names).cast(schema)
