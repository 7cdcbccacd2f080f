"""One token's pass through the layers when earlier tokens skipped layers ("layer debt").

A token that exits at layer e has keys/values only in layers [0, e). Later tokens attend to it in every
layer, so its missing entries must exist before anyone reads them. Here they are computed on the way:
the next token's pass picks the indebted rows up at their own layers and runs them along, in one block
with the new row (a few more rows of a memory-bound GEMV cost almost nothing). Nothing reads a missing
entry, and every entry is computed exactly once, with the same math as a full forward (tested: the
cache equals a full forward's, allclose).

Invariant: the indebted tokens are the positions just before the new token, and their layers do not
increase with position. So in layer i the rows to run are a contiguous run of positions ending at the
new token: the cache of layer i is complete before them. Worked example (L = 30), tokens at positions
7, 8 exited at 20 and 12, the new token is at 9:

    layers  0..11  rows [9]           (positions 7, 8 are cached there)
    layers 12..19  rows [8, 9]        (8 joins with its layer-12 state)
    layers 20..29  rows [7, 8, 9]     (7 joins with its layer-20 state)

If the new token exits at layer 15, rows 8 and 9 become debt at 15, and 7 stays at 20: still
non-increasing. A token that runs through every layer pays every debt off.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass
class DebtRow:
    layer: int  # keys/values exist for layers [0, layer); ``state`` is the input of ``layer``
    state: torch.Tensor  # [1, 1, hidden]


def run_token(
    split,  # selfspec.models.split.SplitModel
    cache,  # selfspec.models.cache.KVCache
    debt: list[DebtRow],  # indebted rows at positions p - len(debt) .. p - 1, layers non-increasing
    h: torch.Tensor | None,  # [1, 1, hidden] the new token's embedding at position p (None: only pay the debt)
    p: int,
    stops: Sequence[int] = (),  # layers (in (0, L)) at which ``visit`` sees the new row's state
    visit: Callable[[int, torch.Tensor], bool] | None = None,  # (layer, state [1, 1, hidden]) -> exit here?
) -> tuple[int, torch.Tensor | None, list[DebtRow]]:
    """Run the new token from layer 0, picking up debt rows at their layers, until ``visit`` says exit at a
    stop layer or all layers ran. Returns (the exit layer, or L; the states of the rows present then
    ``# [1, n, hidden]``, the last row the new token's; the debt after the pass). With ``h=None`` the debt
    rows alone run through every remaining layer (their final states are returned)."""
    L = split.num_layers
    remaining = list(debt)
    for a, b in zip(remaining, remaining[1:]):
        assert a.layer >= b.layer, "debt layers must not increase with position"
    if h is None:
        if not remaining:
            return L, None, []
        i, first, last = remaining[-1].layer, p, p - 1
        stops, visit = [], None
    else:
        i, first, last = 0, p, p
        stops = sorted(s for s in stops if 0 < s < L)
    while True:
        joined = []
        while remaining and remaining[-1].layer == i:
            joined.append(remaining.pop())
        if joined:
            h = torch.cat([r.state for r in reversed(joined)] + ([h] if h is not None else []), dim=1)
            first -= len(joined)
        assert h is not None  # the new row, or (h=None) the debt rows, which join at the first layer run
        nxt = min([L, *(s for s in stops if s > i), *([remaining[-1].layer] if remaining else [])])
        pos = torch.arange(first, last + 1, device=h.device).unsqueeze(0)
        h = split.run_layers(h, i, nxt, pos, cache)
        i = nxt
        if i == L:
            return L, h, []
        if visit is not None and i in stops and visit(i, h[:, -1:]):
            return i, h, remaining + [DebtRow(i, h[:, j : j + 1]) for j in range(h.shape[1])]
