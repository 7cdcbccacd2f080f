"""A light exit head (EESD-style self-distilled head): an RMSNorm, a residual low-rank (or full)
linear map, and the target's final norm, in front of the frozen LM head:

    x = h + B(A(RMSNorm_in(h)))          # A: hidden -> rank, B: rank -> hidden (rank 0: one full matrix)
    logits = LMHead(RMSNorm_out(x))

Stateless (no attention, no cache), so it costs one small matmul on top of the LM head. B starts at
zero and RMSNorm_out at the target's final norm: before training the head equals the untrained exit.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from selfspec.heads.base import ExitHead
from selfspec.heads.kangaroo import RMSNorm
from selfspec.models.split import SplitModel


class LinearHead(ExitHead):
    kind = "linear"

    def __init__(self, split: SplitModel, exit_layer: int, rank: int = 64) -> None:
        super().__init__(split, exit_layer)
        hidden = split.hidden_size
        self.rank = int(rank)
        eps = getattr(split.config, "rms_norm_eps", 1e-6)
        self.norm_in = RMSNorm(hidden, eps)
        inner = self.rank if self.rank > 0 else hidden
        self.down = nn.Linear(hidden, inner, bias=False)
        self.up = nn.Linear(inner, hidden, bias=False)
        self.norm_out = RMSNorm(hidden, eps)
        self.to(device=split.device, dtype=split.dtype)

    def args(self) -> dict[str, Any]:
        return {"rank": self.rank}

    def init_from_target(self) -> None:
        """Identity residual and the target's final norm: logits == the untrained exit's."""
        with torch.no_grad():
            self.up.weight.zero_()
            self.norm_out.weight.copy_(self.split.norm.weight)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, state: Any = None) -> torch.Tensor:
        x = h + self.up(self.down(self.norm_in(h)))
        return self.lm_logits(self.norm_out(x))
