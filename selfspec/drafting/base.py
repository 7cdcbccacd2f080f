"""The one interface every way of proposing tokens implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass
class DraftBlock:
    """What a drafter proposes in one round.

    tokens: the draft tokens d_1..d_g (g may be 0).
    probs: the draft's (processed) distributions q_1..q_g ``# [g, vocab]``, or None for greedy drafts.
    exit_states: the exit-layer states of [pending, d_1..d_g] ``# [1, g + 1, hidden]`` when the draft
        shares the target's first layers (self-speculation): verification then runs only the deep
        layers. None for drafters that do not share layers (the engine runs all layers).
    """

    tokens: list[int]
    probs: torch.Tensor | None
    exit_states: torch.Tensor | None
    start: int = 0  # position of the pending token (exit_states[:, 0])
    source: str = "early_exit"  # or "lookup" (n-gram match): each source learns its own acceptance
    exit_layer: int | None = None  # depth the exit states come from (verification starts there); None: the drafter's
    tree: Any = None  # a TokenTree (selfspec.drafting.tree): tokens are its nodes 1.., exit_states all nodes
    levels: int = 0  # a tree's depth in levels (what its policy learns from); 0 for chains
    # A deep-context head's predicted final states of the drafted rows' positions, f^(p + i) for the rows
    # whose head ran ``# [1, n, hidden]`` (the pipeline drafts ahead from them before the true ones exist).
    predicted_finals: torch.Tensor | None = None


class Drafter(Protocol):
    exit_layer: int  # layers [0, exit_layer) are shared with the target (0: none shared)

    def start(self, seq, prompt_exit_states: torch.Tensor) -> None:
        """After the prompt's prefill (e.g. give a stateful exit head the prompt's exit states)."""

    def propose(self, seq, max_drafts: int, gen, limit: int | None = None) -> DraftBlock:
        """Propose up to ``max_drafts`` tokens after ``seq.pending`` (drafts that cost nothing to
        propose, such as lookup matches, up to ``limit``); may write the shallow KV cache."""

    def accepted(self, seq, block: DraftBlock, num_accepted: int) -> None:
        """After verification rolled ``seq`` back to its accepted length: sync own state, learn."""
