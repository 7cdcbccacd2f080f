"""PPSD and Mirror-SD: the shallow stage drafts while the deep stage verifies.

    ss = SelfSpec.load()
    with Pipeline.of(ss, PipelineConfig(mode="mirror"), ModelConfig()) as pipe:   # starts the deep stage
        tokens, stats = pipe.generate(prompt_ids, GenerateConfig(max_new_tokens=64))

This process is the shallow stage: layers [0, k), their KV cache and the exit head (any head the engine
drafts with: the untrained exit, Kangaroo, the deep-context head). The deep stage (selfspec.pipeline.deep)
holds layers [k, L) and the LM head, in a second process (``transport="process"``, torch.distributed) or
a second thread (``"thread"``, the one-device variant). A round:

    shallow                                          deep
    block (pending, d_1..d_g), states, q?  ------->  layers [k, e)
    draft ahead from its own guess of the verdict:   (Mirror-SD: top-k at layer e of every row
      all accepted, then d_(g+1) = the head's next    <------- SIGNAL, then layers [e, L))
    Mirror-SD: a branch per candidate of the signal  verify: m accepted, next token x
    at the acceptance it predicts                    <------- VERDICT (m, x, final states?)
    roll back to p + 1 + m; if a drafted-ahead block starts with (m, x) it is the next block, its cache
    entries put back; otherwise draft the next block from x now

Drafting ahead supposes a verdict: the drafter is told the block was accepted (``observe=False``,
predicted final states for a deep-context head), drafts, and is put back before the true verdict is
applied. Every emitted token is an accepted draft or the deep stage's own token (greedy, or speculative
sampling with its generator), so the output is the target's, exactly as in the sequential engine.
A stage that dies or raises is a ``PipelineError`` at once (no hang); the pipeline is then closed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from selfspec import round as core
from selfspec.config import GenerateConfig, PipelineConfig
from selfspec.drafting.base import DraftBlock
from selfspec.drafting.early_exit import EarlyExitDrafter
from selfspec.drafting.policy_tables import DepthBandit
from selfspec.errors import InvalidConfigError
from selfspec.models.split import SplitModel
from selfspec.pipeline.deep import RequestParams
from selfspec.pipeline.link import DeepLink, ModelSource
from selfspec.pipeline.transport import (
    BLOCK,
    PREFILL,
    SIGNAL,
    VERDICT,
    Message,
    PipelineError,
)
from selfspec.sampling import make_generator
from selfspec.state import SequenceState

__all__ = ["ModelSource", "Pipeline", "PipelineError", "PipelineStats"]


@dataclass
class PipelineStats:
    rounds: int = 0
    ahead_used: int = 0  # rounds whose block had been drafted while the previous one was verified
    branches: int = 0  # Mirror-SD branches drafted from the deep stage's early signal
    branch_used: int = 0  # rounds whose block was one of those branches
    drafted: int = 0  # draft tokens sent for verification
    accept_lengths: list[int] = field(default_factory=list)
    wait_time: float = 0.0  # seconds the shallow stage waited for the deep stage
    wall_time: float = 0.0

    @property
    def mean_accepted_length(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0

    @property
    def acceptance(self) -> float:
        """Accepted drafts / drafts sent: the per-draft acceptance the cost model reads."""
        return (sum(self.accept_lengths) - len(self.accept_lengths)) / self.drafted if self.drafted else 0.0


@dataclass
class _Ahead:
    """A block drafted before the verdict it supposes; ``saved``: its rows' shallow cache entries."""

    block: DraftBlock
    saved: list
    branch: bool = False


@dataclass
class _Snapshot:
    """The shallow stage's sequence right after a block was drafted (what a supposed verdict changes)."""

    length: int
    pending: int
    n_tokens: int
    backlog: torch.Tensor | None
    depth: int | None
    seen: int  # positions a stateful head had consumed (its backlog not included)


class Pipeline:
    """The shallow stage here; the deep stage in a child process or a thread. One pipeline per process
    at a time with the process transport (it owns the torch.distributed group)."""

    def __init__(self, split: SplitModel, drafter: EarlyExitDrafter, config: PipelineConfig | None = None,
                 source: ModelSource | None = None, eos_token_ids: list[int] | None = None) -> None:
        cfg = self.config = config or PipelineConfig()
        if cfg.gamma < 1:
            raise InvalidConfigError(f"gamma must be >= 1, got {cfg.gamma}")
        if cfg.transport not in ("process", "thread"):
            raise InvalidConfigError(f"unknown pipeline transport {cfg.transport!r} (process or thread)")
        if isinstance(drafter.policy, DepthBandit) and len(drafter.policy.arms) > 1:
            raise InvalidConfigError("the pipeline drafts at one exit depth; a depth bandit changes it per round")
        self.split, self.drafter, self.k = split, drafter, drafter.exit_layer
        self.set_mode(cfg.mode)
        self.eos_token_ids = list(eos_token_ids or [])
        self.stats = PipelineStats()
        self.link = DeepLink(split, self.k, cfg, source)

    def set_mode(self, mode: str) -> None:
        """'ppsd' or 'mirror' for the next requests (the deep stage learns it with each prefill)."""
        L, k, cfg = self.split.num_layers, self.k, self.config
        self.signal_layer = 0
        if mode == "mirror":
            self.signal_layer = cfg.mirror_layer if cfg.mirror_layer is not None else k + 2 * (L - k) // 3
            if not k < self.signal_layer < L:
                raise InvalidConfigError(f"mirror_layer must be in ({k}, {L}), got {self.signal_layer}")
            if cfg.mirror_top_k < 1:
                raise InvalidConfigError(f"mirror_top_k must be >= 1, got {cfg.mirror_top_k}")
        elif mode != "ppsd":
            raise InvalidConfigError(f"unknown pipeline mode {mode!r} (ppsd or mirror)")
        self.mode = mode

    @classmethod
    def of(cls, ss: Any, config: PipelineConfig | None = None, model_config: Any = None) -> Pipeline:
        """A pipeline over a loaded ``SelfSpec``'s model and draft; the deep process loads ``model_config``
        (default: a copy of the loaded weights)."""
        source = ModelSource(model_config=model_config) if model_config is not None else None
        return cls(ss.split, ss.engine.drafter, config, source, ss.eos_token_ids)

    # ---- messages (over the link) -------------------------------------------------------
    @property
    def worker(self) -> Any:  # the deep stage's thread or process
        return self.link.worker

    @property
    def closed(self) -> bool:
        return self.link.closed

    def _verdict(self) -> tuple[int, int, torch.Tensor | None]:
        msg = self.link.recv(VERDICT)
        m, x = msg.tensors[0].tolist()
        finals = msg.tensors[1].to(self.split.dtype) if len(msg.tensors) > 1 else None
        return m, x, finals

    # ---- supposing a verdict (drafting ahead) ----------------------------------------------
    def _snapshot(self, seq: SequenceState) -> _Snapshot:
        head = self.drafter.head
        seen = head.seen(seq.head.state) if head.stateful else 0
        return _Snapshot(seq.length, seq.pending, len(seq.tokens), seq.head.backlog, seq.depth, seen)

    def _restore(self, seq: SequenceState, snap: _Snapshot) -> None:
        seq.length, seq.pending, seq.head.backlog, seq.depth = snap.length, snap.pending, snap.backlog, snap.depth
        seq.tokens = seq.tokens[: snap.n_tokens]  # a new list: the lookup index is rebuilt from it
        head = self.drafter.head
        if head.stateful:  # entries past p + 1 may come from a supposed verdict; accepted() redoes them
            head.rollback(seq.head.state, min(head.seen(seq.head.state), snap.seen, snap.length + 1))

    def _suppose(self, seq: SequenceState, snap: _Snapshot, block: DraftBlock, m: int, x: int) -> None:
        """Put ``seq`` in the state the verdict (m, x) on ``block`` would leave it in."""
        self._restore(seq, snap)
        finals = None
        if self.drafter.head.needs_context:
            finals = seq.cache.keys[0].new_zeros(1, m + 1, self.split.hidden_size)
            if block.predicted_finals is not None:
                n = min(m + 1, block.predicted_finals.shape[1])
                finals[:, :n] = block.predicted_finals[:, :n]
        core.commit(seq, self.drafter, block, m, x, finals, observe=False)

    def _propose(self, seq: SequenceState, max_drafts: int, gen: GenerateConfig) -> DraftBlock:
        """The drafter's block with its exit states: the deep stage starts from them."""
        return self.drafter.with_exit_states(seq, self.drafter.propose(seq, max_drafts, gen))

    def _keep(self, seq: SequenceState, block: DraftBlock, branch: bool = False) -> _Ahead:
        end = block.start + len(block.tokens) + 1
        return _Ahead(block, seq.cache.save(block.start, end, self.k), branch)

    def _draft_ahead(self, seq: SequenceState, snap: _Snapshot, block: DraftBlock, gen: GenerateConfig,
                     budget: int) -> dict[tuple[int, int], _Ahead]:
        """PPSD: suppose every draft accepted and d_g the token after the last accepted one; draft on from d_g:
        the first new draft is the guess of the bonus token, the rest the next block."""
        g = len(block.tokens)
        left = budget - (g + 1)  # tokens still to emit after this block, if it is accepted whole
        if g == 0 or left < 1:
            return {}
        self._suppose(seq, snap, block, g - 1, block.tokens[-1])
        b = self._propose(seq, min(self.config.gamma, left - 1) + 1, gen)
        if not b.tokens:
            return {}
        assert b.exit_states is not None  # the early-exit drafter's blocks carry their exit states
        nxt = DraftBlock(b.tokens[1:], None if b.probs is None else b.probs[1:], b.exit_states[:, 1:],
                         start=b.start + 1, source=b.source, exit_layer=b.exit_layer,
                         predicted_finals=None if b.predicted_finals is None else b.predicted_finals[:, 1:])
        return {(g, b.tokens[0]): self._keep(seq, nxt)}

    def _branches(self, seq: SequenceState, snap: _Snapshot, block: DraftBlock, gen: GenerateConfig, budget: int,
                  signal: torch.Tensor, ahead: dict) -> None:  # signal [g + 1, kappa] token ids
        """Mirror-SD: predict the verdict from the deep stage's early top-k (the drafts it agrees with, then its
        candidates) and draft a branch from each candidate not drafted yet."""
        g = len(block.tokens)
        m = 0
        while m < g and int(signal[m, 0]) == block.tokens[m]:
            m += 1
        left = budget - (m + 1)
        if left < 1:
            return
        for c in signal[m].tolist():
            if (m, c) in ahead:
                continue
            # Greedy: stop as soon as the verdict is in (threads can look). Sampled: always draft every branch,
            # so the draft generator's draws, hence a seeded output, never depend on timing.
            if gen.greedy and self.link.poll() is not None:
                return
            self._suppose(seq, snap, block, m, c)
            ahead[(m, c)] = self._keep(seq, self._propose(seq, min(self.config.gamma, left - 1), gen), True)
            self.stats.branches += 1

    # ---- generation ------------------------------------------------------------------------
    @torch.inference_mode()
    def stream(self, prompt_ids: list[int], gen: GenerateConfig | None = None) -> Iterator[list[int]]:
        """New tokens as the verdicts come in (chunks; an ending EOS included); ``self.stats`` counts."""
        gen = gen or GenerateConfig()
        if not prompt_ids or gen.max_new_tokens < 1:
            raise InvalidConfigError("the pipeline needs a non-empty prompt and max_new_tokens >= 1")
        self.link.check_alive()
        split, d, k, cfg = self.split, self.drafter, self.k, self.config
        st = self.stats = PipelineStats()
        t0, w0 = time.perf_counter(), self.link.wait_time
        eos = set() if gen.ignore_eos else set(gen.eos_token_ids if gen.eos_token_ids is not None
                                                 else self.eos_token_ids)
        P, limit = len(prompt_ids), gen.max_new_tokens
        seq = SequenceState(cache=split.new_cache(P + limit + 4 * cfg.gamma + 8),
                            generator=None if gen.greedy else make_generator(gen.seed, split.device))
        d.begin(seq, gen.seed)
        if d.depth_of(seq) != k:
            raise InvalidConfigError(f"the pipeline drafts at exit layer {k}, the policy chose {d.depth_of(seq)}")
        h = split.run_layers(split.embed(torch.tensor([prompt_ids], device=split.device)), 0, k,
                             seq.positions(0, P), seq.cache)
        rows = d.head.vocab_ids  # [n] the rows of a trimmed vocabulary (empty: all)
        params = RequestParams(gen.temperature, gen.top_k, gen.top_p, gen.seed, d.head.needs_context,
                               self.signal_layer, cfg.mirror_top_k if self.signal_layer else 0)
        self.link.send(Message(PREFILL, [h, params.encode(), rows.cpu()]))
        _, x, finals = self._verdict()
        d.start(seq, h, finals)
        seq.length, seq.pending, seq.tokens = P, x, [*prompt_ids, x]  # (the prefill's verdict: its first token)
        emitted, nxt = 1, None
        yield [x]
        while emitted < limit and x not in eos:  # (x: the first token; later rounds stop through ``cut``)
            budget = limit - emitted
            p = seq.length
            if nxt is None or len(nxt.tokens) > budget - 1:
                seq.cache.truncate(p)
                nxt = self._propose(seq, min(cfg.gamma, budget - 1), gen)
            block = nxt
            assert block.exit_states is not None  # the early-exit drafter's blocks carry their exit states
            msg = [torch.tensor([p, len(block.tokens)], dtype=torch.long), block.exit_states,
                   torch.tensor([block.tokens], dtype=torch.long)]
            self.link.send(Message(BLOCK, msg + ([block.probs.float()] if block.probs is not None else [])))
            snap = self._snapshot(seq)
            own = seq.cache.save(p, p + len(block.tokens) + 1, k)  # branches overwrite this block's rows
            ahead = self._draft_ahead(seq, snap, block, gen, budget)
            if self.signal_layer:
                self._branches(seq, snap, block, gen, budget, self.link.recv(SIGNAL).tensors[0], ahead)
            m, x, finals = self._verdict()
            self._restore(seq, snap)
            seq.cache.restore(p, own)
            new = core.commit(seq, d, block, m, x, finals)
            st.rounds += 1
            st.drafted += len(block.tokens)
            st.accept_lengths.append(len(new))
            hit = ahead.get((m, x))
            nxt = None
            if hit is not None:
                seq.cache.restore(hit.block.start, hit.saved)
                nxt = hit.block
                st.ahead_used += 1
                st.branch_used += hit.branch
            out, done = core.cut(new, budget, eos)
            emitted += len(out)
            st.wait_time = self.link.wait_time - w0
            st.wall_time = time.perf_counter() - t0
            yield out
            if done:
                break
        st.wall_time = time.perf_counter() - t0

    def generate(self, prompt_ids: list[int], gen: GenerateConfig | None = None, **overrides: Any,
                 ) -> tuple[list[int], PipelineStats]:
        """New tokens (an ending EOS included) and the stats. ``overrides``: GenerateConfig fields."""
        gen = replace(gen or GenerateConfig(), **overrides)
        out: list[int] = []
        for chunk in self.stream(prompt_ids, gen):
            out += chunk
        return out, self.stats

    def close(self, stop: bool = True) -> None:
        """Stop the deep stage (and leave the process group)."""
        self.link.close(stop)

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
