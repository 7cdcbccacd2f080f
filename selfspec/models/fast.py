"""The fast forward: decoder layers re-expressed over packed, fused weights, writing the static cache.

``SplitModel(backend="fast")`` runs these instead of transformers' modules (``backend="reference"``,
kept for tests and comparison). Same math, fewer and cheaper ops (docs/BENCHMARKS.md has the profile):

- q, k, v as one packed linear and gate, up as another (fused projections); every linear through
  the kernel chosen for the device and dtype (``selfspec.kernels``);
- o_proj and down_proj add into the residual stream in place (no separate add);
- rotary tables computed once per call of ``run_layers`` (not per layer); rotary for q and k in
  three ops (``x * cos + roll(x) * sin_signed``, bit-identical to transformers' rotate_half form);
- keys and values written straight into the static cache, attention by SDPA with grouped-query
  heads (no repeat of the keys), masks built once per call.
- on CPU in float32, selfspec's fused C++ ops (``selfspec/kernels/ops.cpp``, ``attention.cpp``): RMSNorm,
  rotary + cache write and silu * up for any number of rows (a prefill's rows split over the threads), and
  causal attention over the cache for any number of queries (also on a prefill, in place of SDPA's flash
  kernel; token trees' masks go to SDPA), each one call instead of a chain of small torch ops;
- and for a causal step of one sequence, every layer of a range in one C++ call (``FastLayer.plan``,
  ``selfspec/kernels/step.cpp``): the same ops in the same order, with no Python between them.

One ``FastLayer`` is built from each transformers decoder layer; its weights are read once (packed
copies), the module stays untouched. Supported layouts: Llama / Mistral / Qwen2 (q/k/v bias) /
Qwen3 (q/k norms) / Gemma 3 (q/k norms, sandwich norms, (1 + w) norms) / Phi-3 (fused qkv and
gate_up, partial rotary).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from selfspec.kernels.linear import MAX_GEMV_ROWS, PackedLinear, cpu_extension, pack_linear

_GEMMA_NORMS = ("Gemma3RMSNorm",)


class Norm:
    """An RMSNorm module's weight and epsilon, applied with the module's own numerics."""

    def __init__(self, module: nn.Module) -> None:
        # (1 + w), multiplied before the cast back: Gemma's norms (transformers' class, or a lean tree's flag)
        self.gemma = type(module).__name__ in _GEMMA_NORMS or bool(getattr(module, "plus_one", False))
        weight = module.weight
        assert isinstance(weight, torch.Tensor), f"{type(module).__name__} has no weight tensor"
        w = weight.detach()
        self.weight = (1.0 + w.float()) if self.gemma else w
        self.eps = float(getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6)))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gemma:
            return (y * self.weight).type_as(x)
        return self.weight * y.type_as(x)


class Rotary:
    """cos / sin tables of one call, laid out for ``[batch, n, heads, head_dim]`` tensors."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor) -> None:  # cos, sin [batch, n, rot]
        self.dim = cos.shape[-1]
        self.raw = (cos.contiguous(), sin.contiguous())  # for the fused op
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None  # the unfused path's, made on first use

    @property
    def cos(self) -> torch.Tensor:  # [batch, n, 1, rot]
        return self._unfused()[0]

    @property
    def sin(self) -> torch.Tensor:  # [batch, n, 1, rot], its first half negated
        return self._unfused()[1]

    def _unfused(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables the unfused path multiplies by (the fused op reads ``raw``: a drafted token's head call
        builds them for nothing otherwise). rotate_half(x) * sin == roll(x, half) * (sin with its first half
        negated), exactly."""
        if self._tables is None:
            cos, sin = self.raw
            half = self.dim // 2
            self._tables = (cos.unsqueeze(2), torch.cat([-sin[..., :half], sin[..., half:]], dim=-1).unsqueeze(2))
        return self._tables

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x [batch, n, heads, head_dim]
        if x.shape[-1] == self.dim:
            return x * self.cos + x.roll(self.dim // 2, dims=-1) * self.sin
        rot, rest = x[..., : self.dim], x[..., self.dim :]  # partial rotary (Phi-3 variants)
        return torch.cat([rot * self.cos + rot.roll(self.dim // 2, dims=-1) * self.sin, rest], dim=-1)


@dataclass
class Segment:
    """One sequence's rows in a multi-sequence layer call (``FastLayer.forward_segments``)."""

    offset: int  # its first row
    n: int  # its rows (new tokens)
    rotary: Rotary  # tables for its positions
    mask: torch.Tensor | None  # [1, 1, n, start + n] bool, or None (a single causal query)
    keys: torch.Tensor  # [1, kv_heads, capacity, head_dim] its cache buffers of this layer
    values: torch.Tensor
    start: int  # its cache length of this layer before the call
    causal: bool = True  # False: ``mask`` is a token tree's
    tail: int | None = None  # only its last ``tail`` rows need this layer's output, the others only their keys and
    # values (a prefill's last layer: ``SplitModel.run_layers``'s ``keep``); None: every row


class FastLayer:
    """One decoder layer over packed weights; ``forward`` updates ``h`` in place and returns it."""

    def __init__(self, layer: nn.Module, index: int, window: int | None = None) -> None:
        hf: Any = layer  # a transformers decoder layer: its submodules are read by name (the architecture's)
        attn, mlp = hf.self_attn, hf.mlp
        self.index, self.window = index, window or 0
        if getattr(attn, "attn_logit_softcapping", None):
            raise NotImplementedError("attention logit soft-capping (use backend='reference')")
        self.qkv: PackedLinear = (
            pack_linear(attn.qkv_proj) if hasattr(attn, "qkv_proj") else pack_linear(attn.q_proj, attn.k_proj, attn.v_proj)
        )
        self.o = pack_linear(attn.o_proj)
        self.gate_up = pack_linear(mlp.gate_up_proj) if hasattr(mlp, "gate_up_proj") else pack_linear(mlp.gate_proj, mlp.up_proj)
        self.down = pack_linear(mlp.down_proj)
        self.act = getattr(mlp, "act_fn", None) or mlp.activation_fn
        self.input_norm = Norm(hf.input_layernorm)
        self.post_attn_norm = Norm(hf.post_attention_layernorm)
        self.sandwich = hasattr(hf, "pre_feedforward_layernorm")  # Gemma: norms around attn and MLP outputs
        if self.sandwich:
            self.pre_ff_norm = Norm(hf.pre_feedforward_layernorm)
            self.post_ff_norm = Norm(hf.post_feedforward_layernorm)
        self.q_norm = Norm(attn.q_norm) if hasattr(attn, "q_norm") else None
        self.k_norm = Norm(attn.k_norm) if hasattr(attn, "k_norm") else None
        cfg = attn.config
        self.head_dim: int = attn.head_dim
        self.num_heads: int = cfg.num_attention_heads
        self.num_kv_heads: int = cfg.num_key_value_heads
        self.scaling: float = attn.scaling
        self.ops = cpu_extension() if self.qkv.path in ("selfspec-cpu", "selfspec-quant") else None
        probe = torch.linspace(-6, 6, 64, dtype=self.qkv.dtype, device=self.qkv.device)
        self.silu = bool(torch.equal(self.act(probe), F.silu(probe)))
        self.plan = self._step_plan()
        self._single: Any = None  # ``_one_layer_plan``'s

    @property
    def linears(self) -> tuple[PackedLinear, PackedLinear, PackedLinear, PackedLinear]:
        """The layer's four packed matrices, in the order a step runs them (and ``LayerPlan`` takes them)."""
        return self.qkv, self.o, self.gate_up, self.down

    def _step_plan(self) -> Any | None:
        """The layer as one C++ object (``selfspec/kernels/step.cpp``) that runs a causal step of one sequence
        (1-16 rows) with the fused path's ops, bit for bit, and no Python between them; None where a layout
        needs the Python path (Gemma's sandwich norms, a non-SiLU MLP, a linear off selfspec's kernels)."""
        if self.ops is None or self.sandwich or not self.silu or self.qkv.dtype != torch.float32:
            return None
        linears = [lin.kernel_plan(self.ops) for lin in self.linears]
        if any(lin is None for lin in linears):
            return None
        empty = torch.empty(0)
        qn, kn = self.q_norm, self.k_norm
        return self.ops.LayerPlan(
            *linears, self.input_norm.weight, self.input_norm.eps, self.post_attn_norm.weight, self.post_attn_norm.eps,
            qn.weight if qn else empty, qn.eps if qn else 0.0, kn.weight if kn else empty, kn.eps if kn else 0.0,
            self.num_heads, self.num_kv_heads, self.head_dim, self.window, self.scaling,
        )

    def _one_layer_plan(self) -> Any:
        """This layer alone as a ``StepPlan`` (no embedding, no argmax: ``models/plans.py``), built once."""
        if self._single is None:
            empty = torch.empty(0)
            self._single = self._fused_ops().StepPlan([self.plan], [0], 1, -1, empty, empty, empty, 0, 0, 0.0, 0, None)
        return self._single

    def _sdpa(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, end: int,
              mask: torch.Tensor | None, causal: bool = False) -> torch.Tensor:  # q [b, n, hq, d] -> [b, n, hq * d]
        """Attention of ``q`` over the first ``end`` cache entries under ``mask``; ``causal``: the rows are the whole
        sequence from position 0 and the mask plain causal, so SDPA's own causal form replaces it (its CPU flash
        kernel then skips the blocks above the diagonal, where with the mask it would compute them all and mask out
        about half of the work)."""
        b, n, hq, d = q.shape
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys[:, :, :end], values[:, :, :end], attn_mask=None if causal else mask,
            is_causal=causal, scale=self.scaling, enable_gqa=hq != self.num_kv_heads,
        )  # [b, hq, n, d]
        return a.transpose(1, 2).reshape(b, n, hq * d)

    def forward(
        self,
        h: torch.Tensor,  # [batch, n, hidden], owned by the caller's loop: updated in place
        rotary: Rotary,
        mask: torch.Tensor | None,  # [1, 1, n, kv_len] bool, or None (causal-free single query)
        keys: torch.Tensor,  # [batch, kv_heads, capacity, head_dim] this layer's cache buffers
        values: torch.Tensor,
        start: int,  # this layer's cache length before the call
        causal: bool = True,  # False: ``mask`` is arbitrary (a token tree), never assume causal order
    ) -> torch.Tensor:
        return self.forward_segments(h, [Segment(0, h.shape[1], rotary, mask, keys, values, start, causal)])

    def forward_segments(self, h: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        """The layer over the rows of several sequences at once: ``h`` ``# [batch, rows, hidden]`` holds each
        segment's rows (``Segment.offset``, ``Segment.n``), every segment attends only to its own cache
        (its own length, positions and mask: ragged sequences stay exact), and every weight is read once
        for all rows. Updates ``h`` in place and returns it."""
        b, n, _ = h.shape
        # ops: the compiled row-wise ops (norms, rotary + cache write, silu * up) and causal attention, for any rows
        ops = self.ops is not None and h.dtype == torch.float32
        tails = [self._tail(seg, ops) for seg in segments]
        if any(t < seg.n for t, seg in zip(tails, segments)):
            return self._forward_tails(h, segments, tails, ops)
        if (ops and b * n <= MAX_GEMV_ROWS and self.plan is not None and len(segments) == 1 and segments[0].causal
                and segments[0].n == n and h.is_contiguous()):
            seg = segments[0]  # one causal sequence (a head's block): the layer as one C++ call, the same ops
            self._fused_ops().run_plan(self._one_layer_plan(), 0, 1, h, -1, 0, [seg.rotary.raw[0]],
                                       [seg.rotary.raw[1]], [seg.keys], [seg.values], [seg.start], [], False)
            return h
        qkv = self._qkv(h, ops)  # [b, rows, (hq + 2 hkv) d]
        if len(segments) == 1 and segments[0].n == n:
            a = self._attend(qkv, segments[0], ops)
        else:
            a = h.new_empty(b, n, self.num_heads * self.head_dim)
            for seg in segments:
                a[:, seg.offset : seg.offset + seg.n] = self._attend(qkv[:, seg.offset : seg.offset + seg.n], seg, ops)
        return self._mlp(h, a, ops)

    def _tail(self, seg: Segment, ops: bool) -> int:
        """How many of ``seg``'s last rows this call computes through (its ``tail``, where the compiled ops run a
        causal segment: the attention takes any rows at the end of the cache; elsewhere every row)."""
        return min(seg.n, seg.tail) if seg.tail is not None and ops and seg.causal else seg.n

    def _forward_tails(self, h: torch.Tensor, segments: list[Segment], tails: list[int], ops: bool) -> torch.Tensor:
        """``forward_segments`` where some segments need only their last rows' output (a prefill's last layer): every
        row's keys and values go into its cache, but attention, o_proj and the MLP run on the tails alone. A row's
        result is the one the whole call gives it where the kernels compute rows independently (the panels from
        PANEL_ROWS rows, the compiled attention: what the prefix cache relies on, ``selfspec.prefix_cache``); the
        rows outside the tails keep their input. On a long prompt, the last layer's attention and MLP then run on
        a few rows instead of all of them."""
        qkv = self._qkv(h, ops)
        parts = [self._attend(qkv[:, seg.offset : seg.offset + seg.n], seg, ops, tail=t)
                 for seg, t in zip(segments, tails)]
        a = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]  # [b, sum of tails, hq d]
        starts = [seg.offset + seg.n - t for seg, t in zip(segments, tails)]  # each tail's first row
        if len(segments) == 1:  # one range at the end of the rows: a view, updated in place
            self._mlp(h[:, starts[0] : starts[0] + tails[0]], a, ops)
            return h
        idx = torch.cat([torch.arange(lo, lo + t, device=h.device) for lo, t in zip(starts, tails)])
        h[:, idx] = self._mlp(h[:, idx], a, ops)
        return h

    def _fused_ops(self) -> Any:
        """The compiled ops (``selfspec/kernels/ops.cpp``, ``attention.cpp``): a call is only fused when they were
        built."""
        assert self.ops is not None, "a fused call without the compiled ops"
        return self.ops

    def _norm(self, x: torch.Tensor, norm: Norm, ops: bool) -> torch.Tensor:
        return self._fused_ops().rms_norm(x, norm.weight, norm.eps) if ops else norm(x)

    def _qkv(self, h: torch.Tensor, ops: bool) -> torch.Tensor:  # [b, n, hidden] -> [b, n, (hq + 2 hkv) d]
        b, n, _ = h.shape
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv(self._norm(h, self.input_norm, ops))
        if ops and self.q_norm is not None:  # Qwen3 / Gemma 3: per-head norms of q and k before rotary
            assert self.k_norm is not None  # q and k norms come together
            heads = qkv.view(b, n, hq + 2 * hkv, d)
            heads[:, :, :hq] = self._norm(heads[:, :, :hq].contiguous(), self.q_norm, True)
            heads[:, :, hq : hq + hkv] = self._norm(heads[:, :, hq : hq + hkv].contiguous(), self.k_norm, True)
        return qkv

    def _attend(self, qkv: torch.Tensor, seg: Segment, ops: bool, tail: int | None = None) -> torch.Tensor:
        """One segment's attention: rotary, its keys / values written into its cache, attention over the
        cache (``ops``: by the compiled ops; a token tree's mask by SDPA); ``tail``: only the last rows attend
        (every row's keys and values are written; ``ops`` and a causal segment only).
        ``qkv`` ``# [b, n, (hq + 2 hkv) d]`` -> ``# [b, n, hq d]`` (``# [b, tail, hq d]``)."""
        b, n, _ = qkv.shape
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if ops:
            q = self._fused_ops().rope_qkv(qkv.contiguous(), *seg.rotary.raw, seg.keys, seg.values, seg.start, hq, hkv)
            if tail is not None and tail < n:
                assert seg.causal, "a tail of a token tree's rows"
                return self._fused_ops().attention(q[:, n - tail :].contiguous(), seg.keys, seg.values,
                                                   seg.start + n - tail, self.window, self.scaling)
            # Every causal block takes the fused op, from one query to a prefill: it reads the cache in place (no
            # transposes, no mask tensor), each row's keys end at its own position, and it is one call, not SDPA's
            # chain of ops (timings: docs/BENCHMARKS.md).
            # Its rows never depend on each other, so a verification block's attention gives bitwise the rows of
            # single steps (the int8 mode relies on it).
            if seg.causal:
                return self._fused_ops().attention(q, seg.keys, seg.values, seg.start, self.window, self.scaling)
            return self._sdpa(q, seg.keys, seg.values, seg.start + n, seg.mask)  # a token tree's mask
        heads = qkv.view(b, n, hq + 2 * hkv, d)
        if self.q_norm is not None:
            assert self.k_norm is not None  # q and k norms come together
            q = seg.rotary(self.q_norm(heads[:, :, :hq]))
            k = seg.rotary(self.k_norm(heads[:, :, hq : hq + hkv]))
        else:
            qk = seg.rotary(heads[:, :, : hq + hkv])
            q, k = qk[:, :, :hq], qk[:, :, hq:]
        end = seg.start + n
        seg.keys[:, :, seg.start : end] = k.transpose(1, 2)
        seg.values[:, :, seg.start : end] = heads[:, :, hq + hkv :].transpose(1, 2)
        return self._sdpa(q, seg.keys, seg.values, end, seg.mask, self._from_zero(seg, n))

    def _from_zero(self, seg: Segment, n: int) -> bool:
        """Whether ``seg``'s ``n`` rows are a causal sequence from position 0 within this layer's window (a prefill):
        its mask is then exactly SDPA's ``is_causal``."""
        return seg.causal and seg.start == 0 and n > 1 and (not self.window or n <= self.window)

    def _mlp(self, h: torch.Tensor, a: torch.Tensor, ops: bool) -> torch.Tensor:
        """o_proj into the residual, then the MLP (sandwich norms for Gemma); ``h`` updated in place."""
        if self.sandwich:
            h += self._norm(self.o(a), self.post_attn_norm, ops)
            x = self._norm(h, self.pre_ff_norm, ops)
        else:
            self.o(a, out=h, accumulate=True)
            x = self._norm(h, self.post_attn_norm, ops)
        gu = self.gate_up(x)
        if ops and self.silu:
            y = self._fused_ops().silu_mul(gu)
        else:
            gate, up = gu.chunk(2, dim=-1)
            y = self.act(gate) * up
        if self.sandwich:
            h += self._norm(self.down(y), self.post_ff_norm, ops)
        else:
            self.down(y, out=h, accumulate=True)
        return h


