"""Quantizing a float model at load: ``ModelConfig(quantize="Q4_0")`` on any safetensors / hub model.

Every decoder-layer linear, the LM head and the token embedding are quantized with gguf-py (the reference
quantizers of llama.cpp's legacy types, bit-exact with ggml's): Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0. The
quantized model is then the target: losslessness is measured against *its* dequantized weights (what
``QuantLinear.weight`` gives transformers' forward), not against the float model it came from.
Matrices whose input width is not a multiple of 32 stay float. The result is cached
(``selfspec.quant.store``), so the next load maps the packed weights.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from selfspec.errors import InvalidConfigError
from selfspec.quant.formats import FORMATS
from selfspec.quant.store import assemble, empty_model
from selfspec.quant.weight import QuantWeight

QUANTIZE_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # gguf-py quantizes these


def quantize_weight(w: torch.Tensor, type_name: str) -> QuantWeight:
    """``w`` ``# [N, K]`` float -> a packed QuantWeight of ``type_name`` (K a multiple of 32)."""
    from gguf import GGMLQuantizationType, quantize

    raw = quantize(w.detach().float().cpu().numpy().astype(np.float32), GGMLQuantizationType[type_name])
    return QuantWeight.from_gguf(raw, type_name, w.shape[1])


def quantize_parts(model: nn.Module, type_name: str) -> tuple[dict[str, QuantWeight], dict[str, torch.Tensor]]:
    """(module name -> QuantWeight, parameter name -> float tensor) for ``model`` quantized to ``type_name``:
    what ``selfspec.quant.store.assemble`` puts into an empty model of the same config."""
    if type_name not in QUANTIZE_TYPES:
        raise InvalidConfigError(f"quantize must be one of {', '.join(QUANTIZE_TYPES)}, got '{type_name}'")
    group = FORMATS[type_name].group
    quant: dict[str, QuantWeight] = {}
    hf: Any = model  # a transformers CausalLM (get_input_embeddings, lm_head)
    embed = hf.get_input_embeddings()
    tied = hf.lm_head.weight is embed.weight
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)) and module.weight.shape[1] % group == 0:
            if name == "lm_head" and tied:
                continue  # shares the embedding's (assemble ties it)
            quant[name] = quantize_weight(module.weight, type_name)
    floats = {}
    for pname, p in model.named_parameters():
        module_name, _, kind = pname.rpartition(".")
        if not (module_name in quant and kind == "weight"):
            floats[pname] = p.detach().float().contiguous()
    if tied:
        floats.pop("lm_head.weight", None)
    return quant, floats


def quantize_model(model: nn.Module, type_name: str) -> nn.Module:
    """A new model of ``model``'s config with its weights quantized to ``type_name`` (``model`` untouched)."""

    quant, floats = quantize_parts(model, type_name)
    out = assemble(empty_model(model.config), quant, floats, "the float model")
    out.generation_config = model.generation_config
    return out
