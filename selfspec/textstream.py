"""Incremental detokenization with stop strings, for streaming.

Each push decodes a short window of ids, not all of them (re-decoding every id at every push would make a long
generation's detokenizing quadratic in its length). The
window starts at the ids before the last text that became final (``prefix`` .. ``read``), so pieces that merge
(byte-level BPE) and leading spaces come out as in the whole text: the new text is the window's decoding minus the
decoding of its part before the new ids. A new id whose text is incomplete (an unfinished UTF-8 character, decoded
as U+FFFD) adds nothing until the character completes. A tail is held back while it could still be cut: a prefix
of a stop string. Worked example (byte-level BPE, "é" split over two ids a, b): push a -> window [a] decodes to
"\ufffd": nothing yet; push b -> window [a, b] decodes to "é": "é" is final, the window moves on to start at a.
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
        self.prefix = 0  # the window decoded at each push starts here: the ids before the last final text ...
        self.read = 0  # ... which ends here (ids[read:] are not in ``text`` yet)

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:  # token-id-only use (tests with tokenizer-less tiny models)
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _advance(self, final: bool = False) -> str:
        """``text`` with the new ids' final text appended (see the module's docstring; ``final``: at the end of
        generation, an unfinished character too, as its U+FFFD); -> the whole text."""
        before = self._decode(self.ids[self.prefix : self.read])
        window = self._decode(self.ids[self.prefix :])
        if not window.startswith(before):  # a tokenizer whose text is not prefix-stable here: decode it all
            self.text, self.prefix, self.read = self._decode(self.ids), len(self.ids), len(self.ids)
        elif len(window) > len(before) and (final or not window.endswith("\ufffd")):
            self.text += window[len(before) :]
            self.prefix, self.read = self.read, len(self.ids)
        return self.text

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
        text = self._advance()
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

    def add(self, token_id: int) -> None:
        """Add one token without decoding it: the final ``flush`` decodes every added one in one piece (no stop
        strings are looked for in between)."""
        self.ids.append(token_id)

    def flush(self) -> str:
        """At the end of generation: whatever was held back (an unfinished stop-string prefix is text, an
        unfinished character its U+FFFD, as the whole text's decoding has them)."""
        if not self.stopped and self.read < len(self.ids):
            self._advance(final=True)
        delta, self.sent = self.text[self.sent :], len(self.text)
        return delta
