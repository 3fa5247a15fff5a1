"""Settings of speculation: which proposer drafts, and how many tokens.

Names follow transformers' ``generate()`` / ``GenerationConfig`` where one exists
(``num_assistant_tokens``, ``num_assistant_tokens_schedule``,
``assistant_confidence_threshold``, ``prompt_lookup_num_tokens``,
``max_matching_ngram_size``) and vLLM's where only vLLM has one (``suffix_decoding_*``).
:meth:`SpeculationSettings.validate` raises ``ValueError`` naming the offending setting,
before any decoding starts.  It checks each method's own rules from the method table
(:data:`pipeline.engine.proposers.METHODS`), which this module imports; the table's
modules never import this one (:mod:`pipeline.engine.settings`, the generation settings,
is the leaf they share).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from .proposers import METHODS


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)

SCHEDULES = ("constant", "heuristic")
#: SpeculationSettings fields that are a positive integer when set, and what they count
_POSITIVE_OR_UNSET = {"assistant_early_exit": "layers that draft", "num_mtp_layers": "MTP layers to chain",
                     "draft_vocab_size": "draft-vocabulary ids kept"}
#: the static ensemble verification weight: a setting of the methods with draft logits
_ENSEMBLE_FIELD = "assistant_ensemble_weight"


@dataclass
class SpeculationSettings:
    """Which proposer drafts, and how many tokens.

    Attributes:
        method: a name in the method table (:data:`pipeline.engine.proposers.METHODS`).
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
        draft_vocab: method ``draft_model``: a reduced draft vocabulary (FR-Spec, Zhao et
            al. 2025) -- a draft-head folder (its ``draft_vocab``) or a JSON file holding a
            list of token ids, most frequent first.  The drafter computes only those rows of
            its LM head and ``q`` is zero elsewhere; the target verifies over its full
            vocabulary, so greedy output is unchanged and sampling stays exact.
        draft_vocab_size: methods ``draft_model`` (with ``draft_vocab``) and ``eagle``: use
            only the first ``N`` ids of the draft vocabulary (``None``: all of them).
        suffix_decoding_max_tree_depth: method ``suffix``: the longest substring (match plus
            draft, in tokens) its suffix trees count, >= 2; ``None``: 24 (vLLM's default).
        suffix_decoding_max_cached_requests: method ``suffix``: completed outputs kept in the
            engine's job-wide suffix tree (the oldest leaves first; 0: no job-wide tree);
            ``None``: 10000 (vLLM's default).
        suffix_decoding_max_spec_factor: method ``suffix``: a match of ``m`` tokens drafts at
            most ``floor(factor * m)`` tokens (and ``num_assistant_tokens``), > 0; ``None``:
            1.0 (vLLM's default).
        suffix_decoding_min_token_prob: method ``suffix``: a draft stops before the token
            whose estimated chance of being reached (the product of the observed frequencies
            along the draft) is below this, in [0, 1]; ``None``: 0.1 (vLLM's default).
        num_candidates: tree verification (SpecInfer, Miao et al. 2023): the most candidate
            continuations a row's draft may branch into, verified in one target pass with a
            tree attention mask (1, the default: one linear draft).  Methods whose proposer
            offers trees (``prompt_lookup``: several n-gram matches; ``suffix``: its trees'
            other frequent continuations; ``draft_model`` and ``eagle``:
            the drafter's or the draft head's top candidates at each draft position); greedy rows without logits
            processors only (sampled rows verify one linear draft; ``RowStats.tree_off_steps``
            counts those steps).
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
    draft_vocab: str | None = None
    draft_vocab_size: int | None = None
    suffix_decoding_max_tree_depth: int | None = None
    suffix_decoding_max_cached_requests: int | None = None
    suffix_decoding_max_spec_factor: float | None = None
    suffix_decoding_min_token_prob: float | None = None
    num_candidates: int = 1

    def validate(self) -> "SpeculationSettings":
        """Check every value and the method's own rules (its
        :class:`~pipeline.engine.methods.MethodSpec`); returns ``self``.

        Raises:
            ValueError: an unknown method, a value out of range, a parameter of another
                method, a parameter the method requires left unset, or token trees
                (``num_candidates > 1``) with a method that cannot verify them
                (:meth:`MethodSpec.tree_refusal <pipeline.engine.methods.MethodSpec.tree_refusal>`),
                naming the setting.
        """
        method = METHODS.get(self.method)
        if method is None:
            raise ValueError(f"method must be one of {tuple(METHODS)}, got {self.method!r}")
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
        n = self.num_candidates
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"num_candidates (branches of a token tree; 1: linear drafts) must be a positive "
                             f"integer, got {n!r}")
        why = method.tree_refusal() if n > 1 else None
        if why:
            raise ValueError(f"num_candidates={n} (token trees) cannot be used with method {self.method!r}: {why}; "
                             "set num_candidates to 1")
        w = self.assistant_ensemble_weight
        if w is not None:
            if not isinstance(w, (int, float)) or math.isnan(w) or not (0 < w < 1):
                raise ValueError(f"assistant_ensemble_weight must be in (0, 1), got {w!r}")
            if not method.draft_logits:
                raise ValueError(f"{_ENSEMBLE_FIELD} needs draft logits in the target's vocabulary; method "
                                 f"{self.method!r} has none")
        for f in dataclasses.fields(self):  # a method's own settings: unset (None) unless it takes them
            owners = [m for m, spec in METHODS.items() if f.name in spec.params]
            if f.default is not None or not owners:
                continue
            v = getattr(self, f.name)
            if v is None:
                if f.name in method.required:
                    what = f" ({_POSITIVE_OR_UNSET[f.name]})" if f.name in _POSITIVE_OR_UNSET else ""
                    raise ValueError(f"{f.name}{what} must be set for method {self.method!r}, got None")
                continue
            if f.name not in method.params:
                raise ValueError(f"{f.name} is a setting of method {' / '.join(map(repr, owners))}, not of {self.method!r}")
        if self.draft_vocab is not None and (not isinstance(self.draft_vocab, str) or not self.draft_vocab.strip()):
            raise ValueError(f"draft_vocab must be a path (a draft-head folder or a JSON list of token ids), got "
                             f"{self.draft_vocab!r}")
        d = self.suffix_decoding_max_tree_depth
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 2):
            raise ValueError(f"suffix_decoding_max_tree_depth (tokens of match plus draft) must be an integer >= 2, got {d!r}")
        c = self.suffix_decoding_max_cached_requests
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 0):
            raise ValueError(f"suffix_decoding_max_cached_requests (outputs kept) must be a non-negative integer, got {c!r}")
        f = self.suffix_decoding_max_spec_factor
        if f is not None and (not _is_number(f) or f <= 0 or math.isinf(f)):
            raise ValueError(f"suffix_decoding_max_spec_factor must be a finite number > 0, got {f!r}")
        p = self.suffix_decoding_min_token_prob
        if p is not None and (not _is_number(p) or not 0 <= p <= 1):
            raise ValueError(f"suffix_decoding_min_token_prob must be in [0, 1], got {p!r}")
        for name, what in _POSITIVE_OR_UNSET.items():
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} ({what}) must be a positive integer, got {v!r}")
        return self

    @property
    def k_max(self) -> int:
        """The method's ``k``: the value of its spec's ``k_param`` field
        (``num_assistant_tokens`` for a method that drafts nothing); every row's first cap
        on draft tokens and the draft-length controller's ceiling."""
        return getattr(self, METHODS[self.method].k_param or "num_assistant_tokens")
