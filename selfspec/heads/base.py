"""Exit heads: what turns the exit-layer hidden state into draft logits.

Every head has one interface so the drafter never cares which kind it holds:

    state = head.new_state(capacity)                  # per-sequence (None for stateless heads)
    logits = head(h, positions, state)                # h [batch, n, hidden] -> [batch, n, vocab]
    head.rollback(state, length)                      # after a rejection
    head.seen(state)                                  # positions the head has consumed
    head.skip(state, n)                               # the next n positions are never seen (stateful heads)

Kinds: ``lm`` (the target's own final norm + LM head, no training, LayerSkip style),
``kangaroo`` (Kangaroo's adapter: one attention block with two RMSNorms in front of the frozen
LM head), ``linear``, ``layer`` (a trainable copy of decoder layer k) and ``deep`` (``layer`` fed
with the final-layer states of the verified tokens too, EAGLE-style: ``heads.deep``). Trained heads are saved as ``head_config.json`` + ``head.safetensors``.
What a trained head fits and what tells heads apart: ``heads.identity``; how its weights are built: ``heads.weights``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from selfspec.heads.weights import quantized_linear
from selfspec.kernels.linear import PackedLinear, pack_linear
from selfspec.models.cache import KVCache
from selfspec.models.masks import TreeAttention
from selfspec.models.split import SplitModel

CONFIG_NAME, WEIGHTS_NAME = "head_config.json", "head.safetensors"  # a trained head's directory (heads.io)


class Front(NamedTuple):
    """What ``DeepContextHead.draft_or_step`` gives back: the pending token's exit state ``# [1, 1, hidden]``, the
    head's predicted final states ``# [1, n, hidden]`` (its rows', the last the pending token's), whether the draft
    passed the bar, the draft (drafted) or the target's next token (a blank round), the draft's confidence, and in a
    blank round the pending token's final state ``# [1, 1, hidden]`` (else None)."""

    exit_state: torch.Tensor
    f_hat: torch.Tensor
    drafted: bool
    token: int
    confidence: float
    final: torch.Tensor | None


class ExitHead(nn.Module):
    """Base class. Subclasses set ``kind`` and implement ``forward``; stateful ones also
    ``new_state`` / ``rollback`` / ``seen``.

    VocabTrim (docs/ARCHITECTURE.md): ``trim_vocab(ids)`` restricts the draft's LM head to a few thousand
    frequent token ids. The head then computes only those rows of the frozen LM head and returns
    -inf for every other token, so drafting gets cheaper while verification (always the full
    vocabulary) keeps the output lossless.
    """

    kind: str = "base"
    stateful: bool = False
    needs_context: bool = False  # reads the final-layer states of earlier tokens (``heads.deep``)
    split: SplitModel  # the target, held outside the module tree (set in __init__)

    def __init__(self, split: SplitModel, exit_layer: int) -> None:
        super().__init__()
        # The target is held outside the module tree: saving a head never saves target weights.
        object.__setattr__(self, "split", split)
        self.exit_layer = exit_layer
        self.register_buffer("vocab_ids", torch.empty(0, dtype=torch.long))  # [n] kept ids; empty = all
        self._trim_lm: PackedLinear | None = None  # the kept rows of the frozen LM head, packed
        self._packed: dict[int, tuple[torch.Tensor, int, PackedLinear]] = {}  # id(module) -> (weight, version, packed)
        # Draft settings measured best for this head (head_config.json "draft", e.g. {"tree_width": 2});
        # DraftConfig fields left at None take them.
        self.recommended_draft: dict[str, Any] = {}
        self.source: str | None = None  # the directory the head was loaded from (its SpecEE predictors live there)
        self.released = False  # its float32 matrices dropped for inference (``release_float``): packed copies only
        # every matrix dropped (``unload``: a calibration turned the head off); loaded again from ``source`` by the
        # first use of one (``linear``, a decoder layer's ``run_block``, ``prepare``: every road to its matrices)
        self.unloaded = False

    def linear(self, module: nn.Linear) -> Any:
        """``module`` through selfspec's decoding kernels (packed once per weight version, in ``draft_weights``
        when its input width takes blocks) when drafting on the fast backend; the module itself while training
        (gradients) or on the reference backend."""
        self.ensure_loaded()
        hit = self._packed.get(id(module))
        if hit is not None and hit[1] < 0:  # its float weight released (release_float): the packed copy only
            return hit[2]
        if self.split.backend != "fast" or torch.is_grad_enabled():
            return module
        if hit is None or hit[0] is not module.weight or hit[1] != module.weight._version:
            packed = pack_linear(quantized_linear(module, self.draft_weights))
            hit = self._packed[id(module)] = (module.weight, module.weight._version, packed)
        return hit[2]

    @property
    def supports_tree(self) -> bool:
        """Whether the head can draft token trees: it attends by tree mask (deep) or to nothing (lm, linear)."""
        return self.needs_context or not self.stateful

    def args(self) -> dict[str, Any]:
        """Constructor arguments beyond (split, exit_layer), written into head_config.json."""
        return {}

    def trim_vocab(self, ids: torch.Tensor | None) -> None:
        """Draft only among ``ids`` (``# [n]`` token ids); None restores the full vocabulary."""
        if ids is None or len(ids) == 0:
            self.vocab_ids = torch.empty(0, dtype=torch.long, device=self.split.device)
        else:
            self.vocab_ids = torch.as_tensor(ids, dtype=torch.long, device=self.split.device).unique()
        self._trim_lm = None

    @property
    def draft_weights(self) -> str:
        """The type the head's own matrices draft with (part of what its measured costs are valid for)."""
        return "float32"

    def prepare(self) -> None:
        """Build what drafting uses (the trimmed LM rows, packed or quantized weights) ahead of the first draft."""
        self.ensure_loaded()
        if len(self.vocab_ids) and self._trim_lm is None:
            with torch.inference_mode():
                self._trim_lm = self.split.lm_head_part(self.vocab_ids)

    def release_float(self) -> int:
        """For inference on the fast backend when the head drafts with block-quantized weights (``draft_weights``):
        build the packed copies (``prepare``), then drop the float32 matrices they were made from (the Qwen 0.5B
        head's decoder layer and fuse: 63 MB). Training, saving or running it on the reference backend afterwards
        raises; load the head again for those. -> bytes freed (0: nothing to drop, the head keeps its weights)."""
        if self.split.backend != "fast" or self.draft_weights == "float32" or self.released:
            return 0
        self.prepare()
        freed = 0
        for module in self.float_matrices():
            hit = self._packed.get(id(module))
            if hit is not None:
                self._packed[id(module)] = (torch.empty(0), -1, hit[2])  # the packed copy only
            freed += module.weight.nbytes
            module.weight = nn.Parameter(torch.empty(0, dtype=module.weight.dtype), requires_grad=False)
        self.released = freed > 0
        return freed

    def float_matrices(self) -> list[nn.Linear]:
        """The linear layers whose float32 weights ``release_float`` may drop (each packed before)."""
        return []

    def packed_linears(self) -> list[PackedLinear]:
        """The packed copies drafting computes with (built so far: ``prepare`` builds them), beside the target's
        LM rows of the drafted vocabulary: what a draft reads of the head's own matrices (``bench-forward``)."""
        return [hit[2] for hit in self._packed.values()]

    def draft_reads(self) -> tuple[int, int]:
        """(bytes, matrix weights) of the head's own weights one draft reads, the drafted LM rows aside: its packed
        copies (``packed_linears``) in place of the float matrices they were made from, the matrices drafting does
        not pack, and its other parameters (norms). 2 * n * matrix weights = a draft's FLOPs at n rows."""
        packed = self.packed_linears()
        skip = ({id(m.weight) for m in self.float_matrices()} | {id(hit[0]) for hit in self._packed.values()}
                if packed else set())
        params = [p for p in self.parameters() if id(p) not in skip]
        mats = [m.weight for m in self.modules() if isinstance(m, nn.Linear) and id(m.weight) not in skip]
        return (sum(pl.nbytes for pl in packed) + sum(p.numel() * p.element_size() for p in params),
                sum(pl.in_features * pl.out_features for pl in packed) + sum(w.numel() for w in mats))

    def num_params(self) -> int:
        """The head's parameter count, its dropped matrices (``release_float``, ``unload``) counted as loaded."""
        return (sum(p.numel() for p in self.parameters())
                + sum(m.in_features * m.out_features for m in self.float_matrices() if m.weight.numel() == 0))

    def unload(self) -> None:
        """Drop every matrix the head drafts with (float32 weights, packed copies, the drafted vocabulary's LM rows)
        when it will not draft: the calibration turned it off and its drafter proposes by lookup alone. Only a head
        loaded from its directory (``source``); run again (a cost benchmark, a new calibration, training), it first
        loads them from there (``ensure_loaded``) as a loaded head drafts with them (``release_float``). The default
        model's bundled head: 9.4 MB of the process after load (docs/QUANTIZED.md)."""
        if self.source is None or self.unloaded:
            return
        for module in self.float_matrices():
            module.weight = nn.Parameter(torch.empty(0, dtype=module.weight.dtype), requires_grad=False)
        self._packed.clear()
        self._trim_lm = None
        self._drop_built()
        self.released, self.unloaded = False, True

    def ensure_loaded(self) -> None:
        """Bring back the matrices ``unload`` dropped, from the head's directory (a no-op otherwise)."""
        if not self.unloaded:
            return
        from safetensors.torch import load_file  # noqa: PLC0415 (rarely needed)

        assert self.source is not None  # only a head from a directory unloads
        names = {id(m): n for n, m in self.named_modules()}
        with torch.inference_mode(False):  # (first run inside a draft or a timing's inference mode)
            state = load_file(str(Path(self.source) / WEIGHTS_NAME), device=str(self.split.device))
            for module in self.float_matrices():
                module.weight = nn.Parameter(state[f"{names[id(module)]}.weight"].to(self.split.dtype),
                                             requires_grad=False)
        self.unloaded = False
        self.release_float()  # packed as for drafting, float32 dropped where those suffice

    def _drop_built(self) -> None:
        """Forget what a subclass built for drafting beyond ``linear``'s packed copies (``unload``)."""

    def lm_part(self, x_normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The frozen LM head on normed states ``# [..., hidden]`` over the drafted vocabulary only: (logits
        ``# [..., n]`` float32, their token ids ``# [n]``, ascending), or (full logits, None) when nothing is trimmed.
        A greedy draft picks from these directly (``drafting.chain``), without spreading them over the whole
        vocabulary."""
        if len(self.vocab_ids) == 0:
            return self.split.head_logits(x_normed), None
        if self._trim_lm is None or self._trim_lm.device != x_normed.device:
            self._trim_lm = self.split.lm_head_part(self.vocab_ids)
        part = self._trim_lm(x_normed)
        if self.split.softcap is not None:
            part = torch.tanh(part / self.split.softcap) * self.split.softcap
        return part.float(), self.vocab_ids

    def lm_logits(self, x_normed: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [..., vocab] float32
        """The frozen LM head on normed states (over the trimmed vocabulary when one is set: -inf elsewhere)."""
        part, ids = self.lm_part(x_normed)
        if ids is None:
            return part
        out = part.new_full((*part.shape[:-1], self.split.vocab_size), float("-inf"))
        return out.index_copy_(-1, ids, part)

    def init_from_target(self) -> None:
        """A trainable head: start from the target's own weights (before training)."""
        raise NotImplementedError(f"{type(self).__name__} is not trained")

    def new_state(self, capacity: int) -> Any:
        return None

    def rollback(self, state: Any, length: int) -> None:
        return None

    def seen(self, state: Any) -> int:
        return 0

    def skip(self, state: Any, n: int) -> None:
        """The next ``n`` positions are passed over: the head never attends to them (a stateless head holds none)."""
        return None

    def forward(
        self,
        h: torch.Tensor,  # [batch, n, hidden] exit-layer hidden states
        positions: torch.Tensor,  # [batch, n]
        state: Any = None,
    ) -> torch.Tensor:  # [batch, n, vocab] float32 logits
        raise NotImplementedError

    # ---- what a head that reads context (``needs_context``: heads.deep) adds ----------------------------
    def project(self, h: torch.Tensor, depth: int) -> torch.Tensor:
        """Exit states of depth ``depth`` -> what ``features`` reads."""
        raise NotImplementedError(f"{type(self).__name__} reads no context")

    def features(self, h: torch.Tensor, context: torch.Tensor, positions: torch.Tensor, state: Any = None,
                 tree: TreeAttention | None = None, tail: int | None = None) -> torch.Tensor:
        """The predicted final states f^ ``# [batch, n, hidden]`` from exit states and earlier final states
        (``tail``: only the last ``tail`` rows' are wanted; the others' may then be left uncomputed)."""
        raise NotImplementedError(f"{type(self).__name__} reads no context")

    def logits_of(self, f_hat: torch.Tensor) -> torch.Tensor:
        """Draft logits ``# [..., vocab]`` float32 from predicted final states."""
        raise NotImplementedError(f"{type(self).__name__} reads no context")

    def logits_part_of(self, f_hat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``logits_of`` over the drafted vocabulary only: (logits ``# [..., n]``, their ids or None, ``lm_part``)."""
        raise NotImplementedError(f"{type(self).__name__} reads no context")

    def draft_step(self, h: torch.Tensor, context: torch.Tensor, positions: torch.Tensor,
                   state: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``features`` and ``logits_part_of`` its last row in one compiled call, or None (then the caller takes the
        two steps): (f^ ``# [1, n, hidden]``, logits ``# [V']``, their ids ``# [V']``)."""
        return None

    def front_ready(self, rows: int) -> bool:
        """Whether ``draft_or_step`` applies to a round's first draft over ``rows`` rows (a deep head's compiled call)."""
        return False

    def draft_or_step(self, token: int, position: int, cache: KVCache, exit_layer: int, backlog: torch.Tensor,
                      context: torch.Tensor, positions: torch.Tensor, state: Any, bar: float) -> Front | None:
        """A greedy round's first draft and, under the confidence ``bar``, the target's whole step in one call
        (``DeepContextHead.draft_or_step``), or None where it does not apply (``front_ready``)."""
        return None


class CachedHead(ExitHead):
    """A head with its own one-layer KV cache per sequence (an attention block over the exit states),
    rolled back with the target's cache after a rejection."""

    stateful = True

    def new_state(self, capacity: int) -> KVCache:
        s = self.split
        return KVCache(1, s.num_kv_heads, s.head_dim, capacity, s.dtype, s.device)

    def rollback(self, state: KVCache, length: int) -> None:
        if length < state.skipped:  # back before a skip (a pipeline's draft-ahead undone): restart there
            state.skipped = length
            state.truncate(0)
        else:
            state.truncate(length - state.skipped)

    def seen(self, state: KVCache) -> int:
        return state.skipped + state.lengths[0]

    def skip(self, state: KVCache, n: int) -> None:
        """Pass over the next ``n`` positions: nothing is stored for them, so the head never attends to them. Its
        cache holds one run of consecutive positions (entry i is position ``skipped + i``), so the run restarts
        after the gap: entries held before it are dropped too (a head that skips has not drafted for a while)."""
        if n > 0:
            state.skipped = self.seen(state) + n
            state.truncate(0)


class LMExitHead(ExitHead):
    """The target's own final norm + LM head on the layer-k state (needs no training)."""

    kind = "lm"

    def forward(self, h: torch.Tensor, positions: torch.Tensor, state: Any = None) -> torch.Tensor:
        return self.lm_logits(self.split.final_norm(h))
