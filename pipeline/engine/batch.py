"""The explicit state of the rows in flight, and the per-row settings of a batch.

One :class:`RowState` per row from admission to its end: where it lives (``slot``), what
is committed (``sequence``), its budget, its stopping rule, its logits processors and
random generator, its draft-length schedule, its acceptance record and its :class:`RowStats`.  The loop
(:mod:`pipeline.engine.loop`) reads and updates nothing else.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from .draft_control import RowEvidence
from .grammar import GrammarState
from .reference import ReferenceIndex
from .sampling import LogitsShaper
from .settings import GenerationSettings, resolve_generation_settings
from .stats import RowStats
from .stopping import StopChecker

#: GenerationSettings fields that may differ between the rows of one step (one target pass);
#: rows differing in another field (temperature, top_p, top_k, do_sample, logits processors)
#: share the batch's slots but step in separate groups (:mod:`pipeline.engine.scheduler`)
PER_ROW_FIELDS = ("max_new_tokens", "eos_token_id", "stop_strings", "seed", "response_format", "logprobs")


def per_row_settings(settings, n: int, generation_config=None, vocab_size: int | None = None) -> list[GenerationSettings]:
    """``settings`` (one :class:`GenerationSettings`, ``None`` or a list of ``n``) as a
    list of ``n`` resolved against the target's ``generation_config``
    (:func:`~pipeline.engine.settings.resolve_generation_settings`).

    Rows may differ in any field: the scheduler steps rows that differ beyond
    :data:`PER_ROW_FIELDS` in separate groups, so each row gets what it gets alone.

    Raises:
        ValueError: a list of the wrong length, or a bad setting (naming it).
    """
    resolved: dict[int, GenerationSettings] = {}

    def resolve(s):
        if id(s) not in resolved:
            resolved[id(s)] = resolve_generation_settings(s, generation_config, vocab_size)
        return resolved[id(s)]

    if settings is None or isinstance(settings, GenerationSettings):
        return [resolve(settings)] * n
    settings = list(settings)
    if len(settings) != n:
        raise ValueError(f"settings has {len(settings)} entries for {n} prompts")
    return [resolve(s) for s in settings]


@dataclass
class RowState:
    """One row in flight.

    Attributes:
        index: the row's position in the caller's list (results come back in that order).
        slot: its row in every cache of the engine (reused by the next row when it ends).
        sequence: ``(1, L)`` int64 committed tokens (prompt + generated) on the target's
            device; the target's cache holds every one but the last.
        prompt_len: prompt tokens.
        budget: tokens it may generate (``max_new_tokens``, or less where the context ends).
        context_bound: the budget was cut by the context (finish reason ``context``).
        k: the draft length its schedule asks for now.
        rope_regime: the RoPE regime its target cache was computed in (LongRoPE).
        evidence: its acceptance against the draft-length controller's estimates
            (:class:`~pipeline.engine.draft_control.RowEvidence`), beside ``stats`` (which
            counts verified drafts only).
        reference: the n-gram index of its reference text (:mod:`pipeline.engine.reference`),
            whose drafts the loop offers beside the method's; ``None``: none.
        grammar: its ``response_format``'s matcher (:class:`~pipeline.engine.grammar.GrammarState`;
            the same object its ``shaper`` masks with), or ``None``.
        logprobs: the emitted tokens' log-probabilities when ``settings.logprobs`` is set.
    """

    index: int
    slot: int
    sequence: torch.Tensor
    prompt_len: int
    budget: int
    context_bound: bool
    settings: GenerationSettings
    shaper: LogitsShaper
    stopper: StopChecker
    generator: torch.Generator | None
    stats: RowStats
    k: int
    rope_regime: int = 0
    generated: list[int] = dataclasses.field(default_factory=list)
    finish: str | None = None
    on_tokens: Callable[[list[int]], None] | None = None  # streaming: each committed block
    evidence: RowEvidence = dataclasses.field(default_factory=RowEvidence)
    reference: ReferenceIndex | None = None
    grammar: GrammarState | None = None
    logprobs: list[dict] | None = None

    @property
    def length(self) -> int:
        return int(self.sequence.shape[1])

    @property
    def remaining(self) -> int:
        return self.budget - len(self.generated)
