"""Per-row statistics of one generation, as a plain record.

Definitions follow ``shared/METRICS.md`` (the same as vLLM's spec-decode metrics):

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
  draft position ``i+1`` and how many were accepted there.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RowStats:
    """Exact statistics of one row.  Times are seconds of the engine's clock
    (``time.perf_counter``, wall time, unless the engine was given another).

    ``prefill_time_s`` is the target's prompt forward (the time to first token, less
    drafting); ``verify_time_s`` the target passes after it; ``draft_time_s`` all
    proposing (a drafter's own prompt prefill included); ``wall_time_s`` the whole call.
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
    prefill_time_s: float = 0.0
    verify_time_s: float = 0.0
    wall_time_s: float = 0.0
    finish_reason: str | None = None

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        return 1.0 + self.accepted_tokens / self.draft_steps if self.draft_steps else None

    @property
    def tokens_per_step(self) -> float | None:
        return self.new_tokens / self.verify_steps if self.verify_steps else None

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

    def to_dict(self) -> dict:
        """A flat dict with the derived rates, ready for a Parquet row."""
        d = asdict(self)
        d["acceptance_rate"] = self.acceptance_rate
        d["mean_accepted_length"] = self.mean_accepted_length
        d["tokens_per_step"] = self.tokens_per_step
        return d


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
    """

    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    stats: RowStats
    error: str | None = None

    @classmethod
    def failed(cls, error: str, wall_time_s: float = 0.0) -> "GenerationResult":
        """The result of a row that could not run."""
        return cls(token_ids=[], text=None, finish_reason=None, stats=RowStats(wall_time_s=wall_time_s), error=error)
