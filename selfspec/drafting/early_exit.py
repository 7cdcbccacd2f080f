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

import torch

from selfspec.drafting.base import DraftBlock
from selfspec.drafting.lookup import NgramIndex
from selfspec.drafting.policies import FixedPolicy
from selfspec.heads.base import ExitHead
from selfspec.models.split import SplitModel
from selfspec.sampling import greedy, logits_to_probs, sample
from selfspec.state import SequenceState


class EarlyExitDrafter:
    def __init__(self, split: SplitModel, head: ExitHead, policy: FixedPolicy, lookup: int = 0,
                 lookup_ngram: int = 3, lookup_policy: FixedPolicy | None = None) -> None:
        self.split, self.head, self.policy = split, head, policy
        self.exit_layer = head.exit_layer
        self.lookup, self.lookup_ngram = lookup, lookup_ngram
        self.lookup_policy = lookup_policy or FixedPolicy()

    def start(self, seq: SequenceState, prompt_exit_states: torch.Tensor) -> None:
        """After the prompt's prefill: a stateful head must still see the prompt's exit states."""
        if self.head.stateful:
            seq.head_state = self.head.new_state(seq.cache.capacity)
            seq.head_backlog = prompt_exit_states

    def _head_logits(self, seq: SequenceState, h: torch.Tensor, pos: int) -> torch.Tensor:  # -> [vocab]
        if not self.head.stateful:
            return self.head(h, seq.positions(pos, 1))[0, -1]
        if seq.head_backlog is not None and seq.head_backlog.shape[1] > 0:
            h = torch.cat([seq.head_backlog, h], dim=1)
        seq.head_backlog = None
        start = self.head.seen(seq.head_state)
        return self.head(h, seq.positions(start, h.shape[1]), seq.head_state)[0, -1]

    def _lookup(self, seq: SequenceState, limit: int) -> DraftBlock | None:
        """A block of lookup drafts, or None when the last n-gram has no earlier occurrence."""
        index = seq.extras.get("ngram")
        if index is None or index.tokens is not seq.tokens:
            index = seq.extras["ngram"] = NgramIndex(seq.tokens, self.lookup_ngram)
        g = min(limit, self.lookup_policy.max_drafts(self.lookup))
        drafts = index.continuation(g)
        if not drafts:
            return None
        split, p = self.split, seq.length
        ids = torch.tensor([[seq.pending, *drafts]], dtype=torch.long, device=split.device)
        states = split.run_layers(split.embed(ids), 0, self.exit_layer, seq.positions(p, len(drafts) + 1), seq.cache)
        return DraftBlock(list(drafts), None, states, start=p, source="lookup")

    def propose(self, seq: SequenceState, max_drafts: int, gen, limit: int | None = None) -> DraftBlock:
        if self.lookup > 0 and seq.tokens:
            block = self._lookup(seq, max_drafts if limit is None else limit)
            if block is not None:
                return block
        split, k = self.split, self.exit_layer
        p, tok = seq.length, seq.pending
        sampled = not gen.greedy and gen.draft_sampling == "sample"
        want_conf = getattr(self.policy, "needs_confidence", False)
        states, tokens, probs = [], [], []
        ids = torch.empty((1, 1), dtype=torch.long, device=split.device)
        for i in range(max_drafts + 1):
            ids[0, 0] = tok
            states.append(split.run_layers(split.embed(ids), 0, k, seq.positions(p + i, 1), seq.cache))
            if i == max_drafts:
                break
            logits = self._head_logits(seq, states[-1], p + i)
            if sampled:
                q = logits_to_probs(logits, gen.temperature, gen.top_k, gen.top_p)
                conf = float(q.max()) if want_conf else 1.0
            else:
                q = None
                conf = float(torch.softmax(logits, -1).max()) if want_conf else 1.0
            if not self.policy.keep(i, conf):
                break
            tok = int(sample(q, seq.generator)) if sampled else int(greedy(logits))
            tokens.append(tok)
            if q is not None:
                probs.append(q)
        return DraftBlock(tokens, torch.stack(probs) if probs else None, torch.cat(states, dim=1), start=p)

    def accepted(self, seq: SequenceState, block: DraftBlock, num_accepted: int) -> None:
        """``seq`` now holds ``seq.length`` final tokens; bring the head's state in line with it."""
        policy = self.lookup_policy if block.source == "lookup" else self.policy
        policy.observe(len(block.tokens), num_accepted)
        if not self.head.stateful:
            return
        self.head.rollback(seq.head_state, seq.length)
        seen = self.head.seen(seq.head_state)
        if seen < seq.length:  # states the head never consumed (the last accepted draft's)
            seq.head_backlog = block.exit_states[:, seen - block.start : seq.length - block.start]
