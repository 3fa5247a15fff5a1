"""When a row stops: EOS tokens and stop strings, checked token by token.

The loop commits a verified block one token at a time and asks :meth:`StopChecker.hit`
after each, so a stop inside an accepted block cuts the text, the token ids and the
statistics at the same token, as plain decoding would.
"""

from __future__ import annotations


class StopChecker:
    """Decides whether the newest generated token ends the row.

    Args:
        eos_token_ids: ids that end generation (the EOS token is kept in the output,
            as ``generate()`` keeps it).
        stop_strings: strings that end generation once completed in the decoded
            generated text (the prompt is not searched); the token completing one is
            kept.
        tokenizer: needed to decode when ``stop_strings`` is set.

    Raises:
        ValueError: ``stop_strings`` without a tokenizer.
    """

    def __init__(self, eos_token_ids: set[int], stop_strings: list[str] | None = None, tokenizer=None):
        self.eos = eos_token_ids
        self.stop_strings = list(stop_strings or [])
        if self.stop_strings and tokenizer is None:
            raise ValueError("stop_strings needs a tokenizer: pass tokenizer= to SpeculativeEngine")
        self.tokenizer = tokenizer
        # Enough trailing tokens to hold the longest stop string even if tokens decode to
        # single characters or nothing (byte pieces, special tokens).
        self.window = max((len(s) for s in self.stop_strings), default=0) + 8

    def hit(self, generated: list[int]) -> bool:
        """``generated``: all generated ids so far, the newest last."""
        if generated[-1] in self.eos:
            return True
        if self.stop_strings:
            tail = self.tokenizer.decode(generated[-self.window :], skip_special_tokens=False)
            return any(s in tail for s in self.stop_strings)
        return False
