"""Checks that a drafter's token ids mean the same as the target's."""

from __future__ import annotations

from .draft_model import text_config


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
