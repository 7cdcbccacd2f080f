"""Per-sequence decoding state. Nothing per-sequence lives in globals or in the model objects, so
several sequences (batching, a server's queue) can be decoded by one engine.

Each part has the module that works on it: ``HeadState`` the exit head's (``selfspec.drafting.head_state``;
the pipeline snapshots its backlog to draft ahead), ``LookupState`` lookup drafting's
(``selfspec.drafting.sources``). SpecEE's decoding keeps a dataclass of its own in ``SequenceState.specee``
(``selfspec.specee.decode.SpecEEState``): its fields are SpecEE's classes, which this module sits below."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from selfspec.models.cache import KVCache


@dataclass
class HeadState:
    """The exit head's per-sequence state (``selfspec.drafting.head_state``); a stateless head keeps none of it."""

    state: Any = None  # the head's own (``ExitHead.new_state``: a stateful head's KV cache), if any
    backlog: torch.Tensor | None = None  # [1, b, hidden] exit states of positions the head has not seen
    # A deep-context head's final states of the verified tokens ``# [capacity + 1, width]``: row j + 1 holds position
    # j's (and the context layers' after it, ``Drafter.context_layers``); row 0 (before the first token) is zeros
    finals: torch.Tensor | None = None


@dataclass
class LookupState:
    """Lookup drafting's per-sequence state (``selfspec.drafting.sources``)."""

    # The n-gram index over ``SequenceState.tokens`` (``selfspec.drafting.lookup.NgramIndex``), built by the first
    # lookup and again when the token list is replaced
    index: object = None
    from_store: bool = False  # the last lookup block came from the token store (else from the request's own text)
    match: int = 0  # that block's match length: the policy that sizes it and learns from its verdict
    streak: bool = False  # the last verified block was a lookup block accepted whole


@dataclass
class SequenceState:
    cache: KVCache  # target KV, all layers
    length: int = 0  # tokens whose KV is final in every layer (prompt + accepted outputs)
    pending: int = -1  # last emitted token, not yet in the cache; the next round starts from it
    generator: torch.Generator | None = None
    tokens: list[int] = field(default_factory=list)  # prompt + emitted tokens (pending included): lookup drafts
    policy: Any = None  # this request's drafting policy (adaptive policies keep per-request state)
    depth: int | None = None  # exit depth of the next round (a nested head drafts from several)
    head: HeadState = field(default_factory=HeadState)
    lookup: LookupState = field(default_factory=LookupState)
    specee: object = None  # SpecEE's (``selfspec.specee.decode.SpecEEState``) while SpecEE decodes the sequence

    def positions(self, start: int, n: int) -> torch.Tensor:  # [1, n]
        """Positions start .. start + n - 1 as ``# [1, n]``; the tensor also says its first position (``first``), so
        that ``consecutive`` need not read it back (reading a tensor's values costs a few small ops, each slow
        right after a step has pushed the interpreter's working set out of the caches)."""
        out = torch.arange(start, start + n, device=self.cache.keys[0].device).unsqueeze(0)
        out.first = start  # type: ignore[attr-defined]
        return out
