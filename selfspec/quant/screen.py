"""The LM head's argmax for a greedy verification, screened by the 8-bit kernel: the logits' argmax, bit for bit.

A greedy verification of a block of n rows needs each row's argmax of the LM head, not its logits. At n >= 3
rows the exact kernel multiplies the output matrix (Qwen2.5-0.5B: 151,936 x 896, the largest matrix of the
model) at compute cost, while the int8 kernel reads it at the cost of one row. ``qargmax``
(``selfspec/kernels/qargmax.cpp``) computes every logit with the int8 kernel, bounds its error per block of 16
output rows, and runs the exact kernel only on the blocks whose bound can reach the best row (a median of 3 blocks
of 9,496 on Spec-Bench states): the argmax is then that of the exact logits, first index among equals, as
``torch.argmax`` of ``qlinear``'s output. Greedy output is unchanged; sampling still takes the full logits.

The bound (per block b, group j of g columns): ``E[b, j]`` = the block's largest ``sum_k |w_k|`` over the group,
times 1/2 (rounding moves each activation by at most half its step ``max|x| / 127``), plus room for the float32
rounding of both kernels (``(K + G + 8) 2^-24`` of the largest possible sum of |terms|). Built once per weight
from its own packed codes (``qgroup_l1``: one pass over them), at load (``prepare``).
"""

from __future__ import annotations

import torch

from selfspec.kernels.build import built_extension
from selfspec.quant.packing import LANES
from selfspec.quant.weight import QuantWeight

SCREEN_MIN_ROWS = 3  # from here the screen is never slower than the exact kernel, read from memory, whether memory is
# fast or slow (docs/QUANTIZED.md)
SCREEN_MAX_ROWS = 8  # past 8 rows the int8 kernel takes two tiles and ties the exact one (qargmax takes up to 16)


def error_table(w: QuantWeight) -> torch.Tensor:  # -> [N / 16, G] float32
    """``E[b, j]``: the most the int8 kernel's logit of a row in block ``b`` can differ from the exact kernel's,
    per unit of group ``j``'s rounding step (see the module docstring)."""
    fmt = w.format
    k = w.shape[1]
    nb, groups = w.codes.shape[0], w.codes.shape[1]
    g = fmt.group
    rounding = (k + groups + 8) * 2.0**-24 * 127  # float32 rounding, per unit of |x|'s step (|x| <= 127 step)
    s = w.group_values(w.scales).abs()  # [NB, G, 16]
    o = w.group_values(w.offsets).abs() if w.offsets.numel() else torch.zeros_like(s)
    terms = g * (((1 << fmt.bits) - 1 + abs(fmt.zero)) * s + o)  # >= sum_k |q s| + |z s + o| of a row's group
    l1 = built_extension().qgroup_l1(*w.kernel_args(), torch.empty(nb, groups, LANES))  # sum |w|
    return (0.5 * (1 + 2.0**-16) * l1 + rounding * terms).amax(-1).contiguous()  # [NB, G, 16] -> [NB, G]


class ScreenedArgmax:
    """``argmax(x)`` = ``(x @ W^T).argmax(-1)`` for a quantized LM head ``W``, through ``qargmax``."""

    def __init__(self, weight: QuantWeight) -> None:
        self.weight = weight
        self._table: torch.Tensor | None = None
        self.calls = 0
        self.candidate_blocks = 0  # summed over calls: how many blocks went through the exact kernel

    @staticmethod
    def available(weight: QuantWeight) -> bool:
        """Whether the screen applies: the exact mode's weight, a build whose int8 kernel is VNNI's (AVX-512; on
        AVX2 the int8 kernel was not measured against the exact one at these shapes)."""
        ext = built_extension()
        return weight.mode.screen and hasattr(ext, "qargmax") and bool(ext.qlinear_i8_vnni())

    def covers(self, rows: int) -> bool:
        return SCREEN_MIN_ROWS <= rows <= SCREEN_MAX_ROWS

    def prepare(self) -> None:
        """Build the bound table now (~1 MB for Qwen2.5's LM head), not in the first screened verification:
        that one's request would stall for it (``SelfSpec.set_draft`` calls this)."""
        if self._table is None:
            self._table = error_table(self.weight)

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:  # x [M, K] float32 -> [M] int64, or None
        """Each row's argmax, or None when ``x`` holds a non-finite value (the caller computes the logits)."""
        self.prepare()
        out = torch.empty(x.shape[0], dtype=torch.long)
        codes, scales, offsets, bits, group, z = self.weight.kernel_args()
        blocks = built_extension().qargmax(x.contiguous(), codes, scales, offsets, bits, group, z,
                                           self.weight.shape[0], self._table, out)
        self.calls += 1
        self.candidate_blocks += int(blocks)
        return None if int(out[0]) < 0 else out
