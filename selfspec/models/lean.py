"""A model tree for the fast engine without transformers' model code.

Importing any transformers model (``transformers.modeling_utils``) pulls in accelerate, torch.distributed and
torch._dynamo: memory and import time spent before a single weight is read. The fast engine never runs those
modules' forwards; it reads their weights and a few attributes by name (``FastLayer``, ``SplitModel``). So a
GGUF run natively gets this tree instead: the same attribute names and parameter names as transformers'
model of the architecture (``model.layers.3.self_attn.q_proj`` ...), holding the same quantized modules and
float tensors, built from the config alone.

Where something does need transformers' math, it gets transformers' own modules over the same weights,
built on first use (and only then is transformers' model code imported):

- ``LeanDecoderLayer.forward`` calls the architecture's decoder layer class sharing this layer's weights
  (an exit head's trainable copy of a layer, the reference backend);
- ``LeanCausalLM.forward`` / ``generate`` call the architecture's CausalLM over the same weights
  (``transformers_model``): generate as a peer, the tests' reference.

Norms and rotary tables are computed here with transformers' exact formulas (tests compare them bitwise
with transformers' modules on every architecture). Architectures or RoPE types not covered here (dynamic
or LongRoPE frequency updates, an activation not listed) load transformers' tree as before (``lean_supported``).
"""

from __future__ import annotations

import copy
import importlib
import weakref
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from selfspec.models.configs import transformers_config
from selfspec.models.fast import Norm
from selfspec.quant.modules import QuantEmbedding, QuantLinear
from selfspec.quant.store import empty_model

# model_type -> (transformers module under transformers.models, class name prefix)
ARCHITECTURES = {
    "llama": ("llama", "Llama"),
    "mistral": ("mistral", "Mistral"),
    "qwen2": ("qwen2", "Qwen2"),
    "qwen3": ("qwen3", "Qwen3"),
    "gemma3_text": ("gemma3", "Gemma3"),
    "phi3": ("phi3", "Phi3"),
}

# transformers' ACT2FN entries these architectures use, as the same torch functions
ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
}


def _gemma(config: Any) -> bool:
    return config.model_type == "gemma3_text"


def _activation_name(config: Any) -> str:
    return config.hidden_activation if _gemma(config) else config.hidden_act


def _rope_parameters(config: Any) -> dict[str | None, dict]:
    """RoPE parameters by layer kind (Gemma 3 has one set per kind; the others one set, kind None)."""
    if _gemma(config):
        return {kind: config.rope_parameters[kind] for kind in sorted(set(config.layer_types))
                if config.rope_parameters.get(kind) is not None}
    return {None: config.rope_parameters}


def lean_supported(config: Any) -> bool:
    """Whether ``config``'s model can run as a lean tree: a listed architecture, a listed activation, and RoPE
    frequencies fixed at load (transformers updates dynamic and LongRoPE ones during a forward)."""
    if config.model_type not in ARCHITECTURES or _activation_name(config) not in ACTIVATIONS:
        return False
    if getattr(config, "rope_parameters", None) is None:
        return False
    types = [p.get("rope_type", "default") for p in _rope_parameters(config).values()]
    return all("dynamic" not in t and t != "longrope" for t in types)


class _Linear(nn.Linear):
    """nn.Linear made on the meta device without an initialization (torch's meta ``normal_`` imports torch._dynamo);
    ``assemble`` fills or replaces it."""

    def reset_parameters(self) -> None:
        pass


class _Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        pass


def _meta_linear(n_in: int, n_out: int, bias: bool) -> nn.Linear:
    return _Linear(n_in, n_out, bias=bias, device="meta")


class LeanRMSNorm(nn.Module):
    """RMSNorm as transformers computes it: ``w * norm(x)`` cast back, or Gemma's ``(norm(x) * (1 + w))``."""

    def __init__(self, dim: int, eps: float, plus_one: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, device="meta"))
        self.variance_epsilon = eps
        self.plus_one = plus_one  # Gemma's (1 + w), multiplied before the cast back

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
        return Norm(self)(x)  # the fast layers' RMSNorm: transformers' numerics (the weight read without grads)


class LeanRotary(nn.Module):
    """Rotary cos / sin tables as transformers' RotaryEmbedding of the architecture computes them."""

    positions_only = True  # cos, sin of a position depend on it alone (``selfspec.models.rotary.static_rope``)

    def __init__(self, config: Any) -> None:
        super().__init__()
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        self.scaling: dict[str | None, float] = {}
        for kind, params in _rope_parameters(config).items():
            rope_type = params.get("rope_type", "default")
            if rope_type == "default":
                head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
                dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
                inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
                scaling = 1.0
            else:
                kw = {"layer_type": kind} if kind is not None else {}
                inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None, **kw)
            self.register_buffer(f"{kind}_inv_freq" if kind else "inv_freq", inv_freq, persistent=False)
            self.scaling[kind] = scaling

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor,
                layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # [batch, n] -> [batch, n, rot]
        inv_freq = getattr(self, f"{layer_type}_inv_freq" if layer_type else "inv_freq")
        freqs = position_ids[..., None].float() * inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = self.scaling[layer_type]
        return (emb.cos() * scale).to(dtype=x.dtype), (emb.sin() * scale).to(dtype=x.dtype)


class LeanScaledEmbedding(_Embedding):
    """Gemma's token embedding, multiplied by sqrt(hidden) as transformers does (in the weight's dtype)."""

    def __init__(self, num: int, dim: int, padding_idx: int | None, scale: float) -> None:
        super().__init__(num, dim, padding_idx, device="meta")
        self.embed_scale = torch.tensor(scale)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.embed_scale.to(self.weight.dtype)


class LeanAttention(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.head_dim: int = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.scaling = config.query_pre_attn_scalar ** -0.5 if _gemma(config) else self.head_dim ** -0.5
        self.attn_logit_softcapping = getattr(config, "attn_logit_softcapping", None)
        hidden, q, kv = config.hidden_size, config.num_attention_heads * self.head_dim, \
            config.num_key_value_heads * self.head_dim
        kind = config.model_type
        if kind == "phi3":
            self.qkv_proj = _meta_linear(hidden, q + 2 * kv, False)
        else:
            bias = kind == "qwen2" or (kind != "mistral" and bool(getattr(config, "attention_bias", False)))
            self.q_proj, self.k_proj, self.v_proj = (_meta_linear(hidden, n, bias) for n in (q, kv, kv))
        o_bias = kind in ("llama", "qwen3", "gemma3_text") and bool(getattr(config, "attention_bias", False))
        self.o_proj = _meta_linear(q, hidden, o_bias)
        if kind in ("qwen3", "gemma3_text"):
            self.q_norm = LeanRMSNorm(self.head_dim, config.rms_norm_eps, _gemma(config))
            self.k_norm = LeanRMSNorm(self.head_dim, config.rms_norm_eps, _gemma(config))


class LeanMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        act = ACTIVATIONS[_activation_name(config)]
        bias = config.model_type == "llama" and bool(getattr(config, "mlp_bias", False))  # Llama's option only
        if config.model_type == "phi3":
            self.gate_up_proj = _meta_linear(hidden, 2 * inter, False)
            self.activation_fn = act
        else:
            self.gate_proj, self.up_proj = _meta_linear(hidden, inter, bias), _meta_linear(hidden, inter, bias)
            self.act_fn = act
        self.down_proj = _meta_linear(inter, hidden, bias)


class LeanDecoderLayer(nn.Module):
    """The architecture's decoder layer as weights and attributes; its forward is transformers' own layer over
    these very weights (built on first use, again when a weight module is swapped)."""

    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.self_attn = LeanAttention(config, layer_idx)
        self.mlp = LeanMLP(config)
        eps, plus = config.rms_norm_eps, _gemma(config)
        self.input_layernorm = LeanRMSNorm(config.hidden_size, eps, plus)
        self.post_attention_layernorm = LeanRMSNorm(config.hidden_size, eps, plus)
        if plus:
            self.pre_feedforward_layernorm = LeanRMSNorm(config.hidden_size, eps, plus)
            self.post_feedforward_layernorm = LeanRMSNorm(config.hidden_size, eps, plus)
        layer_types = getattr(config, "layer_types", None)
        self.attention_type = layer_types[layer_idx] if layer_types else "full_attention"

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return _twin(self, _layer_twin)(*args, **kwargs)


class LeanBody(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        pad = getattr(config, "pad_token_id", None)
        if _gemma(config):
            self.embed_tokens: nn.Module = LeanScaledEmbedding(config.vocab_size, config.hidden_size, pad,
                                                               config.hidden_size ** 0.5)
        else:
            self.embed_tokens = _Embedding(config.vocab_size, config.hidden_size, pad, device="meta")
        self.layers = nn.ModuleList(LeanDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = LeanRMSNorm(config.hidden_size, config.rms_norm_eps, _gemma(config))
        self.rotary_emb = LeanRotary(config)


class LeanCausalLM(nn.Module):
    """embed -> layers -> norm -> LM head, with transformers' names; ``forward`` and ``generate`` are transformers'
    CausalLM of the architecture over these weights (``transformers_model``)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        from transformers import GenerationConfig

        self.config = config
        self.generation_config = GenerationConfig.from_model_config(config)
        self.model = LeanBody(config)
        self.lm_head = _meta_linear(config.hidden_size, config.vocab_size, False)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return transformers_model(self)(*args, **kwargs)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        return transformers_model(self).generate(*args, **kwargs)


def lean_model(config: Any) -> LeanCausalLM:
    """The lean tree for ``config`` with its weights on the meta device (``selfspec.quant.store.assemble`` fills
    them), as ``selfspec.quant.store.empty_model`` makes transformers' one."""
    if not lean_supported(config):
        raise ValueError(f"no lean tree for this {config.model_type} configuration")
    return LeanCausalLM(config)


def meta_model(config: Any) -> nn.Module:
    """The model tree for ``config`` with its weights on the meta device, for ``assemble`` to fill: the lean tree
    where it covers the configuration, else transformers' model (``empty_model``)."""
    return lean_model(config) if lean_supported(config) else empty_model(config)


# ---- transformers' modules over the same weights ------------------------------------------------------------
_TWINS: weakref.WeakKeyDictionary[nn.Module, tuple[tuple, nn.Module]] = weakref.WeakKeyDictionary()


def _classes(config: Any) -> Any:
    package, prefix = ARCHITECTURES[config.model_type]
    return importlib.import_module(f"transformers.models.{package}.modeling_{package}"), prefix


def _layer_twin(layer: LeanDecoderLayer) -> nn.Module:
    from accelerate import init_empty_weights

    module, prefix = _classes(layer.config)
    config = copy.copy(transformers_config(layer.config))
    config._attn_implementation = "sdpa"  # as every model selfspec loads
    with init_empty_weights(include_buffers=False):
        return getattr(module, f"{prefix}DecoderLayer")(config, layer_idx=layer.self_attn.layer_idx)


def _model_twin(model: LeanCausalLM) -> nn.Module:
    out: Any = empty_model(model.config)  # transformers' CausalLM
    out.generation_config = model.generation_config
    return out


def _share(twin: nn.Module, lean: nn.Module) -> nn.Module:
    """Point ``twin`` (transformers' modules, weights on the meta device) at ``lean``'s weights: its linears and
    embedding become lean's modules, its norms take lean's parameters. Nothing is copied."""
    for name, module in lean.named_modules():
        parent, _, child = name.rpartition(".")
        if isinstance(module, (nn.Linear, nn.Embedding, QuantLinear, QuantEmbedding)):
            setattr(twin.get_submodule(parent) if parent else twin, child, module)
        elif isinstance(module, LeanRMSNorm):
            twin.get_submodule(name).weight = module.weight
    missing = [n for n, p in twin.named_parameters() if p.is_meta]
    assert not missing, f"transformers' modules have weights the lean tree lacks: {missing[:5]}"
    return twin


def _twin(lean: nn.Module, build: Any) -> nn.Module:
    """``lean``'s transformers twin, rebuilt when any of its modules or parameters was replaced (an exit head's
    copy of a layer swaps its quantized linears for float ones) or a layer index changed."""
    key = (tuple(id(m) for m in lean.modules()), tuple(id(p) for p in lean.parameters()),
           getattr(getattr(lean, "self_attn", None), "layer_idx", None))
    hit = _TWINS.get(lean)
    if hit is None or hit[0] != key:
        hit = (key, _share(build(lean), lean))
        _TWINS[lean] = hit
    return hit[1].train(lean.training)


def transformers_model(model: nn.Module) -> Any:
    """``model`` itself when it is transformers' model; for a lean tree, transformers' CausalLM of the architecture
    over the same weights (imports transformers' model code on first call, then kept while ``model`` lives)."""
    return _twin(model, _model_twin) if isinstance(model, LeanCausalLM) else model
