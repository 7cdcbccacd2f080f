"""A deep-context exit head: EAGLE's feature-level drafting brought into early-exit self-speculation.

Every verification already computes the final-layer states of the verified tokens. This head reads,
for the token at position p, its own exit state h_k(p) (the target's layers [0, k), which the draft
runs anyway) together with the final-layer state of the token before it, f(p - 1):

    x(p)  = Fuse([RMSNorm_h(h_k(p)), RMSNorm_f(f(p - 1))])   # 2 * hidden -> hidden
    f^(p) = DecoderLayer_copy(x(p))                           # attends over x of every earlier position
    logits(p) = LMHead(RMSNorm_out(f^(p)))                    # the draft of token p + 1

The decoder layer keeps its own one-layer KV cache per sequence (rolled back with the target's), so
the head attends over the deep context of the whole verified prefix. f^(p) is trained to be f(p)
(a normalized regression next to the token loss), so later draft positions, whose previous token is a
draft with no final state yet, read f^ in place of f:

    round from pending x at p:   f(p - 1) known  -> f^(p)   -> d_1
                                 h_k(d_1), f^(p) -> f^(p+1) -> d_2 ...

After verification the head's entries past position p are rolled back and the accepted tokens are fed
again with their true final states. Verification is unchanged, so the output stays lossless.

``context_layers`` (EAGLE-3's fused features, Li et al., 2025): the previous token's states after a few
target layers besides the last, each RMS-normed, join the fuse's input,

    x(p)  = Fuse([RMSNorm_h(h_k(p)), RMSNorm_f(f(p - 1)), RMSNorm_c1(h_c1(p - 1)), ...])

and read as zeros at draft positions, whose previous token has no target states (training's pass 2 does the
same). ``context`` is then ``# [batch, n, hidden * (1 + len(context_layers))]`` (f first); a context only
``hidden`` wide (f or f^) reads zeros for the rest.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from selfspec.errors import ExitLayerError
from selfspec.heads.base import Front
from selfspec.heads.kangaroo import RMSNorm
from selfspec.heads.layer import DecoderLayerHead
from selfspec.kernels.build import cpu_extension
from selfspec.kernels.linear import MAX_GEMV_ROWS
from selfspec.models.cache import KVCache
from selfspec.models.masks import TreeAttention
from selfspec.models.split import SplitModel


class DeepContextHead(DecoderLayerHead):
    kind = "deep"
    needs_context = True

    def __init__(self, split: SplitModel, exit_layer: int, context_layers: list[int] | None = None,
                 head_layers: int = 1) -> None:
        super().__init__(split, exit_layer, head_layers)
        hidden, eps = split.hidden_size, getattr(split.config, "rms_norm_eps", 1e-6)
        self.context_layers = sorted(set(context_layers or []))
        bad = [c for c in self.context_layers if not exit_layer < c < split.num_layers]
        if bad:
            raise ExitLayerError(f"context layers {bad} out of range: they lie past the exit layer {exit_layer} and "
                                 f"below the last layer {split.num_layers} (verification captures them)")
        self.norm_h = RMSNorm(hidden, eps)
        self.norm_f = RMSNorm(hidden, eps)
        self.norm_c = nn.ModuleList(RMSNorm(hidden, eps) for _ in self.context_layers)
        self.fuse = nn.Linear((2 + len(self.context_layers)) * hidden, hidden, bias=False)
        # draft_step's compiled plan: ((its decoder layers, fuse, LM rows as packed), (ops, HeadPlan) or None)
        self._plan: tuple[tuple[Any, Any, Any], tuple[Any, Any] | None] | None = None
        self.to(device=split.device, dtype=split.dtype)

    def args(self) -> dict[str, Any]:
        return super().args() | ({"context_layers": list(self.context_layers)} if self.context_layers else {})

    def init_from_target(self) -> None:
        """Both inputs start summed (Fuse = [I, I, 0, ...]: context layers start unread); the block is the
        target's layer k."""
        super().init_from_target()
        hidden = self.split.hidden_size
        eye = torch.eye(hidden, dtype=self.fuse.weight.dtype, device=self.fuse.weight.device)
        with torch.no_grad():
            self.fuse.weight.zero_()
            self.fuse.weight[:, : 2 * hidden].copy_(torch.cat([eye, eye], dim=1))

    def prepare(self) -> None:
        super().prepare()
        with torch.inference_mode():
            self.linear(self.fuse)  # packed now (release_float drops the float copy)

    def float_matrices(self) -> list[nn.Linear]:
        return [*super().float_matrices(), self.fuse]

    def features(
        self,
        h: torch.Tensor,  # [batch, n, hidden] exit states h_k
        context: torch.Tensor,  # [batch, n, hidden] final states of the previous positions (or f^)
        positions: torch.Tensor,  # [batch, n]
        state: KVCache | None = None,
        tree: TreeAttention | None = None,  # the rows are token-tree nodes (drafting a tree)
        tail: int | None = None,  # only the last ``tail`` rows' f^ are wanted (``run_block``)
    ) -> torch.Tensor:  # [batch, n, hidden] f^, the predicted final states
        hidden = self.split.hidden_size
        context = context.to(h.dtype)
        parts = [self.norm_h(h), self.norm_f(context[..., :hidden])]
        for i, norm in enumerate(self.norm_c):
            parts.append(norm(context[..., hidden * (i + 1) : hidden * (i + 2)]) if context.shape[-1] > hidden
                         else torch.zeros_like(h))
        x = self.linear(self.fuse)(torch.cat(parts, dim=-1))
        return self.run_block(x, positions, state, tree, tail)

    def draft_step(self, h: torch.Tensor, context: torch.Tensor, positions: torch.Tensor,
                   state: KVCache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``features`` and ``logits_part_of`` its last row in one compiled call (``head_step``,
        ``selfspec/kernels/step.cpp``), bit for bit the two: (f^ ``# [1, n, hidden]``, the last row's logits over
        the drafted vocabulary ``# [V']``, their ids ``# [V']``). ``h``, ``context`` ``# [1, n, hidden]``, n <= 16.
        None where the call does not apply: training, the reference backend, a layer off the fused path, context
        layers, a soft-capped or untrimmed LM head; the caller then takes the two steps."""
        n = h.shape[1]
        if n > MAX_GEMV_ROWS or h.dtype != torch.float32 or context.shape[-1] != h.shape[-1] or torch.is_grad_enabled():
            return None
        plan = self._head_plan()
        if plan is None:
            return None
        ops, plan = plan
        cos, sin = self.split.rotary_rows(h, positions, self._kind)
        layers = range(self.head_layers)
        starts = [state.reserve(i, n) for i in layers]  # first: reserving may grow (reallocate) a layer's buffers
        f_hat, logits = ops.head_step(plan, h.contiguous(), context.contiguous(), cos, sin,
                                      [state.keys[i] for i in layers], [state.values[i] for i in layers], starts)
        return f_hat, logits[0], self.vocab_ids

    def front_ready(self, rows: int) -> bool:
        """Whether ``draft_or_step`` applies to a first draft over ``rows`` rows (the backlog and the pending token's):
        both compiled plans exist (the head's, ``draft_step``'s; the target's, ``StepPlans.step``'s), the
        rows fit one call, nothing is being trained. Checked before the drafter takes the backlog."""
        plans = self.split.plans
        return self._fits(rows) and self._head_plan() is not None and plans is not None and plans.steps

    def _fits(self, rows: int) -> bool:
        """``front_ready``'s checks other than the plans: the rows fit one call, no gradients, float32."""
        return rows <= MAX_GEMV_ROWS and not torch.is_grad_enabled() and self.split.dtype == torch.float32

    def draft_or_step(self, token: int, position: int, cache: KVCache, exit_layer: int, backlog: torch.Tensor,
                      context: torch.Tensor, positions: torch.Tensor, state: KVCache, bar: float) -> Front | None:
        """A greedy round's first draft in one compiled call (``draft_or_step``, ``selfspec/kernels/step.cpp``):
        ``token`` at ``position`` through layers [0, ``exit_layer``) of the target (into ``cache``), the head over
        [``backlog``, that exit state] (``# [1, b, hidden]`` then one row; ``context`` ``# [1, b + 1, hidden]`` and
        ``positions`` ``# [1, b + 1]`` as ``draft_step`` reads them); and when the draft's confidence is under ``bar``
        (a blank round) the rest of the target's step, its keys and values in ``cache``: bit for bit the drafter's
        Python path (``drafting.chain.Chain``) and the verification of one row. None (nothing done) where
        ``front_ready`` is not."""
        n = backlog.shape[1] + 1
        plan = self._head_plan() if self._fits(n) and context.shape == (1, n, self.split.hidden_size) else None
        plans = self.split.plans
        step = plans.step_args(token, position, cache) if plan is not None and plans is not None else None
        if plan is None or step is None:
            return None
        ops, head_plan = plan
        cos, sin = self.split.rotary_rows(backlog, positions, self._kind)
        layers = range(self.head_layers)
        starts = [state.reserve(i, n) for i in layers]
        (exit_state, f_hat, final), drafted, tok, conf = ops.draft_or_step(
            step[1], head_plan, exit_layer, token, position, *step[2:], backlog.contiguous(), context.contiguous(),
            cos, sin, [state.keys[i] for i in layers],
            [state.values[i] for i in layers], starts, self.vocab_ids, bar)
        if drafted:  # only layers [0, exit_layer) took the token: the others' reserved entries are given back
            for i in range(exit_layer, self.split.num_layers):
                cache.lengths[i] = step[-1][i]
        return Front(exit_state, f_hat, drafted, tok, conf, final)

    def _head_plan(self) -> tuple[Any, Any] | None:
        """(the compiled ops, the head as one ``HeadPlan``), built once per packed weights (rebuilt when its decoder
        layers, fuse or drafted LM rows are packed again), or None where ``draft_step`` does not apply."""
        if self.released and self._plan is not None:  # packed for good (release_float): the plan built stays valid
            return self._plan[1]
        self.ensure_loaded()
        if self.split.backend != "fast" or self.context_layers or self.split.softcap is not None or not len(self.vocab_ids):
            return None
        fast, fuse = self._fast_block(), self.linear(self.fuse)
        if self._trim_lm is None:
            self._trim_lm = self.split.lm_head_part(self.vocab_ids)
        key = (fast, fuse, self._trim_lm)
        if self._plan is not None and all(a is b for a, b in zip(self._plan[0], key)):
            return self._plan[1]
        ops = cpu_extension()
        built = None
        if ops is not None and fast is not None and all(layer.plan is not None for layer in fast):
            fuse_plan, lm_plan = fuse.kernel_plan(ops), self._trim_lm.kernel_plan(ops)
            if fuse_plan is not None and lm_plan is not None:
                built = (ops, ops.HeadPlan(self.norm_h.weight.detach(), self.norm_h.eps, self.norm_f.weight.detach(),
                                           self.norm_f.eps, fuse_plan, [layer.plan for layer in fast],
                                           self.norm_out.weight.detach(), self.norm_out.eps, lm_plan))
        self._plan = (key, built)
        return built

    def _drop_built(self) -> None:
        super()._drop_built()
        self._plan = None

    def project(self, h: torch.Tensor, depth: int) -> torch.Tensor:
        """Exit states -> what ``features`` reads: themselves (a nested head maps each depth, heads.nested)."""
        return h

    def logits_of(self, f_hat: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [..., vocab] float32
        return self.lm_logits(self.norm_out(f_hat))

    def logits_part_of(self, f_hat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``logits_of`` over the drafted vocabulary only (``lm_part``): (logits ``# [..., n]``, ids or None)."""
        return self.lm_part(self.norm_out(f_hat))

    def forward(self, h: torch.Tensor, positions: torch.Tensor, state: KVCache | None = None,
                context: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for every row; without ``context`` the previous final states count as zeros."""
        if context is None:
            context = torch.zeros_like(h)
        return self.logits_of(self.features(h, context, positions, state))
