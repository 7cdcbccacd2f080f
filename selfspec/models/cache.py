"""A static KV cache with a length pointer per layer (gpt-fast style): rollback is moving a pointer.

Self-speculation runs the shallow layers [0, k) ahead of the deep layers [k, L), so each layer
keeps its own length. Transformers' attention modules only call ``cache.update(k, v, layer_idx)``;
this class answers that call, so the model's own attention code runs unchanged.

Memory layout, one buffer per layer: keys/values ``# [batch, kv_heads, capacity, head_dim]``.
Rows past a layer's length hold stale values from rejected drafts; they are never attended to
because ``update`` returns only the filled prefix.
"""

from __future__ import annotations

import torch


class KVCache:
    """Per-sequence KV storage for ``num_layers`` attention layers; grows by doubling when full."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        batch: int = 1,
    ) -> None:
        shape = (batch, num_kv_heads, max(capacity, 1), head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.lengths = [0] * num_layers
        # Positions never stored ahead of entry 0 (a head that skipped the oldest rows of its backlog,
        # ``CachedHead.skip``): entry i holds position skipped + i. The target's cache never skips.
        self.skipped = 0

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def _grow(self, layer: int, needed: int) -> None:
        new_cap = max(needed, 2 * self.capacity)
        for buf in (self.keys, self.values):
            old = buf[layer]
            new = old.new_zeros(old.shape[0], old.shape[1], new_cap, old.shape[3])
            new[:, :, : old.shape[2]] = old
            buf[layer] = new

    def update(
        self,
        key_states: torch.Tensor,  # [batch, kv_heads, new, head_dim]
        value_states: torch.Tensor,  # [batch, kv_heads, new, head_dim]
        layer_idx: int,
        cache_kwargs: dict | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new keys/values of ``layer_idx`` and return the layer's whole filled prefix."""
        i = layer_idx
        start = self.lengths[i]
        end = start + key_states.shape[2]
        if end > self.keys[i].shape[2]:
            self._grow(i, end)
        self.keys[i][:, :, start:end] = key_states
        self.values[i][:, :, start:end] = value_states
        self.lengths[i] = end
        return self.keys[i][:, :, :end], self.values[i][:, :, :end]

    def reserve(self, layer_idx: int, n: int) -> int:
        """Make room for ``n`` new entries of one layer and advance its length; returns the old length
        (the fast layers write keys[layer][:, :, old:old + n] themselves)."""
        start = self.lengths[layer_idx]
        if start + n > self.keys[layer_idx].shape[2]:
            self._grow(layer_idx, start + n)
        self.lengths[layer_idx] = start + n
        return start

    def reserve_all(self, n: int, first: int = 0, end: int | None = None) -> list[int]:
        """``reserve(i, n)`` for layers [first, end) (default: all) in one call (a decoding step's Python, run once
        per round): their old lengths."""
        starts = self.lengths[first:end]
        for i, s in enumerate(starts, first):
            if s + n > self.keys[i].shape[2]:
                self._grow(i, s + n)
            self.lengths[i] = s + n
        return starts

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.lengths[layer_idx]

    def compact(self, start: int, keep: list[int]) -> None:
        """After a token tree was verified: the entries of the accepted nodes ``keep`` (indices after
        ``start``, increasing: a root-to-leaf path) move to start, start + 1, ...; every layer's length
        becomes start + len(keep). Worked example: nodes [x, a, b, c] with c's parent a, accept x, a, c:
        keep [0, 1, 3] -> rows start + 3 move to start + 2."""
        n = len(keep)
        if keep != list(range(n)):  # a path that is not already in place: one gather per buffer
            src = torch.tensor(keep, device=self.keys[0].device) + start
            for buf in (self.keys, self.values):
                for t in buf:
                    t[:, :, start : start + n] = t[:, :, src]
        self.lengths = [start + n] * len(self.lengths)

    def save(self, start: int, end: int, layers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of the entries [start, end) of layers [0, layers): a draft branch kept aside while another
        branch overwrites the same positions (selfspec.pipeline)."""
        return [(self.keys[i][:, :, start:end].clone(), self.values[i][:, :, start:end].clone()) for i in range(layers)]

    def restore(self, start: int, saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put ``save``'s entries back at ``start``; those layers' lengths become start + their count."""
        for i, (k, v) in enumerate(saved):
            end = start + k.shape[2]
            if end > self.keys[i].shape[2]:
                self._grow(i, end)
            self.keys[i][:, :, start:end] = k
            self.values[i][:, :, start:end] = v
            self.lengths[i] = end

    def truncate(self, length: int) -> None:
        """Roll every layer back to at most ``length`` tokens (the accepted length)."""
        self.lengths = [min(n, length) for n in self.lengths]
