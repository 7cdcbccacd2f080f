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

Lookup drafts (``lookup`` > 0, selfspec.drafting.lookup): when the text's last n-gram occurred
before, its continuation [d_1..d_g] is proposed instead, at no model cost; one shallow pass over
[x, d_1..d_g] gives the exit states. How long such a block is, and whether the early-exit draft runs
at all, each source's own policy decides from its measured costs and the acceptance it has seen.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from selfspec.config import GenerateConfig
from selfspec.drafting.base import BaseDrafter, DraftBlock, Drafter
from selfspec.drafting.lookup import NgramIndex
from selfspec.drafting.policies import ByMatchLength, DraftPolicy, FixedPolicy
from selfspec.drafting.store import TokenStore
from selfspec.drafting.tree import TokenTree
from selfspec.heads.base import ExitHead
from selfspec.models.split import SplitModel
from selfspec.sampling import greedy, logits_to_probs, sample
from selfspec.state import SequenceState
from selfspec.stats import BLANK, LOOKUP_SOURCES


class EarlyExitDrafter(BaseDrafter):
    def __init__(self, split: SplitModel, head: ExitHead, policy: DraftPolicy, lookup: int = 0,
                 lookup_ngram: int = 3, lookup_policy: ByMatchLength | None = None, head_drafts: bool = True,
                 catch_up_limit: float = math.inf, head_context: int | None = None,
                 lookup_streak_policy: ByMatchLength | None = None, lookup_longest: bool = True,
                 store: TokenStore | None = None, store_policy: ByMatchLength | None = None) -> None:
        self.split, self.head, self.policy = split, head, policy
        self.exit_layer = head.exit_layer
        self.lookup, self.lookup_ngram = lookup, lookup_ngram
        self.lookup_longest = lookup_longest  # the occurrence matching furthest back (else the latest; NgramIndex)
        # one policy per bucket of match lengths (the block's ``lookup.Match.length``); None: full-length blocks
        self.lookup_policy = lookup_policy or ByMatchLength(FixedPolicy, ())
        # The lookup blocks right after a lookup block that was accepted whole (the answer is copying a span of
        # the prompt) learn their own acceptance, and may run longer; None: one policy for every lookup block
        self.lookup_streak_policy = lookup_streak_policy
        # False: only lookup drafts (a calibration found no early-exit draft that pays, DraftConfig.explore);
        # the head never runs, a round without a lookup match is a plain step
        self.head_drafts = head_drafts
        # A stateful head runs over the rows it has not seen before it drafts (at first the whole prompt). At most
        # this many such rows per token the request may still want: beyond, the catch-up costs more than the head's
        # drafts can save (setup.catch_up_limit), and the round drafts by lookup or not at all
        self.catch_up_limit = catch_up_limit
        # At most this many rows of backlog are caught up before a draft; older ones the head never sees (it
        # restarts its context after them, ``ExitHead.skip``). None: every row (at first the whole prompt)
        self.head_context = head_context
        # Text the target wrote before (selfspec.drafting.store): its continuation is the lookup block when the
        # request's own text has no match; such blocks (source "store") learn their acceptance in store_policy
        self.store = store
        self.store_policy = store_policy or ByMatchLength(FixedPolicy, ())

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
        if not self.head_drafts:
            return 0
        if remaining is not None and self.catch_up_rows(seq) > self.catch_up_limit * remaining:
            return 0
        return self.policy_of(seq).max_drafts(gamma)

    def backlog(self, seq: SequenceState) -> int:
        """Rows a stateful head must still run over before it drafts for ``seq`` (0 for a stateless head)."""
        return 0 if seq.head_backlog is None else int(seq.head_backlog.shape[1])

    def catch_up_rows(self, seq: SequenceState) -> int:
        """Rows the head would run over before its next draft: the backlog, at most ``head_context`` of it."""
        b = self.backlog(seq)
        return b if self.head_context is None else min(b, self.head_context)

    @property
    def context_layers(self) -> list[int]:
        """The head's context layers (a deep head with fused features) when it drafts, else []."""
        return list(getattr(self.head, "context_layers", [])) if self.head_drafts else []

    def depth_of(self, seq: SequenceState) -> int:
        """The exit depth of ``seq``'s next round (the head's own layer unless a depth policy chose another)."""
        return seq.depth or self.exit_layer

    def next_depth(self, seq: SequenceState) -> int:
        """At the start of a round: take the depth the policy chose (DepthBandit), if any."""
        depth = self.policy_of(seq).depth
        if depth is not None:
            seq.depth = depth
        return self.depth_of(seq)

    def _project(self, h: torch.Tensor, depth: int) -> torch.Tensor:
        """Exit states as the head reads them (a nested head maps each depth into one space, heads.nested)."""
        return self.head.project(h, depth) if self.head.needs_context else h

    def start(self, seq: SequenceState, prompt_exit_states: torch.Tensor | None,
              prompt_final_states: torch.Tensor | None = None, first: int = 0) -> None:
        """After the prompt's prefill: a stateful head must still see the prompt's exit states
        ``# [1, P - first, hidden]``; a deep-context head also keeps the final states ``# [1, P - first, hidden]``
        (positions ``first``..: those before came from the prefix cache, and the head passes over them as it
        passes over all but its last ``head_context`` rows anyway, ``prompt_rows_needed``)."""
        if not (self.head.stateful or self.head.needs_context):
            return
        assert prompt_exit_states is not None, "the prefill captures the exit states (depth_of)"
        if self.head.stateful:
            seq.head_state = self.head.new_state(seq.cache.capacity)
            self.head.skip(seq.head_state, first)
            seq.head_backlog = self._project(prompt_exit_states, self.depth_of(seq))
        if self.head.needs_context:
            n = prompt_exit_states.shape[1]
            assert prompt_final_states is not None, "a deep-context head starts from the prompt's final states"
            # row j + 1 holds the final state at position j (and the context layers' states after it, when the
            # verification keeps them: ``context_layers``); row 0 (before the first token) is zeros
            finals = prompt_exit_states.new_zeros(seq.cache.capacity + 1, prompt_final_states.shape[-1])
            finals[first + 1 : first + n + 1] = prompt_final_states[0]
            seq.extras["finals"] = finals

    @property
    def reads_final_states(self) -> bool:
        """Only a drafting head that is stateful or reads the verified tokens' final states (``accepted``)."""
        return self.head_drafts and (self.head.stateful or self.head.needs_context)

    def prompt_rows_needed(self) -> int | None:
        """A stateless head reads nothing of the prompt; a stateful one its last ``head_context`` exit states (a
        deep-context head also the final state before them): the rows a prefill after a cached prefix must
        compute. With no ``head_context`` the head reads the whole prompt."""
        if not self.head_drafts or not (self.head.stateful or self.head.needs_context):
            return 0
        if self.head_context is None:
            return None
        return self.head_context + (1 if self.head.needs_context else 0)

    def _store_finals(self, seq: SequenceState, start: int, states: torch.Tensor) -> None:
        """Final states ``# [n, hidden]`` of positions start..start + n - 1 (verified tokens)."""
        finals = seq.extras["finals"]
        end = start + 1 + states.shape[0]
        if end > finals.shape[0]:
            finals = seq.extras["finals"] = torch.cat([finals, finals.new_zeros(end, finals.shape[1])])
        width = min(finals.shape[1], states.shape[1])  # a verdict without the context layers' states: zeros there
        finals[start + 1 : end, :width] = states[:, :width]
        if width < finals.shape[1]:  # (no empty fill otherwise: each small op after a step runs cold)
            finals[start + 1 : end, width:] = 0

    def _deep_inputs(self, seq: SequenceState, h: torch.Tensor,
                     f_prev: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What the deep head reads for exit state ``h`` (its backlog first): (exit states ``# [1, n, hidden]``,
        the previous positions' final states ``# [1, n, width]``, positions ``# [1, n]``). ``f_prev``: the predicted
        final state of the position before when that token is itself a draft (None: it is verified, its true
        final state is stored)."""
        start, h = self._with_backlog(seq, self._project(h, self.depth_of(seq)))
        n = h.shape[1]
        ctx = seq.extras["finals"][start : start + n].unsqueeze(0)  # [1, n, hidden]: positions start - 1 ...
        if f_prev is not None:  # a draft's context: f^ alone (the context layers' part reads zeros)
            ctx = ctx.clone()
            ctx[:, -1] = 0
            ctx[:, -1, : f_prev.shape[-1]] = f_prev[:, -1]
        return h, ctx, seq.positions(start, n)

    def _deep_features(self, seq: SequenceState, h: torch.Tensor, f_prev: torch.Tensor | None) -> torch.Tensor:
        """The predicted final state ``# [1, 1, hidden]`` at the position of exit state ``h`` (``_deep_inputs``)."""
        h, ctx, pos = self._deep_inputs(seq, h, f_prev)
        return self.head.features(h, ctx, pos, seq.head_state, tail=1)[:, -1:]

    def _deep_draft(self, seq: SequenceState, h: torch.Tensor, f_prev: torch.Tensor | None,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A greedy draft's inputs: (f^ ``# [1, 1, hidden]`` as ``_deep_features``, the drafted vocabulary's logits
        there ``# [V']``, their ids or None), in one compiled call where the head has one (``draft_step``)."""
        h, ctx, pos = self._deep_inputs(seq, h, f_prev)
        fused = self.head.draft_step(h, ctx, pos, seq.head_state)
        if fused is not None:
            return fused[0][:, -1:], fused[1], fused[2]
        f_hat = self.head.features(h, ctx, pos, seq.head_state, tail=1)[:, -1:]
        part, ids = self.head.logits_part_of(f_hat)
        return f_hat, part[0, -1], ids

    def _deep_logits(self, seq: SequenceState, h: torch.Tensor, pos: int,
                     f_prev: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft logits ``# [vocab]`` for the token after position ``pos`` and the predicted final state
        ``# [1, 1, hidden]`` there (``_deep_features``)."""
        f_hat = self._deep_features(seq, h, f_prev)
        return self.head.logits_of(f_hat)[0, -1], f_hat

    def _head_logits(self, seq: SequenceState, h: torch.Tensor, pos: int) -> torch.Tensor:  # -> [vocab]
        if not self.head.stateful:
            return self.head(h, seq.positions(pos, 1))[0, -1]
        start, h = self._with_backlog(seq, h)
        return self.head(h, seq.positions(start, h.shape[1]), seq.head_state)[0, -1]

    def _with_backlog(self, seq: SequenceState, h: torch.Tensor) -> tuple[int, torch.Tensor]:
        """(first position, exit states) a stateful head consumes next: the backlog it has not seen, then ``h``."""
        start, backlog = self._take_backlog(seq)
        return start, h if backlog is None else torch.cat([backlog, h], dim=1)

    def _take_backlog(self, seq: SequenceState) -> tuple[int, torch.Tensor | None]:
        """(first position, the rows ``# [1, b, hidden]`` or None) a stateful head consumes before its next exit
        state: the backlog it has not seen, at most ``head_context`` rows of it (the head skips the oldest others)."""
        backlog, seq.head_backlog = seq.head_backlog, None
        if backlog is not None and self.head_context is not None and backlog.shape[1] > self.head_context:
            self.head.skip(seq.head_state, backlog.shape[1] - self.head_context)  # the oldest rows: never seen
            backlog = backlog[:, backlog.shape[1] - self.head_context :]
        if backlog is not None and backlog.shape[1] == 0:
            backlog = None
        return self.head.seen(seq.head_state), backlog

    def _ngram_index(self, seq: SequenceState) -> NgramIndex:
        """The sequence's n-gram index (rebuilt when its token list was replaced)."""
        index = seq.extras.get("ngram")
        if index is None or index.tokens is not seq.tokens:
            index = seq.extras["ngram"] = NgramIndex(seq.tokens, self.lookup_ngram, longest=self.lookup_longest)
        return index

    def lookup_drafts(self, seq: SequenceState, limit: int) -> list[int]:
        """The lookup drafts a round would propose (at most ``limit``); empty when lookup is off or the text's
        last n-gram has no earlier occurrence. Runs no layers (a batch sends them in from the embeddings)."""
        if self.lookup <= 0 or not seq.tokens:
            return []
        found = self._ngram_index(seq).match(min(limit, self.lookup))
        seq.extras["lookup_store"] = False
        if not found.tokens and self.store is not None:  # nothing in the request's text: text the target wrote before
            found = self.store.match(seq.tokens, min(limit, self.lookup))
            seq.extras["lookup_store"] = True
        if not found.tokens:
            return []
        seq.extras["lookup_match"] = found.length  # the block's policy, here and when its verdict comes
        return list(found.tokens[: self.lookup_policy_of(seq).max_drafts(self.lookup)])

    def lookup_source(self, seq: SequenceState) -> str:
        """The source of the lookup block ``lookup_drafts`` just proposed: "store" or "lookup" (the request's text)."""
        return "store" if seq.extras.get("lookup_store") else "lookup"

    def lookup_policy_of(self, seq: SequenceState) -> DraftPolicy:
        """The policy of ``seq``'s lookup block: a store block's by its match length; the streak's after a lookup
        block accepted whole, else the lookup policy, each the one of the block's match length."""
        if seq.extras.get("lookup_store"):
            return self.store_policy.of(seq.extras.get("lookup_match", 0))
        table = self.lookup_policy
        if self.lookup_streak_policy is not None and seq.extras.get("lookup_streak"):
            table = self.lookup_streak_policy
        return table.of(seq.extras.get("lookup_match", 0))

    def _lookup(self, seq: SequenceState, limit: int) -> DraftBlock | None:
        """A block of lookup drafts, or None when the last n-gram has no earlier occurrence."""
        drafts = self.lookup_drafts(seq, limit)
        if not drafts:
            return None
        block = DraftBlock(list(drafts), None, None, start=seq.length, source=self.lookup_source(seq))
        # without head drafts the exit states are not kept (the head never runs): verified from the embeddings
        return self.with_exit_states(seq, block) if self.head_drafts else block

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

    def lookup_available(self, seq: SequenceState) -> bool:
        """Whether a lookup block would be proposed now (the text's last n-gram occurred before)."""
        if self.lookup <= 0 or not seq.tokens:
            return False
        return bool(self._ngram_index(seq).continuation(1)) or (
            self.store is not None and bool(self.store.match(seq.tokens, 1).tokens))

    def propose(self, seq: SequenceState, max_drafts: int, gen: GenerateConfig,
                limit: int | None = None) -> DraftBlock:
        return self._propose(seq, max_drafts, gen, limit, step=False)

    def propose_or_step(self, seq: SequenceState, max_drafts: int, gen: GenerateConfig,
                        limit: int | None = None) -> DraftBlock:
        """``propose`` where a greedy chain's first draft comes from one compiled call with the deep head
        (``DeepContextHead.draft_or_step``): when the confidence stop refuses it (a blank round) that call has also
        run the rest of the pending token's plain step, and the block carries its verdict."""
        return self._propose(seq, max_drafts, gen, limit, step=True)

    def _propose(self, seq: SequenceState, max_drafts: int, gen: GenerateConfig, limit: int | None,
                 step: bool) -> DraftBlock:
        k = self.next_depth(seq)
        if self.lookup > 0 and seq.tokens:
            block = self._lookup(seq, max_drafts if limit is None else limit)
            if block is not None:
                return block
        if not self.head_drafts:  # a plain step: every layer in one pass (no exit state to keep: the head never runs)
            return DraftBlock([], None, None, start=seq.length)
        chain = _Chain(self, seq, max_drafts, gen, k)
        if step:
            chain.front()
        return self._run_chains([chain])[0]

    def propose_chains(self, seqs: list[SequenceState], max_drafts: list[int], gens: list[GenerateConfig],
                       depths: list[int] | None = None) -> list[DraftBlock]:
        """Early-exit chains for several sequences drafted in lockstep: at each position the current token of
        every sequence still drafting goes through layers [0, k) in one ragged pass (each over its own cache),
        then each sequence's head and policy decide its next draft on their own. Each block equals that
        sequence's own chain. ``depths``: exit depths already chosen this round (default: choose now)."""
        return self._run_chains([_Chain(self, seq, m, gen, k) for seq, m, gen, k in
                                 zip(seqs, max_drafts, gens, depths or [self.next_depth(s) for s in seqs])])

    def _run_chains(self, chains: list[_Chain]) -> list[DraftBlock]:
        """``chains`` drafted to their ends (``propose_chains``) -> their blocks."""
        split = self.split
        while live := [c for c in chains if not c.done]:
            for k in sorted({c.k for c in live}):
                group = [c for c in live if c.k == k]
                ids = torch.tensor([[c.tok for c in group]], dtype=torch.long, device=split.device)  # [1, n]
                rows = split.embed(ids)
                parts = [rows] if len(group) == 1 else list(rows.split(1, dim=1))  # per sequence [1, 1, hidden]
                hs = parts if k == 0 else split.run_layers_batch(  # exit layer 0: the embeddings are the exit states
                    parts, 0, k, [c.seq.positions(c.p + len(c.states), 1) for c in group], [c.seq.cache for c in group])
                for c, h in zip(group, hs):
                    c.advance(h)
        return [c.block() for c in chains]

    @property
    def supports_tree(self) -> bool:
        return self.head.supports_tree

    def propose_tree(self, seq: SequenceState, depth: int, width: int, limit: int) -> DraftBlock:
        """A token tree of ``depth`` levels, ``width`` nodes per level chosen by path score (EAGLE-2),
        plus the lookup continuation as one more branch (at most ``limit`` long). Each level's nodes go
        through the shallow layers as one tree block and then through the head (the deepest level skips
        the head), so every node's exit state is ready for verification."""
        split, k, p, head = self.split, self.next_depth(seq), seq.length, self.head
        dev = split.device
        tree = TokenTree.root(seq.pending)
        ids = torch.tensor([[seq.pending]], dtype=torch.long, device=dev)
        states = [split.run_layers(split.embed(ids), 0, k, seq.positions(p, 1), seq.cache)]
        frontier: list[tuple[int, torch.Tensor, torch.Tensor | None]]  # (node, its draft logits, its f^)
        if head.needs_context:
            logits, f_hat = self._deep_logits(seq, states[0], p, None)
            frontier = [(0, logits, f_hat)]
        else:
            frontier = [(0, self._head_logits(seq, states[0], p), None)]
        for d in range(1, depth + 1):
            cands = []
            for node, logits, f in frontier:
                top = torch.log_softmax(logits.float(), -1).topk(width)
                for lp, tok in zip(top.values.tolist(), top.indices.tolist()):
                    if lp > float("-inf"):
                        cands.append((tree.scores[node] + lp, node, tok, f))
            cands.sort(key=lambda c: -c[0])
            cands = cands[:width]
            rows = [tree.add(tok, node, score) for score, node, tok, _ in cands]
            att = tree.attention(rows, p, dev)
            pos = tree.positions(rows, p, dev)
            new_ids = torch.tensor([[tree.tokens[i] for i in rows]], dtype=torch.long, device=dev)
            h = split.run_layers(split.embed(new_ids), 0, k, pos, seq.cache, tree=att)
            states.append(h)
            if d == depth:
                break
            if head.needs_context:
                # [1, n, hidden]: each parent's f^ (every node has one when the head reads context)
                ctx = torch.cat([f for _, _, _, f in cands if f is not None], dim=1)
                f_new = head.features(self._project(h, k), ctx, pos, seq.head_state, tree=att)
                logits_new = head.logits_of(f_new)[0]
                frontier = [(r, logits_new[j], f_new[:, j : j + 1]) for j, r in enumerate(rows)]
            else:  # a stateless head (supports_tree)
                logits_new = head(h, pos)[0]
                frontier = [(r, logits_new[j], None) for j, r in enumerate(rows)]
        if self.lookup > 0 and seq.tokens:
            rows = tree.insert_chain(self._ngram_index(seq).continuation(min(limit, self.lookup)))
            if rows:
                new_ids = torch.tensor([[tree.tokens[i] for i in rows]], dtype=torch.long, device=dev)
                states.append(split.run_layers(split.embed(new_ids), 0, k, tree.positions(rows, p, dev), seq.cache,
                                               tree=tree.attention(rows, p, dev)))
        return DraftBlock(tree.tokens[1:], None, torch.cat(states, dim=1), start=p, source="tree", tree=tree,
                          exit_layer=k)

    def accepted(self, seq: SequenceState, block: DraftBlock, num_accepted: int,
                 final_states: torch.Tensor | None = None, proposed: int | None = None, observe: bool = True) -> None:
        """``seq`` now holds ``seq.length`` final tokens; bring the head's state in line with it.
        ``final_states`` ``# [1, g + 1, hidden]``: the verification's last-layer states of the block.
        ``proposed``: the draft length the policy learns from (default: the block's tokens; a tree's
        accepted path passes the depth the tree was drafted to). ``observe=False``: a verdict the pipeline
        only supposes, to draft ahead (the policies learn nothing from it)."""
        looked = block.source in LOOKUP_SOURCES
        policy = self.lookup_policy_of(seq) if looked else self.policy_of(seq)
        if observe and (self.head_drafts or looked):
            policy.observe(len(block.tokens) if proposed is None else proposed, num_accepted)
        if observe:
            seq.extras["lookup_streak"] = looked and num_accepted == len(block.tokens) > 0
        if not self.head_drafts:
            return
        if self.head.needs_context:
            assert final_states is not None, "a deep-context head keeps the verified final states"
            self._store_finals(seq, block.start, final_states[0, : num_accepted + 1])
        if not self.head.stateful:
            return
        p, length = block.start, seq.length
        seen = self.head.seen(seq.head_state)
        # Entries the head made from a draft's predicted final state are redone from the true one; the
        # entry at p read the verified f(p - 1) and stays.
        keep = min(seen, p + 1) if self.head.needs_context else min(seen, length)
        self.head.rollback(seq.head_state, keep)
        assert block.exit_states is not None, "a stateful head's drafter makes blocks with exit states"
        new = self._project(block.exit_states[:, max(keep, p) - p : length - p], block.exit_layer or self.exit_layer)
        old = seq.head_backlog  # positions [keep, p) when the head did not run this round
        seq.head_backlog = new if old is None or old.shape[1] == 0 else torch.cat([old, new], dim=1)


class _Chain:
    """One sequence's early-exit chain while it is drafted (``EarlyExitDrafter.propose_chains``): the token
    whose exit state comes next, the states, drafts and draft distributions so far."""

    def __init__(self, drafter: EarlyExitDrafter, seq: SequenceState, max_drafts: int, gen, k: int) -> None:
        self.d, self.seq, self.max_drafts, self.gen, self.k = drafter, seq, max_drafts, gen, k
        self.p, self.tok = seq.length, seq.pending
        self.policy = drafter.policy_of(seq)
        self.sampled = not gen.greedy and gen.draft_sampling == "sample"
        self.want_conf = self.policy.needs_confidence
        self.states: list[torch.Tensor] = []
        self.tokens: list[int] = []
        self.probs: list[torch.Tensor] = []
        self.f_hat: torch.Tensor | None = None
        self.f_hats: list[torch.Tensor] = []
        self.done = False
        self.verdict: tuple[int, torch.Tensor] | None = None  # the target's, when ``front`` ran a blank round's step

    def front(self) -> None:
        """A greedy round that drafts nothing (``max_drafts`` 0) for a head that keeps states: the pending token's
        plain step in one compiled call keeping its exit and final states (``SplitModel.step`` with a tap at the exit layer), its
        verdict kept for the round. Else the chain's first draft in one compiled call with the deep head
        (``DeepContextHead.draft_or_step``),
        when the chain is greedy and its policy's first decision is a confidence bar (``first_bar``): the
        pending token's exit state, the head over its backlog and that state, the draft and its confidence; a
        draft under the bar ends the chain blank and the call has also run the pending token's plain step (its
        verdict kept for the round). The same states, drafts and decisions as ``advance``; nothing done where the
        call does not apply."""
        d, seq, head = self.d, self.seq, self.d.head
        if self.sampled or not self.gen.greedy or self.states:
            return
        if self.max_drafts < 1:  # nothing drafted: the plain step in one call, its states kept for the head
            if d.reads_final_states and not d.context_layers:  # (fused features: wider states than the call's)
                found = d.split.step(self.tok, self.p, seq.cache, taps=(self.k,))
                if found is not None:
                    self.states.append(found.tapped[0])
                    self.done, self.verdict = True, (found.token, found.final)
            return
        if not head.needs_context:
            return
        bar = self.policy.first_bar()
        if bar is None or not head.front_ready(d.catch_up_rows(seq) + 1):
            return
        start, backlog = d._take_backlog(seq)
        if backlog is None:
            backlog = seq.extras["finals"].new_zeros(1, 0, d.split.hidden_size)
        n = backlog.shape[1] + 1
        ctx = seq.extras["finals"][start : start + n].unsqueeze(0)  # [1, n, hidden]: as _deep_inputs
        front = head.draft_or_step(self.tok, self.p, seq.cache, self.k, backlog, ctx, seq.positions(start, n),
                                   seq.head_state, bar)
        assert front is not None, "front_ready checked that the call applies"
        self.states.append(front.exit_state)
        self.f_hat = front.f_hat[:, -1:]
        self.f_hats.append(self.f_hat)
        kept = self.policy.keep(0, front.confidence if self.want_conf else 1.0)
        assert kept == front.drafted, "a policy's first_bar disagrees with its keep(0)"
        if front.drafted:
            self.tok = front.token
            self.tokens.append(self.tok)
        else:
            assert front.final is not None, "a blank round's call ran the step"
            self.done, self.verdict = True, (front.token, front.final)

    def advance(self, h: torch.Tensor) -> None:
        """``h`` ``# [1, 1, hidden]``: the exit state of ``tok``; draft the next token or stop."""
        d, seq, gen = self.d, self.seq, self.gen
        i = len(self.states)
        self.states.append(h)
        if i == self.max_drafts:
            self.done = True
            return
        if d.head.needs_context:
            if not self.sampled:  # greedy: pick from the drafted vocabulary's logits as they come (lm_part)
                self.f_hat, part, ids = d._deep_draft(seq, h, self.f_hat)
                self.f_hats.append(self.f_hat)
                self._pick(i, part, ids)
                return
            self.f_hat = d._deep_features(seq, h, self.f_hat)
            self.f_hats.append(self.f_hat)
            logits = d.head.logits_of(self.f_hat)[0, -1]
        else:
            logits = d._head_logits(seq, h, self.p + i)
        if self.sampled:
            q = logits_to_probs(logits, gen.temperature, gen.top_k, gen.top_p)
            conf = float(q.max()) if self.want_conf else 1.0
        else:
            q = None
            conf = float(torch.softmax(logits, -1).max()) if self.want_conf else 1.0
        if not self.policy.keep(i, conf):
            self.done = True
            return
        self.tok = int(sample(q, seq.generator)) if q is not None else int(greedy(logits))  # q: self.sampled
        self.tokens.append(self.tok)
        if q is not None:
            self.probs.append(q)

    def _pick(self, i: int, logits: torch.Tensor, ids: torch.Tensor | None) -> None:
        """A greedy draft from ``logits`` ``# [n]`` over the token ids ``ids`` ``# [n]`` (ascending; None: the
        whole vocabulary): the same token and confidence as from the logits spread over the whole vocabulary
        with -inf elsewhere (the first maximum is the lowest id either way), without spreading them."""
        conf = float(torch.softmax(logits, -1).max()) if self.want_conf else 1.0
        if not self.policy.keep(i, conf):
            self.done = True
            return
        j = int(greedy(logits))
        self.tok = int(ids[j]) if ids is not None else j
        self.tokens.append(self.tok)

    def block(self) -> DraftBlock:
        blank = self.max_drafts > 0 and not self.tokens  # the head ran for the first draft; the stop refused it
        return DraftBlock(self.tokens, torch.stack(self.probs) if self.probs else None, torch.cat(self.states, dim=1),
                          start=self.p, exit_layer=self.k, source=BLANK if blank else "early_exit",
                          predicted_finals=torch.cat(self.f_hats, dim=1) if self.f_hats else None,
                          verdict=self.verdict)


if TYPE_CHECKING:  # `make test` runs mypy: an EarlyExitDrafter that no longer implements Drafter fails it here

    def _early_exit_drafter_is_a_drafter(d: EarlyExitDrafter) -> Drafter:
        return d
