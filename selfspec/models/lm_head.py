"""The target's final norm and LM head: logits of last-layer states, their greedy verdict, rows of the head.

A greedy verdict takes the cheapest exact way: for 3-8 rows of a quantized LM head the int8 screen (exact kernel
only on the blocks that can hold the maximum, ``selfspec/quant/screen.py``); for other rows up to 16 the plan's
argmax (the final norm, LM head and argmax in one compiled call, ``StepPlans.argmax``); else the logits' argmax.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from selfspec.kernels.linear import MAX_GEMV_ROWS, PackedLinear, pack_linear
from selfspec.models.fast import Norm
from selfspec.quant.modules import weight_rows
from selfspec.quant.screen import ScreenedArgmax
from selfspec.sampling import greedy


class LMHead:
    """``norm`` and ``lm_head`` (the model's modules); ``fast``: packed for selfspec's kernels (else the modules
    run); ``ops``: the compiled ops, if any; ``softcap``: Gemma's final logit soft-capping."""

    def __init__(self, norm: nn.Module, lm_head: Any, softcap: float | None, fast: bool, ops: Any) -> None:
        self.norm, self.softcap, self.ops = norm, softcap, ops
        self.lm_head: Any = lm_head  # an nn.Linear or a QuantLinear
        self.fast_norm = Norm(norm) if fast else None
        self.packed: PackedLinear | None = pack_linear(lm_head) if fast else None
        # the plan's argmax of up to 16 rows (``StepPlans.argmax``), set once the plan is built
        self.plan_argmax: Callable[[torch.Tensor], torch.Tensor | None] | None = None
        qhead = getattr(lm_head, "qweight", None) if fast else None
        # A greedy verification's argmax through the int8 screen (selfspec/quant/screen.py): exact mode, no softcap
        self.screen = (ScreenedArgmax(qhead) if qhead is not None and softcap is None
                       and getattr(lm_head, "bias", None) is None and ScreenedArgmax.available(qhead) else None)

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        if self.fast_norm is None:
            return self.norm(h)
        if self.ops is not None and h.dtype == torch.float32:  # the compiled RMSNorm, as every fast layer's own norms
            return self.ops.rms_norm(h.contiguous(), self.fast_norm.weight, self.fast_norm.eps)
        return self.fast_norm(h)

    def head_logits(self, h_normed: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [..., vocab] float32
        logits = self.packed(h_normed) if self.packed is not None else self.lm_head(h_normed)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.float()

    def logits(self, h: torch.Tensor) -> torch.Tensor:  # last-layer states -> logits
        return self.head_logits(self.final_norm(h))

    def greedy_ids(self, h: torch.Tensor) -> torch.Tensor:  # [..., hidden] last-layer states -> [...] int64
        """``logits(h).argmax(-1)``, bit for bit, the cheapest exact way (the module's docstring)."""
        rows = h.numel() // h.shape[-1]
        screen = self.screen if self.screen is not None and self.screen.covers(rows) else None
        if screen is None and self.plan_argmax is not None and 0 < rows <= MAX_GEMV_ROWS:
            ids = self.plan_argmax(h.reshape(rows, h.shape[-1]))
            if ids is not None:
                return ids.view(h.shape[:-1])
        x = self.final_norm(h)
        if screen is not None:
            found = screen.argmax(x.reshape(rows, x.shape[-1]).float())
            if found is not None:
                return found.view(x.shape[:-1])
        return greedy(self.head_logits(x))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:  # ids [R] -> [R, hidden] float32 rows of the LM head
        """Rows of the LM head's weight (dequantized rows only, for a quantized model)."""
        return weight_rows(self.lm_head, ids).float()

    def part(self, ids: torch.Tensor) -> PackedLinear:
        """The LM head restricted to rows ``ids`` (``# [R]``), packed for decoding (quantized rows stay so)."""
        qweight = getattr(self.lm_head, "qweight", None)
        if qweight is not None:
            return PackedLinear([(qweight.select(ids.cpu()), None)])
        return PackedLinear([(self.lm_head.weight[ids].detach().contiguous(), None)])
