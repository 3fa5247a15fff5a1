"""A smaller causal LM with the target's tokenizer drafts autoregressively.

Leviathan et al. 2023 (arXiv 2211.17192); transformers' ``assistant_model``.  All rows in
flight draft together: draft position ``i`` is one batched drafter pass over the rows
still drafting.  The drafter keeps its own KV cache (a :class:`SlotCache`, one slot per
row): each draft feeds only the tokens the drafter has not seen (at least the newest
committed one), and after verification the row's valid length is cut back to the
committed prefix (KV-cache rollback), so the accepted prefix is never recomputed.  The
drafter's entries of its draft tokens count only where the committed tokens are those
tokens (:class:`~.base.DraftedTokens`): the step may verify another source's draft, or cut
its own, and a tree's path may leave its chain.

Vocabularies padded to different sizes are handled: drafter logits for ids the target
does not have are dropped, ``q`` is padded with zeros to the target's width, and target
ids beyond the drafter's vocabulary (padding) are fed to the drafter as its last id.

A drafter whose context is shorter than the target's drafts only while the row fits in
it; past that the row's steps are plain target steps (the output is unchanged).

Reduced draft vocabulary (``draft_vocab``; FR-Spec, Zhao et al. 2025, arXiv 2502.14856):
the drafter runs its decoder and only the ``N`` rows of its LM head for those ids
(:class:`ReducedHeadLM`); the logits are scattered into a ``-inf`` row of the target's
width, so ``q`` is zero outside the set.  In a small drafter with a large vocabulary the
LM head is most of the cost (SmolLM2's drafter: 49,152 x 192 of its 10.5 M weights).
Verification stays over the full vocabulary: greedy output is unchanged, sampling exact.

Token trees (``num_candidates = c > 1``, greedy rows; a static top-k expansion in the manner
of EAGLE-2, Li et al. 2024, and SpecInfer): the drafter drafts its greedy chain as above,
and at each draft position its next ``c - 1`` likeliest tokens join the tree as leaves,
siblings of the chain's token there.  They cost no drafter pass (the logits are already
computed); a leaf is accepted when the target rejects the chain's token at its position
and picks that one instead, which gains one token.  The chain is the tree's first branch,
and the drafter's cache follows it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..methods import MethodParams, number_in, param, POSITIVE_INT, Rule
from ..runner import ModelRunner, model_layout, prefill, text_config
from .base import Draft, DraftedTokens, DraftRequest, Drafting, draft_tokens, with_leaves


# --------------------------------------------------------------------------- parameters
@dataclass
class ConfidenceParams(MethodParams):
    """The drafter-confidence stop, a parameter of every method whose drafter runs a
    distribution token by token (``draft_model``, ``early_exit``)."""

    assistant_confidence_threshold: float = param(
        0.0, "the draft model stops drafting early when its top probability falls below this (0 disables; "
        "transformers' default is 0.4).", number_in(0, 1, high_open=True))


@dataclass
class VocabSizeParams(MethodParams):
    """The size of a reduced draft vocabulary (``draft_model`` with ``draft_vocab``, ``eagle``)."""

    draft_vocab_size: int | None = param(
        None, "methods ``draft_model`` (with ``draft_vocab``) and ``eagle``: use only the first ``N`` ids of the "
        "draft vocabulary (``None``: all of them).", POSITIVE_INT, what="draft-vocabulary ids kept")


@dataclass
class Params(VocabSizeParams, ConfidenceParams):
    """Method ``draft_model``'s parameters (its draft length is ``num_assistant_tokens``)."""

    draft_vocab: str | None = param(
        None, "method ``draft_model``: a reduced draft vocabulary (FR-Spec, Zhao et al. 2025) -- a draft-head "
        "folder (its ``draft_vocab``) or a JSON file holding a list of token ids, most frequent first.  The "
        "drafter computes only those rows of its LM head and ``q`` is zero elsewhere; the target verifies over "
        "its full vocabulary, so greedy output is unchanged and sampling stays exact.",
        Rule("a path (a draft-head folder or a JSON list of token ids)", lambda v: isinstance(v, str) and v.strip()))


class _Logits:
    def __init__(self, logits):
        self.logits = logits


class ReducedHeadLM(torch.nn.Module):
    """A causal LM's decoder followed by only the rows ``ids`` of its LM head.

    Called like the model (``input_ids``/``inputs_embeds``, ``position_ids``,
    ``attention_mask``, ``cache``, ``use_cache``, ``logits_to_keep``); ``logits`` is
    ``(b, logits_to_keep, N)`` for the ids in order.  The decoder and the row copy share the
    model's config (``config``), so the runner's masks and kernels treat it as the model.

    Args:
        model: a causal LM (``get_decoder()`` and ``get_output_embeddings()``).
        ids: ``(N,)`` int64 token ids below the model's vocabulary size.

    Raises:
        ValueError: ids outside the vocabulary, or a model whose logits are not its
            decoder's last hidden state times its output layer (a probe pass compares them).
    """

    def __init__(self, model, ids: torch.Tensor):
        super().__init__()
        self.config = model.config
        self.body = model.get_decoder()
        head = model.get_output_embeddings()
        vocab = text_config(model).vocab_size
        ids = torch.as_tensor(ids, dtype=torch.long).view(-1)
        if head is None or int(ids.max()) >= vocab or int(ids.min()) < 0:
            raise ValueError(f"draft_vocab: ids must lie in 0 .. {vocab - 1} and the drafter needs an output layer")
        w = head.weight.detach()
        self.head = torch.nn.Linear(w.shape[1], ids.numel(), bias=head.bias is not None, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            self.head.weight.copy_(w.index_select(0, ids.to(w.device)))
            if head.bias is not None:
                self.head.bias.copy_(head.bias.detach().index_select(0, ids.to(w.device)))
        self.softcap = getattr(text_config(model), "final_logit_softcapping", None)
        self.register_buffer("ids", ids.to(w.device), persistent=False)
        self._probe(model)

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    def forward(self, logits_to_keep: int = 1, **kwargs):
        h = self.body(**kwargs).last_hidden_state
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        logits = self.head(h)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return _Logits(logits)

    @torch.no_grad()
    def _probe(self, model) -> None:
        ids = torch.arange(4, device=self.device).view(1, -1) % text_config(model).vocab_size
        full = model(input_ids=ids).logits[0, :, self.ids]
        mine = self.forward(logits_to_keep=0, input_ids=ids).logits[0]
        tol = 1e-3 if full.dtype in (torch.float16, torch.bfloat16) else 1e-5
        if not torch.allclose(full.float(), mine.float(), rtol=tol, atol=tol * float(full.abs().max().clamp_min(1))):
            raise ValueError(f"draft_vocab: {type(model).__name__}'s logits are not its decoder's output times its LM "
                             "head (a scaled or extra output stage), so its head cannot be reduced")


class DraftModelProposer:
    """Args:
        drafter: a causal LM (``PreTrainedModel``) sharing the target's tokenizer.
        target_vocab_size: width ``V_target`` of the target's logits.
        confidence_threshold: stop drafting a row after a token whose drafter probability
            is below this (transformers' ``assistant_confidence_threshold``; 0 disables).
        method: the method name (for error messages).
        draft_vocab: ``(N,)`` int64 token ids of a reduced draft vocabulary (``None``: the
            drafter's whole vocabulary); see the module docstring.

    Raises:
        ValueError: a drafter whose architecture the engine cannot roll back, or a
            ``draft_vocab`` it cannot use.
    """

    def __init__(self, drafter, target_vocab_size: int, confidence_threshold: float = 0.0, method: str = "draft_model",
                 draft_vocab: torch.Tensor | None = None):
        self.model = drafter
        self.reduced = None
        if draft_vocab is not None:
            if int(draft_vocab.max()) >= min(target_vocab_size, text_config(drafter).vocab_size):
                raise ValueError("draft_vocab has ids outside the vocabulary the drafter and the target share")
            self.reduced = ReducedHeadLM(drafter, draft_vocab)
        self.layout = model_layout(drafter, "drafter", method)
        self.context = self.layout.context
        self.device = drafter.device
        self.target_vocab = target_vocab_size
        self.draft_vocab = text_config(drafter).vocab_size
        self.threshold = confidence_threshold
        self.runner: ModelRunner | None = None
        self.seen: list[int] = []  # per slot: committed tokens in the drafter's cache
        self.drafted = DraftedTokens(0)  # per slot: the draft tokens fed to the drafter's cache

    # ------------------------------------------------------------------ state
    def models(self) -> list[tuple[object, str]]:
        """The drafter, then its reduced head (which shares the drafter's decoder)."""
        return [(self.model, "drafter")] + ([(self.reduced, "drafter's reduced head")] if self.reduced is not None else [])

    def bind(self, max_rows: int, target_runner) -> None:
        self.runner = ModelRunner(self.model, max_rows, self.layout)
        self.seen = [0] * max_rows
        self.drafted = DraftedTokens(max_rows)

    def _forward(self, slots, tokens, starts, logits_to_keep=1):
        return self.runner.forward(slots, tokens, starts, logits_to_keep=logits_to_keep, model=self.reduced).logits

    def admit(self, slots: list[int], prompts: list[torch.Tensor]) -> None:
        fits = [(s, p) for s, p in zip(slots, prompts) if self.context is None or p.shape[1] - 1 <= self.context]
        for s in slots:
            self.seen[s] = 0
            self.drafted.forget(s)
        prefill(self._forward, [s for s, _ in fits], [self._feedable(p) for _, p in fits])
        for s, p in fits:
            self.seen[s] = p.shape[1] - 1

    def rollback(self, slot: int, valid_length: int) -> None:
        if self.seen[slot] > valid_length:
            self.seen[slot] = valid_length

    def reserve(self, length: int) -> None:
        self.runner.cache.reserve(length)

    # ------------------------------------------------------------------ drafting
    def _feedable(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.to(self.device)
        if self.draft_vocab < self.target_vocab:
            # Padding ids of the target that the drafter lacks (a target never emits them
            # in practice): feed a valid id instead; only draft quality could suffer.
            ids = ids.clamp_max(self.draft_vocab - 1)
        return ids

    def _to_target_width(self, logits: torch.Tensor) -> torch.Tensor:
        """``(b, V_draft)`` (or ``(b, N)`` of a reduced head) -> ``(b, V_target)``: drop ids the
        target lacks, pad with -inf."""
        if self.reduced is not None:
            full = logits.new_full((logits.shape[0], self.target_vocab), float("-inf"))
            full[:, self.reduced.ids] = logits
            return full
        if self.draft_vocab == self.target_vocab:
            return logits
        if self.draft_vocab > self.target_vocab:
            return logits[:, : self.target_vocab]
        pad = logits.new_full((logits.shape[0], self.target_vocab - self.draft_vocab), float("-inf"))
        return torch.cat([logits, pad], dim=1)

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        drafting = Drafting(requests)
        active = []  # (request index, k)
        for i, r in enumerate(requests):
            length = r.sequence.shape[1]
            agreed = self.drafted.agreed(r.slot, r.sequence[0], 0)  # its last draft's entries, as far as committed
            if agreed is not None:
                self.seen[r.slot] = min(self.seen[r.slot], agreed)
                self.drafted.forget(r.slot)
            k = r.k if self.context is None else min(r.k, self.context - length + 1)
            if k > 0 and self.seen[r.slot] < length:
                active.append((i, k))
        feeds = {i: self._feedable(requests[i].sequence[0, self.seen[requests[i].slot]:]) for i, _ in active}
        leaves: dict[int, list[tuple[int, int, int]]] = {}  # request -> (rank, position, token)
        while active:
            reqs = [requests[i] for i, _ in active]
            slots = [r.slot for r in reqs]
            starts = [self.seen[r.slot] for r in reqs]
            logits = self._forward(slots, [feeds[i] for i, _ in active], starts)[:, -1]
            for r, (i, _) in zip(reqs, active):
                self.seen[r.slot] += feeds[i].shape[0]
            logits = self._to_target_width(logits)
            prefixes = [drafting.prefix(i) if r.shaper.prefix_dependent else r.sequence for r, (i, _) in zip(reqs, active)]
            chosen, qs, conf = draft_tokens(logits, reqs, prefixes, need_q=self.threshold > 0)
            still = []
            for j, (i, k) in enumerate(active):
                tok = chosen[j : j + 1]
                c = reqs[j].candidates
                if c > 1:  # greedy, no processors (the loop asks for trees only then): the next likeliest
                    top = logits[j].topk(min(c, logits.shape[-1])).indices.tolist()
                    others = [t for t in top if t != int(tok[0])][: c - 1]
                    leaves.setdefault(i, []).extend((rank, drafting.count(i), t) for rank, t in enumerate(others))
                drafting.append(i, tok, qs[j], conf[j])
                low = self.threshold > 0 and float(qs[j][0, tok[0]]) < self.threshold
                if drafting.count(i) < k and not low:
                    still.append((i, k))
                    feeds[i] = self._feedable(tok)
                    self.drafted.record(reqs[j].slot, reqs[j].sequence.shape[1] + drafting.count(i) - 1, tok)
            active = still
        drafts = drafting.drafts()
        for i, extra in leaves.items():
            drafts[i] = with_leaves(drafts[i], extra)
        return drafts


def build(inputs) -> DraftModelProposer:
    """The method's factory (:class:`~pipeline.engine.proposers.base.ProposerInputs`).

    Raises:
        ValueError: no drafter, a drafter whose vocabulary does not map onto the target's,
            one whose architecture the engine cannot roll back, or a ``draft_vocab`` it cannot
            use (``draft_vocab_size`` without ``draft_vocab``, a missing or malformed list).
    """
    if inputs.drafter is None:
        raise ValueError("method 'draft_model' needs a drafter (drafter=...)")
    from .vocab import check_shared_vocabulary, read_draft_vocab

    check_shared_vocabulary(inputs.target, inputs.drafter, inputs.tokenizer, inputs.drafter_tokenizer)
    p = Params.of(inputs.spec)
    if p.draft_vocab_size is not None and p.draft_vocab is None:
        raise ValueError("draft_vocab_size needs draft_vocab (the ids, most frequent first) for method 'draft_model'")
    ids = read_draft_vocab(p.draft_vocab, p.draft_vocab_size) if p.draft_vocab is not None else None
    return DraftModelProposer(inputs.drafter, text_config(inputs.target).vocab_size,
                              p.assistant_confidence_threshold, draft_vocab=ids)


def check_pair(target_config, drafter_config, tokenizer, drafter_tokenizer) -> None:
    """The driver's check, from configs and tokenizers alone: the drafter's ids map onto the
    target's tokenizer and mean the same (the engine's own check); raises ``ValueError``."""
    from types import SimpleNamespace

    from .vocab import check_shared_vocabulary

    check_shared_vocabulary(SimpleNamespace(config=target_config), SimpleNamespace(config=drafter_config),
                            tokenizer, drafter_tokenizer)


def tune_candidate(settings, models) -> dict | None:
    """The tuner tries it when a drafter is loaded that shares the target's vocabulary.

    Raises:
        ValueError: a drafter is loaded but does not share the target's vocabulary (why).
    """
    if models.drafter is None:
        return None
    from .vocab import check_shared_vocabulary

    check_shared_vocabulary(models.target, models.drafter, models.tokenizer, models.drafter_tokenizer)
    return {}
