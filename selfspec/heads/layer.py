"""A one-decoder-layer exit head: a trainable copy of the target's own decoder layer k (attention +
MLP, the architecture's own module) and a final RMSNorm, in front of the frozen LM head:

    x = DecoderLayer_copy(h_k)          # starts as the target's layer k: the draft sees layer k + 1
    logits = LMHead(RMSNorm_out(x))     # RMSNorm_out starts as the target's final norm

More capacity than Kangaroo's attention-only adapter (which was designed for 7B-scale targets whose
shallow states are already rich) at the cost of one layer per draft token. Stateful: the copied
attention keeps its own one-layer KV cache per sequence, rolled back with the target's.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from selfspec.errors import InvalidConfigError
from selfspec.heads.base import CachedHead
from selfspec.heads.kangaroo import RMSNorm
from selfspec.heads.weights import quantized_linear, weights_to_follow
from selfspec.kernels.linear import MAX_GEMV_ROWS, PackedLinear
from selfspec.models.cache import KVCache
from selfspec.models.fast import FastLayer, Rotary, Segment
from selfspec.models.masks import TreeAttention, block_mask, causal_mask
from selfspec.models.split import SplitModel
from selfspec.quant.modules import dequantized_copy

OUTPUT_PROJECTIONS = ("o_proj", "down_proj", "dense")  # a decoder layer's writes into the residual stream


def quantized_block(block: nn.Module, type_name: str) -> nn.Module:
    """A copy of ``block`` whose linear layers hold ``type_name`` block-quantized weights (what FastLayer packs);
    its float32 Linears are not copied (the copy's are replaced)."""
    out = copy.deepcopy(block, memo={id(m): m for m in block.modules() if isinstance(m, nn.Linear)})
    for name, module in list(out.named_modules()):
        if isinstance(module, nn.Linear):  # (kept as it is when its input width takes no blocks)
            parent, _, child = name.rpartition(".")
            setattr(out.get_submodule(parent) if parent else out, child, quantized_linear(module, type_name))
    return out


class DecoderLayerHead(CachedHead):
    kind = "layer"

    def __init__(self, split: SplitModel, exit_layer: int, head_layers: int = 1) -> None:
        super().__init__(split, exit_layer)
        if head_layers < 1:
            raise InvalidConfigError(f"head_layers must be at least 1, got {head_layers}")
        src = min(exit_layer, split.num_layers - 1)  # the target layer copied (k, or the last at k = L)
        # the architecture's decoder layer (submodules by name); its values only when no file's follow
        block: Any = dequantized_copy(split.layers[src], values=not weights_to_follow())
        block.self_attn.layer_idx = 0  # its own cache
        self.block: nn.Module = block
        # further decoder layers (a deeper head): copies of the target's next ones, each with its own cache layer
        self.more = nn.ModuleList()
        for i in range(1, head_layers):
            extra: Any = dequantized_copy(split.layers[min(src + i, split.num_layers - 1)],
                                          values=not weights_to_follow())
            extra.self_attn.layer_idx = i
            self.more.append(extra)
        self.norm_out = RMSNorm(split.hidden_size, getattr(split.config, "rms_norm_eps", 1e-6))
        self._kind, self._window = split.layer_types[src], split.windows[src]
        self._fast: tuple[tuple[int, ...], list[FastLayer]] | None = None
        self.to(device=split.device, dtype=split.dtype)

    def args(self) -> dict[str, Any]:
        return {"head_layers": self.head_layers} if self.head_layers > 1 else {}

    @property
    def head_layers(self) -> int:
        """How many decoder layers the head has."""
        return 1 + len(self.more)

    @property
    def blocks(self) -> list[nn.Module]:
        """The head's decoder layers, in order (``block`` first)."""
        return [self.block, *self.more]

    def new_state(self, capacity: int) -> KVCache:
        s = self.split
        return KVCache(self.head_layers, s.num_kv_heads, s.head_dim, capacity, s.dtype, s.device)

    def init_from_target(self) -> None:
        """The final norm is the target's; further layers start as the identity (their attention's and MLP's
        output projections zero: the residual stream passes unchanged), so a head with more layers starts exactly
        as the one-layer head it is fine-tuned from."""
        with torch.no_grad():
            self.norm_out.weight.copy_(self.split.norm.weight)
            for extra in self.more:
                for name, module in extra.named_modules():
                    if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in OUTPUT_PROJECTIONS:
                        module.weight.zero_()
                        if module.bias is not None:
                            module.bias.zero_()

    @property
    def draft_weights(self) -> str:
        """The type the block's matrices (and a deep head's fuse, ``linear``) are drafted with on the fast backend:
        Q4_0 when the target itself runs block-quantized weights (an eighth of float32's bytes: the head is read
        once per draft token, after the target's step has pushed it out of the caches), else float32. Only the
        draft changes; verification, hence the output, does not. Q4_0 rather than Q8_0: a head call and a drafting
        round's proposal read fewer bytes, and the drafts' acceptance stays level. The drafted vocabulary's LM rows
        keep the target's own type: quantized again to Q4_0 (Qwen's Q6_K rows) they would save little of a call and
        cost accepted length."""
        return "Q4_0" if self.split.backend == "fast" and self.split.quantized else "float32"

    def prepare(self) -> None:
        super().prepare()
        with torch.inference_mode():
            self._fast_block()

    def _fast_block(self) -> list[FastLayer] | None:
        """The blocks as FastLayers (packed weights, see ``draft_weights``) for inference on the fast backend;
        rebuilt when the weights change (an optimizer step bumps their version). Its callers (``prepare``,
        ``run_block``) have brought an unloaded head's matrices back."""
        if self.released:
            assert self._fast is not None, "released after the block was packed"
            if torch.is_grad_enabled():
                raise RuntimeError("this head's float32 weights were released for inference (release_float): load it "
                                   "again to train it")
            return self._fast[1]
        if self.split.backend != "fast" or torch.is_grad_enabled():
            return None
        version = tuple(p._version for b in self.blocks for p in b.parameters())
        if self._fast is None or self._fast[0] != version:
            fast = []
            for block in self.blocks:
                if self.draft_weights != "float32":
                    block = quantized_block(block, self.draft_weights)
                fast.append(FastLayer(block, 0, self._window))
            self._fast = (version, fast)
        return self._fast[1]

    def _drop_built(self) -> None:
        self._fast = None

    def packed_linears(self) -> list[PackedLinear]:
        """``ExitHead.packed_linears`` and the blocks' FastLayers' (attention and MLP matrices)."""
        fast = self._fast[1] if self._fast is not None else []
        return [*super().packed_linears(), *(pl for f in fast for pl in f.linears)]

    def float_matrices(self) -> list[nn.Linear]:
        """The blocks' linear layers (packed as ``draft_weights`` in their FastLayers)."""
        return [m for b in self.blocks for m in b.modules() if isinstance(m, nn.Linear)]

    def run_block(self, h: torch.Tensor, positions: torch.Tensor, state: KVCache | None = None,
                  tree: TreeAttention | None = None, tail: int | None = None) -> torch.Tensor:
        """The copied decoder layer over ``h`` ``# [batch, n, hidden]`` (appending to ``state`` when given;
        ``tree``: the n rows are token-tree nodes, as in ``SplitModel.run_layers``). ``tail``: only the last
        ``tail`` rows' output is wanted: the last layer writes every row's keys and values but runs attention and
        the MLP on those rows alone where the fast layers can (``Segment.tail``: a request's first draft catches up
        on 33 rows, 1 GFLOP on Qwen2.5-0.5B's head, four fifths of it the MLP); the other rows' output is then
        not the layer's."""
        split = self.split
        self.ensure_loaded()
        rot = split.rotary(h, positions, self._kind)
        n = h.shape[1]
        if state is not None:
            mask = block_mask(n, state.lengths[0] + n, self._window, h.device, tree)
            fast = self._fast_block()
            if fast is not None:
                h = h.clone()
                for i, layer in enumerate(fast):
                    start = state.reserve(i, n)
                    # only past a decoding step's rows: below them the one-call plan (every row) is faster
                    last = tail if i == len(fast) - 1 and tree is None and n > MAX_GEMV_ROWS else None
                    h = layer.forward_segments(h, [Segment(0, n, Rotary(*rot), mask, state.keys[i], state.values[i],
                                                           start, tree is None, last)])
                return h
        else:  # training over whole sequences: a plain causal mask (None lets SDPA use is_causal)
            mask = None if n == 1 else causal_mask(n, n, None, h.device)
        for block in self.blocks:
            h = block(h, attention_mask=mask, position_ids=positions, past_key_values=state, position_embeddings=rot)
        return h

    def forward(self, h: torch.Tensor, positions: torch.Tensor, state: KVCache | None = None) -> torch.Tensor:
        return self.lm_logits(self.norm_out(self.run_block(h, positions, state)))
