"""Settings of one generation: how to sample and how to speculate.

Names follow transformers' ``generate()`` / ``GenerationConfig`` where one exists
(``max_new_tokens``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``min_p``,
``repetition_penalty``, ``no_repeat_ngram_size``, ``bad_words_ids``, ``min_new_tokens``,
``suppress_tokens``, ``num_assistant_tokens``, ``num_assistant_tokens_schedule``,
``assistant_confidence_threshold``, ``prompt_lookup_num_tokens``,
``max_matching_ngram_size``).  ``validate()`` raises ``ValueError`` naming the
offending setting, before any decoding starts.  How to speculate is
:class:`pipeline.engine.speculation.SpeculationSettings` (it reads the method table; this
module is a leaf that every proposer may import).

Checkpoint defaults.  A :class:`GenerationSettings` field left ``None`` is *unset*:
:func:`resolve_generation_settings` fills it from the target's ``generation_config``
(what the checkpoint's ``generation_config.json`` says), as ``generate()`` does, and
otherwise from :data:`ENGINE_DEFAULTS`.  A value given explicitly always wins.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

log = logging.getLogger(__name__)

#: Values of settings that neither the caller nor the checkpoint set.  ``max_new_tokens``
#: differs from ``generate()``, whose library default is ``max_length=20`` (prompt included).
ENGINE_DEFAULTS = {"max_new_tokens": 128, "do_sample": False, "temperature": 1.0}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)


@dataclass
class GenerationSettings:
    """How tokens are chosen and when a row stops.

    Every field defaults to ``None``, *unset*: the target checkpoint's
    ``generation_config`` value applies, else :data:`ENGINE_DEFAULTS` (see
    :func:`resolve_generation_settings`, which the engine calls for every row).

    The logits processors (repetition penalty, no-repeat n-gram, bad words, min new tokens,
    suppress tokens) shape greedy decoding as well as sampling, on target and drafter alike,
    and run in ``generate()``'s order (those five, then temperature, top-k, top-p, min-p) on
    float32 (or wider) logits.

    Attributes:
        max_new_tokens: budget of generated tokens (> 0); unset: 128.
        do_sample: sample (True) or greedy argmax (False); unset: False.
        temperature, top_k, top_p, min_p: sampling warpers (only used when sampling);
            ``top_k=0`` and ``min_p=0`` disable theirs, ``top_p=1`` keeps everything.
            A temperature so small that ``logits / temperature`` overflows gives the
            greedy limit (the argmax, ties shared uniformly) instead of NaNs.
        repetition_penalty: > 0; divides positive and multiplies negative logits of
            tokens already in the sequence (prompt included); 1.0 disables.
        no_repeat_ngram_size: > 0 bans any token that would repeat an n-gram of this
            size already in the sequence (prompt included); 0 disables.
        bad_words_ids: token-id sequences that must never be generated, e.g.
            ``[[5], [17, 9]]`` (a one-token sequence equal to an EOS id is ignored).
        min_new_tokens: EOS ids are banned until this many tokens were generated (needs
            an EOS id; stop strings can still stop earlier).
        suppress_tokens: token ids that are never generated.
        seed: per-row seed of the ``torch.Generator`` used for every random draw (sampling
            only).  What it fixes depends on the engine's ``draft_length`` (the job's
            ``compute.draft_length``): under ``fixed``, the row's output (the same seed, settings,
            method and draft length draw the same tokens, run after run); under ``auto`` (the
            default), only the law the output is drawn from: the controller's draft lengths
            follow measured times, the draws follow the drafts, so two runs with one seed give
            two valid samples of the target's law, not the same one.
        eos_token_id: one id or a list; unset: the target's ``generation_config.eos_token_id``.
        stop_strings: generation stops once one of them is completed in the decoded
            output (needs a tokenizer).
        response_format: structured output, OpenAI's / vLLM's shape
            (:func:`pipeline.engine.grammar.normalize_response_format`: ``json_schema``,
            ``json_object``, ``regex``, ``choice``; ``text`` or ``None``: free text); the
            target's distribution is masked by its grammar at every position (needs a
            tokenizer and an EOS id).  Kept in canonical form.
        logprobs: vLLM's name: ``None`` (off) or ``N >= 0``: each generated token's
            log-probability and the top ``N`` of its position, from the target's distribution
            after the row's processors and grammar mask (``GenerationResult.logprobs``).
    """

    max_new_tokens: int | None = None
    do_sample: bool | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    no_repeat_ngram_size: int | None = None
    bad_words_ids: list[list[int]] | None = None
    min_new_tokens: int | None = None
    suppress_tokens: list[int] | None = None
    seed: int | None = None
    eos_token_id: int | list[int] | None = None
    stop_strings: list[str] | None = None
    response_format: dict | None = None
    logprobs: int | None = None

    def validate(self, vocab_size: int | None = None) -> "GenerationSettings":
        """Check every set value; with ``vocab_size``, also that token ids are below it.
        Returns ``self``; raises ``ValueError`` naming the setting."""
        m = self.max_new_tokens
        if m is not None and (not _is_int(m) or m <= 0):
            raise ValueError(f"max_new_tokens must be a positive integer, got {m!r}")
        if self.do_sample is not None and not isinstance(self.do_sample, bool):
            raise ValueError(f"do_sample must be true or false, got {self.do_sample!r}")
        t = self.temperature
        if t is not None and (not _is_number(t) or (self.do_sample and (t <= 0 or math.isinf(t)))):
            raise ValueError(f"temperature must be a finite number > 0 when do_sample=True, got {t!r}")
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < 0):
            raise ValueError(f"top_k must be a non-negative integer (0 disables) or None, got {self.top_k!r}")
        p = self.top_p
        if p is not None and (not _is_number(p) or not (0 < p <= 1)):
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        p = self.min_p
        if p is not None and (not _is_number(p) or not (0 <= p <= 1)):
            raise ValueError(f"min_p must be in [0, 1], got {p!r}")
        r = self.repetition_penalty
        if r is not None and (not _is_number(r) or r <= 0 or math.isinf(r)):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {r!r}")
        for name in ("no_repeat_ngram_size", "min_new_tokens"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 0):
                raise ValueError(f"{name} must be a non-negative integer (0 disables), got {v!r}")
        if self.bad_words_ids is not None:
            b = self.bad_words_ids
            if not isinstance(b, (list, tuple)) or not all(
                isinstance(seq, (list, tuple)) and seq and all(_is_int(i) and i >= 0 for i in seq) for seq in b
            ):
                raise ValueError(
                    f"bad_words_ids must be a list of non-empty lists of token ids (e.g. [[5], [17, 9]]), got {b!r}"
                )
            self.bad_words_ids = [list(seq) for seq in b]
        if self.suppress_tokens is not None:
            s = self.suppress_tokens
            if not isinstance(s, (list, tuple)) or not all(_is_int(i) and i >= 0 for i in s):
                raise ValueError(f"suppress_tokens must be a list of token ids, got {s!r}")
            self.suppress_tokens = list(s)
        e = self.eos_token_id
        if e is not None and not (_is_int(e) or (isinstance(e, (list, tuple)) and all(_is_int(i) for i in e))):
            raise ValueError(f"eos_token_id must be a token id or a list of them, got {e!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.stop_strings is not None:
            if isinstance(self.stop_strings, str):
                self.stop_strings = [self.stop_strings]
            if not all(isinstance(s, str) and s for s in self.stop_strings):
                raise ValueError(f"stop_strings must be non-empty strings, got {self.stop_strings!r}")
        if self.response_format is not None:
            from .grammar import normalize_response_format  # raises GrammarError (a ValueError) naming the field

            self.response_format = normalize_response_format(self.response_format)
        lp = self.logprobs
        if lp is not None and (not _is_int(lp) or lp < 0):
            raise ValueError(f"logprobs must be None or a non-negative integer (the top N per position), got {lp!r}")
        if vocab_size is not None:
            for name, ids in (("bad_words_ids", [i for seq in self.bad_words_ids or [] for i in seq]),
                              ("suppress_tokens", self.suppress_tokens or [])):
                high = [i for i in ids if i >= vocab_size]
                if high:
                    raise ValueError(f"{name} has token ids {high} outside the target's vocabulary (size {vocab_size})")
        return self


#: Settings of ``GenerationConfig`` the engine does not implement, with the value at which
#: each changes nothing (``renormalize_logits`` and ``remove_invalid_values`` change no
#: argmax and no distribution, so they are not listed).  A checkpoint that sets another value is decoded without it, and a
#: warning says so (once).
_UNSUPPORTED_DEFAULTS = {
    "min_length": 0, "typical_p": 1.0, "top_h": None, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0,
    "num_beams": 1, "sequence_bias": None, "begin_suppress_tokens": None, "forced_bos_token_id": None,
    "forced_eos_token_id": None, "exponential_decay_length_penalty": None, "guidance_scale": 1.0, "penalty_alpha": None, "dola_layers": None,
    "watermarking_config": None, "encoder_repetition_penalty": 1.0, "encoder_no_repeat_ngram_size": 0,
}
_logged: set[str] = set()


def _log_once(level: int, message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        log.log(level, message)


def resolve_generation_settings(
    settings: GenerationSettings | None, generation_config=None, vocab_size: int | None = None
) -> GenerationSettings:
    """The settings one row is decoded with: explicit values, else the checkpoint's.

    Follows ``generate()``'s priority (``GenerationMixin._prepare_generation_config``):
    a value set in ``settings`` wins; an unset one (``None``) takes the target's
    ``generation_config`` value when the checkpoint sets it, else :data:`ENGINE_DEFAULTS`
    (``generate()``'s own library defaults are not used: no top-k of 50 and no
    ``max_length`` of 20).  A checkpoint's ``top_k=0`` counts as unset.  Which defaults
    were taken is logged once (INFO), and so are settings of the checkpoint that the engine
    does not implement (WARNING: the output may differ from ``generate()``'s).

    Args:
        settings: the caller's settings (``None``: all unset).
        generation_config: the target's ``transformers.GenerationConfig`` (or ``None``).
        vocab_size: the target's vocabulary size; token ids in ``bad_words_ids`` and
            ``suppress_tokens`` must be below it.

    Returns:
        A new validated :class:`GenerationSettings` with ``max_new_tokens``,
        ``do_sample`` and ``temperature`` set.

    Raises:
        ValueError: a bad value, explicit or from the checkpoint, naming the setting.
    """
    settings = (settings or GenerationSettings()).validate()
    resolved = dataclasses.replace(settings)
    taken = []
    for f in dataclasses.fields(GenerationSettings):
        if getattr(settings, f.name) is not None:
            continue
        value = getattr(generation_config, f.name, None) if generation_config is not None else None
        if f.name == "top_k" and value == 0:
            value = None
        if value is not None:
            setattr(resolved, f.name, value)
            if f.name != "eos_token_id":  # the usual case, not worth a line
                taken.append(f"{f.name}={value!r}")
        elif f.name in ENGINE_DEFAULTS:
            setattr(resolved, f.name, ENGINE_DEFAULTS[f.name])
    if taken:
        _log_once(logging.INFO, "generation defaults taken from the target's generation_config: " + ", ".join(taken))
    if generation_config is not None:
        ignored = [f"{k}={getattr(generation_config, k)!r}" for k, noop in _UNSUPPORTED_DEFAULTS.items()
                   if getattr(generation_config, k, None) not in (None, noop)]
        max_length = getattr(generation_config, "max_length", None)
        if max_length is not None and settings.max_new_tokens is None and getattr(generation_config, "max_new_tokens", None) is None:
            ignored.append(f"max_length={max_length!r} (the budget is max_new_tokens={resolved.max_new_tokens})")
        if ignored:
            _log_once(logging.WARNING, "the target's generation_config sets " + ", ".join(ignored)
                      + ", which the engine does not implement: decoding goes on without them, so the "
                      "output may differ from generate()'s")
    try:
        return resolved.validate(vocab_size)
    except ValueError as e:
        if taken:
            raise ValueError(f"{e} (defaults taken from the target's generation_config: {', '.join(taken)})") from None
        raise
