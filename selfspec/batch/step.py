"""One batched round: several sequences, each as it would run alone, through the layers together.

A step's entries are a new request's prompt (its prefill), a plain step's pending token, or a
speculative round's draft block (a chain, a lookup match or a token tree, drafted per sequence under its
own policy). All their rows go through the layers together (``SplitModel.run_rides``: each enters at its
own layer, attends only to its own cache, and every weight is read once per stage) and the LM head
once; each sequence then verifies and commits on its own (``selfspec.round``). Ragged blocks and ragged
acceptance need no padding and no realignment.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from selfspec import round as core
from selfspec.config import GenerateConfig
from selfspec.drafting.base import DraftBlock
from selfspec.engine import Engine
from selfspec.models.split import Ride
from selfspec.sampling import pick
from selfspec.state import SequenceState
from selfspec.stats import GenerationStats


@dataclass
class BatchEntry:
    """One sequence's part in a batched round (``step``)."""

    seq: SequenceState
    gen: GenerateConfig
    stats: GenerationStats
    remaining: int = 1  # tokens it may still emit (a round never drafts past remaining - 1)
    speculative: bool = False  # drafts (selfspec) or plain steps
    prompt: list[int] | None = None  # not prefilled yet: this round is its prefill
    draft_cap: int = 1 << 30  # at most this many drafts from the exit head this round (the batch's rule)
    lookup_cap: int = 1 << 30  # at most this many lookup drafts this round
    first: int = 0  # a prefill's positions already in the cache (the prefix cache's): its rows start here


def step(engine: Engine, entries: list[BatchEntry]) -> list[list[int]]:
    """One round for every entry (see the module's docstring). -> the new tokens of each entry (a prefill's:
    its first token)."""
    split = engine.split
    plan = _plan(engine, entries)
    chains = _draft_chains(engine, entries, plan)  # entry index -> its early-exit chain, drafted in lockstep
    rides, blocks = [], []
    context = tuple(engine.drafter.context_layers) if engine.drafter is not None else ()
    for j, e in enumerate(entries):
        ride, block = _ride(engine, e, chains.get(j), plan.get(j))
        if e.speculative and context:  # the drafter keeps those states of the verified rows (heads.deep)
            ride.context = context
        rides.append(ride)
        blocks.append(block)
    hs = split.run_rides(rides)
    rows = [h[:, -1:] if e.prompt is not None or not e.speculative else h for e, h in zip(entries, hs)]
    logits = split.logits(torch.cat(rows, dim=1)).split([r.shape[1] for r in rows], dim=1)  # LM head read once
    out = []
    for e, ride, block, h, lg in zip(entries, rides, blocks, hs, logits):
        seq = e.seq
        if e.prompt is not None:
            core.take_first(seq, e.prompt, lg[0, -1], e.gen)
            if e.speculative and ride.capture is not None:  # (None: the drafter reads nothing of the prompt)
                engine.need_drafter().start(seq, ride.h if ride.capture == 0 else ride.captured, ride.with_contexts(h), e.first)
            engine.remember_prompt(seq, e.prompt, len(e.prompt) - e.first)
            out.append([seq.pending])
        elif not e.speculative:
            out.append(core.commit_plain(seq, pick(lg[0, -1], e.gen, seq.generator), e.stats))
        else:
            if block is None:  # nothing drafted: a plain step whose exit state the drafter keeps
                block = DraftBlock([], None, None, start=seq.length, exit_layer=ride.capture)
            if block.exit_states is None and ride.capture is not None:
                block.exit_states = ride.h if ride.capture == 0 else ride.captured
            out.append(engine.accept(seq, e.gen, block, h, e.stats, lg, context=ride.with_contexts(h) if ride.context else None))
    return out


def _plan(engine: Engine, entries: list[BatchEntry]) -> dict[int, tuple[int, int]]:
    """Entry index -> (head drafts, lookup drafts) at most this round, for the speculative entries past their
    prefill (their policies are asked once a round)."""
    return {j: (min(engine.need_drafter().max_drafts(e.seq, engine.gamma, e.remaining), e.remaining - 1, e.draft_cap),
                min(e.remaining - 1, e.lookup_cap))
            for j, e in enumerate(entries) if e.prompt is None and e.speculative}


def _ride(engine: Engine, e: BatchEntry, chain: DraftBlock | None,
          plan: tuple[int, int] | None) -> tuple[Ride, DraftBlock | None]:
    """The rows entry ``e`` sends through the layers this round, and its draft block (None: none)."""
    split, seq = engine.split, e.seq
    if e.prompt is not None:  # a prefill; a speculative one keeps its exit states for the drafter
        ids = torch.tensor([e.prompt[e.first :]], dtype=torch.long, device=split.device)
        capture = engine.capture_depth(seq, e.gen) if e.speculative else None
        return Ride(0, split.embed(ids), seq.positions(e.first, ids.shape[1]), seq.cache, capture=capture,
                    tail=engine.prefill_tail(e.gen, e.speculative, capture)), None
    if not e.speculative:
        return engine.ride_of(seq, None), None
    if chain is not None:
        return engine.ride_of(seq, chain), chain
    assert plan is not None  # a speculative entry past its prefill is in the plan (_plan)
    max_drafts, limit = plan
    if engine.drafts_tree(max_drafts):
        block = engine.propose_tree(seq, max_drafts, limit)
        return engine.ride_of(seq, block), block
    # a lookup block or nothing: the rows ride from the embeddings, their exit states kept
    drafter = engine.need_drafter()
    looked = drafter.lookup_drafts(seq, limit)
    k = drafter.next_depth(seq)
    ids = torch.tensor([[seq.pending, *looked]], dtype=torch.long, device=split.device)
    ride = Ride(0, split.embed(ids), seq.positions(seq.length, len(looked) + 1), seq.cache, capture=k)
    looked_block = (DraftBlock(looked, None, None, start=seq.length, source=drafter.lookup_source(seq), exit_layer=k)
                    if looked else None)
    return ride, looked_block


def _draft_chains(engine: Engine, entries: list[BatchEntry], plan: dict[int, tuple[int, int]]) -> dict[int, DraftBlock]:
    """The chains of a batched round (entries that draft: no tree, no lookup match), drafted together
    (``Drafter.propose_chains``)."""
    if not plan:  # no speculative entry past its prefill
        return {}
    drafter = engine.need_drafter()
    want: dict[int, tuple[int, int]] = {}  # entry index -> (most drafts, exit depth)
    for j, (max_drafts, limit) in plan.items():
        e = entries[j]
        if max_drafts > 0 and not engine.drafts_tree(max_drafts) and not drafter.lookup_drafts(e.seq, limit):
            want[j] = (max_drafts, drafter.next_depth(e.seq))
    if not want:
        return {}
    blocks = drafter.propose_chains([entries[j].seq for j in want], [m for m, _ in want.values()],
                                    [entries[j].gen for j in want], [k for _, k in want.values()])
    return dict(zip(want, blocks))
