"""Attention masks of a block of new rows at the end of a cache: causal (with a sliding window where the architecture
has one) or a token tree's. Built from each layer's own cache length, since in a split forward the shallow layers
already hold tokens the deep layers have not seen yet."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
