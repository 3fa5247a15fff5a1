"""Checks that a drafter's token ids mean the same as the target's."""

from __future__ import annotations

from ..runner import text_config


def check_shared_vocabulary(target, drafter, tokenizer=None, drafter_tokenizer=None) -> None:
    """Raise ``ValueError`` when the drafter's vocabulary cannot map onto the target's.

    The embedding matrices may be padded to different sizes (``vocab_size``), but every
    id of the target's tokenizer must exist in both, and where both tokenizers are known
    they must agree on every shared id.
    """
    draft_vocab = text_config(drafter).vocab_size
    shared = min(draft_vocab, text_config(target).vocab_size)
    if tokenizer is not None and len(tokenizer) > shared:
        raise ValueError(
            f"drafter vocabulary ({draft_vocab} ids) cannot map onto the target's tokenizer "
            f"({len(tokenizer)} tokens): the draft model must share the target's tokenizer"
        )
    if tokenizer is not None and drafter_tokenizer is not None:
        d_vocab = drafter_tokenizer.get_vocab()
        if any(d_vocab.get(tok) != idx for tok, idx in tokenizer.get_vocab().items() if idx < shared):
            raise ValueError(
                "drafter tokenizer differs from the target's: method 'draft_model' needs a shared "
                "vocabulary (use universal assisted decoding for different tokenizers)"
            )


def read_draft_vocab(path: str, size: int | None = None):
    """The ids of a reduced draft vocabulary, most frequent first: ``(N,)`` int64.

    Args:
        path: a draft-head folder (the ``draft_vocab`` tensor of its ``model.safetensors``)
            or a JSON file holding a list of token ids (or ``{"draft_vocab": [...]}``).
        size: keep only the first ``size`` ids (``None``: all).

    Raises:
        ValueError: no such file or folder, no id list in it, repeated or negative ids, or a
            ``size`` larger than the list.
    """
    import json
    import os

    import torch

    p = os.path.expanduser(str(path))
    if os.path.isdir(p):
        from safetensors import safe_open

        weights = os.path.join(p, "model.safetensors")
        if not os.path.isfile(weights):
            raise ValueError(f"draft_vocab: {path!r} is a folder without model.safetensors (a draft head's)")
        with safe_open(weights, framework="pt") as f:
            if "draft_vocab" not in f.keys():
                raise ValueError(f"draft_vocab: {weights!r} holds no 'draft_vocab' tensor")
            ids = f.get_tensor("draft_vocab").long().view(-1)
    elif os.path.isfile(p):
        try:
            with open(p) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"draft_vocab: {path!r} is not a JSON list of token ids: {e}") from None
        if isinstance(data, dict):
            data = data.get("draft_vocab")
        if not isinstance(data, list) or not data or not all(isinstance(i, int) and not isinstance(i, bool) for i in data):
            raise ValueError(f"draft_vocab: {path!r} holds no list of token ids")
        ids = torch.tensor(data, dtype=torch.long)
    else:
        raise ValueError(f"draft_vocab: {path!r} does not exist")
    if size is not None:
        if size > ids.numel():
            raise ValueError(f"draft_vocab_size={size} but {path!r} lists only {ids.numel()} ids")
        ids = ids[:size]
    if int(ids.min()) < 0 or ids.unique().numel() != ids.numel():
        raise ValueError(f"draft_vocab: {path!r} has negative or repeated ids")
    return ids
