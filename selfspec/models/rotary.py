"""Rotary position tables: one sequence's consecutive positions read as rows of a table computed once per layer kind.

A step's own rotary call would run ~7 small ops with cold caches; the rotary function run once on positions
0, 1, ... (doubled as a sequence outgrows it) gives the same rows bit for bit, since every row is elementwise
(tested). Other positions (a tree's, a batch's), or a rotary that depends on the longest position seen (dynamic NTK,
LongRoPE), take the call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

ROTARY_TABLE_MIN = 512  # positions a rotary table holds at first (it doubles as a sequence outgrows it)

RotaryFn = Callable[[torch.Tensor, torch.Tensor, str], tuple[torch.Tensor, torch.Tensor]]


class RotaryTables:
    """cos, sin of positions 0, 1, ... per (layer kind, dtype), grown on demand; ``rotary(h, positions, kind)`` is the
    model's own rotary call."""

    def __init__(self, rotary: RotaryFn, static: bool) -> None:
        self.rotary = rotary
        self.static = static  # cos, sin depend on the positions alone (``static_rope``)
        self._tables: dict[tuple[str, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def rows(self, h: torch.Tensor, positions: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``# [1, n, rot]`` of one sequence's consecutive positions ``# [1, n]``, contiguous, from the table;
        the model's call for any other positions."""
        located = self.locate(h, positions, kind)
        if located is None:
            c, s = self.rotary(h, positions, kind)
            return c.contiguous(), s.contiguous()
        (cos, sin), first = located
        n = positions.shape[-1]
        return cos[:, first : first + n], sin[:, first : first + n]

    def locate(self, h: torch.Tensor, positions: torch.Tensor,
               kind: str) -> tuple[tuple[torch.Tensor, torch.Tensor], int] | None:
        """(the table holding ``positions``, their first row), or None where the rows must come from a call."""
        first = consecutive(positions) if self.static else None
        if first is None:
            return None
        return self.table(kind, h, first + positions.shape[-1]), first

    def table(self, kind: str, h: torch.Tensor, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``# [1, >= end, rot]`` of positions 0, 1, ... for layers of ``kind`` in ``h``'s dtype, computed
        once and again (twice the size) only when a sequence outgrows it."""
        key = (kind, h.dtype)
        table = self._tables.get(key)
        if table is None or table[0].shape[1] < end:
            size = max(end, ROTARY_TABLE_MIN, 2 * table[0].shape[1] if table is not None else 0)
            c, s = self.rotary(h, torch.arange(size, device=h.device).unsqueeze(0), kind)
            table = self._tables[key] = (c.contiguous(), s.contiguous())
        return table


def consecutive(positions: torch.Tensor) -> int | None:
    """The first of one sequence's consecutive positions ``# [1, n]`` (a causal step's), or None (a tree's, a batch's)."""
    n = positions.shape[-1]
    if positions.dim() != 2 or positions.shape[0] != 1 or n == 0:
        return None
    known = getattr(positions, "first", None)  # made consecutive (SequenceState.positions): no values to read
    if known is not None:
        return known
    first = int(positions[0, 0])
    return first if n == 1 or positions[0].tolist() == list(range(first, first + n)) else None


def static_rope(rotary: nn.Module) -> bool:
    """Whether a rotary embedding's cos and sin depend on the positions alone; not so for the types transformers
    updates with the longest position seen (dynamic NTK, LongRoPE), nor for a module that does not say its type."""
    if getattr(rotary, "positions_only", False):  # selfspec's lean models' (selfspec.models.lean.LeanRotary)
        return True
    kinds = getattr(rotary, "rope_type", None)
    kinds = list(kinds.values()) if isinstance(kinds, dict) else [kinds]
    return all(isinstance(k, str) and "dynamic" not in k and k != "longrope" for k in kinds)
