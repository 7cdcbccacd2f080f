"""Prompt prefix cache: the keys and values of earlier prompts, reused when a new prompt starts with one.

A chat re-sends the whole conversation at every turn; an application puts the same long system prompt or
document in front of every question. Without a cache each request prefills all of it again, a full forward
per prompt token. With it a request prefills only what follows the longest prefix it shares
with an earlier prompt, the rest copied from the cache (~25 KB a token, a memcpy).

Exact, not approximate: a reused row is bit for bit the row a full prefill of the new prompt computes, so the
output of a request never depends on what was cached before it. That holds because of how the fast backend
computes a prefill's rows (checked on both bundled models, `tests/test_prefix_cache.py`):

- every linear layer of 32 rows or more (PANEL_ROWS) goes through the panel kernel (``qgemm``), or on AMX tiles
  through the decoding kernel (``kernel_rows_independent``), whose result for a row depends on that row alone, not
  on how many rows are computed with it or where it sits among them;
- the compiled attention computes each query row on its own over the cache's keys, in the same order whatever
  the rows around it;
- everything else (norms, rotary, the MLP's gate) is row by row.

(The int8 mode's kernel takes any number of rows the same way, its sums being integers and its activations rounded
per row: there too calls of 32 rows or more agree bit for bit, checked on both models.)

So a prompt cut into a cached prefix and a suffix gives the same bits as the whole prompt in one call as long
as both parts were computed in calls of at least 32 rows. Rows computed in smaller calls (the decoding kernel,
which a step or a block of up to 16 rows takes) differ in the last bits (~4e-5 on the keys), so the cache only
stores rows of prefills of 32 rows or more, never the answer's rows from decoding steps, and a reuse always
leaves at least 32 rows (MIN_ROWS, more if the drafter reads more, ``Drafter.prompt_rows_needed``) to prefill.
Where any of this does not hold (a prefill path other than the panels or the AMX kernel on this machine, float
weights, no compiled ops, transformers' modules) the cache stays off and says why (``PrefixCache.off``): it never
trades exactness for speed.

Worked example (MIN_ROWS 32): turn 1 of a chat is 120 prompt tokens; its prefill (one call of 120 rows) is
stored. Turn 2's prompt is those 120 tokens + the 64-token answer + 30 new tokens = 214: the longest cached
prefix is 120, 94 rows remain >= 32, so rows 0..119 are copied and 94 are prefilled (44% of the prefill). Had
turn 2 added only 10 tokens to a cached 120 (130 in all), 98 rows would be copied and 32 prefilled.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn

from selfspec.models.cache import KVCache
from selfspec.models.split import SplitModel
from selfspec.quant import weight
from selfspec.quant.weight import PANEL_ROWS

MIN_ROWS = PANEL_ROWS  # the fewest rows a cached prompt, or a reuse's suffix, may be computed in (see above)


@dataclass
class Entry:
    """One cached prompt: its token ids and every layer's keys and values of those positions."""

    tokens: list[int]
    keys: list[torch.Tensor]  # per layer [batch=1, kv_heads, n, head_dim]
    values: list[torch.Tensor]  # per layer [batch=1, kv_heads, n, head_dim]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of ``a`` and ``b`` (slice compares, bisected)."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi:  # a[:lo] == b[:lo] and a[:hi + 1] != b[:hi + 1]
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def why_not_exact(split: SplitModel) -> str | None:
    """Why a cut prefill would not give a full prefill's bits on ``split`` (None: it would; see the module)."""
    if split.backend != "fast" or not split.fast_layers:
        return "the cache needs the fast backend"
    if not split.quantized:
        return "the cache needs block-quantized weights (float weights' prefill depends on the rows computed together)"
    if any(layer.ops is None for layer in split.fast_layers):
        return "the cache needs the compiled ops (attention row by row)"
    types: set[str] = set()
    for layer in split.layers:
        for m in layer.modules():
            q = getattr(m, "qweight", None)
            if q is not None:
                if not q.mode.rows_independent:  # e.g. the int8 mode's kernel: integer sums, a scale per row
                    types.add(q.type_name)
            elif isinstance(m, nn.Linear):
                return "the cache needs every layer's matrices block-quantized"
    paths = {t: weight.prefill_path(t) for t in sorted(types)}
    other = {t: p for t, p in paths.items()
             if p != "panels" and not (p == "kernel" and weight.kernel_rows_independent(t))}
    if other:
        return f"this machine's prefill takes the {', '.join(f'{p} path for {t}' for t, p in other.items())} (only the panels, and the kernel on AMX tiles, give a row the same bits in any call)"
    return None


class PrefixCache:
    """Earlier prompts' keys and values, least recently used dropped first past ``capacity_mb``."""

    def __init__(self, split: SplitModel, capacity_mb: float) -> None:
        self.split = split
        self.capacity = int(capacity_mb * 2**20)
        self.entries: OrderedDict[int, Entry] = OrderedDict()  # insertion id -> entry, oldest use first
        self._next = 0
        self._off: str | None = None if capacity_mb > 0 else "capacity 0"
        self._checked = capacity_mb <= 0
        self.hits = 0  # requests that reused a cached prefix
        self.misses = 0  # requests that looked and reused nothing
        self.reused_tokens = 0  # prompt tokens copied instead of prefilled

    @property
    def off(self) -> str | None:
        """Why the cache does nothing (None: it is on). Checked once, at first use."""
        if not self._checked:
            self._off, self._checked = why_not_exact(self.split), True
        return self._off

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def clear(self) -> None:
        self.entries.clear()

    def reuse(self, prompt: list[int], cache: KVCache, leave: int) -> int:
        """Copy into ``cache`` (empty) the keys and values of the longest cached prefix of ``prompt`` that leaves
        at least ``leave`` rows (>= MIN_ROWS) to prefill. -> how many positions were copied (0: none)."""
        if self.off is not None:
            return 0
        best, n = None, 0
        for key, e in self.entries.items():
            m = min(common_prefix(e.tokens, prompt), len(prompt) - max(leave, MIN_ROWS))
            if m > n:
                best, n = key, m
        if best is None:
            self.misses += 1
            return 0
        e = self.entries[best]
        self.entries.move_to_end(best)
        assert n <= cache.capacity and not any(cache.lengths), "reuse fills a new sequence's cache"
        for i in range(len(cache.keys)):
            cache.keys[i][:, :, :n] = e.keys[i][:, :, :n]
            cache.values[i][:, :, :n] = e.values[i][:, :, :n]
        cache.lengths = [n] * len(cache.lengths)
        self.hits += 1
        self.reused_tokens += n
        return n

    def store(self, prompt: list[int], cache: KVCache, computed: int) -> None:
        """Keep the prompt's keys and values, just prefilled into ``cache``, whose last ``computed`` rows were
        computed in one call (the rest came from this cache). Only prompts whose rows all came from calls of
        MIN_ROWS or more are kept; a kept prompt that is a prefix of this one is replaced by it, and a prompt a
        kept one already holds (the same request again, another method on the same question) is not copied."""
        if self.off is not None or computed < MIN_ROWS or len(prompt) < MIN_ROWS:
            return
        n = len(prompt)
        held_whole = []  # kept prompts this one holds whole: replaced by it
        for key, old in self.entries.items():
            shared = common_prefix(old.tokens, prompt)
            if shared == n:
                self.entries.move_to_end(key)  # held already (the same bits: see above), no copy made
                return
            if shared == len(old.tokens):
                held_whole.append(key)
        e = Entry(list(prompt), [k[:, :, :n].clone() for k in cache.keys], [v[:, :, :n].clone() for v in cache.values])
        if e.nbytes > self.capacity:
            return
        for key in held_whole:
            del self.entries[key]
        while self.entries and self.nbytes + e.nbytes > self.capacity:
            self.entries.popitem(last=False)
        self.entries[self._next] = e
        self._next += 1
