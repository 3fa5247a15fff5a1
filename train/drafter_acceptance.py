"""Teacher forcing and the held-back acceptance of a draft head, for
:mod:`train.drafter_from_outputs` (``jobs/train_drafter.py``).

One target pass over a row's prompt plus answer (no generation) gives the head's features
and soft labels (:func:`teacher_forced`), as a training record (:func:`train_record`) or a
held-back record (:func:`held_out_record`); :func:`acceptance` measures a head's greedy
drafts against the answer tokens at every block start, per draft length ``k``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: head positions per training window (the end of each row: its answer and the prompt before it)
MAX_LEN = 384
#: the target's top-k log-probabilities a record keeps as soft labels
TOP_K = 8


def teacher_forced(target, ids: list[int], stored: list[int], eos_ids: list[int], start: int = 0, dtype=None):
    """One target pass over ``ids[:-1]`` (no generation): the features at the ``stored``
    hidden-state layers ``(T-1-start, m, H)`` (``dtype``, default bfloat16) and the top-8 log-probabilities of
    positions ``start .. T-2``, as a training record (:func:`train.draft_head_training.record`)
    of ``ids[start:]``; and the target's argmax at each position.  A final EOS takes the one
    of ``eos_ids`` the target ranks highest."""
    import torch

    from train.draft_head_training import topk_logprobs

    with torch.inference_mode():
        x = torch.tensor([ids[:-1]], device=next(target.parameters()).device)
        out = target(input_ids=x, output_hidden_states=True, use_cache=False)
        logits = out.logits[0, start:].float().cpu()
        feats = torch.stack([out.hidden_states[i][0, start:] for i in stored], dim=1).to(dtype or torch.bfloat16).cpu()
    if len(eos_ids) > 1 and ids[-1] in eos_ids:
        ids = ids[:-1] + [max(eos_ids, key=lambda e: float(logits[-1, e]))]
    v, i = topk_logprobs(logits, TOP_K)
    return feats, v, i, logits.argmax(-1), ids[start:]


def stored_layers(head) -> list[int]:
    """The hidden states a record keeps: the head's feature layers and the last (the
    regression target :func:`make_batch` reads)."""
    return sorted(set(head.head_config.feature_layers) | {head.head_config.target_num_hidden_layers})


def train_record(target, row: Any, stored: list[int], eos_ids: list[int]) -> dict:
    """A training record of ``row``: its last :data:`MAX_LEN` + 2 positions (the window
    :func:`make_batch` keeps of an answer)."""
    from train.draft_head_training import record

    start = max(0, len(row.ids) - 2 - MAX_LEN)
    feats, v, i, _, ids = teacher_forced(target, row.ids, stored, eos_ids, start)
    return record(ids, row.prompt_len - start, feats, v, i, "answer")


@dataclass
class HeldOut:
    """A held-back row as the head sees it at inference: the positions from the head's
    catch-up window before the answer on (:data:`~pipeline.engine.proposers.base.CATCH_UP_WINDOW`)."""

    ids: Any  # (T,) int64
    prompt_len: int
    feats: dict  # layer -> (T-1, H), the target's dtype (what the engine feeds the head)
    argmax_agrees: int  # answer tokens equal to the target's argmax
    answer_tokens: int


def held_out_record(target, row: Any, layers: list[int], eos_ids: list[int]) -> HeldOut:
    import torch

    from pipeline.engine.proposers.base import CATCH_UP_WINDOW

    start = max(0, row.prompt_len - CATCH_UP_WINDOW)
    feats, _, _, argmax, ids = teacher_forced(target, row.ids, layers, eos_ids, start,
                                              dtype=next(target.parameters()).dtype)
    ids = torch.tensor(ids, dtype=torch.long)
    P = row.prompt_len - start
    agree = int((argmax[P - 1:] == ids[P:]).sum())
    return HeldOut(ids, P, {layer: feats[:, n] for n, layer in enumerate(layers)}, agree, len(ids) - P)


def acceptance(head, held: list[HeldOut], max_k: int) -> dict:
    """Teacher-forced acceptance of greedy drafts against the answer tokens, per ``k``.

    Block start ``L`` (committed ids ``x_0 .. x_{L-1}``, ``L`` from the first answer token
    on): draft ``s`` is the head's argmax at step ``s`` of its unroll at position
    ``L - 3 + s`` (chained on its own output, fed the answer's tokens, which are its drafts
    while they are accepted) and is compared with ``x_{L-1+s}``; a block drafts at most the
    tokens left in the answer.

    Returns:
        ``{"blocks", "by_k": {k: {"acceptance_rate", "mean_accepted_length",
        "acceptance_by_position"}}}``.
    """
    import torch

    from train.draft_head_training import unrolled

    drafted = torch.zeros(max_k, dtype=torch.long)  # per draft position s, blocks that draft it
    accepted = torch.zeros(max_k, dtype=torch.long)  # ... and accept it (and every earlier one)
    blocks = 0
    with torch.no_grad():
        for r in held:
            T, P = r.ids.shape[0], r.prompt_len
            p = head.project({layer: f.unsqueeze(0) for layer, f in r.feats.items()})
            e = head.embed(r.ids[1:].unsqueeze(0))
            outs = unrolled(head, p, e, max_k)
            L = torch.arange(P + 1, T)  # block starts
            if L.numel() == 0:
                continue
            blocks += L.numel()
            alive = torch.ones(L.numel(), dtype=torch.bool)
            for s in range(1, max_k + 1):
                j = L - 3 + s
                has = L - 1 + s <= T - 1
                pred = head.draft_vocab[head.logits(outs[s - 1][0]).argmax(-1)]  # (T-1,)
                ok = torch.zeros_like(alive)
                ok[has] = pred[j[has]] == r.ids[(L - 1 + s)[has]]
                alive = alive & ok
                drafted[s - 1] += int(has.sum())
                accepted[s - 1] += int((alive & has).sum())
    by_k = {}
    for k in range(1, max_k + 1):
        d, a = int(drafted[:k].sum()), int(accepted[:k].sum())
        by_k[k] = {"acceptance_rate": round(a / d, 4) if d else None,
                   "mean_accepted_length": round(1 + a / blocks, 4) if blocks else None,
                   "acceptance_by_position": [round(int(accepted[s]) / max(1, int(drafted[s])), 4) for s in range(k)]}
    return {"blocks": blocks, "by_k": by_k}


def score(acc: dict, k: int) -> float:
    """What *better* compares: the mean accepted length at ``k``."""
    return acc["by_k"][k]["mean_accepted_length"] or 0.0
