"""Method ``eagle``: a draft head that reads the target's own hidden states.

EAGLE (Li et al. 2024, arXiv 2401.15077; EAGLE-3, arXiv 2503.01840; vLLM calls the family
``eagle``).  The head -- its math, config and checkpoint -- is
:class:`~pipeline.engine.draft_head.DraftHead`; this module drafts with it, every row
together.  The target verifies over its full vocabulary, so greedy output is unchanged,
and rejection sampling with the head's ``q`` (zero outside its draft vocabulary) keeps the
target's distribution.

State per row (slot), never recomputed for committed tokens:

- ``p_j`` of committed positions, captured from every target pass by
  :meth:`EagleProposer.target_forward` (prefill and verification);
- the head's KV entries in a :class:`SlotCache` (slot ``j`` holds main position ``j``), of
  which the first ``n`` are *real*: fed with the target's ``p_j`` and the committed
  ``x_{j+1}``.  A step first catches up the positions ``n .. L-2`` whose features arrived
  with the last verification (one ragged pass over every drafting row, draft position 1),
  then drafts position ``i = 2 .. k`` one token per pass.  Entries written at draft
  positions ``i > 1`` were fed the head's own feature: they are speculative and never
  counted in ``n``, so whatever verification accepts they are rewritten (the next catch-up
  pass writes those slots before any query reads them).  Rollback to ``V`` valid tokens
  keeps features ``j < V`` and real entries ``j < V - 1``.

Token trees (``num_candidates = c > 1``, greedy rows; EAGLE-2's top-k expansion, Li et al.
2024, arXiv 2406.16858, kept static as in :mod:`.draft_model`): the head drafts its greedy
chain, and at each draft position its next ``c - 1`` likeliest tokens join the tree as
leaves, siblings of the chain's token there, at no head pass.  The target's pass over the
tree writes node ``j``'s feature at position ``L + j`` (its slot in the pass); when the
accepted path takes a leaf, :meth:`EagleProposer.move` moves the path's features to their
positions as the loop moves the target's cache entries, and the rollback keeps the whole
accepted path.  The head's real entries never depend on a draft, so they need no move.
"""

from __future__ import annotations

import os

import torch

from ..draft_head import MODEL_TYPE, WEIGHTS_NAME, DraftHead, DraftHeadConfig, check_fit, is_draft_head, \
    load_draft_head, read_draft_head_config
from ..cpu import attention_implementation
from ..runner import ModelLayout, ModelRunner, text_config
from .base import CATCH_UP_WINDOW, Draft, DraftRequest, Drafting, draft_tokens, top_probability, with_leaves
from .draft_model import VocabSizeParams
from .mtp import Positions, rows_with_state, store_hidden

#: method ``eagle``'s parameters: the size of its head's draft vocabulary (shared with ``draft_model``)
Params = VocabSizeParams


# --------------------------------------------------------------------------- drafting
class EagleProposer:
    """Drafts with a :class:`DraftHead` on the target's hidden states, every row together.

    Args:
        target: the target model (its embeddings, and tied its output rows, are the head's).
        head: the draft head (:func:`load_draft_head`); attached to ``target`` here.
        draft_vocab_size: use only the head's first ``N`` draft-vocabulary ids (``None``: all);
            the head is cut in place (:meth:`DraftHead.truncate_vocab`).

    Raises:
        ValueError: a head that does not fit the target.
    """

    def __init__(self, target, head: DraftHead, draft_vocab_size: int | None = None):
        if draft_vocab_size is not None:
            head.truncate_vocab(draft_vocab_size)
        self.head = head.attach(target)
        self.target = target
        self.vocab_size = text_config(target).vocab_size
        self.feature_layers = list(head.head_config.feature_layers)
        self.device = head.device
        self.vocab_ids = self.head.draft_vocab.to(self.device)  # (N,) target ids of the head's outputs
        self.runner: ModelRunner | None = None

    def models(self) -> list[tuple[object, str]]:
        return [(self.head, "draft head")]

    # ---- per-row state
    def bind(self, max_rows: int, target_runner) -> None:
        layout = ModelLayout(("full_attention",), None, target_runner.layout.context, None, False)
        self.runner = ModelRunner(self.head, max_rows, layout)
        self.runner.device = self.device
        self.feats = [Positions() for _ in range(max_rows)]  # p_j of committed positions
        self.length = [0] * max_rows  # real head KV entries: main positions offset .. n-1
        self.offset = [0] * max_rows  # head position = main position - offset (CATCH_UP_WINDOW)

    def admit(self, slots: list[int], prompts: list[torch.Tensor]) -> None:
        for s in slots:
            self.feats[s] = Positions()
            self.length[s] = self.offset[s] = 0

    def target_forward(self, runner, slots, tokens, starts, logits_to_keep: int, trees=None) -> torch.Tensor:
        """The target pass, keeping the head's feature ``p`` of every position it ran (of a
        token tree: node ``j``'s at position ``starts[b] + 1 + j``, its slot in the pass)."""
        out = runner.forward(slots, tokens, starts, logits_to_keep=logits_to_keep, trees=trees,
                             output_hidden_states=self.feature_layers)
        with torch.no_grad():
            p = self.head.project(out.hidden_states)
        store_hidden(self.feats, slots, tokens, starts, p)
        return out.logits

    def move(self, slot: int, src: list[int], dst: list[int]) -> None:
        """A tree step accepted a path off its first branch: the features of the target
        positions ``src`` (the path's nodes in the pass) now belong at ``dst``."""
        self.feats[slot].move(src, dst)

    def rollback(self, slot: int, valid_length: int) -> None:
        self.feats[slot].crop(valid_length)
        self.length[slot] = max(0, min(self.length[slot], valid_length - 1))
        if self.length[slot] < self.offset[slot]:  # rolled back past the head's window: it restarts
            self.length[slot] = self.offset[slot] = 0
        # older features are never read again: a catch-up reads at most the window before the end
        self.feats[slot].drop_before(max(self.length[slot], valid_length - CATCH_UP_WINDOW - 2))

    def reserve(self, length: int) -> None:
        self.runner.cache.reserve(length)

    # ---- drafting
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        drafting = Drafting(requests)
        rows = rows_with_state(requests, self.feats)
        if not rows:
            return drafting.drafts()
        # draft position 1: catch up main positions n .. L-2 (real features, committed tokens)
        reqs = [requests[i] for i in rows]
        slots, feats, ids, starts = [], [], [], []
        for r in reqs:
            L, n, f = r.sequence.shape[1], self.length[r.slot], self.feats[r.slot]
            if n < f.start or L - 1 - n > CATCH_UP_WINDOW:  # restart the head on the latest positions
                n = max(L - 1 - CATCH_UP_WINDOW, f.start, 0)
                self.offset[r.slot] = n
            slots.append(r.slot)
            feats.append(f.get(n, L - 1))
            ids.append(r.sequence[0, n + 1 : L])
            starts.append(n - self.offset[r.slot])
        g = self._pass(slots, feats, ids, starts)[:, -1]  # (b, H): main position L-2 of every row
        for r in reqs:
            self.length[r.slot] = r.sequence.shape[1] - 1
            self.feats[r.slot].drop_before(self.length[r.slot])
        leaves: dict[int, list[tuple[int, int, int]]] = {}  # request -> (rank, position, token): tree leaves
        chosen = self._choose(g, rows, reqs, drafting, leaves)
        # draft positions 2 .. k: the head chained on its own output (speculative entries)
        position = 1
        while True:
            position += 1
            keep = [j for j, r in enumerate(reqs) if r.k >= position]
            if not keep:
                break
            rows, reqs = [rows[j] for j in keep], [reqs[j] for j in keep]
            g, chosen = g[keep], chosen[keep]
            starts = [r.sequence.shape[1] - 3 + position - self.offset[r.slot] for r in reqs]
            g = self._pass([r.slot for r in reqs], list(g.unsqueeze(1)), list(chosen.view(-1, 1)), starts)[:, -1]
            chosen = self._choose(g, rows, reqs, drafting, leaves)
        drafts = drafting.drafts()
        for i, extra in leaves.items():
            drafts[i] = with_leaves(drafts[i], extra)
        return drafts

    def _choose(self, g: torch.Tensor, rows: list[int], reqs: list[DraftRequest], drafting: Drafting,
                leaves: dict[int, list[tuple[int, int, int]]]) -> torch.Tensor:
        """Each row's next draft token from the head's output ``g`` ``(b, H)``; appended to
        ``drafting``; returns ``(b,)`` int64 target ids.  A row asked for a tree
        (``candidates = c > 1``: greedy, no processors) adds the head's next ``c - 1``
        likeliest tokens at this position to ``leaves``."""
        logits = self.head.logits(g)  # (b, N)
        if not any(r.shaper.active or r.shaper.do_sample or r.want_probs for r in reqs):
            chosen = self.vocab_ids[logits.argmax(-1)]
            qs, conf = [None] * len(reqs), top_probability(logits)
            c = max(r.candidates for r in reqs)
            if c > 1:
                top = self.vocab_ids[logits.topk(min(c, logits.shape[-1]), dim=-1).indices].tolist()  # (b, c) target ids
                for j, (i, r) in enumerate(zip(rows, reqs)):
                    if r.candidates > 1:
                        others = [t for t in top[j] if t != int(chosen[j])][: r.candidates - 1]
                        leaves.setdefault(i, []).extend((rank, drafting.count(i), t) for rank, t in enumerate(others))
        else:  # q through the row's logits processors: full width, -inf outside the draft vocabulary
            full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
            full[:, self.vocab_ids] = logits
            full = full.to(reqs[0].sequence.device)
            chosen, qs, conf = draft_tokens(full, reqs, [drafting.prefix(i) for i in rows])
        for j, i in enumerate(rows):
            drafting.append(i, chosen[j : j + 1], qs[j], conf[j])
        return chosen.to(self.device)

    def _pass(self, slots, feats, ids, starts) -> torch.Tensor:
        """The head over ragged rows: row ``b`` feeds main positions ``starts[b] ..`` with
        features ``feats[b]`` ``(q_b, H)`` and tokens ``ids[b]`` ``(q_b,)``; ``(b, Q, H)``."""
        runner = self.runner
        x_p, positions, write, kv_len, mask = runner.inputs(slots, [f.to(self.device) for f in feats], starts)
        x_e, *_ = runner.inputs(slots, [self.head.embed(t) for t in ids], starts)
        z = self.head.combine(x_p, x_e)
        runner.cache.step(slots, write, kv_len)
        small_query = runner.cpu is not None and runner.cpu.small_query_attention
        try:
            with attention_implementation(self.head, small_query):
                return self.head.decode(z, positions, mask, runner.cache)
        finally:
            runner.cache.current = None


# --------------------------------------------------------------------------- the method's entries
def build(inputs) -> EagleProposer:
    """The method's factory (:class:`~pipeline.engine.proposers.base.ProposerInputs`):
    ``drafter`` is a loaded :class:`DraftHead` or its folder.

    Raises:
        ValueError: no draft head, a causal LM in its place, or a head that does not fit the target.
    """
    head = inputs.drafter
    if head is None:
        raise ValueError("method 'eagle' needs a draft head (drafter=: a DraftHead or its folder, models.drafter)")
    if isinstance(head, (str, os.PathLike)):
        head = load_draft_head(str(head), inputs.target)
    if not isinstance(head, DraftHead):
        raise ValueError(f"method 'eagle' drafts with a draft head (DraftHead, load_draft_head); got "
                         f"{type(head).__name__} (a causal LM drafts with method 'draft_model')")
    return EagleProposer(inputs.target, head, Params.of(inputs.spec).draft_vocab_size)


def check_drafter(path: str, target_config) -> DraftHeadConfig:
    """The driver's check of ``models.drafter`` (no weights read): a draft-head folder whose
    sizes fit the target's config; returns its :class:`DraftHeadConfig`.

    Raises:
        ValueError: not a draft-head folder, or a head for another target (saying what differs:
            :func:`pipeline.engine.draft_head.check_fit`, the engine's own check).
    """
    if not is_draft_head(path):
        raise ValueError(f"method 'eagle' drafts with a draft head folder (config.json with model_type {MODEL_TYPE!r} "
                         f"and {WEIGHTS_NAME}, e.g. models/smollm2-135m-eagle); {path!r} is not one")
    config = read_draft_head_config(path)
    check_fit(config, target_config)
    return config


def load_drafter(path: str, target) -> DraftHead:
    """``models.drafter`` loaded onto the loaded target (:func:`load_draft_head`)."""
    return load_draft_head(path, target)


def tune_candidate(settings, models) -> dict | None:
    """The tuner tries it when the loaded drafter is a draft head."""
    return {} if isinstance(models.drafter, DraftHead) else None
