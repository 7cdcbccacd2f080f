"""Nested exit heads (S2D, Kavehzadeh et al., 2024, "Sorted LLaMA"): one deep-context head that drafts
from several exit depths, trained together (sorted training), so one file offers drafts at several
costs and the engine picks the depth per request or per step.

Each depth d in ``depths`` owns only a small input map; everything else is shared:

    u_d(p) = A_d(RMSNorm_d(h_d(p)))                 # per depth: an RMSNorm and a hidden x hidden map
    f^(p)  = DeepContextHead.features(u_d(p), f(p-1))  # shared: fuse, decoder-layer copy, norms
    logits = LMHead(RMSNorm_out(f^(p)))              # shared, frozen LM head (trimmed vocabulary)

The drafter maps exit states into the shared space (``project``) as soon as they are made, so the
head's own KV cache holds depth-free entries: a switch of depth between rounds needs no catch-up, and
the sorted training includes a pass where every position comes from a random depth, which is what a
per-step switch produces. With A_d = I and RMSNorm_d = 1 the head at its own exit layer is exactly the
deep head it was initialised from.

Verification is unchanged (it starts from the depth the round drafted at), so output stays lossless.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from selfspec.errors import ExitLayerError
from selfspec.heads.deep import DeepContextHead
from selfspec.heads.kangaroo import RMSNorm
from selfspec.models.split import SplitModel


class NestedDeepHead(DeepContextHead):
    kind = "nested"

    def __init__(self, split: SplitModel, exit_layer: int, depths: list[int] | None = None) -> None:
        super().__init__(split, exit_layer)
        depths = sorted(set(depths or [exit_layer]))
        bad = [d for d in depths if not 1 <= d < split.num_layers]
        if bad or exit_layer not in depths:
            raise ExitLayerError(f"nested head depths {depths} must lie in 1..{split.num_layers - 1} and include "
                                 f"the default exit layer {exit_layer}")
        self.depths = depths
        hidden, eps = split.hidden_size, getattr(split.config, "rms_norm_eps", 1e-6)
        self.depth_norm = nn.ModuleDict({str(d): RMSNorm(hidden, eps) for d in depths})
        maps = {str(d): nn.Linear(hidden, hidden, bias=False) for d in depths}
        with torch.no_grad():
            for m in maps.values():
                m.weight.copy_(torch.eye(hidden))
        self.depth_map = nn.ModuleDict(maps)
        self.to(device=split.device, dtype=split.dtype)

    def args(self) -> dict[str, Any]:
        return {"depths": list(self.depths)}

    def front_ready(self, rows: int) -> bool:
        """Never: the compiled first draft does not map exit states into the shared space (``project``)."""
        return False

    def project(self, h: torch.Tensor, depth: int) -> torch.Tensor:
        """Exit states of depth ``depth`` ``# [batch, n, hidden]`` -> the shared input space of ``features``."""
        if str(depth) not in self.depth_map:
            raise ExitLayerError(f"this nested head drafts from depths {self.depths}, not {depth}")
        depth_map = cast(nn.Linear, self.depth_map[str(depth)])  # built as Linears (ModuleDict is not generic)
        return self.linear(depth_map)(self.depth_norm[str(depth)](h))
