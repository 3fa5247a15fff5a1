"""Drafting methods, one per file, all following :class:`base.Proposer`, and the method
table :data:`METHODS`: one :class:`~pipeline.engine.methods.MethodSpec` line per method
(``SpeculationSettings.method``), which everything that depends on a method reads.

Adding a method is one file here (its proposer, its ``Params`` and a ``build(inputs)``
factory, plus its pair check and tuner candidacy where it needs them) and one line in
:data:`METHODS`, which declares its capabilities (trees, target hook, learning from outputs,
adaptive length): ``docs/adding-a-method.md``.
"""

from __future__ import annotations

from ..methods import PLAIN, MethodSpec, always_tried
from . import draft_model, eagle, early_exit, mtp, mtp_assistant, prompt_lookup, suffix, universal
from .base import Draft, DraftRequest, Proposer, ProposerInputs, empty_draft
from .draft_model import DraftModelProposer
from .prompt_lookup import PromptLookupProposer

#: the method table, by name (in the order methods are listed to users)
METHODS: dict[str, MethodSpec] = {spec.name: spec for spec in (
    MethodSpec(PLAIN, k_param=None, tune_candidate=always_tried),
    MethodSpec("draft_model", draft_model.build, draft_model.DraftModelProposer, needs_drafter=True,
               params=draft_model.Params, draft_logits=True, check_pair=draft_model.check_pair,
               tune_candidate=draft_model.tune_candidate, proposes_trees=True, adaptive=True),
    MethodSpec("prompt_lookup", prompt_lookup.build, prompt_lookup.PromptLookupProposer,
               k_param="prompt_lookup_num_tokens", params=prompt_lookup.Params,
               tune_candidate=always_tried, tune_k_max=10, proposes_trees=True),
    MethodSpec("suffix", suffix.build, suffix.SuffixProposer, params=suffix.Params, tune_candidate=always_tried,
               tune_k_max=10, proposes_trees=True, learns_from_outputs=True),
    MethodSpec("early_exit", early_exit.build, early_exit.EarlyExitProposer, params=early_exit.Params,
               draft_logits=True, tune_candidate=early_exit.tune_candidate, hooks_target=True, adaptive=True),
    MethodSpec("mtp", mtp.build, mtp.MTPProposer, params=mtp.Params, draft_logits=True, tune_k_max=None,
               hooks_target=True),
    MethodSpec("universal", universal.build, universal.UniversalProposer, needs_drafter=True,
               tune_candidate=universal.tune_candidate, adaptive=True),
    MethodSpec("mtp_assistant", mtp_assistant.build, mtp_assistant.MTPAssistantProposer, needs_drafter=True,
               draft_logits=True, check_pair=mtp_assistant.check_pair, tune_k_max=None, hooks_target=True, adaptive=True),
    MethodSpec("eagle", eagle.build, eagle.EagleProposer, needs_drafter=True, params=eagle.Params,
               draft_logits=True, check_drafter=eagle.check_drafter, load_drafter=eagle.load_drafter,
               tune_candidate=eagle.tune_candidate, proposes_trees=True, hooks_target=True, moves_tree_state=True,
               adaptive=True),
)}


def method_spec(name: str) -> MethodSpec:
    """The spec of method ``name``.

    Raises:
        ValueError: an unknown method (naming the known ones).
    """
    spec = METHODS.get(name)
    if spec is None:
        raise ValueError(f"unknown method {name!r}; known: {', '.join(METHODS)}")
    return spec


def build_proposer(inputs: ProposerInputs) -> Proposer | None:
    """The proposer for ``inputs.spec.method`` (``None`` for plain decoding).

    Raises:
        ValueError: an unknown method, or a method without what it needs.
    """
    spec = method_spec(inputs.spec.method)
    return spec.build(inputs) if spec.build is not None else None


__all__ = [
    "Draft", "DraftRequest", "Proposer", "ProposerInputs", "METHODS", "MethodSpec", "method_spec", "build_proposer",
    "empty_draft", "DraftModelProposer", "PromptLookupProposer",
]
