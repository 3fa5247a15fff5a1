"""Drafting methods, one per file, all following :class:`base.Proposer`.

``PROPOSERS`` maps a method name (``SpeculationSettings.method``) to a factory
``(engine_inputs) -> Proposer``; adding a method is one file plus one line here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .base import Draft, DraftRequest, Proposer, empty_draft
from .draft_model import DraftModelProposer, text_config
from .prompt_lookup import PromptLookupProposer


@dataclass
class ProposerInputs:
    """Everything a factory may need to build a proposer for one engine."""

    target: Any
    spec: Any  # SpeculationSettings
    drafter: Any = None
    tokenizer: Any = None
    drafter_tokenizer: Any = None


def _draft_model(inputs: ProposerInputs) -> Proposer:
    if inputs.drafter is None:
        raise ValueError("method 'draft_model' needs a drafter (drafter=...)")
    from .vocab import check_shared_vocabulary

    check_shared_vocabulary(inputs.target, inputs.drafter, inputs.tokenizer, inputs.drafter_tokenizer)
    return DraftModelProposer(
        inputs.drafter, text_config(inputs.target).vocab_size, inputs.spec.assistant_confidence_threshold
    )


def _prompt_lookup(inputs: ProposerInputs) -> Proposer:
    return PromptLookupProposer(inputs.spec.max_matching_ngram_size)


def _early_exit(inputs: ProposerInputs) -> Proposer:
    from .early_exit import EarlyExitProposer

    return EarlyExitProposer(inputs.target, inputs.spec.assistant_early_exit, inputs.spec.assistant_confidence_threshold)


def _mtp(inputs: ProposerInputs) -> Proposer:
    from .mtp import MTPProposer, load_mtp

    # drafter=: an already loaded MtpModel (else loaded from the target's checkpoint)
    if inputs.drafter is not None and type(inputs.drafter).__name__ != "MtpModel":
        raise ValueError(
            "method 'mtp' drafts with the MTP layers of the target's checkpoint; drafter= must be None "
            f"(or their MtpModel), got {type(inputs.drafter).__name__}"
        )
    mtp = inputs.drafter if inputs.drafter is not None else load_mtp(inputs.target)
    return MTPProposer(inputs.target, mtp, inputs.spec.num_mtp_layers)


def _universal(inputs: ProposerInputs) -> Proposer:
    from .universal import UniversalProposer

    return UniversalProposer(inputs.target, inputs.drafter, inputs.tokenizer, inputs.drafter_tokenizer)


def _mtp_assistant(inputs: ProposerInputs) -> Proposer:
    from .mtp_assistant import MTPAssistantProposer

    return MTPAssistantProposer(inputs.target, inputs.drafter)


PROPOSERS: dict[str, Callable[[ProposerInputs], Proposer]] = {
    "draft_model": _draft_model,
    "prompt_lookup": _prompt_lookup,
    "universal": _universal,
    "early_exit": _early_exit,
    "mtp": _mtp,
    "mtp_assistant": _mtp_assistant,
}


def build_proposer(inputs: ProposerInputs) -> Proposer | None:
    """The proposer for ``inputs.spec.method`` (``None`` for plain decoding).

    Raises:
        ValueError: an unknown method, or a method without what it needs.
    """
    method = inputs.spec.method
    if method == "plain":
        return None
    if method not in PROPOSERS:
        raise ValueError(f"unknown method {method!r}; known: plain, {', '.join(sorted(PROPOSERS))}")
    return PROPOSERS[method](inputs)


__all__ = [
    "Draft", "DraftRequest", "Proposer", "ProposerInputs", "PROPOSERS", "build_proposer", "empty_draft",
    "DraftModelProposer", "PromptLookupProposer",
]
