"""``nn.Module``s holding block-quantized weights in place of a transformers model's Linear and Embedding.

A model loaded from a GGUF natively (``selfspec.models.gguf``) keeps its transformers structure, with its
linears and token embedding swapped for these. The fast backend reads their ``qweight`` and runs the
quantized kernels; transformers' own forward (the reference backend, ``generate`` as a peer, the
lossless tests) calls ``forward`` here, which dequantizes the weight on first use and keeps that float32
copy for later calls: only the reference path ever materializes one (``drop_dense`` frees it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from selfspec.errors import InvalidConfigError
from selfspec.quant.numerics import numerics as numerics_of
from selfspec.quant.weight import QuantWeight


class QuantLinear(nn.Module):
    """``y = x @ W^T + b`` with W a ``QuantWeight`` ``# [out_features, in_features]``."""

    def __init__(self, qweight: QuantWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.qweight = qweight
        self.out_features, self.in_features = qweight.shape
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self._dense: torch.Tensor | None = None

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (float32, made on first use and kept: the reference path only)."""
        if self._dense is None:
            self._dense = self.qweight.dense()
        return self._dense

    def drop_dense(self) -> None:
        self._dense = None

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of W in float32, without dequantizing the rest."""
        return self.qweight.rows(ids)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, type={self.qweight.type_name}"


class QuantEmbedding(nn.Module):
    """A token embedding whose rows are dequantized as they are looked up (``embed_scale``: Gemma's)."""

    def __init__(self, qweight: QuantWeight, padding_idx: int | None = None,
                 embed_scale: torch.Tensor | None = None) -> None:
        super().__init__()
        self.qweight = qweight
        self.num_embeddings, self.embedding_dim = qweight.shape
        self.padding_idx = padding_idx
        self.embed_scale = embed_scale

    @property
    def weight(self) -> torch.Tensor:
        """The whole table in float32 (transient; nothing in the engine asks for it)."""
        return self.qweight.dense()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.qweight.rows(ids.reshape(-1)).view(*ids.shape, self.embedding_dim)
        if self.embed_scale is not None:
            out = out * self.embed_scale.to(out.dtype)
        return out

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, type={self.qweight.type_name}"


def weight_rows(module: nn.Linear | QuantLinear, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` ``# [R]`` of a Linear's or QuantLinear's weight, ``# [R, in_features]``."""
    if isinstance(module, QuantLinear):
        return module.rows(ids)
    return module.weight[ids]


def set_numerics(model: nn.Module, numerics: str) -> nn.Module:
    """Switch every quantized weight of ``model`` to the numerics named ``numerics`` (``ModelConfig.numerics``,
    selfspec/quant/numerics.py) before the engine packs it; transformers' own forward (the reference) always stays
    exact."""
    mode = numerics_of(numerics)  # an unknown name: an error listing the known ones
    weights = [m.qweight for m in model.modules() if isinstance(m, (QuantLinear, QuantEmbedding))]
    if not mode.exact and not weights:
        raise InvalidConfigError(f"numerics={numerics!r} needs quantized weights: a GGUF (dtype='auto') or quantize=TYPE")
    for w in weights:
        w.numerics = mode.name
    return model


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, (QuantLinear, QuantEmbedding)) for m in model.modules())


def zero_linear(in_features: int, out_features: int, bias: bool) -> nn.Linear:
    """An ``nn.Linear`` of zeros whose values are set next (copied, or loaded from a file). Not nn.Linear's random init
    (paid at every head load, for values never used) nor the meta device (its first use imports sympy); zeros touch
    the memory as that init does (uninitialized Linears leave more resident, through the allocator)."""
    lin = nn.Linear(1, 1, bias=bias)
    lin.in_features, lin.out_features = in_features, out_features
    lin.weight = nn.Parameter(torch.zeros(out_features, in_features))
    if bias:
        lin.bias = nn.Parameter(torch.zeros(out_features))
    return lin


def dequantized_copy(module: nn.Module, values: bool = True) -> nn.Module:
    """A deep copy of ``module`` with every QuantLinear turned into a float32 ``nn.Linear`` (a trainable
    copy of a target layer: an exit head's block). ``values=False``: those Linears are zeros (a head whose
    weights are loaded from its file next: nothing is dequantized). The QuantLinears
    are never copied (the copy's are replaced; a deep copy would duplicate the packed buffer they are views of)."""
    import copy

    quantized = {id(m): m for m in module.modules() if isinstance(m, QuantLinear)}
    out = copy.deepcopy(module, memo=dict(quantized))
    for name, child in list(out.named_modules()):
        if isinstance(child, QuantLinear):
            bias = child.bias is not None
            lin = zero_linear(child.in_features, child.out_features, bias)
            if values:
                had_dense = child._dense is not None  # (the target's own module: leave it as it was)
                with torch.no_grad():
                    lin.weight.copy_(child.weight)
                    if child.bias is not None:
                        lin.bias.copy_(child.bias)
                if not had_dense:
                    child.drop_dense()
            parent, _, attr = name.rpartition(".")
            setattr(out.get_submodule(parent) if parent else out, attr, lin)
    return out
