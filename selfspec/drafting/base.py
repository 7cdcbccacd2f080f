"""The one interface every way of proposing tokens implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from selfspec.config import GenerateConfig
from selfspec.drafting.tree import TokenTree
from selfspec.state import SequenceState


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
    # "early_exit", "lookup" (an n-gram match in the request's text) or "store" (in text the target wrote before,
    # selfspec.drafting.store): each source learns its own acceptance
    source: str = "early_exit"
    exit_layer: int | None = None  # depth the exit states come from (verification starts there); None: the drafter's
    tree: TokenTree | None = None  # a token tree (selfspec.drafting.tree): tokens are its nodes 1.., exit_states all nodes
    levels: int = 0  # a tree's depth in levels (what its policy learns from); 0 for chains
    # A deep-context head's predicted final states of the drafted rows' positions, f^(p + i) for the rows
    # whose head ran ``# [1, n, hidden]`` (the pipeline drafts ahead from them before the true ones exist).
    predicted_finals: torch.Tensor | None = None
    # The target's verdict, when the drafter's call already ran the pending token's whole step (``propose_or_step``:
    # a blank round's one compiled call): (the next token, the pending token's final state ``# [1, 1, hidden]``)
    verdict: tuple[int, torch.Tensor] | None = None


class Drafter(Protocol):
    """What the decode loops (``selfspec.round``, ``selfspec.engine``, ``selfspec.batch``) ask of a way to draft.

    ``BaseDrafter`` implements every method with the behaviour of a drafter that shares no layers with
    the target and keeps no state; a new way to draft subclasses it, overrides ``propose`` (and whatever
    else it needs) and is registered by name (``selfspec.drafting.registry.register_drafter``)."""

    exit_layer: int  # layers [0, exit_layer) are shared with the target (0: none shared)

    @property
    def supports_tree(self) -> bool:
        """Whether ``propose_tree`` works (token trees, EAGLE-2 style); read-only, so a property may give it."""

    @property
    def context_layers(self) -> list[int]:
        """Target layers whose states of the verified tokens the drafter keeps besides the last layer's (a deep
        head's fused features, ``heads.deep``): verification and the prefill capture them ([]: none)."""

    @property
    def reads_final_states(self) -> bool:
        """Whether ``accepted`` reads the verification's last-layer states (a head that drafts from them); if not,
        a round with nothing drafted is a plain step (``Engine.speculative_step``: one compiled call, no states)."""

    def begin(self, seq: SequenceState, seed: int | None) -> None:
        """Before a request's prefill: its own per-request state (e.g. a seeded adaptive policy)."""

    def depth_of(self, seq: SequenceState) -> int:
        """The exit depth of ``seq``'s next round: a prefill captures the states after this many layers."""

    def next_depth(self, seq: SequenceState) -> int:
        """At the start of a round: the depth this round drafts at (a depth policy may change it)."""

    def max_drafts(self, seq: SequenceState, gamma: int, remaining: int | None = None) -> int:
        """At most this many drafts this round (its policy's choice, at most ``gamma``); ``remaining``: the most
        tokens the request still wants (None: not known)."""

    def start(self, seq: SequenceState, prompt_exit_states: torch.Tensor | None,
              prompt_final_states: torch.Tensor | None = None, first: int = 0) -> None:
        """After the prompt's prefill, with its states after ``depth_of(seq)`` layers and after the last one
        ``# [1, P - first, hidden]`` (the latter followed by those after each of ``context_layers``, one
        ``hidden`` each) of positions ``first``.. (e.g. a stateful exit head catches up on the
        prompt); ``first`` > 0 when the positions before came from the prefix cache (``selfspec.prefix_cache``)."""

    def prompt_rows_needed(self) -> int | None:
        """How many of the prompt's last positions ``start`` must see for drafting to go exactly as after a
        full prefill (0: none; None: every one, so a request never reuses a cached prefix)."""

    def lookup_drafts(self, seq: SequenceState, limit: int) -> list[int]:
        """Drafts that cost no model work (an n-gram match), at most ``limit``; [] when there are none."""

    def lookup_source(self, seq: SequenceState) -> str:
        """Where the drafts ``lookup_drafts`` just gave came from: "lookup" (the request's text) or "store"."""

    def lookup_available(self, seq: SequenceState) -> bool:
        """Whether ``lookup_drafts`` would give a block now."""

    def propose(self, seq: SequenceState, max_drafts: int, gen: GenerateConfig,
                limit: int | None = None) -> DraftBlock:
        """Up to ``max_drafts`` tokens after ``seq.pending`` (free drafts such as lookup matches up to
        ``limit``); may write the shallow layers' KV cache."""

    def propose_or_step(self, seq: SequenceState, max_drafts: int, gen: GenerateConfig,
                        limit: int | None = None) -> DraftBlock:
        """``propose``, but a round that ends with no draft may also have run the pending token's step through every
        layer in the same call: its block then carries the target's verdict (``DraftBlock.verdict``), the
        pending token's keys and values are in the cache, and the round only commits it (``Engine``)."""

    def propose_chains(self, seqs: list[SequenceState], max_drafts: list[int], gens: list[GenerateConfig],
                       depths: list[int] | None = None) -> list[DraftBlock]:
        """One chain per sequence (a batched round), each equal to that sequence's own ``propose``."""

    def propose_tree(self, seq: SequenceState, depth: int, width: int, limit: int) -> DraftBlock:
        """A token tree of ``depth`` levels and ``width`` nodes per level (when ``supports_tree``)."""

    def accepted(self, seq: SequenceState, block: DraftBlock, num_accepted: int,
                 final_states: torch.Tensor | None = None, proposed: int | None = None,
                 observe: bool = True) -> None:
        """After verification rolled ``seq`` back to its accepted length: sync own state; learn (``observe``)."""


class BaseDrafter:
    """A drafter that shares no layers with the target and keeps no state: override ``propose``. Its blocks
    carry no exit states, so their rows go through every layer from the embeddings to be verified."""

    exit_layer = 0

    @property
    def supports_tree(self) -> bool:
        return False

    @property
    def context_layers(self) -> list[int]:
        return []

    @property
    def reads_final_states(self) -> bool:
        return True  # a subclass's ``accepted`` may read them; one that does not can say so

    def begin(self, seq: SequenceState, seed: int | None) -> None:
        return None

    def depth_of(self, seq: SequenceState) -> int:
        return self.exit_layer

    def next_depth(self, seq: SequenceState) -> int:
        return self.depth_of(seq)

    def max_drafts(self, seq: SequenceState, gamma: int, remaining: int | None = None) -> int:
        return gamma

    def start(self, seq: SequenceState, prompt_exit_states: torch.Tensor | None,
              prompt_final_states: torch.Tensor | None = None, first: int = 0) -> None:
        return None

    def prompt_rows_needed(self) -> int | None:
        return 0

    def lookup_drafts(self, seq: SequenceState, limit: int) -> list[int]:
        return []

    def lookup_source(self, seq: SequenceState) -> str:
        return "lookup"

    def lookup_available(self, seq: SequenceState) -> bool:
        return False

    def propose(self, seq: SequenceState, max_drafts: int, gen: GenerateConfig,
                limit: int | None = None) -> DraftBlock:
        raise NotImplementedError

    def propose_or_step(self, seq: SequenceState, max_drafts: int, gen: GenerateConfig,
                        limit: int | None = None) -> DraftBlock:
        return self.propose(seq, max_drafts, gen, limit=limit)

    def propose_chains(self, seqs: list[SequenceState], max_drafts: list[int], gens: list[GenerateConfig],
                       depths: list[int] | None = None) -> list[DraftBlock]:
        return [self.propose(s, m, g) for s, m, g in zip(seqs, max_drafts, gens)]

    def propose_tree(self, seq: SequenceState, depth: int, width: int, limit: int) -> DraftBlock:
        raise NotImplementedError(f"{type(self).__name__} drafts no token trees")

    def accepted(self, seq: SequenceState, block: DraftBlock, num_accepted: int,
                 final_states: torch.Tensor | None = None, proposed: int | None = None,
                 observe: bool = True) -> None:
        return None


if TYPE_CHECKING:  # `make test` runs mypy: a BaseDrafter that lost or changed a Drafter method fails it here

    def _base_drafter_is_a_drafter(d: BaseDrafter) -> Drafter:
        return d
