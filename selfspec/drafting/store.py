"""A token store: lookup drafts from text the target wrote before, where the request's own text has no match
(REST, He et al., 2024, "REST: Retrieval-Based Speculative Decoding": a datastore of earlier text; SuffixDecoding,
Oliaro et al., 2024: a store of the model's own earlier outputs).

The store is the target's own greedy answers to prompts outside the benchmark (``selfspec build-store``: ShareGPT
first turns answered by ``selfspec answer-prompts``), its token ids in one array, documents separated by -1
(``DraftConfig.store``, off by default: on Spec-Bench it was level with the default on both bundled models,
docs/ADAPTIVE.md "A token store"). Drafts from it are lookup blocks with their own learned acceptance per match
length (``LookupSources.store_policy``), so they stay lossless like every draft: verification decides.

Worked example (ngram 3): store [5 7 3 9 4 -1 8 7 3 9 2 -1 6 7 3 9 2 7], text [... 1 7 3 9]: the text's last
3-gram [7 3 9] ends at store positions 3, 9 and 15; each matches 3 tokens back (5, 8 and 6 differ from the text's
1), so all three vote: 2 follows twice, 4 once -> 2; of the occurrences that continue with 2, only the last goes
on (the other meets a separator) -> 7: Match([2, 7], 3). With the text [... 8 7 3 9] the occurrence at 9 matches 4
back, alone: Match([2], 4).

The index: the n-grams' 64-bit keys (``_keys``, a polynomial over the token ids, collisions ruled out by comparing
the tokens) sorted once, with the position each n-gram ends at, so a lookup is a binary search and one vectorized
comparison of at most CANDIDATES occurrences: 16 bytes per stored token in all (tokens, keys, positions).
Voting among the occurrences that match furthest back (REST drafts the most frequent continuations of a datastore
too) is right more often than the earliest of them: the most frequent continuation is the likelier one
(docs/ADAPTIVE.md, "A token store").
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np

from selfspec.drafting.lookup import MAX_MATCH, Match
from selfspec.errors import InvalidConfigError

SEPARATOR = -1  # between documents: no n-gram and no continuation crosses it
CANDIDATES = 256  # occurrences of the text's last n-gram compared for the longest match (the earliest ones stored)
_MUL = np.uint64(0x9E3779B97F4A7C15)  # an odd 64-bit multiplier (the n-gram keys' polynomial)


def _keys(tokens: np.ndarray, ends: np.ndarray, n: int) -> np.ndarray:  # tokens [T] int64, ends [E] -> [E] uint64
    """The key of the n-gram ending at each position of ``ends``: sum_i (token_i + 1) * MUL^(n - 1 - i), modulo 2^64."""
    key = np.zeros(len(ends), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for i in range(n):
            key = key * _MUL + (tokens[ends - (n - 1) + i] + 1).astype(np.uint64)
    return key


class TokenStore:
    """Earlier text's token ids (``# [T] int32``, documents separated by SEPARATOR) and an index of its n-grams."""

    def __init__(self, tokens: np.ndarray, ngram: int = 3) -> None:
        if ngram < 2:
            raise InvalidConfigError(f"a token store's n-grams are at least 2 tokens long, got {ngram}")
        self.tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        self.ngram = ngram
        t = self.tokens.astype(np.int64)
        ends = np.arange(ngram - 1, len(t) - 1)  # an n-gram ending here has a continuation token after it
        if len(ends):
            sep = t == SEPARATOR
            window = np.zeros(len(ends), dtype=bool)
            for i in range(ngram + 1):  # the n-gram and its next token hold no separator
                window |= sep[ends - (ngram - 1) + i]
            ends = ends[~window]
        keys = _keys(t, ends, ngram)
        order = np.argsort(keys, kind="stable")  # equal keys keep the order of their positions: the earliest first
        self._keys, self._ends = keys[order], ends[order].astype(np.int32)

    def __len__(self) -> int:
        return int((self.tokens != SEPARATOR).sum())

    @property
    def nbytes(self) -> int:
        return self.tokens.nbytes + self._keys.nbytes + self._ends.nbytes

    @classmethod
    def load(cls, path: str | Path, ngram: int = 3) -> TokenStore:
        """A store saved by ``save`` (``.npy``, int32 token ids with SEPARATOR between documents)."""
        p = Path(path)
        if not p.is_file():
            raise InvalidConfigError(f"token store not found: {p}")
        try:
            tokens = np.load(p, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise InvalidConfigError(f"token store {p} is not a .npy array of token ids: {e}") from e
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer) or (tokens < SEPARATOR).any():
            raise InvalidConfigError(f"token store {p} must be a 1-D array of token ids >= 0 (and {SEPARATOR} "
                                     "between documents)")
        return cls(tokens, ngram)

    @classmethod
    def from_documents(cls, docs: list[list[int]], ngram: int = 3) -> TokenStore:
        """A store of these token id lists, in order."""
        parts: list[int] = []
        for d in docs:
            if d:
                parts.extend(d)
                parts.append(SEPARATOR)
        return cls(np.array(parts, dtype=np.int32), ngram)

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        np.save(p, self.tokens)
        return p

    def match(self, text: list[int], max_tokens: int) -> Match:
        """Up to ``max_tokens`` stored tokens that followed the text's last n-gram where it occurred in the store,
        and the match length: of its first CANDIDATES occurrences, those matching furthest back vote token by token
        (the most frequent next token among the occurrences still agreeing; the earliest one's among equals);
        ([], 0) when the n-gram never occurred (the module's docstring has a worked example)."""
        n = self.ngram
        if max_tokens <= 0 or len(text) < n or not len(self._keys):
            return Match([], 0)
        last = np.array(text[-MAX_MATCH:], dtype=np.int64)
        key = _keys(last, np.array([len(last) - 1]), n)[0]
        tail = last[::-1]  # the text backwards from its last token
        lo = int(np.searchsorted(self._keys, key, side="left"))
        hi = min(int(np.searchsorted(self._keys, key, side="right")), lo + CANDIDATES)
        if lo >= hi:
            return Match([], 0)
        ends = self._ends[lo:hi].astype(np.int64)  # [C], earliest first
        back = ends[:, None] - np.arange(len(tail))[None, :]  # [C, m] store positions going back from each end
        same = (back >= 0) & (self.tokens[np.maximum(back, 0)] == tail[None, :])
        lengths = np.where(same.all(1), len(tail), same.argmin(1))  # [C] how far back each occurrence matches
        best = int(lengths.max())
        if best < n:  # a key collision, not the n-gram
            return Match([], 0)
        live = ends[lengths == best]
        out: list[int] = []
        for i in range(max_tokens):
            pos = live + 1 + i
            nxt = self.tokens[np.minimum(pos, len(self.tokens) - 1)]
            ok = (pos < len(self.tokens)) & (nxt != SEPARATOR)
            live, nxt = live[ok], nxt[ok]
            if not len(nxt):
                break
            vals, first, counts = np.unique(nxt, return_index=True, return_counts=True)
            top = counts == counts.max()
            tok = int(vals[top][first[top].argmin()])  # the most frequent; among equals the earliest occurrence's
            out.append(tok)
            live = live[nxt == tok]
        return Match(out, best)


def resolve_store(spec: str) -> TokenStore | None:
    """The store ``DraftConfig.store`` names: 'none', or a ``.npy`` file. A file already loaded (same path, size and
    time) is not read or indexed again: a new draft setup (``SelfSpec.set_draft``) reuses it."""
    if spec == "none":
        return None
    try:
        st = Path(spec).stat()
    except OSError:
        return TokenStore.load(spec)  # the clear error
    return _loaded(str(Path(spec).resolve()), st.st_size, st.st_mtime_ns)


@lru_cache(maxsize=4)
def _loaded(path: str, size: int, mtime_ns: int) -> TokenStore:
    return TokenStore.load(path)
