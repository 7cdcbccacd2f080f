"""Per-sequence decoding state. Nothing per-sequence lives in globals or in the model objects, so
several sequences (batching, a server's queue) can be decoded by one engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from selfspec.models.cache import KVCache


@dataclass
class SequenceState:
    cache: KVCache  # target KV, all layers
    length: int = 0  # tokens whose KV is final in every layer (prompt + accepted outputs)
    pending: int = -1  # last emitted token, not yet in the cache; the next round starts from it
    generator: torch.Generator | None = None
    head_state: Any = None  # the exit head's own state (Kangaroo adapter KV), if any
    head_backlog: torch.Tensor | None = None  # [1, b, hidden] exit states of positions the head has not seen
    tokens: list[int] = field(default_factory=list)  # prompt + emitted tokens (pending included): lookup drafts
    policy: Any = None  # this request's drafting policy (adaptive policies keep per-request state)
    depth: int | None = None  # exit depth of the next round (a nested head drafts from several)
    extras: dict[str, Any] = field(default_factory=dict)

    def positions(self, start: int, n: int) -> torch.Tensor:  # [1, n]
        """Positions start .. start + n - 1 as ``# [1, n]``; the tensor also says its first position (``first``), so
        that ``consecutive`` need not read it back (reading a tensor's values costs a few small ops, each slow
        right after a step has pushed the interpreter's working set out of the caches)."""
        out = torch.arange(start, start + n, device=self.cache.keys[0].device).unsqueeze(0)
        out.first = start  # type: ignore[attr-defined]
        return out
