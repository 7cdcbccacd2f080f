"""SpecEE's two modes on the engine (``GenerateConfig.method``):

``specee`` (LOSSY, as published): each token runs layers from 0; at every scheduled layer i >= k the
candidates' logits give the predictor's features, and when it fires the token is that layer's best
candidate and the remaining layers are skipped for it. Their keys/values are computed later, batched
into the next token's pass (``ragged.py``), so no token ever attends to a missing entry (SpecEE's public
code leaves them missing). The candidates are the exit head's top-c at layer k (plus the lookup match).
Output can differ from the model's own; the engine counts, for free, how often an exit emitted what the
full model would have given the same prefix (when the indebted rows reach the last layer).

``specee-verified`` (lossless): the same exits choose, per draft token, how deep the draft goes. The
draft token at position p + j runs layers [0, e_j) and exits with its best candidate; the round ends at
the first token whose predictors do not fire (or after ``max_drafts``), which runs through every layer,
carrying the drafted rows from their own exit layers (verification starts each token from its exit
layer); then the engine's verification of a chain (``Engine.accept``). Every layer of every row runs once.

Worked example (verified, L = 30, k = 2): x at p exits at 12 -> d1; d1 at p + 1 exits at 9 -> d2; d2 at
p + 2 does not fire: layers 0..8 run [d2], 9..11 run [d1, d2], 12..29 run [x, d1, d2]; logits of the
three rows verify d1, d2 and give the bonus token. When the text's last n-gram occurred before, the
round is the engine's lookup round instead (its continuation drafted at no cost, verified the same way).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from selfspec.drafting import head_state
from selfspec.drafting.base import DraftBlock
from selfspec.models.fast import Norm
from selfspec.round import commit_plain
from selfspec.sampling import logits_to_probs, pick, sample
from selfspec.specee.candidates import CandidateScorer, features_list
from selfspec.specee.predictors import ExitPredictors
from selfspec.specee.ragged import DebtRow, run_token
from selfspec.specee.schedule import OnlineSchedule
from selfspec.state import SequenceState

SPECEE_METHODS = ("specee", "specee-verified")
MAX_DEBT = 8  # a lossy token with this many indebted rows before it runs every layer (pays the debt)
DEFAULT_THRESHOLDS = {"specee": 0.95, "specee-verified": 0.5}


@dataclass
class SpecEESettings:
    threshold: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_THRESHOLDS))  # per mode
    window: int = 4  # online schedule: recent tokens whose exit layers are looked at (0: off)
    radius: int = 2  # online schedule: check layers within this distance of a recent exit
    max_drafts: int = 8  # specee-verified: most drafts per round
    cost_aware: bool = True  # specee-verified: an exit at layer i needs probability >= max(threshold, i / L)
    max_layer: int | None = None  # specee-verified: drafts exit at layers <= this only (None: any predictor layer)


@dataclass
class SpecEEState:
    """What SpecEE keeps per sequence (``SequenceState.specee``, from ``SpecEERunner.start``)."""

    schedule: OnlineSchedule  # the layers whose predictors are checked next
    debt: list[DebtRow]  # specee (lossy): the rows whose deep layers a later token's pass computes (ragged.py)


def _state(seq: SequenceState) -> SpecEEState:
    state = seq.specee
    assert isinstance(state, SpecEEState), "SpecEERunner.start gives a sequence its SpecEE state"
    return state


@dataclass
class _Pass:
    exit_layer: int
    states: torch.Tensor | None  # [1, n, hidden] rows present at the end of the pass
    debt: list[DebtRow]
    h_k: torch.Tensor | None = None  # [1, 1, hidden] the new row's exit-layer state
    token: int | None = None  # the best candidate at the exit layer
    cand_logits: torch.Tensor | None = None  # [c] at the exit layer
    cands: torch.Tensor | None = None  # [c] candidate ids
    f_hat: torch.Tensor | None = None  # [1, 1, hidden] a deep head's predicted final state
    draft_probs: list[float] | None = None  # the head's probability of each candidate
    scorer: CandidateScorer | None = None


class SpecEERunner:
    def __init__(self, split, drafter, predictors: ExitPredictors, settings: SpecEESettings | None = None) -> None:
        self.split, self.drafter, self.predictors = split, drafter, predictors
        self.settings = settings or SpecEESettings()
        k = drafter.exit_layer
        norm = Norm(split.norm)
        self._norm = (norm.weight, norm.eps)
        self.layers = [i for i in predictors.layers if k <= i < split.num_layers]

    def start(self, seq) -> None:
        s = self.settings
        seq.specee = SpecEEState(OnlineSchedule(self.layers, s.window, s.radius), [])

    # ---- one token ---------------------------------------------------------------------
    def _candidates(self, seq, h_k: torch.Tensor, p: int, f_prev: torch.Tensor | None):
        d = self.drafter
        if d.head.needs_context:
            logits, f_hat = head_state.deep_logits(d.head, seq, h_k, f_prev, d.depth_of(seq), d.head_context)
        else:
            logits, f_hat = head_state.head_logits(d.head, seq, h_k, p, d.head_context), None
        cands = logits.topk(self.predictors.candidates).indices  # [c]
        q = torch.softmax(logits.float(), dim=-1)
        if d.sources.lookup > 0 and len(seq.tokens) == p + 1:  # the text ends at p: a lookup match predicts p + 1
            nxt = d.sources.index(seq).continuation(1)
            if nxt and nxt[0] not in cands.tolist():
                cands = cands.clone()
                cands[-1] = nxt[0]
        return cands, q[cands].tolist(), f_hat

    def token_pass(self, seq, tok: int, p: int, debt: list[DebtRow], f_prev: torch.Tensor | None,
                   check: bool, head: bool, threshold: float, stats, cost_aware: bool = False) -> _Pass:
        """Token ``tok`` at ``p`` from layer 0 (see ``ragged.run_token``); with ``check`` it may exit at a
        scheduled layer; with ``head`` the exit head runs at layer k (candidates for the next token).
        ``cost_aware``: an exit at layer i also needs probability >= i / L (a draft that costs i / L of a
        forward must be right at least that often to pay; specee-verified)."""
        floor = 1.0 / self.split.num_layers if cost_aware else 0.0
        split, k = self.split, self.drafter.exit_layer
        sched = _state(seq).schedule
        check_layers = sched.layers_to_check() if check else []
        if cost_aware and self.settings.max_layer is not None:
            check_layers = [i for i in check_layers if i <= self.settings.max_layer]
        out = _Pass(split.num_layers, None, [])
        prev: list[list[float] | None] = [None]  # the previous checked layer's candidate probabilities

        def visit(i: int, h: torch.Tensor) -> bool:
            if i == k:
                out.h_k = h
                if head:
                    out.cands, out.draft_probs, out.f_hat = self._candidates(seq, h, p, f_prev)
                    out.scorer = CandidateScorer(*self._norm, split.lm_rows(out.cands), split.softcap)
            if i not in check_layers or out.cands is None:
                return False
            assert out.scorer is not None and out.draft_probs is not None  # set with the candidates
            t0 = time.perf_counter()
            logits = out.scorer(h[0, 0])
            feats, prev[0] = features_list(logits, prev[0], out.draft_probs)
            fire = self.predictors[i].prob_of(feats) >= max(threshold, i * floor)
            stats.predictor_time += time.perf_counter() - t0
            stats.predictor_checks += 1
            if fire:
                out.cand_logits = torch.tensor(logits)
                out.token = int(out.cands[max(range(len(logits)), key=logits.__getitem__)])
            return fire

        emb = split.embed(torch.tensor([[tok]], dtype=torch.long, device=split.device))
        out.exit_layer, out.states, out.debt = run_token(split, seq.cache, debt, emb, p, [k, *check_layers], visit)
        return out

    # ---- the two modes -----------------------------------------------------------------
    def lossy_step(self, seq, gen, stats) -> list[int]:
        """One token of ``specee`` (lossy). ``seq.length`` is the pending token's position; positions before
        it may be indebted (``SpecEEState.debt``)."""
        split, d = self.split, self.drafter
        state = _state(seq)
        p, debt, sched = seq.length, state.debt, state.schedule
        r = self.token_pass(seq, seq.pending, p, debt, None, check=len(debt) < MAX_DEBT, head=True,
                            threshold=self.settings.threshold["specee"], stats=stats)
        L = split.num_layers
        if r.exit_layer < L:  # a predictor fired: its token, candidates and their logits are set
            assert r.token is not None and r.cands is not None and r.cand_logits is not None
            if gen.greedy:
                nxt = r.token
            else:
                q = logits_to_probs(r.cand_logits, gen.temperature, gen.top_k, gen.top_p)
                nxt = int(r.cands[int(sample(q, seq.generator))])
            if d.head.needs_context:
                assert r.f_hat is not None  # the head ran at layer k
                head_state.store_finals(seq.head, p, r.f_hat[0])  # the head's estimate stands in for f(p) at p + 1
            state.debt = r.debt
            sched.observe(r.exit_layer)
        else:
            assert r.states is not None  # the token's rows ran through every layer
            n = r.states.shape[1]
            rows = r.states if gen.greedy else r.states[:, -1:]
            logits = split.logits(rows)[0]  # [n or 1, vocab]
            nxt = pick(logits[-1], gen, seq.generator)
            if gen.greedy and n > 1:  # the indebted rows' full-model choices, now known: did their exits agree?
                full = logits[:-1].argmax(-1).tolist()
                emitted = seq.tokens[p - n + 2 : p + 1]
                stats.exit_compared += len(full)
                stats.exit_agreed += sum(a == b for a, b in zip(full, emitted))
            if d.head.needs_context:
                head_state.store_finals(seq.head, p - n + 1, r.states[0])
            state.debt = []
            sched.observe(None)
        stats.exit_layers.append(r.exit_layer)
        return commit_plain(seq, nxt, stats)  # the pending token's row is in the cache (or owed: the debt)

    def verified_round(self, seq, max_drafts: int, stats) -> tuple[DraftBlock, torch.Tensor]:
        """Draft one round of ``specee-verified``; returns the drafts and the last-layer states of their rows
        ``# [1, g + 1, hidden]`` (pending token and drafts), which ``Engine.accept`` verifies."""
        split = self.split
        p, tok = seq.length, seq.pending
        sched = _state(seq).schedule
        threshold = self.settings.threshold["specee-verified"]
        debt: list[DebtRow] = []
        drafts: list[int] = []
        h_ks: list[torch.Tensor] = []
        f_prev = None
        for j in range(max_drafts + 1):
            check = j < max_drafts
            r = self.token_pass(seq, tok, p + j, debt, f_prev, check=check, head=check, threshold=threshold,
                                stats=stats, cost_aware=self.settings.cost_aware)
            assert r.h_k is not None  # every pass stops at the exit layer k
            h_ks.append(r.h_k)
            if r.exit_layer == split.num_layers:
                if check:
                    sched.observe(None)
                break
            debt = r.debt
            sched.observe(r.exit_layer)
            stats.exit_layers.append(r.exit_layer)
            assert r.token is not None  # a predictor fired before the last layer
            drafts.append(r.token)
            tok, f_prev = r.token, r.f_hat
        assert r.states is not None and r.states.shape[1] == len(drafts) + 1  # every row at the last layer
        return DraftBlock(drafts, None, torch.cat(h_ks, dim=1), start=p, source="specee"), r.states
