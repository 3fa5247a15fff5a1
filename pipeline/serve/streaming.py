"""Streaming text: incremental detokenization of one row with OpenAI's (and vLLM's) stop
semantics."""

from __future__ import annotations


class TextStream:
    """Incremental detokenization of one row for streaming, with OpenAI's stop semantics.

    The text ends at the earliest stop string: just before it, or with
    ``include_stop_str_in_output`` just after it (as vLLM, whose field this is: the rest of
    the stop's last token is dropped either way).  Each :meth:`push` of committed ids
    returns the new text that is safe to send: text that ends in an incomplete character,
    or that could still turn out to begin a stop string, is held back.  :meth:`finish`
    returns the rest of :meth:`final_text`.
    """

    def __init__(self, tokenizer, stops: list[str], include_stop: bool):
        self.tokenizer, self.stops, self.include_stop = tokenizer, stops, include_stop
        self.ids: list[int] = []
        self.sent = ""
        self._hold = max((len(s) for s in stops), default=1) - 1

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _stop_end(self, text: str) -> int | None:
        """Where the text ends because of a stop string (None: no stop string in it)."""
        hits = [(i, len(s)) for s in self.stops for i in [text.find(s)] if i >= 0]
        if not hits:
            return None
        i, n = min(hits)  # the earliest; of two starting there, the shorter
        return i + n if self.include_stop else i

    def final_text(self, text: str, finish_reason: str | None) -> str:
        """The row's text as returned: cut at the stop string that ended it (see the class)."""
        if finish_reason == "stop" and self.stops:
            end = self._stop_end(text)
            if end is not None:
                return text[:end]
        return text

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        text = self.decode(self.ids)
        safe = len(text) - self._hold
        while safe > 0 and text[safe - 1] == "\ufffd":
            safe -= 1
        end = self._stop_end(text) if self.stops else None
        if end is not None:
            safe = end  # the stop is complete: everything up to where the text ends may go
        if safe <= len(self.sent) or not text.startswith(self.sent):
            return ""
        delta = text[len(self.sent):safe]
        self.sent += delta
        return delta

    def finish(self, text: str, finish_reason: str | None) -> str:
        final = self.final_text(text, finish_reason)
        rest = final[len(self.sent):] if final.startswith(self.sent) else ""
        self.sent += rest
        return rest
