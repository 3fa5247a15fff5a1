"""Per-row statistics of one generation, as one record: :class:`RowStats` owns the counts,
times and per-position lists of a row, their sum over rows (``+``, :meth:`RowStats.merge`,
:meth:`RowStats.total`), every rate derived from them, and their columns in the job's
output (:data:`COLUMNS`, :meth:`RowStats.to_columns`, :meth:`RowStats.from_columns`, with
the defaults for outputs written before a column existed).  The output schema
(:mod:`pipeline.schema`), the API's ``speculation`` object, the run summary, the report and
the tuner's pilot are derived from it.

Definitions follow ``docs/metrics.md`` (the same as vLLM's spec-decode metrics); over
several rows, counts are summed first, then divided (never a mean of per-row rates):

- ``verify_steps``: target forward passes after the prefill (one per draft verified,
  or per plain step when nothing was drafted).
- ``draft_tokens``: tokens proposed to the verifier (after capping to the budget).
- ``accepted_tokens``: proposed tokens the verifier kept and that were emitted.
- ``new_tokens``: tokens emitted = accepted + one per step, less what a stop cut off.
- ``draft_steps``: verify steps that verified a non-empty draft (a prompt-lookup miss is
  a plain step, not a draft step).
- ``acceptance_rate`` = accepted / drafted (``None`` when nothing was drafted).
- ``mean_accepted_length`` = 1 + accepted / draft_steps (1 … k+1; ``None`` when nothing
  was drafted): vLLM's and llama.cpp's *mean acceptance length*, steps without a draft
  left out.
- ``tokens_per_step`` = new_tokens / verify_steps: tokens emitted per target forward pass,
  every step counted (1.0 for plain decoding; what the speedup follows).
- ``drafted_per_position[i]`` / ``accepted_per_position[i]``: how many drafts reached
  draft position ``i+1`` and how many were accepted there; ``acceptance_by_position[i]``
  = accepted / drafted there.
- ``token_acceptance``: Leviathan et al.'s per-token α, the chance a draft token is
  accepted given that every token before it was: Σ accepted / Σ evaluated, evaluated at
  position 1 = ``drafted_per_position[0]`` and at i > 1 = ``min(accepted_per_position[i-2],
  drafted_per_position[i-1])`` (exact unless a draft was cut short by the budget);
  ``token_acceptance_by_position`` the same per position
  (:func:`pipeline.engine.cost_model.per_token_acceptance`).
- ``accepted_length_steps[j]``: verify steps whose accepted draft prefix was ``j`` tokens
  long, reconstructed exactly from the per-position counts (drafts are verified left to
  right and accepted as a prefix): ``j = 0``: ``verify_steps - accepted_per_position[0]``
  (steps without a draft included); ``j >= 1``: ``accepted_per_position[j-1] -
  accepted_per_position[j]``.
- ``tree_steps``: draft steps whose draft was a token tree (``num_candidates > 1``, branched);
  ``tree_nodes``: the tree nodes they verified.  A tree counts as a draft of its depth in
  ``draft_tokens`` and the per-position lists (position ``i`` = depth ``i``), and its accepted
  path as the accepted tokens, so the rates above keep their meaning (accepted tokens per
  draft position); ``tree_nodes / tree_steps`` is the tree's mean size.
- ``tree_off_steps``: draft steps of a row with ``num_candidates > 1`` verified as one linear
  draft because the row samples or has logits processors (trees are greedy only).
- ``accepted_from_prompt`` / ``_pool`` / ``_reference`` / ``_drafter``: ``accepted_tokens`` by the
  source of the draft they came from (``Draft.source``: the row's own text, the outputs of
  earlier rows, a per-row reference, a model); they sum to ``accepted_tokens``.
- ``tokens_per_s`` = new_tokens / wall_time_s (the engine's throughput);
  ``decode_tokens_per_s`` = new_tokens / (wall_time_s - prefill_time_s): the target's
  prompt prefill, the same work for every method, left out.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Mapping

from .cost_model import per_token_acceptance


@dataclass
class RowStats:
    """Exact statistics of one row (or, summed, of several).  Times are seconds of the
    engine's clock (``time.perf_counter``, wall time, unless the engine was given another).

    ``prefill_time_s`` is the target's prompt forward (the time to first token, less
    drafting); ``verify_time_s`` the target passes after it; ``draft_time_s`` all
    proposing (a drafter's own prompt prefill included); ``wall_time_s`` the whole call.
    ``prefill_time_s`` is ``None`` when unknown (rows of an output written before the
    column existed); a sum with an unknown part is unknown.  ``finish_reason`` is the
    row's (``None`` for a sum); the output writes it from the result.
    """

    prompt_tokens: int = 0
    new_tokens: int = 0
    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    draft_steps: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    draft_time_s: float = 0.0
    prefill_time_s: float | None = 0.0
    verify_time_s: float = 0.0
    wall_time_s: float = 0.0
    tree_steps: int = 0
    tree_nodes: int = 0
    tree_off_steps: int = 0
    accepted_from_prompt: int = 0
    accepted_from_pool: int = 0
    accepted_from_reference: int = 0
    accepted_from_drafter: int = 0
    accepted_from_grammar: int = 0
    forced_tokens: int = 0
    finish_reason: str | None = None

    # ------------------------------------------------------------------ rates
    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        return 1.0 + self.accepted_tokens / self.draft_steps if self.draft_steps else None

    @property
    def tokens_per_step(self) -> float | None:
        return self.new_tokens / self.verify_steps if self.verify_steps else None

    @property
    def acceptance_by_position(self) -> list[float | None]:
        return [a / d if d else None for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    @property
    def token_acceptance_by_position(self) -> list[float | None]:
        return per_token_acceptance(self.drafted_per_position, self.accepted_per_position)

    @property
    def token_acceptance(self) -> float | None:
        """Leviathan et al.'s per-token α over every position (see the module docstring)."""
        acc, dr = self.accepted_per_position, self.drafted_per_position
        if not dr or not dr[0]:
            return None
        evaluated = dr[0] + sum(min(acc[i - 1], dr[i]) for i in range(1, len(dr)))
        return sum(acc) / evaluated if evaluated else None

    @property
    def accepted_length_steps(self) -> list[int]:
        """Verify steps by accepted draft length 0, 1, ..., k (see the module docstring)."""
        acc = self.accepted_per_position
        counts = [self.verify_steps - (acc[0] if acc else 0)]
        for j in range(1, len(acc) + 1):
            counts.append(acc[j - 1] - (acc[j] if j < len(acc) else 0))
        return counts

    @property
    def tokens_per_s(self) -> float | None:
        return self.new_tokens / self.wall_time_s if self.wall_time_s else None

    @property
    def decode_time_s(self) -> float | None:
        """``wall_time_s - prefill_time_s`` (``None`` when the prefill time is unknown)."""
        return self.wall_time_s - self.prefill_time_s if self.prefill_time_s is not None else None

    @property
    def decode_tokens_per_s(self) -> float | None:
        t = self.decode_time_s
        return self.new_tokens / t if t is not None and t > 0 else None

    # ------------------------------------------------------------------ counting
    def record_draft(self, drafted: int, accepted: int) -> None:
        """Count one verified draft of ``drafted`` > 0 tokens of which ``accepted`` were kept
        (one draft step); the loop calls it once per verify step that had a draft."""
        if drafted <= 0:
            return
        self.draft_steps += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        grow = drafted - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position.extend([0] * grow)
            self.accepted_per_position.extend([0] * grow)
        for i in range(drafted):
            self.drafted_per_position[i] += 1
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    def record_source(self, source: str, accepted: int) -> None:
        """Count ``accepted`` tokens of a draft from ``source`` (one of
        :data:`~pipeline.engine.proposers.base.SOURCES`) in ``accepted_from_<source>``."""
        name = f"accepted_from_{source}"
        setattr(self, name, getattr(self, name) + accepted)

    def merge(self, other: "RowStats") -> "RowStats":
        """Add ``other`` into this record (counts and times summed, per-position lists
        element-wise, an unknown prefill time stays unknown); returns ``self``."""
        for name in SUMMED:
            a, b = getattr(self, name), getattr(other, name)
            setattr(self, name, None if a is None or b is None else a + b)
        for name in PER_POSITION:
            _add_lists(getattr(self, name), getattr(other, name))
        self.finish_reason = None
        return self

    def __add__(self, other: "RowStats") -> "RowStats":
        if not isinstance(other, RowStats):
            return NotImplemented
        return RowStats().merge(self).merge(other)

    @classmethod
    def total(cls, stats: Iterable["RowStats"]) -> "RowStats":
        """The sum of several rows' statistics (an empty sum is all zeros)."""
        out = cls()
        for s in stats:
            out.merge(s)
        return out

    # ------------------------------------------------------------------ columns
    def to_dict(self) -> dict:
        """Every field and the column rates (:data:`RATE_COLUMNS`) as a flat dict."""
        d = asdict(self)
        d.update({name: getattr(self, name) for name in RATE_COLUMNS})
        return d

    def vllm_metrics(self) -> dict[str, Any]:
        """The same statistics under the per-request names vLLM uses for speculative decoding
        (:data:`VLLM_NAMES`; ``docs/metrics.md``): ``num_spec_steps`` (draft steps),
        ``num_draft_tokens``, ``num_accepted_draft_tokens``, ``draft_acceptance_rate``
        (accepted / drafted; None without drafts), ``mean_acceptance_length`` (``1 +`` accepted
        per draft step; None without drafts) and ``acceptance_histogram`` (entry ``j``: draft
        steps whose accepted prefix was ``j`` tokens long, steps without a draft left out).
        Derived here only: the counts' one owner is this record."""
        histogram = self.accepted_length_steps
        if histogram:
            histogram = [histogram[0] - (self.verify_steps - self.draft_steps)] + histogram[1:]
        return {"num_spec_steps": self.draft_steps, "num_draft_tokens": self.draft_tokens,
                "num_accepted_draft_tokens": self.accepted_tokens, "draft_acceptance_rate": self.acceptance_rate,
                "mean_acceptance_length": self.mean_accepted_length, "acceptance_histogram": histogram}

    def to_columns(self) -> dict[str, Any]:
        """The statistics columns of an output row (:data:`COLUMNS`, in schema order)."""
        return {c.name: getattr(self, c.name) for c in COLUMNS}

    @classmethod
    def from_columns(cls, row: Mapping[str, Any]) -> "RowStats":
        """A row's statistics from its output columns (a Parquet row, a manifest entry's sums,
        a ``speculation`` object).  Rates are recomputed, not read.  A column the row lacks
        or holds null takes its :attr:`StatColumn.older` default when it has one (outputs
        written before it existed), else 0 (an empty list for the per-position counts)."""
        kw: dict[str, Any] = {}
        for c in COLUMNS:
            if c.name in RATE_COLUMNS:
                continue
            value = row.get(c.name)
            if value is None:
                value = c.older(row) if c.older is not None else PY_TYPES[c.type]()
            kw[c.name] = list(value) if c.name in PER_POSITION else value
        return cls(**kw, finish_reason=row.get("finish_reason"))


@dataclass(frozen=True)
class StatColumn:
    """One statistics column of the job's output.

    Attributes:
        name: a :class:`RowStats` field, or one of its rates (:data:`RATE_COLUMNS`).
        type: ``"int"``, ``"float"`` or ``"list[int]"`` (int64 / float64 / list of int64).
        doc: what it holds (counts are tokens of the target tokenizer, times seconds).
        appended: added after the output's first schema, so written at its end.
        older: for a column that outputs written before it existed lack: its value from
            the rest of the row (``None``: the column is in every output).
    """

    name: str
    type: str
    doc: str
    appended: bool = False
    older: Callable[[Mapping[str, Any]], Any] | None = None


def _first_position(row: Mapping[str, Any]) -> int:
    """``draft_steps`` of an older row: ``drafted_per_position[0]`` counts the same steps."""
    return (row.get("drafted_per_position") or [0])[0]


#: the statistics columns of the job's output, in schema order (:data:`pipeline.schema.OUTPUT_SCHEMA`)
COLUMNS: tuple[StatColumn, ...] = (
    StatColumn("prompt_tokens", "int", "the prompt's tokens"),
    StatColumn("new_tokens", "int", "tokens generated"),
    StatColumn("verify_steps", "int", "target passes after the prefill"),
    StatColumn("draft_tokens", "int", "draft tokens verified"),
    StatColumn("accepted_tokens", "int", "draft tokens accepted"),
    StatColumn("acceptance_rate", "float", "accepted / drafted; null when nothing was drafted"),
    StatColumn("mean_accepted_length", "float", "1 + accepted / draft_steps; null when nothing was drafted"),
    StatColumn("drafted_per_position", "list[int]", "[i]: drafts that reached position i+1"),
    StatColumn("accepted_per_position", "list[int]", "[i]: drafts accepted at position i+1"),
    StatColumn("draft_time_s", "float", "proposing, a drafter's prompt prefill included"),
    StatColumn("prefill_time_s", "float", "the target's prompt forward", older=lambda row: None),
    StatColumn("verify_time_s", "float", "target passes after the prefill"),
    StatColumn("wall_time_s", "float", "the engine's time for this row"),
    StatColumn("draft_steps", "int", "verify steps that verified a non-empty draft", appended=True,
               older=_first_position),
    StatColumn("tokens_per_step", "float", "new_tokens / verify_steps (1.0 for plain decoding)", appended=True),
    StatColumn("tree_steps", "int", "verify steps that verified a token tree (several branches)", appended=True,
               older=lambda row: 0),
    StatColumn("tree_nodes", "int", "draft tokens (tree nodes) verified in those steps", appended=True,
               older=lambda row: 0),
    StatColumn("tree_off_steps", "int", "draft steps verified linearly although num_candidates > 1, because the "
               "row samples or has logits processors (trees are greedy only)", appended=True, older=lambda row: 0),
    *(StatColumn(f"accepted_from_{source}", "int", f"accepted tokens drafted from {what} (0 in outputs written "
                 "before the column existed)", appended=True, older=lambda row: 0)
      for source, what in (("prompt", "the row's own text (prompt and output so far)"),
                           ("pool", "the outputs of earlier rows (a job-wide pool)"),
                           ("reference", "a per-row reference text"), ("drafter", "a model"),
                           ("grammar", "the grammar's forced runs (response_format)"))),
    StatColumn("forced_tokens", "int", "generated tokens that the row's grammar allowed alone (0 without a "
               "response_format)", appended=True, older=lambda row: 0),
)
#: the rates written as columns (recomputed from the counts when read)
RATE_COLUMNS = ("acceptance_rate", "mean_accepted_length", "tokens_per_step")
#: vLLM's per-request name -> ours (:meth:`RowStats.vllm_metrics`)
VLLM_NAMES = {"num_spec_steps": "draft_steps", "num_draft_tokens": "draft_tokens",
              "num_accepted_draft_tokens": "accepted_tokens", "draft_acceptance_rate": "acceptance_rate",
              "mean_acceptance_length": "mean_accepted_length",
              "acceptance_histogram": "accepted_length_steps (steps without a draft left out)"}
#: the per-position lists (summed element-wise)
PER_POSITION = tuple(f.name for f in dataclasses.fields(RowStats) if f.default_factory is list)
#: the counts and times (summed)
SUMMED = tuple(f.name for f in dataclasses.fields(RowStats) if f.name not in PER_POSITION and f.name != "finish_reason")


#: the Python type of each column type (called without an argument: its zero)
PY_TYPES: dict[str, Callable[..., Any]] = {"int": int, "float": float, "list[int]": list}


def _add_lists(acc: list[int], values: list[int] | None) -> None:
    """``acc += values`` element-wise, ``acc`` grown to the longer length."""
    if not values:
        return
    if len(values) > len(acc):
        acc.extend([0] * (len(values) - len(acc)))
    for i, v in enumerate(values):
        acc[i] += int(v)


@dataclass
class GenerationResult:
    """What one row's generation produced.

    Attributes:
        token_ids: generated token ids (prompt excluded), EOS included when it stopped
            the row, exactly what plain decoding emits.
        text: ``token_ids`` decoded with the target tokenizer (``None`` without one).
        finish_reason: ``"stop"`` (EOS or stop string), ``"length"`` (``max_new_tokens``)
            or ``"context"`` (the target's context window is full); ``"cancelled"``
            when :meth:`~pipeline.engine.scheduler.Scheduler.cancel` stopped it; ``None``
            when the row failed.
        stats: the row's :class:`RowStats`.
        error: why the row could not run, as ``"ExceptionType: message"`` (``generate_batch``
            only; ``generate`` raises the ``ValueError``).
        grammar_complete: ``None``: the row had no ``response_format``; ``True``: its grammar
            reached an accepting state and the row stopped there (finish reason ``"stop"``);
            ``False``: cut before (``"length"``, ``"context"``, a stop string).
        logprobs: with ``settings.logprobs = N``: one dict per generated token,
            ``{"token_id": int, "logprob": float, "top": [[token_id, logprob], ...]}`` (natural
            log; the top ``N`` of the target's distribution after the row's processors and
            grammar mask); ``None`` when off.
    """

    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    stats: RowStats
    error: str | None = None
    grammar_complete: bool | None = None
    logprobs: list[dict] | None = None

    @classmethod
    def failed(cls, error: str, wall_time_s: float = 0.0) -> "GenerationResult":
        """The result of a row that could not run."""
        return cls(token_ids=[], text=None, finish_reason=None, stats=RowStats(wall_time_s=wall_time_s), error=error)
