"""Incremental detokenization with stop strings, for streaming.

Text is re-decoded from all generated ids at every push (robust for tokenizers whose pieces
merge, e.g. byte-level BPE), and a tail is held back while it could still be cut: an incomplete
UTF-8 character (decoded as U+FFFD) or a prefix of a stop string.
"""

from __future__ import annotations

from typing import Any


class TextStream:
    def __init__(self, tokenizer: Any, stop: list[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.ids: list[int] = []
        self.text = ""  # text of all ids so far (cut at a stop string once one is found)
        self.sent = 0  # characters already handed out
        self.stopped = False

    def _decode(self) -> str:
        if self.tokenizer is None:  # token-id-only use (tests with tokenizer-less tiny models)
            return ""
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def _held_back(self, text: str) -> int:
        """How many trailing characters must wait for more tokens."""
        hold = 0
        if text.endswith("\ufffd"):
            hold = len(text) - len(text.rstrip("\ufffd"))
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        return hold

    def push(self, token_id: int) -> str:
        """Add one token; return the text that became final. Sets ``stopped`` on a stop string."""
        self.ids.append(token_id)
        text = self._decode()
        if self.stop:
            lookback = max(0, self.sent - max(len(s) for s in self.stop))
            cuts = [i for i in (text.find(s, lookback) for s in self.stop) if i >= 0]
            if cuts:
                self.text, self.stopped = text[: min(cuts)], True
                delta, self.sent = self.text[self.sent :], len(self.text)
                return delta
        self.text = text
        ready = len(text) - self._held_back(text)
        if ready <= self.sent:
            return ""
        delta, self.sent = text[self.sent : ready], ready
        return delta

    def flush(self) -> str:
        """At the end of generation: whatever was held back (an unfinished stop-string prefix is text)."""
        delta, self.sent = self.text[self.sent :], len(self.text)
        return delta
