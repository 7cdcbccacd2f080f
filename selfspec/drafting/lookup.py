"""Lookup drafts (prompt lookup decoding): the continuation of an earlier occurrence of the text's last
n-gram, in the prompt or in what was generated so far. No model cost to propose; the early-exit drafter
verifies them like its own drafts (one shallow pass over the whole block, then the deep pass), so they stay
lossless: greedy by the usual longest prefix, sampling as one-hot drafts.

Worked example, ngram 2: tokens [7 3 9 4 | 1 7 3] (the last two, [7 3], occurred at positions 0-1)
-> the continuation after that occurrence, [9 4 1 7 3], cut to the draft length; its match length is 2
(position 4's token, 1, is not the text's third-last token, 4).

Which occurrence: of the longest trailing n-gram (n = ngram down to min_ngram) that occurred before, the
one whose match reaches furthest back (the text's longest suffix seen before, counted up to MAX_MATCH
tokens), the latest among equals, over its RECENT latest occurrences. The match length is returned with
the continuation: a long match is a copied span that tends to go on (the lookup policy sizes blocks by it,
``selfspec.drafting.policy_tables.ByMatchLength``; acceptance by match length on Spec-Bench: docs/ADAPTIVE.md).

The index maps each n-gram to the end positions of its latest RECENT occurrences; it is brought up to date
incrementally (each token is indexed once), so a lookup costs O(ngram) dictionary probes and a few list
comparisons, not a scan of the text.
"""

from __future__ import annotations

from typing import NamedTuple

RECENT = 8  # occurrences of an n-gram kept (latest first) to choose the longest match among
MAX_MATCH = 32  # match lengths are counted up to this many tokens


class Match(NamedTuple):
    tokens: list[int]  # the continuation (at most the tokens asked for; [] when nothing matched)
    length: int  # how many trailing tokens of the text the occurrence matches (0 when nothing matched)


def common_suffix(toks: list[int], end: int, cap: int = MAX_MATCH) -> int:
    """How many tokens ending at ``end`` equal the ones ending at the text's last position (at most ``cap``;
    by bisection over slice comparisons: equal suffixes of length s imply equal ones of every shorter length)."""
    last = len(toks) - 1
    lo, hi = 0, min(cap, end + 1)  # lo: known to match; hi: most that can
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if toks[end - mid + 1 : end + 1] == toks[last - mid + 1 : last + 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class NgramIndex:
    """Earlier occurrences of the text's trailing n-grams, over a token list that only grows (a sequence's
    prompt + emitted tokens, shared, not copied)."""

    def __init__(self, tokens: list[int], ngram: int = 3, min_ngram: int = 2, longest: bool = True) -> None:
        self.sizes = list(range(ngram, min_ngram - 1, -1))
        self.longest = longest  # False: the latest occurrence, however far back it matches
        self.tokens = tokens
        self._index: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in self.sizes}
        self._indexed = 0  # n-grams ending before this position are in the index

    def _catch_up(self) -> None:
        end = len(self.tokens) - 1  # the trailing n-grams end here: index only the earlier ones
        toks = self.tokens
        for e in range(self._indexed, end):
            for n in self.sizes:
                if e >= n - 1:
                    ends = self._index[n].setdefault(tuple(toks[e - n + 1 : e + 1]), [])
                    ends.append(e)
                    if len(ends) > RECENT:
                        del ends[0]
        self._indexed = max(self._indexed, end)

    def match(self, max_tokens: int) -> Match:
        """Up to ``max_tokens`` tokens that followed the chosen earlier occurrence of the text's trailing
        n-gram (the module's docstring), and its match length; ([], 0) when none occurred."""
        if max_tokens <= 0 or not self.tokens:
            return Match([], 0)
        self._catch_up()
        toks = self.tokens
        for n in self.sizes:
            if len(toks) < n + 1:
                continue
            ends = self._index[n].get(tuple(toks[-n:]))
            if ends:
                if self.longest:
                    length, end = max((common_suffix(toks, e), e) for e in ends)  # longest, then latest
                else:
                    length, end = common_suffix(toks, ends[-1]), ends[-1]
                return Match(toks[end + 1 : end + 1 + max_tokens], length)
        return Match([], 0)

    def continuation(self, max_tokens: int) -> list[int]:
        """The tokens of ``match`` (the module's docstring)."""
        return self.match(max_tokens).tokens
