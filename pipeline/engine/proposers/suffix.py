"""Suffix decoding: draft the continuation seen most often after the text's latest tokens,
in the row's own text and in the outputs the engine completed earlier.

Follows SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975), vLLM's method ``suffix``
(through Arctic Inference), with vLLM's option names:

- **a suffix tree per row** over its prompt and its output so far: a trie of every
  substring of at most ``max_tree_depth`` tokens (a suffix tree of bounded depth), each
  node counting the substring's occurrences.  It indexes committed tokens only, so a
  verification never has to be undone in it;
- **a job-wide tree** per proposer (per engine, so per actor) over the outputs of the rows
  completed earlier (each with the last ``max_tree_depth - 1`` tokens of its prompt, so an
  answer's first tokens are predicted from the prompt's end, which a chat template makes
  the same in every row).  It holds the latest ``max_cached_requests`` outputs: the oldest
  is evicted (its counts taken out) when a new one comes, so its size is bounded by
  ``max_cached_requests * (longest output + max_tree_depth) * max_tree_depth`` nodes;
- **proposals by frequency**: the pattern is the text's last ``m`` tokens for every match
  length ``m`` the tree has seen followed by something; from the pattern's node the draft
  follows the most frequent child, multiplying the estimated probabilities
  ``count(child) / count(continued node)`` and stopping once the product falls below
  ``min_token_prob``; the draft length grows with the match, up to
  ``floor(max_spec_factor * m)`` tokens (and ``k``).  Of the candidates of both trees the
  draft with the highest score (the sum of the products: its expected accepted tokens)
  wins, the longer match on a tie.

Sources (:attr:`Draft.source`): each linear draft comes with the proposer's other candidates
as :attr:`Draft.alternatives`, each with its confidence per token (the frequency above):
the row's tree (``"prompt"``), the job-wide tree (``"pool"``), and prompt lookup's copy of
what followed the first earlier occurrence of the text's last n-gram (up to
:data:`PROMPT_NGRAM` tokens; ``"prompt"``, its confidence how often that n-gram was followed
so: :func:`~pipeline.engine.proposers.prompt_lookup.lookup_with_confidence`).  The engine's
draft-length controller verifies the one with the most expected accepted tokens
(:mod:`pipeline.engine.draft_control`); with a fixed draft length the primary (the higher
score of the two trees, as above) is verified.  On held-out news articles the copy and the
row's tree each win where the other misses, and the pool of 31 other outputs drafts far
worse (accepted tokens per step at ``k = 4``, SmolLM2 greedy outputs of XSum 200-231: the
choice by calibrated confidence 1.09, prompt lookup alone 0.99, the primary 0.96).

Deterministic: a draft is a function of the committed text and the trees, never of a
random draw, so ``q`` is one-hot (``Draft.probs`` is ``None``) and verification is exact:
greedy output equals plain greedy output and sampled output follows the target's law,
whatever the trees hold and whatever order the rows came in.  The trees change which
tokens are drafted, never which tokens are emitted.

Token trees (``num_candidates = c > 1``, greedy rows): the linear draft above is the first
branch; the other branches are the most frequent other continuations of the longest
continued match, in the row's tree and the job-wide one (:meth:`SuffixProposer.branches`),
each followed greedily for up to ``k`` tokens, merged into one trie of at most ``c``
branches that the target verifies in one pass (SpecInfer's token-tree verification, as
SuffixDecoding's speculation trees).
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Sequence

import torch

from ..methods import int_at_least, MethodParams, number_in, param, Rule
from .base import Draft, DraftRequest, empty_draft, tree_from_branches
from .prompt_lookup import lookup_with_confidence

#: vLLM's defaults of the four options (``SpeculativeConfig.suffix_decoding_*``)
DEFAULT_MAX_TREE_DEPTH = 24
DEFAULT_MAX_CACHED_REQUESTS = 10_000
DEFAULT_MAX_SPEC_FACTOR = 1.0
DEFAULT_MIN_TOKEN_PROB = 0.1
#: the longest n-gram of the row's text matched for the prompt-lookup source (its copy of what
#: followed the n-gram's first occurrence, as prompt lookup drafts)
PROMPT_NGRAM = 3


class _Node:
    """One substring: ``count`` occurrences, ``cont`` of them followed by a child's token
    (the sum of the children's counts), and the child seen most often (``best``; ``None``
    when it must be searched again after an eviction)."""

    __slots__ = ("children", "count", "cont", "best")

    def __init__(self):
        self.children: dict[int, _Node] = {}
        self.count = 0
        self.cont = 0
        self.best: int | None = None

    def best_child(self) -> tuple[int, "_Node"] | None:
        if not self.children:
            return None
        if self.best is None or self.best not in self.children:
            # the first of the most frequent (dicts keep insertion order: deterministic)
            self.best = max(self.children, key=lambda t: self.children[t].count)
        return self.best, self.children[self.best]


class SuffixTree:
    """Counts of every substring of at most ``max_depth`` tokens of the documents it holds
    (substrings never cross documents).

    A document grows token by token (:meth:`extend`, ``O(max_depth)`` per token) or comes
    whole (:meth:`add`), and can be taken out again (:meth:`remove`).  :attr:`nodes` is the
    number of distinct substrings held (the tree's memory, in nodes).
    """

    def __init__(self, max_depth: int):
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2 (a match and a token to draft), got {max_depth}")
        self.max_depth = max_depth
        self.root = _Node()
        self.nodes = 0

    # ------------------------------------------------------------------ building
    def _inc(self, node: _Node, token: int) -> _Node:
        child = node.children.get(token)
        if child is None:
            child = node.children[token] = _Node()
            self.nodes += 1
        child.count += 1
        node.cont += 1
        best = node.best
        if best is not None and best != token and node.children[best].count < child.count:
            node.best = token
        elif best is None and len(node.children) == 1:
            node.best = token
        return child

    def extend(self, active: list[tuple[_Node, int]], tokens: Iterable[int]) -> list[tuple[_Node, int]]:
        """Append ``tokens`` to the document whose open substrings are ``active`` (the nodes,
        with their depths, of the document's suffixes shorter than ``max_depth``; ``[]`` for
        a new document); returns the new open substrings."""
        root = (self.root, 0)
        for t in tokens:
            grown = [root]
            for node, depth in active or [root]:
                child = self._inc(node, int(t))
                if depth + 1 < self.max_depth:
                    grown.append((child, depth + 1))
            active = grown
        return active

    def add(self, tokens: Sequence[int]) -> None:
        """Add one whole document."""
        self.extend([], tokens)

    def remove(self, tokens: Sequence[int]) -> None:
        """Take out a document :meth:`add` put in (its every substring's occurrences)."""
        tokens = [int(t) for t in tokens]
        for s in range(len(tokens)):
            node = self.root
            for t in tokens[s : s + self.max_depth]:
                child = node.children[t]
                child.count -= 1
                node.cont -= 1
                if child.count == 0:
                    del node.children[t]
                    self.nodes -= self._size(child)
                    if node.best == t:
                        node.best = None
                    break
                if node.best == t:
                    node.best = None  # it may no longer be the most frequent
                node = child

    @staticmethod
    def _size(node: _Node) -> int:
        n, stack = 0, [node]
        while stack:
            x = stack.pop()
            n += 1
            stack.extend(x.children.values())
        return n

    # ------------------------------------------------------------------ drafting
    def node_of(self, pattern: Sequence[int]) -> _Node | None:
        node = self.root
        for t in pattern:
            node = node.children.get(int(t))
            if node is None:
                return None
        return node

    def speculate(self, context: Sequence[int], k: int, max_spec_factor: float, min_token_prob: float
                  ) -> "Speculation":
        """The best draft continuing ``context`` (its last tokens are the pattern).

        Returns:
            A :class:`Speculation`: up to ``k`` tokens, their score (the sum of the estimated
            probabilities that the draft's first ``j`` tokens are right, for every ``j``),
            the length of the pattern they continue and each token's estimated probability
            given the tokens before it (``count(child) / count(continued node)``); empty,
            with score 0 and match length 0, when no suffix of ``context`` was ever
            followed by a token.
        """
        best = Speculation([], 0.0, 0, [])
        n = len(context)
        # If the last m tokens were never followed by a token, no longer suffix was either
        # (it contains them), so match lengths are tried upwards until the first miss.
        for m in range(1, min(self.max_depth - 1, n) + 1):
            node = self.node_of(context[n - m :])
            if node is None or not node.cont:
                break
            limit = min(k, int(m * max_spec_factor + 1e-9), self.max_depth - m)
            tokens, probs, score, prob = [], [], 0.0, 1.0
            while len(tokens) < limit and node.cont:
                token, child = node.best_child()
                step = child.count / node.cont
                prob *= step
                if prob < min_token_prob:
                    break
                tokens.append(token)
                probs.append(step)
                score += prob
                node = child
            if tokens and score >= best.score:
                best = Speculation(tokens, score, m, probs)
        return best

    def continuations(self, context: Sequence[int], width: int, depth: int) -> list[tuple[list[int], float]]:
        """The ``width`` most frequent continuations of the longest continued suffix of
        ``context``, each followed greedily for up to ``depth`` tokens, with the estimated
        probability of its first token: branches for a token tree (the most frequent
        first; the first is the greedy draft's path)."""
        n = len(context)
        node = None
        for m in range(min(self.max_depth - 1, n), 0, -1):
            node = self.node_of(context[n - m :])
            if node is not None and node.cont:
                break
            node = None
        if node is None:
            return []
        first = sorted(node.children.items(), key=lambda kv: -kv[1].count)[:width]
        out = []
        for token, child in first:
            path, x = [token], child
            while len(path) < depth and x.cont:
                t, x = x.best_child()
                path.append(t)
            out.append((path, child.count / node.cont))
        return out


class Speculation(NamedTuple):
    """A suffix tree's draft (:meth:`SuffixTree.speculate`)."""

    tokens: list[int]
    score: float
    match_length: int
    probs: list[float]


@dataclass
class _Row:
    tree: SuffixTree
    active: list
    indexed: int  # tokens of the row's sequence in its tree
    prompt_len: int
    tokens: list[int]  # the row's committed tokens seen so far


class SuffixProposer:
    """Suffix decoding for every row in flight (see the module docstring).

    Args:
        max_tree_depth: the longest substring the trees count (match + draft); ``>= 2``.
        max_cached_requests: completed outputs the job-wide tree keeps (0: no job-wide tree).
        max_spec_factor: a match of ``m`` tokens drafts at most ``floor(max_spec_factor * m)``.
        min_token_prob: a draft stops before the token whose estimated probability of being
            reached (the product along the draft) falls below this.
    """

    def __init__(self, max_tree_depth: int = DEFAULT_MAX_TREE_DEPTH,
                 max_cached_requests: int = DEFAULT_MAX_CACHED_REQUESTS,
                 max_spec_factor: float = DEFAULT_MAX_SPEC_FACTOR, min_token_prob: float = DEFAULT_MIN_TOKEN_PROB):
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.global_tree = SuffixTree(max_tree_depth)
        self.cached: deque[list[int]] = deque()  # the documents in the job-wide tree, oldest first
        self.rows: dict[int, _Row] = {}
        #: drafts taken from each tree (a test's and a benchmark's view of what the job-wide tree buys)
        self.drafts_from = {"row": 0, "job": 0}

    # ------------------------------------------------------------------ protocol
    def models(self) -> list:
        return []

    def bind(self, max_rows: int, target_runner) -> None:
        pass

    def admit(self, slots: list[int], prompts: list[torch.Tensor]) -> None:
        for slot, prompt in zip(slots, prompts):
            old = self.rows.pop(slot, None)
            if old is not None:  # its row left without finish() (a caller driving the steps itself)
                self._cache(old)
            ids = prompt.view(-1).tolist()
            tree = SuffixTree(self.max_tree_depth)
            self.rows[slot] = _Row(tree, tree.extend([], ids), len(ids), len(ids), ids)

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        out = []
        for r in requests:
            row = self.rows.get(r.slot)
            seq = r.sequence[0].tolist()
            if row is None:  # not admitted through admit(): start from this text
                tree = SuffixTree(self.max_tree_depth)
                row = self.rows[r.slot] = _Row(tree, [], 0, len(seq), [])
            if len(seq) > row.indexed:
                row.active = row.tree.extend(row.active, seq[row.indexed :])
                row.indexed = len(seq)
            row.tokens = seq
            context = seq[-(self.max_tree_depth - 1):]
            args = (r.k, self.max_spec_factor, self.min_token_prob)
            local = row.tree.speculate(context, *args)
            job = self.global_tree.speculate(context, *args) if self.cached else Speculation([], 0.0, 0, [])
            tokens, source = (local.tokens, "row") if local.score >= job.score else (job.tokens, "job")
            if tokens:
                self.drafts_from[source] += 1
            device = r.sequence.device
            if r.candidates > 1:  # a token tree: the linear draft first, then the trees' other branches
                paths = [tokens] if tokens else []
                for path, _ in self.branches(seq, r.slot, r.candidates, r.k):
                    if len(paths) >= r.candidates:
                        break
                    if not any(q[: len(path)] == path for q in paths):
                        paths.append(path)
                out.append(tree_from_branches(paths, device, "prompt") if paths else empty_draft(device))
                continue
            drafts = [_draft(local, "prompt", device), _draft(job, "pool", device)]
            copy, confidence = lookup_with_confidence(r.sequence[0], r.k, PROMPT_NGRAM)
            drafts.append(Draft(copy, confidence=confidence, source="prompt"))
            primary = drafts[0] if source == "row" else drafts[1]
            others = tuple(d for d in drafts if d is not primary and len(d) and
                           not torch.equal(d.tokens, primary.tokens[: len(d)]))
            out.append(dataclasses.replace(primary, alternatives=others))
        return out

    def rollback(self, slot: int, valid_length: int) -> None:
        pass  # the trees index committed tokens only

    def reserve(self, length: int) -> None:
        pass  # no cache

    def finish(self, slot: int, generated: Sequence[int]) -> None:
        """The row in ``slot`` finished with output ``generated``: its output joins the
        job-wide tree (the oldest cached output leaves it beyond ``max_cached_requests``)."""
        row = self.rows.pop(slot, None)
        if row is not None:
            row.tokens = row.tokens[: row.prompt_len] + [int(t) for t in generated]
            self._cache(row)

    # ------------------------------------------------------------------ the job-wide tree
    def reset_learning(self) -> None:
        """Empty the job-wide tree (the outputs of earlier rows) and the draft counters; the
        rows in flight keep their own trees (:meth:`StepEngine.reset_learning`)."""
        self.global_tree = SuffixTree(self.max_tree_depth)
        self.cached.clear()
        self.drafts_from = {"row": 0, "job": 0}

    def seed_pool(self, documents: Iterable[Sequence[int]]) -> int:
        """Add earlier outputs to the job-wide tree, as if rows with these outputs had finished
        (a previous run's outputs: :mod:`pipeline.reuse`), after :meth:`reset_learning`.  Each
        document is an output's token ids (optionally preceded by its prompt's tail); the
        bound ``max_cached_requests`` holds (the oldest leave first).  Lossless whatever they
        hold: they change which tokens are drafted, never which are emitted.

        Returns:
            How many documents were added (empty ones, or all with no job-wide tree, are not).
        """
        return sum(self._remember([int(t) for t in doc]) for doc in documents)

    def _cache(self, row: _Row) -> None:
        output = row.tokens[row.prompt_len :]
        if not output:
            return
        tail = row.tokens[max(0, row.prompt_len - (self.max_tree_depth - 1)) : row.prompt_len]
        self._remember(tail + output)

    def _remember(self, doc: list[int]) -> bool:
        """Put ``doc`` in the job-wide tree, evicting beyond ``max_cached_requests``."""
        if not doc or self.max_cached_requests <= 0:
            return False
        self.global_tree.add(doc)
        self.cached.append(doc)
        while len(self.cached) > self.max_cached_requests:
            self.global_tree.remove(self.cached.popleft())
        return True

    def branches(self, sequence: Sequence[int], slot: int, width: int, depth: int) -> list[tuple[list[int], float]]:
        """Up to ``width`` candidate continuations of ``sequence`` for a token tree, from the
        row's tree and the job-wide one (:meth:`SuffixTree.continuations`), most probable
        first: the other branches of a token tree (``num_candidates > 1``), after the linear
        draft."""
        context = list(sequence)[-(self.max_tree_depth - 1):]
        row = self.rows.get(slot)
        cands = (row.tree.continuations(context, width, depth) if row is not None else []) + \
            self.global_tree.continuations(context, width, depth)
        seen, out = set(), []
        for path, p in sorted(cands, key=lambda c: -c[1]):
            if path[0] not in seen:
                seen.add(path[0])
                out.append((path, p))
        return out[:width]


def _draft(spec: Speculation, source: str, device) -> Draft:
    """A tree's draft as a :class:`Draft` of ``source`` whose confidence is the tree's
    frequency of each token (:attr:`Speculation.probs`)."""
    return Draft(torch.tensor(spec.tokens, dtype=torch.long, device=device),
                 confidence=torch.tensor(spec.probs, dtype=torch.float64), source=source)


@dataclass
class Params(MethodParams):
    """Method ``suffix``'s parameters: vLLM's ``suffix_decoding_*`` options, vLLM's defaults
    where unset (``None``)."""

    suffix_decoding_max_tree_depth: int | None = param(
        None, "method ``suffix``: the longest substring (match plus draft, in tokens) its suffix trees count, >= 2; "
        f"``None``: {DEFAULT_MAX_TREE_DEPTH} (vLLM's default).", int_at_least(2), what="tokens of match plus draft")
    suffix_decoding_max_cached_requests: int | None = param(
        None, "method ``suffix``: completed outputs kept in the engine's job-wide suffix tree (the oldest leaves "
        f"first; 0: no job-wide tree); ``None``: {DEFAULT_MAX_CACHED_REQUESTS} (vLLM's default).", int_at_least(0),
        what="outputs kept")
    suffix_decoding_max_spec_factor: float | None = param(
        None, "method ``suffix``: a match of ``m`` tokens drafts at most ``floor(factor * m)`` tokens (and "
        f"``num_assistant_tokens``), > 0; ``None``: {DEFAULT_MAX_SPEC_FACTOR} (vLLM's default).",
        Rule("a finite number > 0", number_in(0, math.inf, low_open=True, high_open=True).ok))
    suffix_decoding_min_token_prob: float | None = param(
        None, "method ``suffix``: a draft stops before the token whose estimated chance of being reached (the "
        "product of the observed frequencies along the draft) is below this, in [0, 1]; ``None``: "
        f"{DEFAULT_MIN_TOKEN_PROB} (vLLM's default).", number_in(0, 1))

    def resolved(self) -> tuple[int, int, float, float]:
        """``(max_tree_depth, max_cached_requests, max_spec_factor, min_token_prob)``, vLLM's
        defaults where unset: :class:`SuffixProposer`'s arguments."""
        pick = lambda v, d: d if v is None else v
        return (pick(self.suffix_decoding_max_tree_depth, DEFAULT_MAX_TREE_DEPTH),
                pick(self.suffix_decoding_max_cached_requests, DEFAULT_MAX_CACHED_REQUESTS),
                pick(self.suffix_decoding_max_spec_factor, DEFAULT_MAX_SPEC_FACTOR),
                pick(self.suffix_decoding_min_token_prob, DEFAULT_MIN_TOKEN_PROB))

    def pool_size(self) -> int:
        """The job-wide tree's bound: the outputs it keeps (what the nightly reuse seeds it with)."""
        return int(self.resolved()[1])


def build(inputs) -> SuffixProposer:
    """The method's factory (:class:`~pipeline.engine.proposers.base.ProposerInputs`): the
    ``suffix_decoding_*`` settings, vLLM's defaults where unset."""
    return SuffixProposer(*Params.of(inputs.spec).resolved())
