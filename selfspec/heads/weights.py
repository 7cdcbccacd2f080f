"""A head's weights as they are built: from a file next (``weights_follow``: no initial values computed first), and
block-quantized for drafting (``quantized_linear``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from torch import nn

from selfspec.quant.convert import quantize_weight
from selfspec.quant.modules import QuantLinear

_WEIGHTS_FOLLOW: ContextVar[bool] = ContextVar("selfspec_head_weights_follow", default=False)


@contextmanager
def weights_follow() -> Iterator[None]:
    """Heads built inside receive every weight from a file next (``heads.io.load_head``): they skip computing
    initial ones (a layer head's copy of the target's layer is then not dequantized only to be overwritten)."""
    token = _WEIGHTS_FOLLOW.set(True)
    try:
        yield
    finally:
        _WEIGHTS_FOLLOW.reset(token)


def weights_to_follow() -> bool:
    """Whether a head built now receives its weights from a file next (``weights_follow``)."""
    return _WEIGHTS_FOLLOW.get()


def quantized_linear(module: nn.Linear, type_name: str) -> nn.Module:
    """``module`` with ``type_name`` block-quantized weights (a QuantLinear, what the kernels pack), or ``module``
    itself when its input width takes no blocks of 32 or the type is float32 (a head's draft weights)."""
    if type_name == "float32" or module.in_features % 32 != 0:
        return module
    bias = None if module.bias is None else module.bias.detach().float()
    return QuantLinear(quantize_weight(module.weight, type_name), bias)
