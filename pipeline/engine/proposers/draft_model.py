"""A smaller causal LM with the target's tokenizer drafts autoregressively.

Leviathan et al. 2023 (arXiv 2211.17192); transformers' ``assistant_model``.  The
drafter keeps its own KV cache across steps of a row: each draft feeds only the tokens
it has not seen (at least the newest committed one), and after verification its cache
is cropped to the still-valid prefix (KV-cache rollback), so the accepted prefix is never
recomputed.

Vocabularies padded to different sizes are handled: drafter logits for ids the target
does not have are dropped, ``q`` is padded with zeros to the target's width, and target
ids beyond the drafter's vocabulary (padding) are fed to the drafter as its last id.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from .base import Draft, DraftRequest, draft_token


def text_config(model):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


class DraftModelProposer:
    """Args:
        drafter: a causal LM (``PreTrainedModel``) sharing the target's tokenizer.
        target_vocab_size: width ``V_target`` of the target's logits.
        confidence_threshold: stop drafting after a token whose drafter probability is
            below this (transformers' ``assistant_confidence_threshold``; 0 disables).
    """

    adaptive = True

    def __init__(self, drafter, target_vocab_size: int, confidence_threshold: float = 0.0):
        self.model = drafter
        self.device = drafter.device
        self.target_vocab = target_vocab_size
        self.draft_vocab = text_config(drafter).vocab_size
        self.threshold = confidence_threshold
        self.cache = None
        self.seen = 0  # tokens in the drafter's cache

    def reset(self, target_cache=None) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.seen = 0

    def rollback(self, valid_length: int) -> None:
        if self.seen > valid_length:
            self.cache.crop(valid_length - self.seen)
            self.seen = valid_length

    def _to_target_width(self, logits: torch.Tensor) -> torch.Tensor:
        """``(1, V_draft)`` -> ``(1, V_target)``: drop ids the target lacks, pad with -inf."""
        if self.draft_vocab == self.target_vocab:
            return logits
        if self.draft_vocab > self.target_vocab:
            return logits[:, : self.target_vocab]
        pad = logits.new_full((1, self.target_vocab - self.draft_vocab), float("-inf"))
        return torch.cat([logits, pad], dim=1)

    def propose(self, request: DraftRequest) -> Draft:
        seq = request.sequence.to(self.device)
        shaper = request.shaper
        want_probs = request.want_probs
        feed = seq[:, self.seen :]
        if self.draft_vocab < self.target_vocab:
            # Padding ids of the target that the drafter lacks (a target never emits them
            # in practice): feed a valid id instead; only draft quality could suffer.
            feed = feed.clamp_max(self.draft_vocab - 1)
        tokens: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        prefix = seq
        for i in range(request.k):
            logits = self.model(input_ids=feed, cache=self.cache, use_cache=True, logits_to_keep=1).logits[:, -1]
            self.seen += feed.shape[1]
            logits = self._to_target_width(logits)
            token, q = draft_token(logits, prefix, request, need_q=self.threshold > 0)
            tokens.append(token)
            if want_probs:
                probs.append(q)
            if self.threshold > 0 and float(q[0, token[0, 0]]) < self.threshold:
                break
            if i + 1 < request.k:
                feed = token
                if shaper.prefix_dependent:
                    prefix = torch.cat([prefix, token], dim=1)
        draft_tokens = torch.cat(tokens, dim=1)[0]
        return Draft(tokens=draft_tokens, probs=torch.cat(probs, dim=0) if want_probs else None)
