"""Kangaroo's adapter (Liu et al., 2024, "Kangaroo: Lossless Self-Speculative Decoding via Double
Early Exiting"): one attention block with two RMSNorms and no MLP, between the exit layer and the
target's frozen LM head:

    x = h + Attn(RMSNorm_1(h))          # attention over the exit states of all previous tokens
    logits = LMHead(RMSNorm_2(x))       # LM head shared with (and frozen like) the target

The attention has the target's geometry (heads, kv heads, head_dim) and uses the target's rotary
embedding, so it sees positions the same way. It keeps its own one-layer KV cache per sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from selfspec.heads.base import CachedHead
from selfspec.kernels.build import cpu_extension
from selfspec.models.cache import KVCache
from selfspec.models.masks import causal_mask
from selfspec.models.split import SplitModel


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (not torch.is_grad_enabled() and x.dtype == torch.float32 and self.weight.dtype == torch.float32
                and x.device.type == "cpu"):
            ops = cpu_extension()  # drafting: one compiled call (selfspec/kernels/ops.cpp) instead of seven small ops
            if ops is not None:
                return ops.rms_norm(x.contiguous(), self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on the first ``cos.shape[-1]`` dims of ``x`` (partial rotary allowed).
    x [batch, heads, n, head_dim]; cos/sin [batch, n, rot_dim]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rot = cos.shape[-1]
    xr, xp = x[..., :rot], x[..., rot:]
    x1, x2 = xr[..., : rot // 2], xr[..., rot // 2 :]
    rotated = torch.cat((-x2, x1), dim=-1)
    return torch.cat((xr * cos + rotated * sin, xp), dim=-1)


class KangarooAdapter(CachedHead):
    kind = "kangaroo"

    def __init__(self, split: SplitModel, exit_layer: int) -> None:
        super().__init__(split, exit_layer)
        c = split.config
        hidden, hd = split.hidden_size, split.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, split.num_kv_heads, hd
        eps = getattr(c, "rms_norm_eps", 1e-6)
        self.norm_in = RMSNorm(hidden, eps)
        self.q_proj = nn.Linear(hidden, self.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.num_heads * hd, hidden, bias=False)
        self.norm_out = RMSNorm(hidden, eps)
        self.to(device=split.device, dtype=split.dtype)

    def init_from_target(self) -> None:
        """Start from the exit layer's own attention and the target's final norm: a head that
        already drafts about as well as the untrained exit, which training then improves."""
        layer = self.split.layers[self.exit_layer - 1] if self.exit_layer > 0 else self.split.layers[0]
        attn = layer.self_attn
        with torch.no_grad():
            self.norm_in.weight.copy_(layer.input_layernorm.weight)
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                src = getattr(attn, name, None)
                if src is not None and src.weight.shape == getattr(self, name).weight.shape:
                    getattr(self, name).weight.copy_(src.weight)
            self.o_proj.weight.mul_(0.0)  # residual starts as the identity: logits == untrained exit
            self.norm_out.weight.copy_(self.split.norm.weight)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, state: KVCache | None = None) -> torch.Tensor:
        b, n, _ = h.shape
        x = self.norm_in(h)
        q = self.q_proj(x).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.split.rotary(h, positions)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if state is not None:
            k, v = state.update(k, v, 0)
            mask = causal_mask(n, k.shape[2], None, h.device)
            causal = False
        else:
            mask, causal = None, n > 1
        rep = self.num_heads // self.num_kv_heads
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        x = h + self.o_proj(attn.transpose(1, 2).reshape(b, n, -1))
        return self.lm_logits(self.norm_out(x))
