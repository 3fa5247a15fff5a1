"""Settings of speculation: which proposer drafts, and how many tokens.

:class:`SpeculationSettings` is composed: the settings every drafting method reads
(:class:`DraftParams`, declared here) and the ``Params`` dataclass of each method of the
table (:data:`pipeline.engine.proposers.METHODS`), declared in the method's own file
(:class:`~pipeline.engine.methods.MethodParams`), all flat under their own names, which are
the ``method:`` section's keys.  Names follow transformers' ``generate()`` /
``GenerationConfig`` where one exists (``num_assistant_tokens``,
``num_assistant_tokens_schedule``, ``assistant_confidence_threshold``,
``prompt_lookup_num_tokens``, ``max_matching_ngram_size``) and vLLM's where only vLLM has one
(``suffix_decoding_*``).  :meth:`SpeculationSettings.validate` raises ``ValueError`` naming
the offending setting, before any decoding starts.  This module imports the method table;
the table's modules never import this one (:mod:`pipeline.engine.settings`, the generation
settings, and :mod:`pipeline.engine.methods` are the leaves they share).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass

from .methods import ENSEMBLE_FIELD, MethodParams, check_param, foreign_params, number_in, one_of, param, \
    POSITIVE_INT
from .proposers import METHODS

SCHEDULES = ("constant", "heuristic")


@dataclass
class DraftParams(MethodParams):
    """The settings every drafting method reads (a method's own are its ``Params``)."""

    num_assistant_tokens: int = param(
        5, "draft length ``k`` (tokens per draft, > 0); with the ``heuristic`` schedule, the starting length.",
        POSITIVE_INT, what="draft length k")
    num_assistant_tokens_schedule: str = param(
        "constant", "``constant`` keeps ``k``; ``heuristic`` (as in transformers) adds 2 after a fully accepted "
        "draft and subtracts 1 (down to 1) otherwise.  The state lives in one row and is never carried to the next.",
        one_of(SCHEDULES))
    assistant_ensemble_weight: float | None = param(
        None, "static ensemble verification weight ``w`` in (0, 1): drafts are accepted against "
        "``w*p + (1-w)*q`` (lossy).  ``None``: lossless.", number_in(0, 1, low_open=True, high_open=True))
    num_candidates: int = param(
        1, "tree verification (SpecInfer, Miao et al. 2023): the most candidate continuations a row's draft may "
        "branch into, verified in one target pass with a tree attention mask (1, the default: one linear draft).  "
        "Methods whose proposer offers trees (``prompt_lookup``: several n-gram matches; ``suffix``: its trees' "
        "other frequent continuations; ``draft_model`` and ``eagle``: the drafter's or the draft head's top "
        "candidates at each draft position); greedy rows without logits processors only (sampled rows verify one "
        "linear draft; ``RowStats.tree_off_steps`` counts those steps).",
        POSITIVE_INT, what="branches of a token tree; 1: linear drafts")


class _Speculation:
    """The behaviour of :class:`SpeculationSettings` (its fields are composed below)."""

    def validate(self) -> "SpeculationSettings":
        """Check every value and the method's own rules (its
        :class:`~pipeline.engine.methods.MethodSpec` and ``Params``); returns ``self``.

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
        fields = dataclasses.fields(self)
        foreign = foreign_params(METHODS, self.method)
        for f in fields:  # a method's own settings (default None): refused on another method
            if f.name in foreign and f.default is None and getattr(self, f.name) is not None:
                raise ValueError(f"{f.name} is a setting of method {' / '.join(map(repr, foreign[f.name]))}, "
                                 f"not of {self.method!r}")
        for f in fields:
            check_param(f, getattr(self, f.name))
        n = self.num_candidates
        why = method.tree_refusal() if n > 1 else None
        if why:
            raise ValueError(f"num_candidates={n} (token trees) cannot be used with method {self.method!r}: {why}; "
                             "set num_candidates to 1")
        if self.assistant_ensemble_weight is not None and not method.draft_logits:
            raise ValueError(f"{ENSEMBLE_FIELD} needs draft logits in the target's vocabulary; method "
                             f"{self.method!r} has none")
        for f in fields:
            if f.name in method.required and getattr(self, f.name) is None:
                what = f.metadata.get("what")
                raise ValueError(f"{f.name}{f' ({what})' if what else ''} must be set for method {self.method!r}, "
                                 "got None")
        return self

    @property
    def k_max(self) -> int:
        """The method's ``k``: the value of its spec's ``k_param`` field
        (``num_assistant_tokens`` for a method that drafts nothing); every row's first cap
        on draft tokens and the draft-length controller's ceiling."""
        return getattr(self, METHODS[self.method].k_param or "num_assistant_tokens")


def compose(methods) -> type:
    """The settings dataclass: ``method``, then :class:`DraftParams`' fields, then each
    method's ``Params`` fields in the table's order; a field two methods share is the one
    field their common ``Params`` base declares.

    Raises:
        TypeError: two ``Params`` declaring the same name each on their own.
    """
    fields: dict[str, dataclasses.Field] = {}
    hints: dict[str, typing.Any] = {}
    for cls in [DraftParams, *dict.fromkeys(m.params for m in methods.values() if m.params is not None)]:
        cls_hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if fields.setdefault(f.name, f) is not f:
                raise TypeError(f"the setting {f.name} is declared twice (in {cls.__qualname__} and before): declare "
                                "it once, in a Params both methods take")
            hints[f.name] = cls_hints[f.name]
    method = dataclasses.field(default="plain", metadata={"doc": "a name in the method table "
                                                                   "(:data:`pipeline.engine.proposers.METHODS`)."})
    spec = [("method", str, method)] + [
        (name, hints[name], dataclasses.field(default=f.default, metadata=f.metadata)) for name, f in fields.items()]
    doc = ["Which proposer drafts, and how many tokens: the fields of :class:`DraftParams` and of",
           "every method's ``Params``, flat under their own names (built by :func:`compose`).", "",
           "Attributes:"]
    for name, _, f in spec:
        doc.append(f"    {name}: {f.metadata['doc']}")
    return dataclasses.make_dataclass("SpeculationSettings", spec, bases=(_Speculation,), namespace={
        "__doc__": "\n".join(doc), "__module__": __name__, "__qualname__": "SpeculationSettings"})


#: which proposer drafts, and how many tokens (see :func:`compose`; ``validate`` and ``k_max``)
SpeculationSettings = compose(METHODS)
