"""Logits processors shared by target and drafter.

The processors are transformers' own (``RepetitionPenaltyLogitsProcessor``,
``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper``), built in the
order ``generate()`` builds them, so ``p`` and ``q`` are shaped exactly as transformers
shapes them.
"""

from __future__ import annotations

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from .settings import GenerationSettings


class LogitsShaper:
    """Applies a row's logits processors to one or several positions.

    ``shape(prefix, logits)``: ``prefix`` is ``(1, L)`` int64, the tokens before the first
    position; ``logits`` is ``(n, V)``, the logits of positions ``L .. L+n-1``, whose own
    tokens are ``extra`` (``(n-1,)`` or more) when a processor depends on the prefix
    (repetition penalty).  Returns ``(n, V)`` processed logits (a new tensor).
    """

    def __init__(self, settings: GenerationSettings):
        self.do_sample = settings.do_sample
        procs: list = []
        if settings.repetition_penalty is not None and settings.repetition_penalty != 1.0:
            procs.append(RepetitionPenaltyLogitsProcessor(penalty=settings.repetition_penalty))
        self.prefix_dependent = bool(procs)
        if settings.do_sample:
            if settings.temperature != 1.0:
                procs.append(TemperatureLogitsWarper(settings.temperature))
            if settings.top_k is not None and settings.top_k != 0:
                procs.append(TopKLogitsWarper(top_k=settings.top_k))
            if settings.top_p is not None and settings.top_p < 1.0:
                procs.append(TopPLogitsWarper(top_p=settings.top_p))
        self.processors = LogitsProcessorList(procs)
        self.active = bool(procs)

    def shape(self, prefix: torch.Tensor, logits: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        if not self.active:
            return logits
        if not self.prefix_dependent:
            # Warpers act row by row and ignore input_ids: one batched call for all positions.
            return self.processors(prefix, logits)
        out = torch.empty_like(logits)
        for i in range(logits.shape[0]):
            ids = prefix if i == 0 else torch.cat([prefix, extra[:i].view(1, -1)], dim=1)
            out[i : i + 1] = self.processors(ids, logits[i : i + 1])
        return out

    def probs(self, prefix: torch.Tensor, logits: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        """Processed probabilities ``(n, V)`` in float32 or wider."""
        shaped = self.shape(prefix, logits, extra)
        if shaped.dtype in (torch.float16, torch.bfloat16):
            shaped = shaped.float()
        return torch.softmax(shaped, dim=-1)
