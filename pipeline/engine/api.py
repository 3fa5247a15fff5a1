"""The engine as most callers use it: :class:`SpeculativeEngine` is the step API of
:class:`~pipeline.engine.loop.StepEngine` plus :meth:`~SpeculativeEngine.generate` (one row)
and :meth:`~SpeculativeEngine.generate_batch` (many rows, continuous batching), both a
:class:`~pipeline.engine.scheduler.Scheduler` run: calls go downward only
(this module -> scheduler -> step API).
"""

from __future__ import annotations

import torch

from .batch import per_row_settings
from .loop import StepEngine
from .scheduler import Scheduler
from .settings import GenerationSettings
from .stats import GenerationResult


class SpeculativeEngine(StepEngine):
    """Speculative decoding of many rows at once with a target model (constructor arguments:
    :class:`~pipeline.engine.loop.StepEngine`)."""

    def generate(self, input_ids, settings: GenerationSettings | None = None) -> GenerationResult:
        """Generate one row (a batch of one).

        Args:
            input_ids: the prompt, ``list[int]`` or int64 tensor ``(1, seq_len)`` / ``(seq_len,)``.
            settings: :class:`GenerationSettings`; unset fields take the target's
                ``generation_config`` values, else greedy with 128 new tokens
                (:func:`~pipeline.engine.settings.resolve_generation_settings`).

        Returns:
            :class:`GenerationResult`: the generated ids (prompt excluded), the text, the
            finish reason (``"stop"`` | ``"length"`` | ``"context"``) and exact :class:`RowStats`.

        Raises:
            ValueError: a bad setting, an empty prompt, a token id outside the target's
                vocabulary, or a prompt that leaves no room in the target's context.
        """
        result = self.generate_batch([input_ids], settings)[0]
        if result.error is not None:
            raise ValueError(result.error.removeprefix("ValueError: "))
        return result

    @torch.inference_mode()
    def generate_batch(self, prompts, settings=None, max_batch_size: int | None = None) -> list[GenerationResult]:
        """Generate many rows, up to ``max_batch_size`` in flight, in input order.

        Args:
            prompts: a list of prompts, each ``list[int]`` or an int64 tensor.
            settings: one :class:`GenerationSettings` for every row, or a list with one per
                prompt; rows may differ only in ``max_new_tokens``, ``eos_token_id``,
                ``stop_strings`` and ``seed``.
            max_batch_size: rows in flight (default: the engine's).

        Returns:
            One :class:`GenerationResult` per prompt, in order, each what :meth:`generate`
            gives for that row alone (greedy: the same tokens; sampling: the same law,
            drawn from the row's own generator).  A row that cannot run (empty prompt,
            prompt longer than the context, bad token ids) has ``error`` set and the
            others go on.

        Raises:
            ValueError: bad or mixed settings (before any decoding).
        """
        prompts = list(prompts)
        rows_settings = per_row_settings(settings, len(prompts), self.target.generation_config, self.target_vocab)
        scheduler = Scheduler(self, min(max_batch_size or self.max_batch_size, max(1, len(prompts))))
        tickets = [scheduler.submit(p, s, resolved=True) for p, s in zip(prompts, rows_settings)]
        results = scheduler.run()
        return [results[t] for t in tickets]

