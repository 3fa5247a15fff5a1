"""Logits processors shared by target and drafter.

The processors are transformers' own, built in the order ``generate()`` builds them
(``GenerationMixin._get_logits_processor``), so ``p`` and ``q`` are shaped exactly as
transformers shapes them:

1. ``RepetitionPenaltyLogitsProcessor`` (``repetition_penalty``)
2. ``NoRepeatNGramLogitsProcessor`` (``no_repeat_ngram_size``)
3. ``NoBadWordsLogitsProcessor`` (``bad_words_ids``)
4. ``MinNewTokensLengthLogitsProcessor`` (``min_new_tokens``; only with an EOS id)
5. the row's grammar (``response_format``, :mod:`pipeline.engine.grammar`): tokens it forbids
   after the position's prefix get ``-inf``
6. ``SuppressTokensLogitsProcessor`` (``suppress_tokens``)
7. sampling only: ``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper``,
   ``MinPLogitsWarper``

Processors 1-5 depend on the tokens before the position they shape, so under
speculation each verified (or drafted) position is shaped with its *own* prefix: the
committed tokens plus the draft tokens before it.  That keeps speculation lossless.

As in ``generate()``, half-precision logits are cast to float32 before any processor (a
bf16 repetition penalty would turn near-ties into ties and flip the argmax); float32 and
float64 logits are used as they are.

A temperature so small that ``logits / temperature`` overflows (e.g. 1e-40 in float32)
would give NaN probabilities; the temperature step then returns the limit of the
distribution as the temperature goes to 0 instead: every maximal logit 0, the rest
``-inf`` (greedy, ties shared uniformly).
"""

from __future__ import annotations

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from .settings import GenerationSettings


class TemperatureWithGreedyLimit(TemperatureLogitsWarper):
    """``TemperatureLogitsWarper`` whose rows that overflow (``logits / temperature``
    with an infinite maximum, or NaN) take the temperature-to-zero limit instead: 0 at
    the row's maximal logits, ``-inf`` elsewhere."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        scaled = super().__call__(input_ids, scores)
        top = scores.max(dim=-1, keepdim=True).values
        broken = (~torch.isfinite(scaled.max(dim=-1, keepdim=True).values) | scaled.isnan().any(-1, keepdim=True))
        broken &= torch.isfinite(top)
        if bool(broken.any()):
            limit = torch.where(scores == top, 0.0, float("-inf")).to(scaled.dtype)
            scaled = torch.where(broken, limit, scaled)
        return scaled


class LogitsShaper:
    """Applies one row's logits processors to one or several positions.

    Args:
        settings: the row's resolved :class:`GenerationSettings` (unset ``do_sample`` and
            ``temperature`` count as ``False`` and 1.0).
        prompt_length: tokens in the row's prompt (``min_new_tokens`` counts from there;
            required when ``min_new_tokens`` applies).
        eos_token_ids: the row's EOS ids (``min_new_tokens`` bans them; a one-token bad
            word equal to one of them is ignored, as in ``generate()``).
        grammar: the row's :class:`~pipeline.engine.grammar.GrammarState` (its
            ``response_format``), or ``None``; needs ``prompt_length`` (the grammar reads the
            output after the prompt).  Masked before the warpers, so top-k / top-p / min-p
            act on the grammar's allowed tokens (the masked, renormalised distribution).

    Raises:
        ValueError: ``min_new_tokens`` without ``prompt_length``.

    Attributes:
        active: whether any processor applies (otherwise :meth:`shape` only casts).
        prefix_dependent: whether a processor reads the tokens before the position, so
            each position needs its own prefix (``extra``).
        do_sample: whether the row samples.
    """

    def __init__(
        self,
        settings: GenerationSettings,
        prompt_length: int | None = None,
        eos_token_ids: list[int] | set[int] | tuple[int, ...] | None = None,
        grammar=None,
    ):
        s = settings
        if grammar is not None and prompt_length is None:
            raise ValueError("a grammar needs the prompt length: LogitsShaper(..., prompt_length=...)")
        self.grammar = grammar
        self.do_sample = bool(s.do_sample)
        self.prompt_length = prompt_length
        eos = sorted(set(eos_token_ids or ()))
        self.eos_token_ids = eos
        # (class, kwargs) recipes; built per device on first use, since some processors
        # keep tensors on the device they were built for.
        per_position: list = []
        if s.repetition_penalty is not None and s.repetition_penalty != 1.0:
            per_position.append((RepetitionPenaltyLogitsProcessor, dict(penalty=s.repetition_penalty)))
        if s.no_repeat_ngram_size:
            per_position.append((NoRepeatNGramLogitsProcessor, dict(ngram_size=s.no_repeat_ngram_size)))
        bad = [list(w) for w in s.bad_words_ids or [] if not (len(w) == 1 and w[0] in eos)]
        if bad:
            per_position.append((NoBadWordsLogitsProcessor, dict(bad_words_ids=bad, eos_token_id=eos or None)))
        if s.min_new_tokens and eos:
            if prompt_length is None:
                raise ValueError("min_new_tokens needs the prompt length: LogitsShaper(..., prompt_length=...)")
            per_position.append((MinNewTokensLengthLogitsProcessor, dict(
                prompt_length_to_skip=prompt_length, min_new_tokens=s.min_new_tokens, eos_token_id=eos)))
        batched: list = []
        if s.suppress_tokens:
            batched.append((SuppressTokensLogitsProcessor, dict(suppress_tokens=list(s.suppress_tokens))))
        if self.do_sample:
            if s.temperature is not None and s.temperature != 1.0:
                batched.append((TemperatureWithGreedyLimit, dict(temperature=float(s.temperature))))
            if s.top_k:
                batched.append((TopKLogitsWarper, dict(top_k=s.top_k)))
            if s.top_p is not None and s.top_p < 1.0:
                batched.append((TopPLogitsWarper, dict(top_p=float(s.top_p))))
            if s.min_p:
                batched.append((MinPLogitsWarper, dict(min_p=float(s.min_p))))
        self._recipes = (per_position, batched)
        self._built: dict[str, tuple[LogitsProcessorList, LogitsProcessorList]] = {}
        self.prefix_dependent = bool(per_position) or grammar is not None
        self.active = bool(per_position or batched) or grammar is not None

    def processors(self, device: torch.device | str = "cpu") -> tuple[LogitsProcessorList, LogitsProcessorList]:
        """The row's transformers processors for ``device``, in the order they run:
        ``(per_position, batched)``; the first group reads each position's prefix."""
        key = str(device)
        if key not in self._built:
            def build(recipes):
                procs = []
                for cls, kw in recipes:
                    if cls in (MinNewTokensLengthLogitsProcessor, SuppressTokensLogitsProcessor):
                        kw = dict(kw, device=device)
                    procs.append(cls(**kw))
                return LogitsProcessorList(procs)

            self._built[key] = (build(self._recipes[0]), build(self._recipes[1]))
        return self._built[key]

    def shape(self, prefix: torch.Tensor, logits: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        """Processed logits of ``n`` consecutive positions.

        Args:
            prefix: ``(1, L)`` int64, the committed tokens before the first position.
            logits: ``(n, V)`` raw logits of positions ``L .. L+n-1`` (any float dtype).
            extra: ``(n-1,)`` int64 (or longer), the tokens of positions ``L .. L+n-2``
                (draft tokens): position ``i`` is shaped with ``prefix + extra[:i]``.
                Needed when ``n > 1`` and :attr:`prefix_dependent`.

        Returns:
            ``(n, V)`` logits in float32 (half-precision input) or the input's dtype; a
            new tensor when a processor applied.
        """
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        if not self.active:
            return logits
        per_position, batched = self.processors(logits.device)
        if per_position or self.grammar is not None:
            prefix = prefix.to(logits.device)
        if per_position:
            prefix = prefix.to(logits.device)
            out = torch.empty_like(logits)
            for i in range(logits.shape[0]):
                ids = prefix if i == 0 else torch.cat([prefix, extra[:i].to(prefix.device).view(1, -1)], dim=1)
                out[i : i + 1] = per_position(ids, logits[i : i + 1])
            logits = out
        if self.grammar is not None:
            output = prefix[0, self.prompt_length:].tolist()
            ahead = extra[: logits.shape[0] - 1].tolist() if extra is not None else []
            allowed = self.grammar.masks(output, ahead, logits.shape[0]).to(logits.device)
            logits = logits.masked_fill(~allowed, float("-inf"))
        if batched:
            # Suppression and the warpers act row by row and ignore input_ids: one call.
            logits = batched(prefix, logits)
        return logits

    def probs(self, prefix: torch.Tensor, logits: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        """Processed probabilities ``(n, V)``: softmax of :meth:`shape`, in float32 or wider."""
        return torch.softmax(self.shape(prefix, logits, extra), dim=-1)
