"""Layer-split forward over a Hugging Face decoder-only model.

``SplitModel`` exposes the target as a ladder of small pieces so the engine can run layers
[0, k) for new tokens (the draft), keep their exit-layer hidden states, and later run layers
[k, L) over those cached states (the verification), all writing one ``KVCache``:

    h = split.embed(ids)                              # [batch, n, hidden]
    h_k = split.run_layers(h, 0, k, positions, cache)  # shallow: draft
    h_L = split.run_layers(h_k, k, L, positions, cache)  # deep: verify
    logits = split.logits(h_L)                        # final norm + LM head (models/lm_head.py)

Two backends run the same ladder. ``fast`` (the default) runs ``selfspec.models.fast.FastLayer``s:
the same math over packed, fused weights with the kernel chosen per device and dtype
(``selfspec.kernels``). ``reference`` calls transformers' own decoder modules directly (no config
is mutated, no weights are copied): the yardstick the tests compare the fast path with. On the fast
backend one causal block of 1-16 rows runs the compiled plan (models/plans.py); everything else (prefill,
ragged batches, trees) the fast layers' per-op path. Masks: models/masks.py; rotary tables: models/rotary.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from selfspec.errors import InvalidConfigError
from selfspec.kernels.linear import PackedLinear, kernel_name
from selfspec.models.architectures import check_supported
from selfspec.models.cache import KVCache
from selfspec.models.fast import FastLayer, Rotary, Segment
from selfspec.models.lm_head import LMHead
from selfspec.models.masks import TreeAttention, block_mask
from selfspec.models.plans import Step, StepPlans
from selfspec.models.rotary import RotaryTables, static_rope
from selfspec.quant.modules import QuantEmbedding, is_quantized
from selfspec.quant.numerics import NUMERICS, Numerics
from selfspec.quant.weight import QuantWeight

BACKENDS = ("fast", "reference")

@dataclass
class Ride:
    """One sequence's rows in ``SplitModel.run_rides``: they enter at ``layer`` and run to the last layer."""

    layer: int  # the first layer the rows go through (0: embeddings; k: exit states of layers [0, k))
    h: torch.Tensor  # [1, n, hidden] the rows' states entering ``layer``
    positions: torch.Tensor  # [1, n] absolute positions
    cache: KVCache  # the sequence's own cache
    tree: TreeAttention | None = None  # the rows are nodes of a token tree
    capture: int | None = None  # also keep the states after this many layers ...
    captured: torch.Tensor | None = None  # ... here, # [1, n, hidden]
    context: tuple[int, ...] = ()  # and after each of these (a deep head's context layers, past ``layer``) ...
    contexts: list[torch.Tensor] = field(default_factory=list)  # ... here, in order, each # [1, n, hidden]
    tail: int | None = None  # only the last ``tail`` rows' last-layer states are needed (``SplitModel.run_layers``)

    def with_contexts(self, h: torch.Tensor) -> torch.Tensor:
        """The last-layer states ``h`` ``# [1, n, hidden]`` followed by the context layers' (``round.through_layers``)."""
        return torch.cat([h, *self.contexts], dim=-1) if self.context else h


class SplitModel:
    """The target model seen as embed -> layers[i:j] -> final norm -> LM head."""

    def __init__(self, model: nn.Module, backend: str = "fast") -> None:
        hf: Any = model  # a transformers CausalLM: its config and submodules are read by name (the architecture's)
        cfg = hf.config
        check_supported(cfg.model_type)
        if backend not in BACKENDS:
            raise InvalidConfigError(f"unknown backend '{backend}' (known: {', '.join(BACKENDS)})")
        self.model = model
        self.config = cfg
        inner = hf.model
        self.embed_tokens = inner.embed_tokens  # Gemma's scaled embedding scales inside
        self.layers = inner.layers
        self.norm = inner.norm
        self.rotary_emb = inner.rotary_emb
        self.lm_head = hf.lm_head
        self.num_layers: int = cfg.num_hidden_layers
        self.softcap: float | None = getattr(cfg, "final_logit_softcapping", None)
        self._rotary_by_type = cfg.model_type == "gemma3_text"
        layer_types = getattr(cfg, "layer_types", None)
        window = getattr(cfg, "sliding_window", None)
        if layer_types is None:  # Mistral / Phi-3: one window (or none) for every layer
            layer_types = ["sliding_attention" if window else "full_attention"] * self.num_layers
        self.layer_types: list[str] = list(layer_types)
        self.windows: list[int | None] = [window if t == "sliding_attention" else None for t in self.layer_types]
        self.head_dim: int = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.num_kv_heads: int = cfg.num_key_value_heads
        self.hidden_size: int = cfg.hidden_size
        self.vocab_size: int = cfg.vocab_size
        self.context_length: int = getattr(cfg, "max_position_embeddings", None) or 2048
        p = next(model.parameters())
        self.dtype, self.device = p.dtype, p.device
        self.backend = backend
        self.quantized = is_quantized(model)  # a GGUF with its block-quantized weights (selfspec.quant)
        self.kernel = kernel_name(self.device, self.dtype) if backend == "fast" else "transformers-modules"
        self.numerics: Numerics = NUMERICS["exact"]  # how the quantized weights multiply (quant/numerics.py)
        qweights = [w for m in model.modules() if isinstance(w := getattr(m, "qweight", None), QuantWeight)]
        # the GGUF block types of the weights, '+<numerics>' outside the exact mode ([] unquantized)
        self.block_types: list[str] = sorted({w.type_name + ("" if w.mode.exact else f"+{w.numerics}")
                                              for w in qweights})
        if backend == "fast" and self.quantized:
            modes = {w.mode for w in qweights}
            self.numerics = min(modes, key=lambda m: m.exact) if modes else NUMERICS["exact"]  # (one per model)
            self.kernel = "selfspec-quant" + self.numerics.suffix
        self.fast_layers: list[FastLayer] = []
        if backend == "fast":
            self.fast_layers = [FastLayer(layer, i, self.windows[i]) for i, layer in enumerate(self.layers)]
        ops = self.fast_layers[0].ops if self.fast_layers else None
        self.lm = LMHead(self.norm, self.lm_head, self.softcap, bool(self.fast_layers), ops)
        self.screen = self.lm.screen
        self.rotary_tables = RotaryTables(self.rotary, static_rope(self.rotary_emb))
        embed: Any = self.embed_tokens
        self._embed_rows: QuantWeight | None = (  # ``embed``'s table when a lookup of it is all the module does
            embed.qweight if isinstance(embed, QuantEmbedding) and embed.embed_scale is None
            and isinstance(embed.qweight, QuantWeight) else None)
        self.plans: StepPlans | None = None  # the compiled plan of one sequence's steps (models/plans.py)
        if self.fast_layers:
            assert self.lm.fast_norm is not None  # packed with the fast layers
            self.plans = StepPlans(self.fast_layers, self.layer_types, self.embed_tokens, self._embed_rows,
                                   self.lm.fast_norm, self.lm.packed if self.softcap is None else None,
                                   self.vocab_size, self.rotary_tables)
            self.lm.plan_argmax = self.plans.argmax

    # ---- the ladder -------------------------------------------------------------------
    def rotary(self, h: torch.Tensor, positions: torch.Tensor,
               kind: str = "full_attention") -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of ``positions`` ``# [batch, n]`` for layers of ``kind`` (Gemma 3 has one table per kind)."""
        return self.rotary_emb(h, positions, kind) if self._rotary_by_type else self.rotary_emb(h, positions)

    def rotary_rows(self, h: torch.Tensor, positions: torch.Tensor,
                    kind: str = "full_attention") -> tuple[torch.Tensor, torch.Tensor]:
        """``rotary`` for one sequence's consecutive positions ``# [1, n]``, contiguous, as rows of a table
        (``RotaryTables``: bit for bit the call's)."""
        return self.rotary_tables.rows(h, positions, kind)

    def new_cache(self, capacity: int, batch: int = 1) -> KVCache:
        return KVCache(self.num_layers, self.num_kv_heads, self.head_dim, capacity, self.dtype, self.device, batch)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:  # ids [batch, n] -> [batch, n, hidden]
        if self._embed_rows is not None:  # a quantized table's rows, without the module call around them
            return self._embed_rows.rows(ids.reshape(-1)).view(*ids.shape, self.hidden_size)
        return self.embed_tokens(ids)

    def run_layers(
        self,
        h: torch.Tensor,  # [batch, n, hidden]
        start: int,
        end: int,
        positions: torch.Tensor,  # [batch, n] absolute positions
        cache: KVCache,
        tree: TreeAttention | None = None,
        tail: int | None = None,
    ) -> torch.Tensor:  # [batch, n, hidden]
        """Run decoder layers [start, end) on ``h``, appending their keys/values to ``cache``. With
        ``tree`` the n new tokens are nodes of a token tree (``positions``: prefix length + depth): each
        sees the cached prefix and the tree nodes ``tree.mask`` allows (itself and its ancestors).
        ``tail``: only the last ``tail`` rows' states after the last layer are needed (a prefill's: its last row,
        or what a drafter reads); that layer then runs attention and MLP on them alone (the fast layers with the
        compiled ops; ``Segment.tail``), the other rows only their keys and values, and the returned rows before
        them hold their states entering that layer. The caller keeps it >= PANEL_ROWS where a row must have a full
        call's bits (``Engine.prefill_tail``)."""
        if start >= end:
            return h
        if self.fast_layers:  # the fast layers' one path: a batch of one sequence
            return self.run_layers_batch([h], start, end, [positions], [cache], [tree], [tail])[0]
        n = h.shape[1]
        rotary: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        masks: dict[tuple[int, int | None], torch.Tensor | None] = {}
        for i in range(start, end):
            kind = self.layer_types[i]
            if kind not in rotary:
                rotary[kind] = self.rotary(h, positions, kind)
            key = (cache.lengths[i] + n, self.windows[i])
            if key not in masks:
                masks[key] = block_mask(n, key[0], key[1], h.device, tree)
            h = self.layers[i](
                h,
                attention_mask=masks[key],
                position_ids=positions,
                past_key_values=cache,
                position_embeddings=rotary[kind],
            )
        return h

    def run_layers_batch(
        self,
        hs: list[torch.Tensor],  # per sequence [1, n_j, hidden]: ragged, n_j new tokens each
        start: int,
        end: int,
        positions: list[torch.Tensor],  # per sequence [1, n_j] absolute positions
        caches: list[KVCache],  # per sequence: its own cache, its own length
        trees: list[TreeAttention | None] | None = None,
        tails: list[int | None] | None = None,  # per sequence: ``run_layers``'s ``tail``
    ) -> list[torch.Tensor]:  # per sequence [1, n_j, hidden]
        """``run_layers`` for several sequences in one pass: their rows are stacked so every weight is read
        once for all of them, and each sequence attends only to its own cache under its own mask (its
        length, positions and tree), so ragged batches need no padding and no realignment. Each result
        equals that sequence's own ``run_layers`` (up to float summation order in the linears)."""
        trees = trees or [None] * len(hs)
        tails = tails or [None] * len(hs)
        if not self.fast_layers:
            return [self.run_layers(h, start, end, p, c, t) for h, p, c, t in zip(hs, positions, caches, trees)]
        if start >= end:
            return hs
        if self.plans is not None:  # one call of the compiled plan where it covers the rows (models/plans.py)
            if len(hs) == 1 and self.plans.covers(hs[0], trees[0]):
                return [self.plans.run(hs[0], start, end, positions[0], caches[0])]
            if len(hs) > 1:
                batched = self.plans.run_batch(hs, start, end, positions, caches, trees, tails)
                if batched is not None:
                    return batched
        sizes = [h.shape[1] for h in hs]
        offsets = [sum(sizes[:j]) for j in range(len(sizes))]
        h = torch.cat(hs, dim=1)  # a new tensor: the fast layers update it in place, the callers keep theirs
        tables: list[dict[str, Rotary]] = [{} for _ in hs]  # per sequence: rotary tables by layer kind
        masks: list[dict[tuple[int, int | None], torch.Tensor | None]] = [{} for _ in hs]  # ... masks by (kv_len, window)
        for i in range(start, end):
            kind = self.layer_types[i]
            segments = []
            for j, (n, cache) in enumerate(zip(sizes, caches)):
                if kind not in tables[j]:
                    tables[j][kind] = Rotary(*self.rotary(hs[j], positions[j], kind))
                key = (cache.lengths[i] + n, self.windows[i])
                if key not in masks[j]:
                    masks[j][key] = block_mask(n, key[0], key[1], h.device, trees[j])
                at = cache.reserve(i, n)  # first: reserving may grow (reallocate) this layer's buffers
                tail = tails[j] if i == self.num_layers - 1 else None
                segments.append(Segment(offsets[j], n, tables[j][kind], masks[j][key], cache.keys[i], cache.values[i],
                                        at, trees[j] is None, tail))
            self.fast_layers[i].forward_segments(h, segments)
        return [h[:, o : o + n] for o, n in zip(offsets, sizes)]

    def run_rides(self, rides: list[Ride]) -> list[torch.Tensor]:  # per ride [1, n, hidden] after the last layer
        """Rows of several sequences that enter the model at different layers (a plain step's token at layer 0,
        a draft block's exit states at its exit depth) ride to the last layer together: the layers are run
        in stages cut at every entry layer, and from its entry on each ride joins the stage's ragged batch
        (``run_layers_batch``), so every weight of a stage is read once for all rows in it. A ride with
        ``capture`` also keeps its states after that layer (a speculative prefill's exit states), one with
        ``context`` after each of those layers."""
        cuts = sorted({r.layer for r in rides} | {r.capture for r in rides if r.capture is not None}
                      | {c for r in rides for c in r.context} | {self.num_layers})
        for r in rides:
            r.contexts = []
        cur = [r.h for r in rides]
        for r in rides:  # captured where it enters (exit layer 0: the embeddings)
            if r.capture is not None and r.capture == r.layer:
                r.captured = r.h
        for lo, hi in zip(cuts, cuts[1:]):
            on = [j for j, r in enumerate(rides) if r.layer <= lo]
            outs = self.run_layers_batch([cur[j] for j in on], lo, hi, [rides[j].positions for j in on],
                                         [rides[j].cache for j in on], [rides[j].tree for j in on],
                                         [rides[j].tail for j in on])
            for j, h in zip(on, outs):
                cur[j] = h
                if rides[j].capture == hi:
                    rides[j].captured = h
                if hi in rides[j].context:
                    rides[j].contexts.append(h)
        return cur

    # ---- the LM head (models/lm_head.py) and one-call steps (models/plans.py) ---------------
    def lm_rows(self, ids: torch.Tensor) -> torch.Tensor:  # ids [R] -> [R, hidden] float32 rows of the LM head
        return self.lm.rows(ids)

    def lm_head_part(self, ids: torch.Tensor) -> PackedLinear:
        return self.lm.part(ids)

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm.final_norm(h)

    def head_logits(self, h_normed: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [..., vocab] float32
        return self.lm.head_logits(h_normed)

    def logits(self, h: torch.Tensor) -> torch.Tensor:  # last-layer states -> logits
        return self.lm.logits(h)

    def greedy_ids(self, h: torch.Tensor) -> torch.Tensor:  # [..., hidden] last-layer states -> [...] int64
        return self.lm.greedy_ids(h)

    def step(self, token: int, position: int, cache: KVCache, taps: tuple[int, ...] = ()) -> Step | None:
        """A greedy step of ``token`` at ``position`` in one compiled call (``StepPlans.step``): the next token, bit
        for bit ``greedy_ids(forward_all(...))``, and the rows entering each layer of ``taps`` (a round that drafts
        nothing keeps its exit state). None (nothing done) where the call does not apply: off the fast layers'
        compiled path, a batched cache, a scaled embedding (Gemma), a rotary that is not a fixed table, a soft-capped
        LM head."""
        if any(not 0 <= t <= self.num_layers for t in taps):
            raise IndexError(f"taps {taps} out of range [0, {self.num_layers}]")
        return self.plans.step(token, position, cache, taps) if self.plans is not None else None

    def forward_all(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Plain full forward of new tokens (all layers), returning the final hidden states."""
        return self.run_layers(self.embed(ids), 0, self.num_layers, positions, cache)
