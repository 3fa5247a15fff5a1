"""Drafting methods, one per file, all following :class:`base.Proposer`."""

from .base import Draft, DraftRequest, Proposer
from .draft_model import DraftModelProposer
from .prompt_lookup import PromptLookupProposer

__all__ = ["Draft", "DraftRequest", "Proposer", "DraftModelProposer", "PromptLookupProposer"]
