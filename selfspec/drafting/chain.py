"""Early-exit chains: one sequence's drafts d_1..d_g, each from the exit state of the token before it
(``EarlyExitDrafter.propose``; its module's docstring has a worked example), and several sequences' chains drafted
in lockstep (``run_chains``: a batched round)."""

from __future__ import annotations

import torch

from selfspec.config import GenerateConfig
from selfspec.drafting import head_state
from selfspec.drafting.base import DraftBlock
from selfspec.drafting.policies import DraftPolicy
from selfspec.heads.base import ExitHead
from selfspec.models.split import SplitModel
from selfspec.sampling import greedy, logits_to_probs, sample
from selfspec.state import SequenceState
from selfspec.stats import BLANK


class Chain:
    """One sequence's early-exit chain while it is drafted: the token whose exit state comes next, the states,
    drafts and draft distributions so far. Its drafts come from ``head`` at exit depth ``k`` (catching up at most
    ``context`` rows of backlog, ``selfspec.drafting.head_state``), as long as ``policy`` goes on and at most
    ``max_drafts``."""

    def __init__(self, split: SplitModel, head: ExitHead, context: int | None, policy: DraftPolicy,
                 seq: SequenceState, max_drafts: int, gen: GenerateConfig, k: int) -> None:
        self.split, self.head, self.context, self.policy = split, head, context, policy
        self.seq, self.max_drafts, self.gen, self.k = seq, max_drafts, gen, k
        self.p, self.tok = seq.length, seq.pending
        self.sampled = not gen.greedy and gen.draft_sampling == "sample"
        self.want_conf = policy.needs_confidence
        self.states: list[torch.Tensor] = []
        self.tokens: list[int] = []
        self.probs: list[torch.Tensor] = []
        self.f_hat: torch.Tensor | None = None
        self.f_hats: list[torch.Tensor] = []
        self.done = False
        # the target's, when the chain's first call also ran the pending token's step (plain_step, first_draft)
        self.verdict: tuple[int, torch.Tensor] | None = None

    def plain_step(self) -> None:
        """A greedy round that drafts nothing, for a head that keeps the verified tokens' states: the pending
        token's plain step in one compiled call that keeps its exit and final states
        (``SplitModel.step`` tapping the exit layer), with the target's verdict; nothing done where the call declines."""
        found = self.split.step(self.tok, self.p, self.seq.cache, taps=(self.k,))
        if found is not None:
            self.states.append(found.tapped[0])
            self.done, self.verdict = True, (found.token, found.final)

    def first_draft(self) -> None:
        """A greedy chain's first draft in one compiled call with the deep head (``DeepContextHead.draft_or_step``)
        where its policy's first decision is a confidence bar (``first_bar``). A draft under the bar ends the chain
        blank, with the target's verdict: the call has run the pending token's plain step too. The same states,
        drafts and decisions as ``advance``; nothing done where the call does not apply."""
        seq, head = self.seq, self.head
        if not head.needs_context:
            return
        bar = self.policy.first_bar()
        if bar is None or not head.front_ready(head_state.catch_up_rows(seq.head, self.context) + 1):
            return
        start, backlog = head_state.take_backlog(head, seq.head, self.context)
        finals = seq.head.finals
        assert finals is not None, "a deep-context head's finals start with the prompt's (head_state.start)"
        if backlog is None:
            backlog = finals.new_zeros(1, 0, self.split.hidden_size)
        n = backlog.shape[1] + 1
        ctx = finals[start : start + n].unsqueeze(0)  # [1, n, hidden]: as head_state.deep_inputs
        front = head.draft_or_step(self.tok, self.p, seq.cache, self.k, backlog, ctx, seq.positions(start, n),
                                   seq.head.state, bar)
        assert front is not None, "front_ready checked that the call applies"
        self.states.append(front.exit_state)
        self.f_hat = front.f_hat[:, -1:]
        self.f_hats.append(self.f_hat)
        drafts = self.policy.go_on(0, front.confidence if self.want_conf else 1.0)
        assert drafts == front.drafted, "a policy's first_bar disagrees with its go_on(0)"
        if front.drafted:
            self.tok = front.token
            self.tokens.append(self.tok)
        else:
            assert front.final is not None, "a blank round's call ran the step"
            self.done, self.verdict = True, (front.token, front.final)

    def advance(self, h: torch.Tensor) -> None:
        """``h`` ``# [1, 1, hidden]``: the exit state of ``tok``; draft the next token or stop."""
        seq, gen, head = self.seq, self.gen, self.head
        i = len(self.states)
        self.states.append(h)
        if i == self.max_drafts:
            self.done = True
            return
        if head.needs_context:
            if not self.sampled:  # greedy: pick from the drafted vocabulary's logits as they come (lm_part)
                self.f_hat, part, ids = head_state.deep_draft(head, seq, h, self.f_hat, self.k, self.context)
                self.f_hats.append(self.f_hat)
                self._pick(i, part, ids)
                return
            self.f_hat = head_state.deep_features(head, seq, h, self.f_hat, self.k, self.context)
            self.f_hats.append(self.f_hat)
            logits = head.logits_of(self.f_hat)[0, -1]
        else:
            logits = head_state.head_logits(head, seq, h, self.p + i, self.context)
        if self.sampled:
            q = logits_to_probs(logits, gen.temperature, gen.top_k, gen.top_p)
            conf = float(q.max()) if self.want_conf else 1.0
        else:
            q = None
            conf = float(torch.softmax(logits, -1).max()) if self.want_conf else 1.0
        if not self.policy.go_on(i, conf):
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
        if not self.policy.go_on(i, conf):
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


def run_chains(split: SplitModel, chains: list[Chain]) -> list[DraftBlock]:
    """``chains`` drafted to their ends -> their blocks. At each position the current token of every chain still
    drafting goes through layers [0, k) in one ragged pass (each over its own cache), then each chain's head and
    policy decide its next draft on their own: each block equals its sequence's own chain."""
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
