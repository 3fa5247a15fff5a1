"""Settings of one generation: how to sample and how to speculate.

Names follow transformers' ``generate()`` / ``GenerationConfig`` where one exists
(``max_new_tokens``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``,
``repetition_penalty``, ``num_assistant_tokens``, ``num_assistant_tokens_schedule``,
``assistant_confidence_threshold``, ``prompt_lookup_num_tokens``,
``max_matching_ngram_size``).  Every ``validate()`` raises ``ValueError`` naming the
offending setting, before any decoding starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: Methods the engine knows.  ``plain`` is target-only decoding (the baseline); each
#: other name has a proposer in ``pipeline/engine/proposers/`` (see ``PROPOSERS``).
METHODS = ("plain", "draft_model", "prompt_lookup", "early_exit", "mtp", "universal", "mtp_assistant")
SCHEDULES = ("constant", "heuristic")


@dataclass
class GenerationSettings:
    """How tokens are chosen and when a row stops.

    Attributes:
        max_new_tokens: budget of generated tokens (> 0).
        do_sample: sample (True) or greedy argmax (False).
        temperature, top_k, top_p, repetition_penalty: logits processors, applied in
            transformers' order (repetition penalty, then temperature, top-k, top-p) to
            the target's and the drafter's logits alike.  Only used for sampling,
            except ``repetition_penalty``, which also shapes greedy decoding.
        seed: per-row seed of the ``torch.Generator`` used for every random draw.
        eos_token_id: one id or a list; ``None`` takes the target's
            ``generation_config.eos_token_id``.
        stop_strings: generation stops once one of them is completed in the decoded
            output (needs a tokenizer).
    """

    max_new_tokens: int = 128
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    eos_token_id: int | list[int] | None = None
    stop_strings: list[str] | None = None

    def validate(self) -> "GenerationSettings":
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if self.do_sample:
            t = self.temperature
            if not isinstance(t, (int, float)) or math.isnan(t) or t <= 0 or math.isinf(t):
                raise ValueError(f"temperature must be a finite number > 0 when do_sample=True, got {t!r}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k <= 0):
            raise ValueError(f"top_k must be a positive integer or None, got {self.top_k!r}")
        if self.top_p is not None:
            p = self.top_p
            if not isinstance(p, (int, float)) or math.isnan(p) or not (0 < p <= 1):
                raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        if self.repetition_penalty is not None:
            r = self.repetition_penalty
            if not isinstance(r, (int, float)) or math.isnan(r) or r <= 0:
                raise ValueError(f"repetition_penalty must be > 0, got {r!r}")
        if self.stop_strings is not None:
            if isinstance(self.stop_strings, str):
                self.stop_strings = [self.stop_strings]
            if not all(isinstance(s, str) and s for s in self.stop_strings):
                raise ValueError(f"stop_strings must be non-empty strings, got {self.stop_strings!r}")
        return self


@dataclass
class SpeculationSettings:
    """Which proposer drafts, and how many tokens.

    Attributes:
        method: one of :data:`METHODS`.
        num_assistant_tokens: draft length ``k`` (tokens per draft, > 0); with the
            ``heuristic`` schedule, the starting length.
        num_assistant_tokens_schedule: ``constant`` keeps ``k``; ``heuristic`` (as in
            transformers) adds 2 after a fully accepted draft and subtracts 1 (down to 1)
            otherwise.  The state lives in one row and is never carried to the next.
        assistant_confidence_threshold: the draft model stops drafting early when its
            top probability falls below this (0 disables; transformers' default is 0.4).
        prompt_lookup_num_tokens: tokens copied after an n-gram match.
        max_matching_ngram_size: longest n-gram searched for (tried from longest to 1).
        assistant_ensemble_weight: static ensemble verification weight ``w`` in (0, 1):
            drafts are accepted against ``w*p + (1-w)*q`` (lossy).  ``None``: lossless.
        num_mtp_layers: method ``mtp`` only: how many of the checkpoint's MTP layers to
            chain (a draft of that many tokens, capped by ``num_assistant_tokens``);
            ``None``: all of them.  transformers' switch for these layers is
            ``generate(use_mtp=True)``; the count is ``config.num_mtp_layers``
            (``num_nextn_predict_layers`` in DeepSeek-V3 / GLM-4.5 configs).
        assistant_early_exit: method ``early_exit`` only: the number ``L`` of the
            target's first layers that draft (with its final norm and LM head); must be
            in ``1 .. num_hidden_layers - 1`` (checked when the engine is built).
    """

    method: str = "plain"
    num_assistant_tokens: int = 5
    num_assistant_tokens_schedule: str = "constant"
    assistant_confidence_threshold: float = 0.0
    prompt_lookup_num_tokens: int = 10
    max_matching_ngram_size: int = 2
    assistant_ensemble_weight: float | None = None
    num_mtp_layers: int | None = None
    assistant_early_exit: int | None = None

    def validate(self) -> "SpeculationSettings":
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if not isinstance(self.num_assistant_tokens, int) or self.num_assistant_tokens <= 0:
            raise ValueError(
                f"num_assistant_tokens (draft length k) must be a positive integer, got {self.num_assistant_tokens!r}"
            )
        if self.num_assistant_tokens_schedule not in SCHEDULES:
            raise ValueError(
                f"num_assistant_tokens_schedule must be one of {SCHEDULES}, got {self.num_assistant_tokens_schedule!r}"
            )
        c = self.assistant_confidence_threshold
        if not isinstance(c, (int, float)) or math.isnan(c) or not (0 <= c < 1):
            raise ValueError(f"assistant_confidence_threshold must be in [0, 1), got {c!r}")
        if not isinstance(self.prompt_lookup_num_tokens, int) or self.prompt_lookup_num_tokens <= 0:
            raise ValueError(
                f"prompt_lookup_num_tokens must be a positive integer, got {self.prompt_lookup_num_tokens!r}"
            )
        if not isinstance(self.max_matching_ngram_size, int) or self.max_matching_ngram_size <= 0:
            raise ValueError(
                f"max_matching_ngram_size must be a positive integer, got {self.max_matching_ngram_size!r}"
            )
        w = self.assistant_ensemble_weight
        if w is not None:
            if not isinstance(w, (int, float)) or math.isnan(w) or not (0 < w < 1):
                raise ValueError(f"assistant_ensemble_weight must be in (0, 1), got {w!r}")
            if self.method in ("plain", "prompt_lookup"):
                raise ValueError(
                    f"assistant_ensemble_weight needs draft logits; method {self.method!r} has none"
                )
            if self.method == "universal":
                raise ValueError(
                    "assistant_ensemble_weight needs draft logits in the target's vocabulary; "
                    "method 'universal' (different tokenizers) has none"
                )
        e = self.assistant_early_exit
        if self.method == "early_exit":
            if isinstance(e, bool) or not isinstance(e, int) or e < 1:
                raise ValueError(
                    f"assistant_early_exit (layers that draft) must be a positive integer for method "
                    f"'early_exit', got {e!r}"
                )
        elif e is not None:
            raise ValueError(f"assistant_early_exit is a setting of method 'early_exit', not of {self.method!r}")
        m = self.num_mtp_layers
        if m is not None:
            if self.method != "mtp":
                raise ValueError(f"num_mtp_layers is a setting of method 'mtp', not of {self.method!r}")
            if isinstance(m, bool) or not isinstance(m, int) or m < 1:
                raise ValueError(f"num_mtp_layers (MTP layers to chain) must be a positive integer or None, got {m!r}")
        return self

    @property
    def draft_length(self) -> int:
        """The draft length the method starts with (``k``)."""
        if self.method == "prompt_lookup":
            return self.prompt_lookup_num_tokens
        return self.num_assistant_tokens
