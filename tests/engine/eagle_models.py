"""Tiny draft heads (method ``eagle``) for tiny float64 targets, built from configs (no hub).

:func:`random_head` is a head with random weights (its drafts are mostly rejected);
:func:`trained_head` trains one for a few steps on the target's own greedy continuations
(training-time test over 3 draft positions), so its drafts are mostly accepted and the
lossless tests exercise long accepted blocks too.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from pipeline.engine.draft_head import DraftHead, DraftHeadConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: train/
from train.draft_head_training import unrolled  # noqa: E402

from tiny_models import build, prompt_of


def tiny_target(seed: int = 0, vocab: int = 96, **kw):
    return build("llama", seed=seed, vocab=vocab, **kw)


def random_head(target, feature_layers=None, draft_vocab=None, tie: bool = False, seed: int = 0) -> DraftHead:
    """A random float64 head for ``target``; ``draft_vocab``: its ids (default: all)."""
    vocab = target.config.vocab_size
    ids = torch.arange(vocab) if draft_vocab is None else torch.as_tensor(draft_vocab, dtype=torch.long)
    cfg = DraftHeadConfig.for_target(target, feature_layers=feature_layers, draft_vocab_size=int(ids.numel()),
                                     tie_lm_head=tie)
    torch.manual_seed(seed)
    head = DraftHead(cfg)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    head.set_draft_vocab(ids)
    return head.double().eval().attach(target)


@torch.no_grad()
def greedy_sequences(target, prompts: list[torch.Tensor], new: int = 40) -> list[torch.Tensor]:
    """Each ``(1, P)`` prompt followed by the target's greedy continuation of ``new`` tokens."""
    return [target.generate(p, max_new_tokens=new, do_sample=False, min_new_tokens=new) for p in prompts]


def head_inputs(head: DraftHead, target, seqs: torch.Tensor):
    """``(p, e, labels)`` for training: features of positions ``0 .. T-1``, embeddings of
    ``x_1 .. x_T`` and the target's argmax at positions ``1 .. T`` (what the head at ``j``
    predicts) as draft-vocabulary indices (-1: outside it)."""
    with torch.no_grad():
        out = target(seqs, output_hidden_states=True)
        p = head.project(out.hidden_states)[:, :-1]
        e = head.embed(seqs[:, 1:])
        argmax = out.logits[:, 1:].argmax(-1)
    index = torch.full((target.config.vocab_size,), -1, dtype=torch.long)
    index[head.draft_vocab] = torch.arange(head.draft_vocab.numel())
    return p, e, index[argmax]


def trained_head(target, prompts: list[torch.Tensor], steps: int = 120, unroll: int = 3, feature_layers=None,
                 draft_vocab=None, tie: bool = False, seed: int = 0, lr: float = 1e-2, new: int = 40) -> DraftHead:
    """A head trained ``steps`` Adam steps (cross-entropy against the target's argmax at
    every draft position ``1 .. unroll``) on the target's own greedy continuations of
    ``prompts`` (the tests' own prompts: a head that knows them drafts long accepted blocks)."""
    head = random_head(target, feature_layers, draft_vocab, tie, seed)
    seqs = greedy_sequences(target, prompts, new)
    parts = [head_inputs(head, target, s) for s in seqs]
    T = max(x[0].shape[1] for x in parts)

    def pad(t, value):
        return torch.nn.functional.pad(t, (0, 0, 0, T - t.shape[1]) if t.dim() == 3 else (0, T - t.shape[1]), value=value)

    p = torch.cat([pad(x[0], 0.0) for x in parts])
    e = torch.cat([pad(x[1], 0.0) for x in parts])
    labels = torch.cat([pad(x[2], -1) for x in parts])
    params = [q for q in head.parameters() if q.requires_grad]
    opt = torch.optim.Adam(params, lr=lr)
    head.train()
    for _ in range(steps):
        outs = unrolled(head, p, e, unroll)  # right padding: no real position attends to it
        loss = 0.0
        for s, g in enumerate(outs, start=1):
            logits = head.logits(g[:, s - 1 :])
            loss = loss + torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), labels[:, s - 1 :].reshape(-1), ignore_index=-1)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval()
