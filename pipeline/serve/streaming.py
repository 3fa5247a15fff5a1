"""Streaming text: incremental detokenization of one row with OpenAI's stop semantics."""

from __future__ import annotations


class TextStream:
    """Incremental detokenization of one row for streaming, with OpenAI's stop semantics.

    Each :meth:`push` of committed ids returns the new text that is safe to send: text
    that ends in an incomplete character, or that could still turn out to begin a stop
    string, is held back.  :meth:`finish` returns the rest of :meth:`final_text`.
    """

    def __init__(self, tokenizer, stops: list[str], include_stop: bool):
        self.tokenizer, self.stops, self.include_stop = tokenizer, stops, include_stop
        self.ids: list[int] = []
        self.sent = ""
        self._hold = max((len(s) for s in stops), default=1) - 1 if not include_stop else 0

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def final_text(self, text: str, finish_reason: str | None) -> str:
        """The row's text as OpenAI returns it: cut before the stop string that ended it,
        unless ``include_stop_str_in_output``."""
        if finish_reason == "stop" and self.stops and not self.include_stop:
            hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
            if hits:
                return text[:min(hits)]
        return text

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        text = self.decode(self.ids)
        safe = len(text) - self._hold
        while safe > 0 and text[safe - 1] == "\ufffd":
            safe -= 1
        if self.stops and not self.include_stop:
            hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
            if hits:
                safe = min(safe, min(hits))
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
