"""Self-speculative drafting with an early exit (LayerSkip / Kangaroo / EESD style).

The draft is the target's own layers [0, k) followed by an exit head. Each draft token goes
through the shallow layers once; its layer-k KV entries and hidden state are exactly what the
target computes for that token, so verification only runs layers [k, L) over the cached exit
states, and nothing is computed twice.

One round, from the pending token x at position p (worked example, gamma = 3):

    shallow(x)  @p   -> h_x  -> head -> q_1 -> d_1
    shallow(d_1)@p+1 -> h_1  -> head -> q_2 -> d_2
    shallow(d_2)@p+2 -> h_2  -> head -> q_3 -> d_3
    shallow(d_3)@p+3 -> h_3                      (no head: gamma reached; h_3 is needed to verify)
    exit_states = [h_x, h_1, h_2, h_3]  # [1, gamma + 1, hidden]

With the confidence policy, if q_2's top-1 probability is below the threshold the round stops
after h_1 (drafts [d_1]; exit_states [h_x, h_1]): no extra shallow pass is needed.

Lookup drafts (``lookup`` > 0, selfspec.drafting.sources): when the text's last n-gram occurred
before, its continuation [d_1..d_g] is proposed instead, at no model cost; one shallow pass over
[x, d_1..d_g] gives the exit states. How long such a block is, and whether the early-exit draft runs
at all, each source's own policy decides from its measured costs and the acceptance it has seen.

The drafter puts the parts together: the chains (``selfspec.drafting.chain``), token trees
(``selfspec.drafting.tree_drafting``), the lookup sources and their policies (``selfspec.drafting.sources``) and the
head's per-sequence state (``selfspec.drafting.head_state``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from selfspec.config import GenerateConfig
from selfspec.drafting import head_state
from selfspec.drafting.base import BaseDrafter, DraftBlock, Drafter
from selfspec.drafting.chain import Chain, run_chains
from selfspec.drafting.policies import DraftPolicy
from selfspec.drafting.policy_tables import ByMatchLength
from selfspec.drafting.sources import LookupSources
from selfspec.drafting.store import TokenStore
from selfspec.drafting.tree_drafting import propose_tree
from selfspec.heads.base import ExitHead
from selfspec.models.split import SplitModel
from selfspec.state import SequenceState
from selfspec.stats import LOOKUP_SOURCES


class EarlyExitDrafter(BaseDrafter):
    def __init__(self, split: SplitModel, head: ExitHead, policy: DraftPolicy, lookup: int = 0,
                 lookup_ngram: int = 3, lookup_policy: ByMatchLength | None = None, lookup_only: bool = False,
                 catch_up_limit: float = math.inf, head_context: int | None = None,
                 lookup_streak_policy: ByMatchLength | None = None, lookup_longest: bool = True,
                 store: TokenStore | None = None, store_policy: ByMatchLength | None = None) -> None:
        self.split, self.head, self.policy = split, head, policy
        self.exit_layer = head.exit_layer
        # Lookup blocks: ``lookup`` tokens at most (0: off), one policy per bucket of match lengths in each table
        # (None: full-length blocks); after a lookup block accepted whole, the streak's table (None: the same one);
        # from the token ``store`` when the request's own text has no match
        self.sources = LookupSources(lookup, lookup_ngram, lookup_policy, lookup_streak_policy, lookup_longest, store,
                                     store_policy)
        # Only lookup drafts (DraftConfig.lookup_only, or a calibration that found no early-exit draft that pays):
        # the head never runs, a round without a lookup match is a plain step
        self.lookup_only = lookup_only
        # A stateful head runs over the rows it has not seen before it drafts (at first the whole prompt). At most
        # this many such rows per token the request may still want: beyond, the catch-up costs more than the head's
        # drafts can save (setup.catch_up_limit), and the round drafts by lookup or not at all
        self.catch_up_limit = catch_up_limit
        # At most this many rows of backlog are caught up before a draft; older ones the head never sees (it
        # restarts its context after them, ``ExitHead.skip``). None: every row (at first the whole prompt)
        self.head_context = head_context

    def begin(self, seq: SequenceState, seed: int | None) -> None:
        """Before a request's prefill: its own policy state (seeded) and its first exit depth."""
        seq.policy = self.policy.for_request(seed)
        seq.depth = seq.policy.depth or self.exit_layer

    def policy_of(self, seq: SequenceState) -> DraftPolicy:
        return seq.policy if seq.policy is not None else self.policy

    def max_drafts(self, seq: SequenceState, gamma: int, remaining: int | None = None) -> int:
        """This round's most drafts: the sequence's policy decides (at the start of every round); none when the
        head does not draft, or when catching it up on the rows it has not seen would cost more than its drafts
        can save in the ``remaining`` tokens (lookup blocks are capped by their own policy)."""
        if self.lookup_only:
            return 0
        if remaining is not None and self.catch_up_rows(seq) > self.catch_up_limit * remaining:
            return 0
        return self.policy_of(seq).max_drafts(gamma)

    def backlog(self, seq: SequenceState) -> int:
        """Rows a stateful head must still run over before it drafts for ``seq`` (0 for a stateless head)."""
        return head_state.backlog(seq.head)

    def catch_up_rows(self, seq: SequenceState) -> int:
        """Rows the head would run over before its next draft: the backlog, at most ``head_context`` of it."""
        return head_state.catch_up_rows(seq.head, self.head_context)

    @property
    def context_layers(self) -> list[int]:
        """The head's context layers (a deep head with fused features) when it drafts, else []."""
        return [] if self.lookup_only else list(getattr(self.head, "context_layers", []))

    def depth_of(self, seq: SequenceState) -> int:
        """The exit depth of ``seq``'s next round (the head's own layer unless a depth policy chose another)."""
        return seq.depth or self.exit_layer

    def next_depth(self, seq: SequenceState) -> int:
        """At the start of a round: take the depth the policy chose (DepthBandit), if any."""
        depth = self.policy_of(seq).depth
        if depth is not None:
            seq.depth = depth
        return self.depth_of(seq)

    def start(self, seq: SequenceState, prompt_exit_states: torch.Tensor | None,
              prompt_final_states: torch.Tensor | None = None, first: int = 0) -> None:
        """After the prompt's prefill: a stateful head must still see the prompt's exit states
        ``# [1, P - first, hidden]``; a deep-context head also keeps the final states ``# [1, P - first, hidden]``
        (positions ``first``..: those before came from the prefix cache, and the head passes over them as it
        passes over all but its last ``head_context`` rows anyway, ``prompt_rows_needed``)."""
        if not (self.head.stateful or self.head.needs_context):
            return
        assert prompt_exit_states is not None, "the prefill captures the exit states (depth_of)"
        head_state.start(self.head, seq, prompt_exit_states, prompt_final_states, first, self.depth_of(seq))

    @property
    def reads_final_states(self) -> bool:
        """Only a drafting head that is stateful or reads the verified tokens' final states (``accepted``)."""
        return not self.lookup_only and (self.head.stateful or self.head.needs_context)

    def prompt_rows_needed(self) -> int | None:
        """A stateless head reads nothing of the prompt; a stateful one its last ``head_context`` exit states (a
        deep-context head also the final state before them): the rows a prefill after a cached prefix must
        compute. With no ``head_context`` the head reads the whole prompt."""
        if self.lookup_only or not (self.head.stateful or self.head.needs_context):
            return 0
        if self.head_context is None:
            return None
        return self.head_context + (1 if self.head.needs_context else 0)

    def lookup_drafts(self, seq: SequenceState, limit: int) -> list[int]:
        """The lookup drafts a round would propose (at most ``limit``; ``LookupSources.drafts``). Runs no layers (a
        batch sends them in from the embeddings)."""
        return self.sources.drafts(seq, limit)

    def lookup_source(self, seq: SequenceState) -> str:
        return self.sources.source(seq)

    def lookup_available(self, seq: SequenceState) -> bool:
        return self.sources.available(seq)

    def _lookup(self, seq: SequenceState, limit: int) -> DraftBlock | None:
        """A block of lookup drafts, or None when the last n-gram has no earlier occurrence."""
        drafts = self.lookup_drafts(seq, limit)
        if not drafts:
            return None
        block = DraftBlock(list(drafts), None, None, start=seq.length, source=self.lookup_source(seq))
        # lookup alone: the exit states are not kept (the head never runs): verified from the embeddings
        return block if self.lookup_only else self.with_exit_states(seq, block)

    def with_exit_states(self, seq: SequenceState, block: DraftBlock) -> DraftBlock:
        """``block`` with the exit states of [pending, drafts...] (layers [0, k) run now) if it has none: what
        verification from the exit depth and the head's state need (the pipeline's shallow stage always)."""
        if block.exit_states is None:
            split, k = self.split, self.depth_of(seq)
            ids = torch.tensor([[seq.pending, *block.tokens]], dtype=torch.long, device=split.device)
            rows = split.embed(ids)  # exit layer 0: the embeddings are the exit states (no positions, no layers)
            block.exit_states = rows if k == 0 else split.run_layers(rows, 0, k, seq.positions(block.start,
                                                                                             ids.shape[1]), seq.cache)
            block.exit_layer = k
        return block

    def propose(self, seq: SequenceState, max_drafts: int, gen: GenerateConfig,
                limit: int | None = None) -> DraftBlock:
        return self._propose(seq, max_drafts, gen, limit, step=False)

    def propose_or_step(self, seq: SequenceState, max_drafts: int, gen: GenerateConfig,
                        limit: int | None = None) -> DraftBlock:
        """``propose`` where a greedy chain starts with one compiled call: a round that drafts nothing is the
        pending token's step keeping the head's states (``Chain.plain_step``), and a deep head's first draft is
        one call that, when the confidence stop refuses the draft (a blank round), has also run the rest of the
        pending token's plain step (``Chain.first_draft``); the block then carries the verdict."""
        return self._propose(seq, max_drafts, gen, limit, step=True)

    def _propose(self, seq: SequenceState, max_drafts: int, gen: GenerateConfig, limit: int | None,
                 step: bool) -> DraftBlock:
        k = self.next_depth(seq)
        if self.sources.lookup > 0 and seq.tokens:
            block = self._lookup(seq, max_drafts if limit is None else limit)
            if block is not None:
                return block
        if self.lookup_only:  # a plain step: every layer in one pass (no exit state to keep: the head never runs)
            return DraftBlock([], None, None, start=seq.length)
        chain = self._chain(seq, max_drafts, gen, k)
        if step and gen.greedy:  # the chain's start in one compiled call, where it applies
            if max_drafts > 0:
                chain.first_draft()
            elif self.reads_final_states and not self.context_layers:  # (fused features: states wider than its)
                chain.plain_step()
        return run_chains(self.split, [chain])[0]

    def _chain(self, seq: SequenceState, max_drafts: int, gen: GenerateConfig, k: int) -> Chain:
        return Chain(self.split, self.head, self.head_context, self.policy_of(seq), seq, max_drafts, gen, k)

    def propose_chains(self, seqs: list[SequenceState], max_drafts: list[int], gens: list[GenerateConfig],
                       depths: list[int] | None = None) -> list[DraftBlock]:
        """Early-exit chains for several sequences drafted in lockstep (``chain.run_chains``): each block equals
        that sequence's own chain. ``depths``: exit depths already chosen this round (default: choose now)."""
        return run_chains(self.split, [self._chain(seq, m, gen, k) for seq, m, gen, k in
                                       zip(seqs, max_drafts, gens, depths or [self.next_depth(s) for s in seqs])])

    @property
    def supports_tree(self) -> bool:
        return self.head.supports_tree

    def propose_tree(self, seq: SequenceState, depth: int, width: int, limit: int) -> DraftBlock:
        """A token tree of ``depth`` levels and ``width`` nodes per level, plus the lookup continuation as one more
        branch (``tree_drafting.propose_tree``)."""
        return propose_tree(self.split, self.head, self.head_context, self.sources, seq, self.next_depth(seq), depth,
                            width, limit)

    def accepted(self, seq: SequenceState, block: DraftBlock, num_accepted: int,
                 final_states: torch.Tensor | None = None, proposed: int | None = None, observe: bool = True) -> None:
        """``seq`` now holds ``seq.length`` final tokens; bring the head's state in line with it.
        ``final_states`` ``# [1, g + 1, hidden]``: the verification's last-layer states of the block.
        ``proposed``: the draft length the policy learns from (default: the block's tokens; a tree's
        accepted path passes the depth the tree was drafted to). ``observe=False``: a verdict the pipeline
        only supposes, to draft ahead (the policies learn nothing from it)."""
        looked = block.source in LOOKUP_SOURCES
        policy = self.sources.policy_of(seq) if looked else self.policy_of(seq)
        if observe and (looked or not self.lookup_only):
            policy.observe(len(block.tokens) if proposed is None else proposed, num_accepted)
        if observe:
            self.sources.verified(seq, looked, len(block.tokens), num_accepted)
        if not self.lookup_only:
            head_state.accepted(self.head, seq, block, num_accepted, final_states, self.exit_layer)


if TYPE_CHECKING:  # `make test` runs mypy: an EarlyExitDrafter that no longer implements Drafter fails it here

    def _early_exit_drafter_is_a_drafter(d: EarlyExitDrafter) -> Drafter:
        return d
