"""Universal assisted decoding: a drafter with its own tokenizer drafts through text.

Timor et al. 2025, "Accelerating LLM Inference with Lossless Speculative Decoding
Algorithms for Heterogeneous Vocabularies" (arXiv 2502.05202); transformers'
``generate(assistant_model=..., tokenizer=..., assistant_tokenizer=...)``.

Each step:

1. Re-synchronise the drafter with the committed text: decode the target's committed
   sequence to text, encode it with the drafter's tokenizer, and compare with the
   drafter ids its KV cache holds.  The cache is cropped to their longest common prefix
   and only the new drafter ids are fed (at least one, for the next-token logits).  So
   the accepted part of the last draft is never recomputed, and a rejected tail or a
   re-tokenised word boundary is dropped.
2. Draft up to ``k`` tokens greedily in the drafter's vocabulary (stopping at its EOS).
3. Re-encode the drafted text into the target's vocabulary, aligned with the committed
   target ids: the drafted text is appended to the decoded text of the last few
   committed target tokens, re-encoded with the target's tokenizer, and the draft is
   what follows the part that tokenises as before.  When the drafted text would change
   how the committed text is tokenised (it continues a word the target cut), the suffix
   is encoded on its own instead; a candidate is used only if the committed ids plus
   the draft decode exactly to the committed text plus the drafted text.  At most ``k``
   target ids are proposed.  (A tokenizer that adds a dummy-prefix space when encoding a
   lone suffix, as SentencePiece Llama tokenizers do, fails that check when the drafted
   text continues a word the target cut: that step proposes nothing.)

Rows draft together: each draft position is one batched drafter pass over the rows still
drafting (each feeding its own ids at its own positions, in its own slot of the drafter's
cache); steps 1 and 3 are per row (tokenizer work on the CPU).

The proposer is deterministic (``q`` one-hot), so greedy and sampled decoding both stay
lossless; static ensemble verification is refused (no draft logits in the target's
vocabulary).  A drafter whose context cannot hold the row proposes nothing (the step
is a plain decoding step).  Cost per step: one decode of the committed sequence and one
encode of its text with the drafter's tokenizer (linear in the row's length); the drafter runs
over at most :data:`~pipeline.engine.proposers.base.CATCH_UP_WINDOW` tokens of a row that it has not seen (a row's first draft,
or the first after the draft-length controller drafted nothing for a while).
"""

from __future__ import annotations

import torch

from ..runner import ModelRunner, model_layout, text_config
from .base import CATCH_UP_WINDOW, Draft, DraftRequest, empty_draft

#: committed target tokens whose text is re-encoded together with the drafted text
CONTEXT_TOKENS = 8


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class UniversalProposer:
    """Args:
        target: the target model (only its vocabulary width is used).
        drafter: a causal LM with its own tokenizer.
        tokenizer: the target's tokenizer.
        drafter_tokenizer: the drafter's tokenizer.

    Raises:
        ValueError: a missing drafter or tokenizer.
    """

    def __init__(self, target, drafter, tokenizer, drafter_tokenizer):
        if drafter is None:
            raise ValueError("method 'universal' needs a drafter (drafter=...)")
        if tokenizer is None or drafter_tokenizer is None:
            raise ValueError(
                "method 'universal' needs both tokenizers: tokenizer= (the target's) and drafter_tokenizer="
            )
        self.model = drafter
        self.layout = model_layout(drafter, "drafter", "universal")
        self.device = drafter.device
        self.tok_t = tokenizer
        self.tok_d = drafter_tokenizer
        self.target_vocab = text_config(target).vocab_size
        self.draft_width = min(text_config(drafter).vocab_size, len(drafter_tokenizer))
        self.context = self.layout.context
        eos = getattr(drafter.generation_config, "eos_token_id", None)
        eos = set([eos] if isinstance(eos, int) else (eos or []))
        if drafter_tokenizer.eos_token_id is not None:
            eos.add(drafter_tokenizer.eos_token_id)
        self.draft_eos = eos
        self.runner: ModelRunner | None = None
        self.ids: list[list[int]] = []  # per slot: the drafter ids in the drafter's cache, in order
        self.base: list[int] = []  # per slot: the index, in the text's drafter ids, of cache position 0

    def models(self) -> list[tuple[object, str]]:
        return [(self.model, "drafter")]

    def bind(self, max_rows: int, target_runner) -> None:
        self.runner = ModelRunner(self.model, max_rows, self.layout)
        self.ids = [[] for _ in range(max_rows)]
        self.base = [0] * max_rows

    def admit(self, slots, prompts) -> None:
        for s in slots:
            self.ids[s] = []
            self.base[s] = 0

    def rollback(self, slot: int, valid_length: int) -> None:
        pass  # re-synchronised from the committed text at the next propose()

    def reserve(self, length: int) -> None:
        self.runner.cache.reserve(length)  # in the drafter's tokens: about as many for a text

    # ------------------------------------------------------------------ text <-> ids
    def _decode_t(self, ids: list[int]) -> str:
        return self.tok_t.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _decode_d(self, ids: list[int]) -> str:
        return self.tok_d.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def to_target(self, committed: list[int], suffix: str, k: int) -> list[int]:
        """Target ids (at most ``k``) that continue ``committed`` with the text ``suffix``."""
        suffix = suffix.rstrip("\ufffd")  # an incomplete character at the end of the draft
        if not suffix:
            return []
        ctx = committed[-CONTEXT_TOKENS:]
        ctx_text = self._decode_t(ctx)
        want = ctx_text + suffix
        before = self.tok_t(ctx_text, add_special_tokens=False).input_ids
        after = self.tok_t(want, add_special_tokens=False).input_ids
        candidates = []
        if _common_prefix(before, after) == len(before):
            candidates.append(after[len(before) :])
        candidates.append(self.tok_t(suffix, add_special_tokens=False).input_ids)
        for ids in candidates:
            ids = [i for i in ids if i < self.target_vocab]
            if ids and self._decode_t(ctx + ids) == want:
                return ids[:k]
        return []

    # ------------------------------------------------------------------ drafting
    def _sync(self, slot: int, text: str) -> list[int] | None:
        """Crop the slot's drafter cache to what still matches ``text``; the ids to feed."""
        full = self.tok_d(text, add_special_tokens=True).input_ids
        if not full:
            return None
        target_ids = full[self.base[slot]:]
        keep = min(_common_prefix(self.ids[slot], target_ids), len(target_ids) - 1)
        if len(target_ids) - keep > CATCH_UP_WINDOW:  # far behind: restart on the latest window
            self.base[slot] = len(full) - CATCH_UP_WINDOW
            target_ids, keep = full[self.base[slot]:], 0
        self.ids[slot] = self.ids[slot][:keep]  # the cache's entries past them are never read again
        return target_ids[keep:]

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        drafts = [empty_draft(r.sequence.device) for r in requests]
        committed = [r.sequence[0].tolist() for r in requests]
        feeds: dict[int, list[int]] = {}
        synced: dict[int, int] = {}
        for i, r in enumerate(requests):
            feed = self._sync(r.slot, self._decode_t(committed[i]))
            if feed is None or (self.context is not None and len(self.ids[r.slot]) + len(feed) + r.k > self.context):
                continue
            feeds[i] = feed
            synced[i] = len(self.ids[r.slot]) + len(feed)  # the drafter's ids of the committed text
        drafted: dict[int, list[int]] = {i: [] for i in feeds}
        active = list(feeds)
        while active:
            slots = [requests[i].slot for i in active]
            inputs = [torch.tensor(feeds[i], dtype=torch.long, device=self.device) for i in active]
            starts = [len(self.ids[s]) for s in slots]
            logits = self.runner.forward(slots, inputs, starts, logits_to_keep=1).logits[:, -1, : self.draft_width]
            chosen = logits.argmax(-1).tolist()
            still = []
            for i, s, token in zip(active, slots, chosen):
                self.ids[s].extend(feeds[i])
                if token in self.draft_eos:
                    continue
                drafted[i].append(token)
                feeds[i] = [token]
                if len(drafted[i]) < requests[i].k:
                    still.append(i)
            active = still
        for i, tokens in drafted.items():
            if tokens:
                drafts[i] = self._to_draft(requests[i], committed[i], self.ids[requests[i].slot][: synced[i]], tokens)
        return drafts

    def _to_draft(self, request: DraftRequest, committed: list[int], base: list[int], drafted: list[int]) -> Draft:
        """The drafter's tokens ``drafted`` after its ids ``base`` of the committed text, as a
        draft in the target's vocabulary (empty when the text does not carry over)."""
        device = request.sequence.device
        base_text = self._decode_d(base)
        full = self._decode_d(base + drafted)
        if not full.startswith(base_text):
            return empty_draft(device)
        ids = self.to_target(committed, full[len(base_text) :], request.k)
        if not ids:
            return empty_draft(device)
        return Draft(tokens=torch.tensor(ids, dtype=torch.long, device=device))


def build(inputs) -> UniversalProposer:
    """The method's factory (:class:`~pipeline.engine.proposers.base.ProposerInputs`)."""
    return UniversalProposer(inputs.target, inputs.drafter, inputs.tokenizer, inputs.drafter_tokenizer)


def tune_candidate(settings, models) -> dict | None:
    """The tuner tries it when a drafter is loaded whose vocabulary the target's does not
    share (a shared one drafts as a draft model, without re-tokenising)."""
    if models.drafter is None:
        return None
    from .vocab import check_shared_vocabulary

    try:
        check_shared_vocabulary(models.target, models.drafter, models.tokenizer, models.drafter_tokenizer)
    except ValueError:
        return {}
    return None
