"""The compiled plan every fast step of one sequence runs: ``StepPlan`` (``selfspec/kernels/step.cpp``).

A plan is a range of the target's decoder layers as C++ objects (each ``FastLayer.plan``), the token embedding in
front of them and the final norm, LM head and argmax after them; one call, ``run_plan``, runs any part of it over
1-16 rows of one causal sequence, the same ops in the same order as the per-op path (``FastLayer.forward_segments``),
so bit for bit its results, without Python between the ~10 ops of each layer:

    plain greedy step           token -> embedding row -> layers [0, L) -> argmax        ``step``
    a round that drafts nothing the same, keeping the rows entering layer k (a tap)      ``step(taps=(k,))``
    a draft, a verification     rows -> layers [a, b)                                    ``run``
    a batched round's stage     several sequences' rows -> layers [a, b), each its cache ``run_batch``
    a block's greedy verdict    rows -> argmax (no layers)                               ``argmax``

A deep head's first draft (``draft_or_step``) runs the same plan in two ranges around the head's own step. What the
plan does not cover takes the per-op path: token trees, more than 16 rows (a prefill, a large batch), Gemma's
sandwich norms, anything not float32; ``backend="reference"`` runs transformers' modules.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from selfspec.kernels.linear import MAX_GEMV_ROWS, PackedLinear
from selfspec.models.cache import KVCache
from selfspec.models.fast import FastLayer, Norm
from selfspec.models.rotary import RotaryTables
from selfspec.quant.weight import QuantWeight


class Step(NamedTuple):
    """A one-call step's result: the next token, and the rows each tap kept ``# [1, 1, hidden]``, then the last
    layer's (the final state)."""

    token: int
    tapped: list[torch.Tensor]
    final: torch.Tensor


class StepPlans:
    """The target's ``StepPlan``, built once, and the calls made of it. ``layers``: the fast layers; ``kinds``: each
    layer's rotary kind; ``embed``: the token embedding module, and ``embed_rows`` its quantized table where a lookup
    of it is all the module does (``SplitModel._embed_rows``); ``norm``, ``lm_head``: the final norm and the packed
    LM head (None: no argmax, e.g. a soft-capped one)."""

    def __init__(self, layers: list[FastLayer], kinds: list[str], embed: nn.Module, embed_rows: QuantWeight | None,
                 norm: Norm, lm_head: PackedLinear | None, vocab_size: int, rotary: RotaryTables) -> None:
        self.layers, self.vocab_size, self.rotary = layers, vocab_size, rotary
        self.kinds = list(dict.fromkeys(kinds))  # the rotary kinds in table order
        self.ops: Any = layers[0].ops if layers else None
        self._probe = torch.zeros(1, dtype=torch.float32)  # the dtype a float32 step's tables take
        self._no_rows = torch.empty(0)  # a step's rows: its token's embedding row, made by the call
        plans = [layer.plan for layer in layers]
        # every layer compiled, or the plan holds none (its head alone: ``argmax``)
        self.planned = bool(plans) and all(p is not None for p in plans)
        head = None
        if self.ops is not None and lm_head is not None:
            lm = lm_head.kernel_plan(self.ops)
            head = None if lm is None else self.ops.ArgmaxHead(norm.weight, norm.eps, lm)
        self.has_head = head is not None
        self.embeds, embed_args = self._embedding(embed, embed_rows)
        self.plan: Any = None
        if self.ops is not None and (self.planned or head is not None):
            self.plan = self.ops.StepPlan(plans if self.planned else [],
                                          [self.kinds.index(k) for k in kinds] if self.planned else [],
                                          len(self.kinds), *embed_args, vocab_size, head)

    @staticmethod
    def _embedding(embed: Any, embed_rows: QuantWeight | None) -> tuple[bool, tuple]:
        """(whether the plan can look tokens up itself, the plan's embedding arguments): a quantized table's rows
        (dequantized), a plain float32 table's, or none (a scaled embedding: Gemma)."""
        empty = torch.empty(0)
        if embed_rows is not None:
            return True, (0, *embed_rows.kernel_args())
        if (isinstance(embed, nn.Embedding) and type(embed).forward is nn.Embedding.forward  # a plain lookup
                and embed.max_norm is None and embed.weight.dtype == torch.float32):
            return True, (2, embed.weight.detach().contiguous(), empty, empty, 0, 0, 0.0)
        return False, (-1, empty, empty, empty, 0, 0, 0.0)

    # ---- what applies ----------------------------------------------------------------------------------------------
    def covers(self, h: torch.Tensor, tree: Any = None) -> bool:
        """Whether ``run`` takes these rows: one causal block of 1-16 float32 rows, every layer compiled."""
        return (self.planned and tree is None and h.dtype == torch.float32
                and h.shape[0] * h.shape[1] <= MAX_GEMV_ROWS)

    @property
    def steps(self) -> bool:
        """Whether ``step`` applies: every layer compiled, the plan's own embedding and argmax, a fixed rotary table."""
        return self.planned and self.has_head and self.embeds and self.rotary.static

    # ---- the calls -------------------------------------------------------------------------------------------------
    def run(self, h: torch.Tensor, start: int, end: int, positions: torch.Tensor,
            cache: KVCache) -> torch.Tensor:  # h [B, n, hidden], B n <= 16 -> [B, n, hidden]
        """Layers [start, end) of one causal block in one call; ``h`` stays as it was."""
        n = h.shape[1]
        tables, first = self._tables(h, positions)
        starts = cache.reserve_all(n, start, end)  # first: reserving may grow (reallocate) a layer's buffers
        out = h.clone(memory_format=torch.contiguous_format)  # updated in place; the caller keeps h
        self.ops.run_plan(self.plan, start, end, out, -1, first, tables[0], tables[1], cache.keys[start:end],
                          cache.values[start:end], starts, [], False)
        return out

    def run_batch(self, hs: list[torch.Tensor], start: int, end: int, positions: list[torch.Tensor],
                  caches: list[KVCache], trees: list[Any], tails: list[int | None]) -> list[torch.Tensor] | None:
        """Layers [start, end) of several sequences' causal blocks in one call (a batched round's stage), each over
        its own cache, every weight read once for all rows; ``hs`` stay as they were. None (nothing done) where the
        plan does not cover them: a tree, more than 16 rows in all, a tail that cuts rows, not float32."""
        sizes = [h.shape[1] for h in hs]
        if (not self.planned or sum(sizes) > MAX_GEMV_ROWS or any(t is not None for t in trees)
                or any(h.shape[0] != 1 or h.dtype != torch.float32 for h in hs)
                or any(t is not None and t < n for t, n in zip(tails, sizes))):
            return None
        offsets = [sum(sizes[:j]) for j in range(len(sizes))]
        tables = [self._tables(h, p) for h, p in zip(hs, positions)]
        starts = [cache.reserve_all(n, start, end) for cache, n in zip(caches, sizes)]  # first: may grow buffers
        h = torch.cat(hs, dim=1)  # a new tensor, updated in place
        self.ops.run_segments(self.plan, start, end, h, offsets, sizes, [t[0][0] for t in tables],
                              [t[0][1] for t in tables], [t[1] for t in tables], [c.keys[start:end] for c in caches],
                              [c.values[start:end] for c in caches], starts)
        return [h[:, o : o + n] for o, n in zip(offsets, sizes)]

    def argmax(self, h: torch.Tensor) -> torch.Tensor | None:  # [rows, hidden] last-layer states -> [rows] int64
        """Each row's argmax of the final norm and LM head in one call, or None without the plan's head."""
        if not self.has_head or h.dtype != torch.float32 or not 0 < h.shape[0] <= MAX_GEMV_ROWS:
            return None
        at = len(self.layers) if self.planned else 0
        return self.ops.run_plan(self.plan, at, at, h.contiguous().unsqueeze(0), -1, 0, [], [], [], [], [], [],
                                 True)[2]

    def step(self, token: int, position: int, cache: KVCache, taps: tuple[int, ...] = ()) -> Step | None:
        """A greedy step of ``token`` at ``position`` in one call: its embedding row, every layer (keys and values
        appended to ``cache``), the argmax; the rows entering each layer of ``taps`` kept. None (nothing done) where
        it does not apply (``steps``, a batched cache)."""
        args = self.step_args(token, position, cache)
        if args is None:
            return None
        _, plan, cos, sin, keys, values, starts = args
        final, tapped, ids = self.ops.run_plan(plan, 0, len(self.layers), self._no_rows, token,
                                               position, cos, sin, keys, values, starts, list(taps), True)
        return Step(int(ids), tapped, final)

    def step_args(self, token: int, position: int, cache: KVCache) -> tuple | None:
        """What a one-call step of ``token`` at ``position`` takes (``step``, a deep head's ``draft_or_step``): (the
        compiled ops, the plan, per rotary kind the cos and sin tables, every layer's key and value buffers, their
        starts), one entry reserved in every layer of ``cache``. None (nothing reserved) where ``step`` does not
        apply."""
        if not self.steps or cache.keys[0].shape[0] != 1:
            return None
        if not 0 <= token < self.vocab_size:
            raise IndexError(f"token id {token} out of range [0, {self.vocab_size})")
        tables = [self.rotary.table(kind, self._probe, position + 1) for kind in self.kinds]
        starts = cache.reserve_all(1)  # reserving may grow a layer's buffers
        return self.ops, self.plan, [t[0] for t in tables], [t[1] for t in tables], cache.keys, cache.values, starts

    def _tables(self, h: torch.Tensor, positions: torch.Tensor) -> tuple[tuple[list, list], int]:
        """(per rotary kind the cos and sin tables, the block's first row in them): the fixed tables where they hold
        the positions, else the block's own rows (first row 0)."""
        cos, sin, first = [], [], 0
        for kind in self.kinds:
            located = self.rotary.locate(h, positions, kind)
            if located is None:
                c, s = self.rotary.rotary(h, positions, kind)
                cos.append(c.contiguous())
                sin.append(s.contiguous())
                first = 0
            else:
                (c, s), first = located
                cos.append(c)
                sin.append(s)
        return (cos, sin), first
