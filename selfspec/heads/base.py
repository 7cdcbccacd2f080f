"""Exit heads: what turns the exit-layer hidden state into draft logits.

Every head has one interface so the drafter never cares which kind it holds:

    state = head.new_state(capacity)                  # per-sequence (None for stateless heads)
    logits = head(h, positions, state)                # h [batch, n, hidden] -> [batch, n, vocab]
    head.rollback(state, length)                      # after a rejection
    head.seen(state)                                  # positions the head has consumed

Kinds: ``lm`` (the target's own final norm + LM head, no training, LayerSkip style) and
``kangaroo`` (Kangaroo's adapter: one attention block with two RMSNorms in front of the frozen
LM head). Trained heads are saved as ``head_config.json`` + ``head.safetensors``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from selfspec.errors import HeadMismatchError
from selfspec.models.split import SplitModel


def model_fingerprint(split: SplitModel) -> dict[str, Any]:
    """What a trained head must agree with to be loaded into a model."""
    c = split.config
    return {
        "model_type": c.model_type,
        "num_layers": split.num_layers,
        "hidden_size": split.hidden_size,
        "vocab_size": split.vocab_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": split.num_kv_heads,
        "head_dim": split.head_dim,
    }


def check_fingerprint(saved: dict[str, Any], split: SplitModel, where: str) -> None:
    want = model_fingerprint(split)
    diff = {k: (saved.get(k), v) for k, v in want.items() if saved.get(k) != v}
    if diff:
        details = ", ".join(f"{k}: head has {a}, model has {b}" for k, (a, b) in diff.items())
        raise HeadMismatchError(f"exit head {where} does not match this model ({details})")


class ExitHead(nn.Module):
    """Base class. Subclasses set ``kind`` and implement ``forward``; stateful ones also
    ``new_state`` / ``rollback`` / ``seen``."""

    kind: str = "base"
    stateful: bool = False

    def __init__(self, split: SplitModel, exit_layer: int) -> None:
        super().__init__()
        # The target is held outside the module tree: saving a head never saves target weights.
        object.__setattr__(self, "split", split)
        self.exit_layer = exit_layer

    def new_state(self, capacity: int) -> Any:
        return None

    def rollback(self, state: Any, length: int) -> None:
        return None

    def seen(self, state: Any) -> int:
        return 0

    def forward(
        self,
        h: torch.Tensor,  # [batch, n, hidden] exit-layer hidden states
        positions: torch.Tensor,  # [batch, n]
        state: Any = None,
    ) -> torch.Tensor:  # [batch, n, vocab] float32 logits
        raise NotImplementedError


class LMExitHead(ExitHead):
    """The target's own final norm + LM head on the layer-k state (needs no training)."""

    kind = "lm"

    def forward(self, h: torch.Tensor, positions: torch.Tensor, state: Any = None) -> torch.Tensor:
        return self.split.logits(h)
