"""The proposer protocol: what every drafting method implements.

A proposer drafts for many rows at once.  Each row lives in a *slot* (its row of the
engine's caches) from admission until it finishes; the proposer keeps whatever per-slot
state it needs (a drafter's KV cache length, hidden states of the target) and is told:

- :meth:`Proposer.admit` -- rows entered these slots with these prompts (after the
  target's prefill of ``prompt[:-1]``); forget the slots' old state;
- :meth:`Proposer.propose` -- draft up to ``k`` tokens for each of these rows;
- :meth:`Proposer.rollback` -- after verification, only the first ``valid_length`` tokens
  of a row (committed sequence) are still valid;
- :meth:`Proposer.reserve` -- rows of up to this many positions are coming (size caches once).

It never verifies: acceptance lives in :mod:`pipeline.engine.verify`, the loop in
:mod:`pipeline.engine.loop`.

Foreign drafts.  The step may verify a draft that is not the proposer's own: the
draft-length controller picks, per row, the draft with the most expected accepted tokens
among the proposer's primary draft, its alternatives and the row's reference
(:mod:`pipeline.engine.draft_control`, :mod:`pipeline.engine.reference`), and cuts it.  So
any state a proposer computed *while drafting* (a drafter's cache entries of its draft
tokens, hidden states of the draft positions, an MTP layer's entries fed its own drafts)
is valid only for the positions where the committed (or verified) tokens are the tokens
it was computed on.  Each proposer checks it, by token ids and positions
(:class:`DraftedTokens`), and recomputes or drops the rest; the loop's ``rollback`` says
only how many tokens are committed.

Token trees (optional; SpecInfer, Miao et al. 2023, arXiv 2305.09781; Medusa; EAGLE-2).  A
proposer whose method declares ``proposes_trees`` (its
:class:`~pipeline.engine.methods.MethodSpec`) may answer a request with
``DraftRequest.candidates > 1`` by a *tree*: :attr:`Draft.parents` gives each node's parent
(``-1``: the row's last committed token, the root), nodes in topological order (a parent
before its children).  Node ``0`` and each first child after it form the draft's *first
branch*: the linear draft the proposer would have made (a proposer that keeps per-row state,
such as a drafter's cache, keeps it along the first branch only).  The loop verifies the
tree in one target pass and accepts its longest verified path; :meth:`Proposer.rollback`
then counts the whole accepted path, and a proposer whose state followed the first branch
finds by its tokens where the path left it (:class:`DraftedTokens`).  Trees are greedy only:
a request for a sampled row, or one with logits processors, always has ``candidates == 1``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

import torch

from ..sampling import LogitsShaper

#: a proposer that keeps per-row state (a draft head's cache, a drafter's) and has not drafted
#: for a row for a while catches up on at most this many of the row's latest positions (of its
#: own sequence: the target's positions for a draft head, the drafter's tokens for universal);
#: its cache restarts there, positions shifted.  Drafts only: the target verifies as always.
#: A catch-up over a whole prompt is a prefill by the proposer, paid at every probe of the
#: draft-length controller even when drafting does not pay.
CATCH_UP_WINDOW = 64


@dataclass
class ProposerInputs:
    """Everything a method's ``build`` (:attr:`pipeline.engine.methods.MethodSpec.build`)
    may need to build a proposer for one engine."""

    target: Any
    spec: Any  # SpeculationSettings
    drafter: Any = None
    tokenizer: Any = None
    drafter_tokenizer: Any = None


#: where a draft's tokens come from (:attr:`Draft.source`): the row's own text (prompt and
#: output so far), the outputs of earlier rows (a job-wide pool), a per-row reference text,
#: a model, the row's grammar (a run its response_format forces, :mod:`pipeline.engine.grammar`);
#: the statistics count accepted tokens by source (``RowStats.accepted_from_*``)
SOURCES = ("prompt", "pool", "reference", "drafter", "grammar")


@dataclass
class Draft:
    """Tokens proposed for one row for one verification step.

    Attributes:
        tokens: ``(n,)`` int64 draft token ids in the target's vocabulary, ``n <= k``
            (``n == 0``: nothing to propose, the step is an ordinary target step).
        probs: ``(n, V_target)`` the exact distribution each draft token was drawn from
            (after the same logits processors as the target), or ``None`` for a
            deterministic proposer, whose distribution is one-hot on the token.
        parents: a token tree's structure (see the module docstring): ``parents[j]`` is
            the index of node ``j``'s parent (``< j``), ``-1`` for a child of the root;
            ``None`` for a linear draft (node ``j``'s parent is ``j - 1``).  Sibling tokens
            differ.  A tree's depth is at most the request's ``k``; its ``probs`` is ``None``.
        confidence: ``(n,)`` float64 on the CPU, or ``None``: the proposer's own estimate,
            per token, that the token is accepted given that the tokens before it were (a
            conditional probability in [0, 1], uncalibrated: the draft-length controller
            calibrates it against measured acceptance, :mod:`pipeline.engine.draft_control`).
            A deterministic proposer may use anything it knows (suffix: the frequency of the
            continuation in its tree; prompt lookup: how often the matched n-gram was followed
            by it); a proposer that *samples* its tokens must give only what it knew before
            drawing token ``j`` (the top probability of ``q_j``, never ``q_j(x_j)``), so that
            a cut by confidence is a stopping rule and verification stays exact.  ``None``:
            the controller falls back to measured acceptance by position (trees: always).
        source: where the draft comes from, one of :data:`SOURCES` (``"prompt"``: the row's
            own text, prompt and output so far; ``"pool"``: the outputs of earlier rows;
            ``"reference"``: a per-row reference text; ``"drafter"``: a model); its accepted
            tokens are counted by source in the row's statistics.
        alternatives: drafts of the same row from the proposer's other sources (linear,
            each with its own ``source``), for the controller to pick from by expected
            accepted tokens; the proposer's own state (a drafter's cache) follows this draft,
            the *primary*, whichever is verified, and holds only where the verified tokens
            are its own (see "Foreign drafts" in the module docstring).
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None = None
    parents: list[int] | None = None
    confidence: torch.Tensor | None = None
    source: str = "drafter"
    alternatives: tuple["Draft", ...] = ()

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def is_tree(self) -> bool:
        """Whether some node is not the child of the node before it (a branched tree)."""
        return self.parents is not None and any(p != j - 1 for j, p in enumerate(self.parents))

    def depths(self) -> list[int]:
        """Per node its depth (1: a child of the root): its draft position."""
        if self.parents is None:
            return list(range(1, len(self) + 1))
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def first_branch(self) -> list[int]:
        """The nodes of the first branch, root to leaf: node 0, then each node's first child."""
        if self.parents is None:
            return list(range(len(self)))
        first_child: dict[int, int] = {}
        for j, p in enumerate(self.parents):
            first_child.setdefault(p, j)
        out, cur = [], -1
        while cur in first_child:
            cur = first_child[cur]
            out.append(cur)
        return out

    def truncated(self, n: int) -> "Draft":
        """The draft's first ``n`` tokens (and their distributions); of a tree, its first ``n``
        nodes (a tree again: parents come first)."""
        parents = None if self.parents is None else self.parents[:n]
        return Draft(self.tokens[:n], None if self.probs is None else self.probs[:n], parents,
                     None if self.confidence is None else self.confidence[:n], self.source)

    def pruned(self, depth: int, nodes: int) -> "Draft":
        """A tree cut to its nodes of depth ``<= depth`` and then to its first ``nodes`` of them
        (the first branch's nodes come first when the proposer orders them so); a linear draft
        cut to ``min(depth, nodes)`` tokens."""
        if self.parents is None:
            return self.truncated(min(depth, nodes))
        keep = [j for j, d in enumerate(self.depths()) if d <= depth][:nodes]
        index = {j: i for i, j in enumerate(keep)}
        parents = [-1 if self.parents[j] < 0 else index[self.parents[j]] for j in keep]
        idx = torch.tensor(keep, dtype=torch.long, device=self.tokens.device)
        conf = None if self.confidence is None else self.confidence.index_select(0, idx.cpu())
        return Draft(self.tokens.index_select(0, idx), None, parents, conf, self.source)


@dataclass
class DraftRequest:
    """What the loop asks of a proposer for one row in one step.

    Attributes:
        slot: the row's slot (its row in every cache of the engine).
        sequence: ``(1, seq_len)`` int64 committed tokens (prompt + generated), on the
            target's device.
        k: the most tokens to draft (>= 1; already capped by the budget, the context and
            the load).
        shaper: the row's logits processors (shared with the target).
        generator: the row's seeded ``torch.Generator`` (used only when sampling).
        want_probs: whether the verifier needs ``Draft.probs`` (sampling or ensemble).
        candidates: the most branches a token tree may have (1: a linear draft; see the
            module docstring); only a method that declares ``proposes_trees`` is asked for more.
    """

    slot: int
    sequence: torch.Tensor
    k: int
    shaper: LogitsShaper
    generator: torch.Generator | None
    want_probs: bool
    candidates: int = 1


@runtime_checkable
class Proposer(Protocol):
    """Protocol of a drafting method (one implementation per file in this package).  Its
    capabilities (token trees, a target hook, learning from outputs, an adaptive draft length,
    a row limit) are declared on its method's :class:`~pipeline.engine.methods.MethodSpec`."""

    def models(self) -> list[tuple[Any, str]]:
        """Every model it runs through a runner of its own, each with its role (``"drafter"``,
        ``"draft head"`` ...), in the order they are to be prepared: the engine prepares each
        once for the CPU (:func:`pipeline.engine.cpu.prepare`), as it prepares the target.
        Empty for a proposer that runs no model, or only the target's own layers."""

    def bind(self, max_rows: int, target_runner) -> None:
        """Allocate per-slot state for ``max_rows`` slots; ``target_runner`` is the target's
        :class:`pipeline.engine.runner.ModelRunner` (a proposer drafting with the target's
        own layers shares its cache)."""

    def admit(self, slots: list[int], prompts: list[torch.Tensor]) -> None:
        """Rows with these ``(1, P)`` prompts now occupy ``slots``; reset their state."""

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        """Draft up to ``request.k`` tokens continuing each ``request.sequence``."""

    def rollback(self, slot: int, valid_length: int) -> None:
        """After a verification: the row's first ``valid_length`` tokens are committed and
        were run by the target's pass (the row's committed tokens but the newest, the
        target's token).  The verified draft may not be the proposer's own (see "Foreign
        drafts" in the module docstring), nor its first branch: state the proposer computed
        on its own draft tokens stays valid only where those tokens are the committed ones,
        which the proposer checks itself (:class:`DraftedTokens`)."""

    def reserve(self, length: int) -> None:
        """Rows of up to ``length`` positions (prompt, budget and the widest draft) are coming:
        a proposer with caches of its own sizes them once now, rather than growing them
        pass by pass (one that shares the target's cache, or keeps none, does nothing)."""


def tree_from_branches(branches: list[list[int]], device, source: str = "drafter") -> Draft:
    """A token tree (a trie) from candidate continuations, the first branch first: shared
    prefixes become one node, nodes are numbered branch by branch (so the first branch's
    nodes are ``0 .. len(branches[0]) - 1`` and :meth:`Draft.truncated` keeps it first).
    A single branch gives a linear draft (``parents`` ``None``)."""
    tokens: list[int] = []
    parents: list[int] = []
    children: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    for branch in branches:
        cur = -1
        for tok in branch:
            node = children.get((cur, tok))
            if node is None:
                node = len(tokens)
                children[(cur, tok)] = node
                tokens.append(tok)
                parents.append(cur)
            cur = node
    draft = Draft(torch.tensor(tokens, dtype=torch.long, device=device), None, parents, source=source)
    return draft if draft.is_tree else Draft(draft.tokens, source=source)


def with_leaves(chain: Draft, leaves: list[tuple[int, int, int]]) -> Draft:
    """A linear draft ``chain`` with side leaves: ``(rank, position, token)`` says that at draft
    position ``position`` (0-based) the proposer's ``rank``-th alternative to the chain's token
    there is ``token``, a sibling of it (a child of the chain's node ``position - 1``, or of
    the root).  The chain stays the first branch (nodes ``0 .. len(chain) - 1``); the leaves
    follow, likeliest first, shallow before deep.  A static top-k expansion as in EAGLE-2 (Li
    et al. 2024, arXiv 2406.16858) and SpecInfer; no leaves: ``chain`` itself."""
    if not leaves:
        return chain
    extra = sorted(leaves)
    tokens = torch.cat([chain.tokens, torch.tensor([t for _, _, t in extra], dtype=torch.long,
                                                   device=chain.tokens.device)])
    parents = list(range(-1, len(chain) - 1)) + [pos - 1 for _, pos, _ in extra]
    return Draft(tokens, None, parents, source=chain.source)


class Finish(Protocol):
    """Hooks of a proposer that learns from finished rows (``suffix``'s job-wide tree), whose
    method declares ``learns_from_outputs``: the engine calls :meth:`finish` once per row that
    leaves its slot (any finish reason), before the slot takes another row,
    :meth:`~pipeline.engine.loop.StepEngine.reset_learning` calls its ``reset_learning``, and
    :meth:`~pipeline.engine.loop.StepEngine.seed_pool` its ``seed_pool``."""

    def finish(self, slot: int, generated: list[int]) -> None:
        """The row in ``slot`` finished; ``generated`` are its output token ids."""

    def reset_learning(self) -> None:
        """Forget what :meth:`finish` taught it (the job-wide pool): rows decoded so far,
        e.g. an engine's warm-up, must not draft for the rows that follow."""

    def seed_pool(self, documents) -> int:
        """Learn from earlier outputs (token-id lists) as if rows with them had finished;
        returns how many it took."""


class TargetForward(Protocol):
    """Optional hook of a proposer that needs more from the target than its logits
    (hidden states for MTP layers and draft heads, the shared cache for early exit).  When a
    proposer has ``target_forward``, the loop runs every target pass (prefill and
    verification) through it instead of :meth:`ModelRunner.forward`.  A proposer that also
    has ``proposes_trees`` and :class:`TreeState`'s ``move`` is passed ``trees`` (as
    :meth:`ModelRunner.forward` takes them); any other is never asked for a tree.
    """

    def target_forward(self, runner, slots: list[int], tokens: list[torch.Tensor], starts: list[int],
                       logits_to_keep: int, trees=None) -> torch.Tensor:
        """Run the target on each row's ``tokens`` (positions from ``starts``); return
        ``(b, logits_to_keep, V)`` logits of the last positions of every row."""


class TreeState(Protocol):
    """Optional hook of a proposer that keeps per-position state from the target's passes
    (``target_forward``: a draft head's features) and drafts token trees.  The target pass
    of a tree step writes node ``j``'s state at position ``L + j`` (its slot in the pass, as
    the target's cache does); when the accepted path leaves the first branch, the loop calls
    :meth:`move` with the moves it makes in the target's cache, and then rolls the proposer
    back to the whole accepted path (as every proposer: what it drafted along its first
    branch, it checks itself)."""

    def move(self, slot: int, src: list[int], dst: list[int]) -> None:
        """The state of positions ``src`` now belongs at ``dst`` (``dst[i] < src[i]``, in
        increasing order), as :meth:`SlotCache.move` moves cache entries."""


class DraftedTokens:
    """Per slot, the token ids a proposer ran its own state on while drafting (from position
    ``start``), so that it can tell which of that state holds for the tokens verified or
    committed there: a draft verified in its place (another source's, or its own cut or
    left by a tree's path) must not reuse it.

    Args:
        rows: slots.
    """

    def __init__(self, rows: int):
        self.start = [0] * rows
        self.ids: list[list[int] | None] = [None] * rows

    def record(self, slot: int, start: int, ids) -> None:
        """The proposer ran ``ids`` (ints, or an int tensor) at positions ``start ..`` of the
        slot's row; appended to what it recorded since :meth:`forget` when contiguous,
        otherwise in its place."""
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else [int(t) for t in ids]
        held = self.ids[slot]
        if held is not None and self.start[slot] + len(held) == start:
            held.extend(ids)
        else:
            self.start[slot], self.ids[slot] = start, ids

    def forget(self, slot: int) -> None:
        self.ids[slot] = None

    def held(self, slot: int) -> tuple[int, list[int]] | None:
        """``(start, ids)`` recorded for the slot, or ``None``."""
        ids = self.ids[slot]
        return None if ids is None else (self.start[slot], ids)

    def agreed(self, slot: int, tokens, start: int) -> int | None:
        """The recorded ids compared with ``tokens`` (ints or an int tensor ``(q,)``) placed at
        positions ``start ..``: the first position from ``max(start, record's start)`` where
        they differ (or where either ends); the recorded state holds before it.  Recorded
        positions before ``start`` are not compared (the caller's committed tokens, which a
        proposer fed as they were).  ``None``: nothing recorded.  A record that starts after
        ``start + q`` agrees nowhere (its start is returned)."""
        held = self.held(slot)
        if held is None:
            return None
        begin, ids = held
        tokens = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        at = max(begin, start)
        if at > start + len(tokens):
            return begin
        n = 0
        for a, b in zip(ids[at - begin:], tokens[at - start:]):
            if a != b:
                break
            n += 1
        return at + n


def top_probability(logits: torch.Tensor) -> list[float]:
    """``max_v softmax(logits)_v`` per row of ``(b, V)`` logits: a drafter's confidence in its
    next token, known before the token is drawn (:attr:`Draft.confidence`)."""
    wide = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    return (wide.amax(-1) - wide.logsumexp(-1)).exp().tolist()


def draft_tokens(
    logits: torch.Tensor, requests: list[DraftRequest], prefixes: list[torch.Tensor], need_q: bool = False
) -> tuple[torch.Tensor, list[torch.Tensor | None], list[float]]:
    """Pick each row's next draft token the way the target would: the row's logits
    processors shape its logits (``prefixes[i]`` ``(1, L_i)`` is the text before it), then
    the token is sampled from ``q = softmax`` with the row's generator when sampling, else
    the argmax.

    Args:
        logits: ``(b, V_target)`` drafter logits, one row per request.

    Returns:
        ``(tokens (b,) int64, [q_i (1, V_target) or None], confidence)``; ``q`` (float32 or
        wider) is given when sampling, when the request wants probs, or when ``need_q``;
        ``confidence[i]`` is the top probability of row ``i``'s (shaped) ``q``, known before
        its token is drawn (:func:`top_probability`).
    """
    b = logits.shape[0]
    if not any(r.shaper.active or r.shaper.do_sample or r.want_probs for r in requests) and not need_q:
        return logits.argmax(-1), [None] * b, top_probability(logits)
    tokens = torch.empty(b, dtype=torch.long, device=logits.device)
    qs: list[torch.Tensor | None] = []
    confidence: list[float] = []
    for i, r in enumerate(requests):
        row = logits[i : i + 1]
        if r.shaper.active:
            row = r.shaper.shape(prefixes[i], row)
        q = torch.softmax(row.float() if row.dtype in (torch.float16, torch.bfloat16) else row, -1)
        confidence.append(float(q.max()))
        if r.shaper.do_sample:
            tokens[i] = torch.multinomial(q, 1, generator=r.generator).view(())
        else:
            tokens[i] = row.argmax(-1).view(())
        qs.append(q if r.shaper.do_sample or r.want_probs or need_q else None)
    return tokens, qs, confidence


class Drafting:
    """The drafts of a step's rows, built position by position.

    ``requests[i]``'s drafted tokens and, when it wants them, their distributions ``q``
    accumulate with :meth:`append`; :meth:`prefix` is the row's text so far (committed
    sequence + its drafted tokens) and :meth:`drafts` the finished :class:`Draft` per row.
    """

    def __init__(self, requests: list[DraftRequest]):
        self.requests = requests
        self.tokens: list[list[torch.Tensor]] = [[] for _ in requests]
        self.probs: list[list[torch.Tensor]] = [[] for _ in requests]
        self.confidence: list[list[float]] = [[] for _ in requests]

    def append(self, i: int, token: torch.Tensor, q: torch.Tensor | None, confidence: float) -> None:
        """Row ``i`` drafted ``token`` ``(1,)`` int64 from ``q`` ``(1, V)``, whose top
        probability is ``confidence`` (:attr:`Draft.confidence`)."""
        self.tokens[i].append(token.to(self.requests[i].sequence.device))
        self.confidence[i].append(confidence)
        if self.requests[i].want_probs:
            self.probs[i].append(q)

    def count(self, i: int) -> int:
        return len(self.tokens[i])

    def prefix(self, i: int) -> torch.Tensor:
        """``(1, L + n)``: row ``i``'s committed tokens and its ``n`` draft tokens so far."""
        seq = self.requests[i].sequence
        if not self.tokens[i]:
            return seq
        return torch.cat([seq, torch.cat(self.tokens[i]).view(1, -1)], dim=1)

    def drafts(self) -> list[Draft]:
        out = []
        for r, tokens, probs, conf in zip(self.requests, self.tokens, self.probs, self.confidence):
            if not tokens:
                out.append(empty_draft(r.sequence.device))
            else:
                out.append(Draft(tokens=torch.cat(tokens), probs=torch.cat(probs, dim=0) if r.want_probs else None,
                                 confidence=torch.tensor(conf, dtype=torch.float64)))
        return out


def empty_draft(device: torch.device | str) -> Draft:
    return Draft(tokens=torch.empty(0, dtype=torch.long, device=device))


class NoState:
    """Mixin for proposers without per-slot state to bind, admit or roll back, and no model."""

    def models(self) -> list[tuple[Any, str]]:
        return []

    def bind(self, max_rows: int, target_runner) -> None:
        pass

    def admit(self, slots: list[int], prompts: list[torch.Tensor]) -> None:
        pass

    def rollback(self, slot: int, valid_length: int) -> None:
        pass

    def reserve(self, length: int) -> None:
        pass
