"""EQSPEC: batch speculative decoding in the padded layout, realigning after every verification.

The textbook way to batch speculative decoding (docs/ARCHITECTURE.md: batch speculative decoding) keeps all
sequences in one padded tensor: one KV cache of ``batch`` rows with one shared length, each row
left-padded so every sequence ends at the same slot. Every step drafts the same number of tokens
for every sequence (the early exit, layers [0, k) + a stateless exit head, all rows in lockstep),
verifies all rows in one padded pass of the deep layers, and each sequence accepts its own prefix.
The rows now end at different slots, so the batch is *realigned*: each row's entries are shifted
right by (most accepted - its accepted), its padding grows by as much, and finished rows are
dropped. Correct, simple, and it copies every layer's KV cache of every lagging row after every
step: ``PaddedBatch.realign_time`` measures that share (docs/BENCHMARKS.md).

Worked example, 2 sequences, 3 drafts each, shared length T = 10 before the step:
    row 0 accepts 3 -> its tokens end at slot 10 + 1 + 3 = 14
    row 1 accepts 0 -> its tokens end at slot 11; shift right by 3, pad[1] += 3
    new shared length 14; the 3 freed slots of row 1 are padding from now on.

Selfspec's own batching (``selfspec.batch``, EXSPEC's idea taken to the end) gives every
sequence its own cache, so nothing is ever realigned. This module is the measured comparison;
it decodes greedily (the padded realignment is the point, not sampling).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from selfspec import round as core
from selfspec.errors import InvalidConfigError
from selfspec.heads.base import ExitHead
from selfspec.models.cache import KVCache
from selfspec.models.fast import Rotary, Segment
from selfspec.models.split import SplitModel
from selfspec.verify import greedy_verify


@dataclass
class PaddedStats:
    """Where a padded batch's time went."""

    steps: int = 0
    accepted: list[int] = field(default_factory=list)  # tokens emitted per live row per step, bonus included
    prefill_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    realign_time: float = 0.0  # shifting lagging rows' KV entries and dropping finished rows
    wall_time: float = 0.0

    @property
    def realign_share(self) -> float:
        return self.realign_time / self.wall_time if self.wall_time else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return sum(self.accepted) / len(self.accepted) if self.accepted else 0.0


class PaddedBatch:
    """Greedy EQSPEC over ``split`` with a stateless exit ``head`` (e.g. the untrained exit, 'lm')."""

    def __init__(self, split: SplitModel, head: ExitHead, gamma: int = 3) -> None:
        if head.stateful or head.needs_context:
            raise InvalidConfigError(f"the padded batch (EQSPEC) drafts with a stateless exit head, not '{head.kind}'")
        if gamma < 0:
            raise InvalidConfigError(f"gamma must be >= 0, got {gamma}")
        self.split, self.head, self.gamma = split, head, gamma
        self.stats = PaddedStats()

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: list[int],
                 eos_token_ids: list[int] | None = None) -> list[list[int]]:
        """-> each prompt's greedy continuation (up to its max_new_tokens, cut after an EOS)."""
        split, k, L = self.split, self.head.exit_layer, self.split.num_layers
        if not prompts or any(not p for p in prompts) or len(prompts) != len(max_new_tokens):
            raise InvalidConfigError("the padded batch needs non-empty prompts, one max_new_tokens each")
        st = self.stats = PaddedStats()
        eos, dev = set(eos_token_ids or []), split.device
        t_start = time.perf_counter()
        # ---- prefill: each prompt alone (a padded prefill would attend over the padding of the longest
        # prompt), its KV entries placed right-aligned into its row of the batch cache
        P = max(len(p) for p in prompts)
        pad = torch.tensor([P - len(p) for p in prompts], device=dev)  # [B]
        cache = split.new_cache(P + max(max_new_tokens) * 2 + self.gamma + 2, batch=len(prompts))
        last = []
        for r, p in enumerate(prompts):
            own = split.new_cache(len(p))
            ids = torch.tensor([p], device=dev)
            last.append(split.forward_all(ids, torch.arange(len(p), device=dev)[None], own)[:, -1:])
            for buf, src in ((cache.keys, own.keys), (cache.values, own.values)):
                for layer, s in zip(buf, src):
                    layer[r, :, P - len(p) : P] = s[0, :, : len(p)]
        cache.lengths = [P] * L
        pending = split.logits(torch.cat(last))[:, -1].argmax(-1)  # [B]
        rows = list(range(len(prompts)))  # the live sequences, in row order
        outs: list[list[int]] = [[int(t)] for t in pending]
        st.prefill_time = time.perf_counter() - t_start

        def live(j: int) -> bool:
            return len(outs[j]) < max_new_tokens[j] and not (eos and outs[j][-1] in eos)

        keep = [r for r, j in enumerate(rows) if live(j)]
        cache, pad, pending, rows = self._drop(cache, pad, pending, rows, keep)
        while rows:
            T = cache.lengths[0]
            g = max(0, min(self.gamma, *(max_new_tokens[j] - len(outs[j]) - 1 for j in rows)))
            # ---- draft: g tokens for every row in lockstep (layers [0, k) + the exit head)
            t0 = time.perf_counter()
            x, states, drafts = pending, [], []
            for i in range(g + 1):
                hk = run_layers_padded(split, split.embed(x[:, None]), 0, k, self._positions(T + i, 1, pad), cache, pad)
                states.append(hk)
                if i < g:
                    x = self.head(hk, self._positions(T + i, 1, pad))[:, -1].argmax(-1)  # [B]
                    drafts.append(x)
            t1 = time.perf_counter()
            # ---- verify: every row's pending token and drafts through layers [k, L) in one padded pass
            h = run_layers_padded(split, torch.cat(states, dim=1), k, L, self._positions(T, g + 1, pad), cache, pad)
            d = torch.stack(drafts, dim=1) if drafts else pending.new_zeros(len(rows), 0)  # [B, g]
            res = greedy_verify(d, split.logits(h))  # [B, g + 1, vocab] -> accepted, next per row
            m = res.num_accepted.tolist()
            st.steps += 1
            t2 = time.perf_counter()
            for r, j in enumerate(rows):
                new, _ = core.cut(d[r, : m[r]].tolist() + [int(res.next_token[r])], max_new_tokens[j] - len(outs[j]), eos)
                outs[j].extend(new)
                st.accepted.append(len(new))
            pending = res.next_token
            # ---- realign: every row's tokens end at the same slot again; finished rows leave
            self._realign(cache, pad, T, m)
            keep = [r for r, j in enumerate(rows) if live(j)]
            cache, pad, pending, rows = self._drop(cache, pad, pending, rows, keep)
            t3 = time.perf_counter()
            st.draft_time += t1 - t0
            st.verify_time += t2 - t1
            st.realign_time += t3 - t2
        st.wall_time = time.perf_counter() - t_start
        return outs

    def _positions(self, slot: int, n: int, pad: torch.Tensor) -> torch.Tensor:  # -> [B, n]
        pos = torch.arange(slot, slot + n, device=pad.device)[None, :] - pad[:, None]
        return pos.clamp_min(0)  # padding slots: any position (masked out)

    @staticmethod
    def _realign(cache, pad: torch.Tensor, T: int, accepted: list[int]) -> None:
        """Row r kept T + 1 + accepted[r] slots: shift it right so all rows end at T + 1 + max(accepted)."""
        top = max(accepted)
        end = T + 1 + top
        for r, a in enumerate(accepted):
            s = top - a
            if s == 0:
                continue
            lo = int(pad[r])
            for buf in (cache.keys, cache.values):
                for layer in buf:
                    layer[r, :, lo + s : end] = layer[r, :, lo : T + 1 + a].clone()
            pad[r] += s
        cache.lengths = [end] * len(cache.lengths)

    @staticmethod
    def _drop(cache, pad, pending, rows, keep):
        """Keep only the rows ``keep`` (finished sequences leave the batch: a copy of every layer)."""
        if len(keep) == len(rows):
            return cache, pad, pending, rows
        if keep:
            idx = torch.tensor(keep, device=pad.device)
            cache.keys = [t.index_select(0, idx) for t in cache.keys]
            cache.values = [t.index_select(0, idx) for t in cache.values]
            pad, pending = pad[idx], pending[idx]
        return cache, pad, pending, [rows[r] for r in keep]


def run_layers_padded(
split: SplitModel,
    h: torch.Tensor,  # [batch, n, hidden]: every sequence's n rows, padding rows included
    start: int,
    end: int,
    positions: torch.Tensor,  # [batch, n] each row's position in its own sequence
    cache: KVCache,  # one cache of ``batch`` rows sharing one length per layer
    pad: torch.Tensor,  # [batch] each row's left padding: its cache slots [0, pad) hold no token
) -> torch.Tensor:  # [batch, n, hidden]
    """Layers [start, end) over a padded batch (EQSPEC's layout): all sequences
    share the cache length, each keeps its own positions and masks out its padding slots."""
    if start >= end:
        return h
    rotary: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    masks: dict[tuple[int, int | None], torch.Tensor] = {}
    n = h.shape[1]
    if split.fast_layers:
        h = h.clone()
    for i in range(start, end):
        kind = split.layer_types[i]
        if kind not in rotary:
            rotary[kind] = split.rotary(h, positions, kind)
        key = (cache.lengths[i] + n, split.windows[i])
        if key not in masks:
            masks[key] = padded_mask(n, key[0], key[1], pad)
        mask = masks[key]
        if split.fast_layers:
            at = cache.reserve(i, n)
            seg = Segment(0, n, Rotary(*rotary[kind]), mask, cache.keys[i], cache.values[i], at, False)
            split.fast_layers[i].forward_segments(h, [seg])
        else:
            h = split.layers[i](h, attention_mask=mask, position_ids=positions, past_key_values=cache,
                               position_embeddings=rotary[kind])
    return h


def padded_mask(q_len: int, kv_len: int, window: int | None, pad: torch.Tensor) -> torch.Tensor:
    """``# [batch, 1, q_len, kv_len]`` bool for the last ``q_len`` slots of a left-padded batch: slot i sees
    slot j when pad[b] <= j <= i (and i - j < window, if any)."""
    q = torch.arange(kv_len - q_len, kv_len, device=pad.device)[:, None]  # [q_len, 1]
    k = torch.arange(kv_len, device=pad.device)[None, :]  # [1, kv_len]
    ok = k <= q
    if window is not None:
        ok = ok & (q - k < window)
    return (ok[None] & (k[None] >= pad[:, None, None]))[:, None]
