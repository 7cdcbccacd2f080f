"""Layer-split forward over a Hugging Face decoder-only model.

``SplitModel`` exposes the target as a ladder of small pieces so the engine can run layers
[0, k) for new tokens (the draft), keep their exit-layer hidden states, and later run layers
[k, L) over those cached states (the verification), all writing one ``KVCache``:

    h = split.embed(ids)                              # [batch, n, hidden]
    h_k = split.run_layers(h, 0, k, positions, cache)  # shallow: draft
    h_L = split.run_layers(h_k, k, L, positions, cache)  # deep: verify
    logits = split.logits(h_L)                        # final norm + LM head

Two backends run the same ladder. ``fast`` (the default) runs ``selfspec.models.fast.FastLayer``s:
the same math over packed, fused weights with the kernel chosen per device and dtype
(``selfspec.kernels``). ``reference`` calls transformers' own decoder modules directly (no config
is mutated, no weights are copied): the yardstick the tests compare the fast path with. Masks are
built here (causal, with a sliding window where the
architecture has one) from each layer's own cache length, since in a split forward the shallow
layers already hold tokens the deep layers have not seen yet.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from selfspec.errors import InvalidConfigError, UnsupportedArchitectureError
from selfspec.kernels.linear import MAX_GEMV_ROWS, PackedLinear, kernel_name, pack_linear
from selfspec.models.cache import KVCache
from selfspec.models.fast import FastLayer, Norm, Rotary, Segment
from selfspec.quant.modules import QuantEmbedding, is_quantized, weight_rows
from selfspec.quant.screen import ScreenedArgmax
from selfspec.quant.weight import QuantWeight
from selfspec.sampling import greedy

BACKENDS = ("fast", "reference")
ROTARY_TABLE_MIN = 512  # positions a rotary table holds at first (it doubles as a sequence outgrows it)

# model_type -> human name. The layer-split forward relies on the Llama-style layout
# (model.embed_tokens, model.layers, model.norm, model.rotary_emb, lm_head).
SUPPORTED_ARCHITECTURES = {
    "llama": "Llama",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "gemma3_text": "Gemma 3 (text)",
    "phi3": "Phi-3",
}


def check_supported(model_type: str) -> None:
    if model_type not in SUPPORTED_ARCHITECTURES:
        names = ", ".join(f"{v} ({k})" for k, v in SUPPORTED_ARCHITECTURES.items())
        raise UnsupportedArchitectureError(
            f"unsupported architecture '{model_type}': selfspec supports {names}"
        )


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
    keep: int | None = None  # only the last ``keep`` rows' last-layer states are needed (``SplitModel.run_layers``)

    def kept(self, h: torch.Tensor) -> torch.Tensor:
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
        if backend == "fast" and self.quantized:
            int8 = any(getattr(getattr(m, "qweight", None), "int8", False) for m in model.modules())
            self.kernel = "selfspec-quant-int8" if int8 else "selfspec-quant"
        self.fast_layers: list[FastLayer] = []
        if backend == "fast":
            self.fast_layers = [FastLayer(layer, i, self.windows[i]) for i, layer in enumerate(self.layers)]
            self._fast_norm = Norm(self.norm)
            self._fast_lm_head = pack_linear(self.lm_head)
        self._greedy: tuple[tuple[Any, Any] | None] | None = None  # ``_greedy_head``'s, once built
        # per (layer kind, dtype): cos, sin ``# [1, positions, rot]`` of positions 0, 1, ... (``rotary_rows``)
        self._rotary_tables: dict[tuple[str, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        self._static_rope = static_rope(self.rotary_emb)
        embed: Any = self.embed_tokens
        self._embed_rows: QuantWeight | None = (  # ``embed``'s table when a lookup of it is all the module does
            embed.qweight if isinstance(embed, QuantEmbedding) and embed.embed_scale is None
            and isinstance(embed.qweight, QuantWeight) else None)
        self._probe = torch.zeros(1, dtype=torch.float32, device=self.device)  # the dtype a float32 step's tables take
        self._plain: tuple[tuple[Any, Any, list[str]] | None] | None = None  # ``_plain_step``'s, once built
        qhead = getattr(self.lm_head, "qweight", None) if backend == "fast" else None
        # A greedy verification's argmax through the int8 screen (selfspec/quant/screen.py): exact mode, no softcap
        self.screen = (ScreenedArgmax(qhead) if qhead is not None and self.softcap is None
                        and getattr(self.lm_head, "bias", None) is None and ScreenedArgmax.available(qhead) else None)

    # ---- the ladder -------------------------------------------------------------------
    def rotary(self, h: torch.Tensor, positions: torch.Tensor,
               kind: str = "full_attention") -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of ``positions`` ``# [batch, n]`` for layers of ``kind`` (Gemma 3 has one table per kind)."""
        return self.rotary_emb(h, positions, kind) if self._rotary_by_type else self.rotary_emb(h, positions)

    def rotary_rows(self, h: torch.Tensor, positions: torch.Tensor,
                    kind: str = "full_attention") -> tuple[torch.Tensor, torch.Tensor]:
        """``rotary`` for one sequence's consecutive positions ``# [1, n]``, contiguous: rows of a table computed
        once per layer kind (the same function on positions 0, 1, ...; every row is elementwise, so it equals a
        call's bit for bit, tested). A step's own call would run ~7 small ops with cold caches. Other positions (a
        tree's, a batch), or a rotary that depends on the longest position seen (dynamic NTK, LongRoPE), take the
        call."""
        n = positions.shape[-1]
        first = consecutive(positions) if self._static_rope else None
        if first is None:
            c, s = self.rotary(h, positions, kind)
            return c.contiguous(), s.contiguous()
        cos, sin = self._rotary_table(kind, h, first + n)
        return cos[:, first : first + n], sin[:, first : first + n]

    def _rotary_table(self, kind: str, h: torch.Tensor, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``# [1, >= end, rot]`` of positions 0, 1, ... for layers of ``kind`` in ``h``'s dtype, computed
        by ``rotary`` once and again (twice the size) only when a sequence outgrows it."""
        key = (kind, h.dtype)
        table = self._rotary_tables.get(key)
        if table is None or table[0].shape[1] < end:
            size = max(end, ROTARY_TABLE_MIN, 2 * table[0].shape[1] if table is not None else 0)
            c, s = self.rotary(h, torch.arange(size, device=h.device).unsqueeze(0), kind)
            table = self._rotary_tables[key] = (c.contiguous(), s.contiguous())
        return table

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
        keep: int | None = None,
    ) -> torch.Tensor:  # [batch, n, hidden]
        """Run decoder layers [start, end) on ``h``, appending their keys/values to ``cache``. With
        ``tree`` the n new tokens are nodes of a token tree (``positions``: prefix length + depth): each
        sees the cached prefix and the tree nodes ``tree.mask`` allows (itself and its ancestors).
        ``keep``: only the last ``keep`` rows' states after the last layer are needed (a prefill's: its last row,
        or what a drafter reads); that layer then runs attention and MLP on them alone (the fast layers with the
        compiled ops; ``Segment.tail``), the other rows only their keys and values, and the returned rows before
        them hold their states entering that layer. The caller keeps it >= PANEL_ROWS where a row must have a full
        call's bits (``Engine.prefill_keep``)."""
        if start >= end:
            return h
        if self.fast_layers:  # the fast layers' one path: a batch of one sequence
            return self.run_layers_batch([h], start, end, [positions], [cache], [tree], [keep])[0]
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
        keeps: list[int | None] | None = None,  # per sequence: ``run_layers``'s ``keep``
    ) -> list[torch.Tensor]:  # per sequence [1, n_j, hidden]
        """``run_layers`` for several sequences in one pass: their rows are stacked so every weight is read
        once for all of them, and each sequence attends only to its own cache under its own mask (its
        length, positions and tree), so ragged batches need no padding and no realignment. Each result
        equals that sequence's own ``run_layers`` (up to float summation order in the linears)."""
        trees = trees or [None] * len(hs)
        keeps = keeps or [None] * len(hs)
        if not self.fast_layers:
            return [self.run_layers(h, start, end, p, c, t) for h, p, c, t in zip(hs, positions, caches, trees)]
        if start >= end:
            return hs
        if len(hs) == 1 and trees[0] is None and hs[0].shape[0] * hs[0].shape[1] <= MAX_GEMV_ROWS:
            plans = [layer.plan for layer in self.fast_layers[start:end]]
            if hs[0].dtype == torch.float32 and all(p is not None for p in plans):
                return [self._run_planned(hs[0], start, end, positions[0], caches[0], plans)]
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
                tail = keeps[j] if i == self.num_layers - 1 else None
                segments.append(Segment(offsets[j], n, tables[j][kind], masks[j][key], cache.keys[i], cache.values[i],
                                        at, trees[j] is None, tail))
            self.fast_layers[i].forward_segments(h, segments)
        return [h[:, o : o + n] for o, n in zip(offsets, sizes)]

    def _run_planned(self, h: torch.Tensor, start: int, end: int, positions: torch.Tensor, cache: KVCache,
                     plans: list[Any]) -> torch.Tensor:  # h [1, n, hidden], n <= 16 -> [1, n, hidden]
        """Layers [start, end) of one sequence's causal step as one C++ call (``selfspec/kernels/step.cpp``): bit for
        bit ``FastLayer.forward_segments``'s fused path, without Python between the ~10 ops of each layer."""
        n = h.shape[1]
        kinds = self.layer_types[start:end]
        tables = {kind: self.rotary_rows(h, positions, kind) for kind in set(kinds)}
        cos, sin = [tables[kind][0] for kind in kinds], [tables[kind][1] for kind in kinds]
        starts = cache.reserve_all(n, start, end)  # first: reserving may grow (reallocate) a layer's buffers
        out = h.clone(memory_format=torch.contiguous_format)  # updated in place; the caller keeps h
        ops = self.fast_layers[start].ops
        assert ops is not None  # a plan exists only where the compiled ops do
        ops.run_layers(plans, out, cos, sin, cache.keys[start:end], cache.values[start:end], starts)
        return out

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
                                         [rides[j].keep for j in on])
            for j, h in zip(on, outs):
                cur[j] = h
                if rides[j].capture == hi:
                    rides[j].captured = h
                if hi in rides[j].context:
                    rides[j].contexts.append(h)
        return cur

    def lm_rows(self, ids: torch.Tensor) -> torch.Tensor:  # ids [R] -> [R, hidden] float32 rows of the LM head
        """Rows of the LM head's weight (dequantized rows only, for a quantized model)."""
        return weight_rows(self.lm_head, ids).float()

    def lm_head_part(self, ids: torch.Tensor) -> PackedLinear:
        """The LM head restricted to rows ``ids`` (``# [R]``), packed for decoding (quantized rows stay so)."""
        qweight = getattr(self.lm_head, "qweight", None)
        if qweight is not None:
            return PackedLinear([(qweight.select(ids.cpu()), None)])
        return PackedLinear([(self.lm_head.weight[ids].detach().contiguous(), None)])

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        if not self.fast_layers:
            return self.norm(h)
        ops = self.fast_layers[0].ops
        if ops is not None and h.dtype == torch.float32:  # the compiled RMSNorm, as every fast layer's own norms
            return ops.rms_norm(h.contiguous(), self._fast_norm.weight, self._fast_norm.eps)
        return self._fast_norm(h)

    def head_logits(self, h_normed: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [..., vocab] float32
        logits = self._fast_lm_head(h_normed) if self.fast_layers else self.lm_head(h_normed)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.float()

    def logits(self, h: torch.Tensor) -> torch.Tensor:  # last-layer states -> logits
        return self.head_logits(self.final_norm(h))

    def greedy_ids(self, h: torch.Tensor) -> torch.Tensor:  # [..., hidden] last-layer states -> [...] int64
        """``logits(h).argmax(-1)``, bit for bit: for 3-8 rows of a quantized LM head, through the int8 screen
        (``selfspec/quant/screen.py``: the exact kernel only on the blocks that can hold the maximum)."""
        rows = h.numel() // h.shape[-1]
        screen = self.screen if self.screen is not None and self.screen.covers(rows) else None
        if screen is None and 0 < rows <= MAX_GEMV_ROWS and h.dtype == torch.float32:
            fused = self._greedy_head()
            if fused is not None:  # the final norm, the LM head and the argmax in one compiled call, the same ops
                return fused[0].greedy_head(fused[1], h.reshape(rows, h.shape[-1])).view(h.shape[:-1])
        x = self.final_norm(h)
        if screen is not None:
            ids = screen.argmax(x.reshape(rows, x.shape[-1]).float())
            if ids is not None:
                return ids.view(x.shape[:-1])
        return greedy(self.head_logits(x))

    def _greedy_head(self) -> tuple[Any, Any] | None:
        """(the compiled ops, ``GreedyHead``: final norm, LM head, argmax; ``selfspec/kernels/step.cpp``) for a
        greedy step's rows, built once; None off the fast layers' compiled path or with a soft-capped LM head."""
        if self._greedy is None:
            ops: Any = self.fast_layers[0].ops if self.fast_layers else None
            lm = self._fast_lm_head.kernel_plan(ops) if ops is not None and self.softcap is None else None
            self._greedy = (None if lm is None else
                            (ops, ops.GreedyHead(self._fast_norm.weight, self._fast_norm.eps, lm)),)
        return self._greedy[0]

    def greedy_step(self, token: int, position: int, cache: KVCache) -> int | None:
        """A plain greedy step in one compiled call (``greedy_step``, ``selfspec/kernels/step.cpp``): ``token`` at
        ``position`` through every layer, its keys and values appended to ``cache``; -> the next token, bit for bit
        ``greedy_ids(forward_all(...))``. None (nothing done) where the call does not apply: off the fast layers'
        compiled path, a batched cache, a scaled embedding (Gemma), a rotary that is not a fixed table, a
        soft-capped LM head."""
        args = self.step_args(token, position, cache)
        if args is None:
            return None
        ops, plan, *rest = args
        return ops.greedy_step(plan, token, position, *rest)

    def step_with_states(self, token: int, position: int, cache: KVCache,
                         exit_layer: int) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """``greedy_step`` that also keeps the token's states (``step_with_states``, ``selfspec/kernels/step.cpp``):
        (its exit state after layers [0, ``exit_layer``) ``# [1, 1, hidden]``, its last-layer state ``# [1, 1, hidden]``,
        the next token), bit for bit a round that drafts nothing run in parts (the exit state, then layers
        [``exit_layer``, L) over it and ``greedy_ids``). None (nothing done) where ``greedy_step`` does not apply."""
        if not 0 <= exit_layer <= self.num_layers:
            raise IndexError(f"exit layer {exit_layer} out of range [0, {self.num_layers}]")
        args = self.step_args(token, position, cache)
        if args is None:
            return None
        ops, plan, *rest = args
        exit_state, final, nxt = ops.step_with_states(plan, exit_layer, token, position, *rest)
        return exit_state, final, int(nxt)

    def step_args(self, token: int, position: int, cache: KVCache) -> tuple | None:
        """What a one-call step of ``token`` at ``position`` takes (``greedy_step``, ``draft_or_step`` of
        ``selfspec/kernels/step.cpp``): (the compiled ops, ``PlainStep``, per rotary kind the cos and sin tables,
        every layer's key and value buffers, their starts), one entry reserved in every layer of ``cache``. None
        (nothing reserved) where ``greedy_step`` does not apply."""
        built = self._plain_step() if cache.keys[0].shape[0] == 1 else None
        if built is None:
            return None
        if not 0 <= token < self.vocab_size:
            raise IndexError(f"token id {token} out of range [0, {self.vocab_size})")
        ops, plan, kinds = built
        tables = [self._rotary_table(kind, self._probe, position + 1) for kind in kinds]
        starts = cache.reserve_all(1)  # reserving may grow a layer's buffers
        return ops, plan, [t[0] for t in tables], [t[1] for t in tables], cache.keys, cache.values, starts

    def _plain_step(self) -> tuple[Any, Any, list[str]] | None:
        """(the compiled ops, ``PlainStep``, its rotary kinds in table order), built once, or None where
        ``greedy_step`` does not apply."""
        if self._plain is None:
            self._plain = (self._build_plain_step(),)
        return self._plain[0]

    def _build_plain_step(self) -> tuple[Any, Any, list[str]] | None:
        greedy = self._greedy_head()
        plans = [layer.plan for layer in self.fast_layers]
        if greedy is None or not plans or any(p is None for p in plans) or not self._static_rope:
            return None
        ops, head = greedy
        embed: Any = self.embed_tokens
        if self._embed_rows is not None:  # a quantized table's rows (``embed``'s check)
            args: tuple = (0, *self._embed_rows.kernel_args())
        elif (isinstance(embed, nn.Embedding) and type(embed).forward is nn.Embedding.forward  # a plain lookup
              and embed.max_norm is None and embed.weight.dtype == torch.float32):
            empty = torch.empty(0)
            args = (2, embed.weight.detach().contiguous(), empty, empty, 0, 0, 0.0)
        else:
            return None
        kinds = list(dict.fromkeys(self.layer_types))
        plan = ops.PlainStep(plans, [kinds.index(k) for k in self.layer_types], len(kinds), *args, self.vocab_size,
                             head)
        return ops, plan, kinds

    def forward_all(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Plain full forward of new tokens (all layers), returning the final hidden states."""
        return self.run_layers(self.embed(ids), 0, self.num_layers, positions, cache)


def consecutive(positions: torch.Tensor) -> int | None:
    """The first of one sequence's consecutive positions ``# [1, n]`` (a causal step's), or None (a tree's, a batch's)."""
    n = positions.shape[-1]
    if positions.dim() != 2 or positions.shape[0] != 1 or n == 0:
        return None
    known = getattr(positions, "first", None)  # made consecutive (SequenceState.positions): no values to read
    if known is not None:
        return known
    first = int(positions[0, 0])
    return first if n == 1 or positions[0].tolist() == list(range(first, first + n)) else None


def static_rope(rotary: nn.Module) -> bool:
    """Whether a rotary embedding's cos and sin depend on the positions alone; not so for the types transformers
    updates with the longest position seen (dynamic NTK, LongRoPE), nor for a module that does not say its type."""
    if getattr(rotary, "positions_only", False):  # selfspec's lean models' (selfspec.models.lean.LeanRotary)
        return True
    kinds = getattr(rotary, "rope_type", None)
    kinds = list(kinds.values()) if isinstance(kinds, dict) else [kinds]
    return all(isinstance(k, str) and "dynamic" not in k and k != "longrope" for k in kinds)


def causal_mask(q_len: int, kv_len: int, window: int | None, device: torch.device | str) -> torch.Tensor | None:
    """Boolean attention mask ``# [1, 1, q_len, kv_len]`` (True = attend) for ``q_len`` new tokens at the
    end of a ``kv_len``-long cache, or None when plain full attention is already right (one query, no
    window cut). Query i sits at absolute position kv_len - q_len + i and sees keys j <= that position
    (and j > position - window under a sliding window, as transformers' sliding_window_overlay)."""
    if q_len == 1 and (window is None or kv_len <= window):
        return None
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device).unsqueeze(1)
    k_pos = torch.arange(kv_len, device=device).unsqueeze(0)
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask[None, None]


def block_mask(q_len: int, kv_len: int, window: int | None, device: torch.device | str,
               tree: TreeAttention | None) -> torch.Tensor | None:
    """The mask of ``q_len`` new rows at the end of a ``kv_len``-long cache: causal, or ``tree``'s."""
    return causal_mask(q_len, kv_len, window, device) if tree is None else tree.full_mask(kv_len, window)


@dataclass
class TreeAttention:
    """Who sees whom in a token-tree block. The last ``t`` cache entries (after this call) are tree nodes,
    the n new ones included; everything before them is the verified prefix, which every node sees.

    mask:          ``# [n, t]`` bool, new node i sees tree entry j (its ancestors and itself)
    key_positions: ``# [t]`` absolute positions of the t tree entries (for sliding windows)
    """

    mask: torch.Tensor
    key_positions: torch.Tensor

    def full_mask(self, kv_len: int, window: int | None) -> torch.Tensor:  # [1, 1, n, kv_len] bool
        n, t = self.mask.shape
        prefix = kv_len - t
        out = torch.ones(n, kv_len, dtype=torch.bool, device=self.mask.device)
        out[:, prefix:] = self.mask
        if window is not None:
            q_pos = self.key_positions[t - n :]
            k_pos = torch.cat([torch.arange(prefix, device=self.mask.device), self.key_positions])
            out &= k_pos[None, :] > q_pos[:, None] - window
        return out[None, None]
