"""How quantized weights multiply float32 activations: one entry per ``ModelConfig.numerics`` choice.

Every decision that depends on the numerics reads its entry here: which kernel a linear calls (``QuantWeight``,
and ``PackedLinear.kernel_plan`` for the compiled plan), whether a prefill may take the panels, whether the prefix
cache's promise holds at any row count, whether token trees stay bitwise, whether the LM head's screen applies.
A new numerics path is an entry here and its kernels (a function of the extension and a ``Part`` kind in
``kernels/step.cpp``); nothing else branches on the mode.
"""

from __future__ import annotations

from dataclasses import dataclass

from selfspec.errors import InvalidConfigError


@dataclass(frozen=True)
class Numerics:
    """One way of multiplying; the fields are what the rest of the engine asks of it."""

    name: str  # ModelConfig.numerics
    kernel: str  # the extension's function for 1-16 rows (and, 16 at a time, for more)
    part_kind: int  # the ``Part`` kind the compiled plan calls (kernels/step.cpp: 0 qlinear, 1 qlinear_i8)
    exact: bool  # the dequantized model's result (the target losslessness is measured against)
    panels: bool  # many rows may take the prefill's panels or torch's GEMM (the same exact values, another order)
    rows_independent: bool  # a row's result never depends on the rows computed with it, at any row count
    trees: bool  # a token tree's rows (SDPA under a mask) are bitwise single steps' under this numerics
    screen: bool  # the LM head's int8 screen may pick a greedy verdict (it bounds the gap to this mode's logits)
    arithmetic: str  # what a product is, in words (printed at load: ``SelfSpec.describe``)

    @property
    def suffix(self) -> str:
        """'' for the exact mode, else '-<name>': the kernel label's and the cost cache key's tag."""
        return "" if self.exact else f"-{self.name}"


NUMERICS: dict[str, Numerics] = {
    "exact": Numerics("exact", "qlinear", 0, exact=True, panels=True, rows_independent=False, trees=True,
                      screen=True, arithmetic="float32 activations times the dequantized weights, float32 FMA sums"),
    # llama.cpp's numerics: activations rounded to 8 bits per block, integer dot products (docs/QUANTIZED.md)
    "int8": Numerics("int8", "qlinear_i8", 1, exact=False, panels=False, rows_independent=True, trees=False,
                     screen=False, arithmetic="activations rounded to 8 bits per block, integer dot products"),
}


def numerics(name: str) -> Numerics:
    """The entry of ``name``; an unknown name is an error listing the known ones."""
    if name not in NUMERICS:
        raise InvalidConfigError(f"numerics must be one of {', '.join(map(repr, NUMERICS))}, got {name!r}")
    return NUMERICS[name]
