"""Lookup drafts (prompt lookup decoding): the continuation of the latest earlier occurrence of the
text's last n-gram, in the prompt or in what was generated so far. No model cost to propose; the
early-exit drafter verifies them like its own drafts (one shallow pass over the whole block, then
the deep pass), so they stay lossless: greedy by the usual longest prefix, sampling as one-hot
drafts.

Worked example, ngram 2: tokens [7 3 9 4 | 1 7 3] (the last two, [7 3], occurred at positions 0-1)
-> the continuation after that occurrence, [9 4 1 7 3], cut to the draft length.

The index maps each n-gram (n = ngram down to min_ngram) to the end position of its latest
occurrence; it is brought up to date incrementally (each token is indexed once), so a lookup costs
O(ngram) dictionary probes, not a scan of the text.
"""

from __future__ import annotations


class NgramIndex:
    """Latest earlier occurrence of the text's trailing n-grams, over a token list that only grows
    (a sequence's prompt + emitted tokens, shared, not copied)."""

    def __init__(self, tokens: list[int], ngram: int = 3, min_ngram: int = 2) -> None:
        self.sizes = list(range(ngram, min_ngram - 1, -1))
        self.tokens = tokens
        self._index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self._indexed = 0  # n-grams ending before this position are in the index

    def _catch_up(self) -> None:
        end = len(self.tokens) - 1  # the trailing n-grams end here: index only the earlier ones
        toks = self.tokens
        for e in range(self._indexed, end):
            for n in self.sizes:
                if e >= n - 1:
                    self._index[n][tuple(toks[e - n + 1 : e + 1])] = e
        self._indexed = max(self._indexed, end)

    def continuation(self, max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` tokens that followed the latest earlier occurrence of the longest
        trailing n-gram that occurred before ([] when none did)."""
        if max_tokens <= 0 or not self.tokens:
            return []
        self._catch_up()
        toks = self.tokens
        for n in self.sizes:
            if len(toks) < n + 1:
                continue
            end = self._index[n].get(tuple(toks[-n:]))
            if end is not None:
                return toks[end + 1 : end + 1 + max_tokens]
        return []
