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

import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from selfspec.config import GenerateConfig, PipelineConfig
from selfspec.drafting.base import DraftBlock
from selfspec.errors import InvalidConfigError
from selfspec.pipeline.deep import DeepStage, RequestParams
from selfspec.pipeline.transport import (
    BLOCK,
    ERROR,
    PREFILL,
    SIGNAL,
    STOP,
    VERDICT,
    Message,
    PipelineError,
    ProcessChannel,
    ThreadChannel,
    error_text,
)
from selfspec.sampling import make_generator
from selfspec.state import SequenceState

__all__ = ["ModelSource", "Pipeline", "PipelineError", "PipelineStats"]


@dataclass
class ModelSource:
    """How a stage process gets the model: a ModelConfig to load, or (config, state_dict) to rebuild (tests)."""

    model_config: Any = None
    hf_config: Any = None
    state_dict: dict | None = None

    @classmethod
    def of(cls, model: Any) -> ModelSource:
        from selfspec.config import ModelConfig

        if isinstance(model, ModelConfig):
            return cls(model_config=model)
        return cls(hf_config=model.config, state_dict={k: v.clone() for k, v in model.state_dict().items()})

    def load(self) -> Any:
        if self.model_config is not None:
            from selfspec.models.loading import load_model

            return load_model(self.model_config)[0]
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(self.hf_config, attn_implementation="sdpa", dtype=torch.float32)
        model.load_state_dict(self.state_dict)
        return model.eval().requires_grad_(False)


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _deep_process(source: ModelSource, exit_layer: int, port: int, threads: int, backend: str, timeout: float) -> None:
    """Rank 1: the deep stage in its own process."""
    from selfspec.models.split import SplitModel

    torch.set_num_threads(threads)
    split = SplitModel(source.load(), backend)  # first: a model that does not load ends the start at once
    store = dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=timeout))
    store.set("ready", "1")
    dist.init_process_group("gloo", store=store, rank=1, world_size=2, timeout=timedelta(seconds=timeout))
    try:
        DeepStage(split, exit_layer).serve(ProcessChannel(1))
    finally:
        dist.destroy_process_group()


class Pipeline:
    """The shallow stage here; the deep stage in a child process or a thread. One pipeline per process
    at a time with the process transport (it owns the torch.distributed group)."""

    def __init__(self, split: Any, drafter: Any, config: PipelineConfig | None = None,
                 source: ModelSource | None = None, eos_token_ids: list[int] | None = None) -> None:
        cfg = self.config = config or PipelineConfig()
        if cfg.gamma < 1:
            raise InvalidConfigError(f"gamma must be >= 1, got {cfg.gamma}")
        if cfg.transport not in ("process", "thread"):
            raise InvalidConfigError(f"unknown pipeline transport {cfg.transport!r} (process or thread)")
        if getattr(drafter.policy, "arms", None) and len(drafter.policy.arms) > 1:
            raise InvalidConfigError("the pipeline drafts at one exit depth; a depth bandit changes it per round")
        self.split, self.drafter, self.k = split, drafter, drafter.exit_layer
        self.set_mode(cfg.mode)
        self.eos_token_ids = list(eos_token_ids or [])
        self.stats = PipelineStats()
        self.closed = False
        self._stash: Message | None = None
        threads = cfg.threads or (torch.get_num_threads() if cfg.transport == "thread" else 1)
        torch.set_num_threads(threads)
        if cfg.transport == "thread":
            self.channel, deep_end = ThreadChannel.pair(cfg.timeout)
            self.worker = threading.Thread(target=DeepStage(split, self.k).serve, args=(deep_end, False), daemon=True,
                                           name="selfspec-deep-stage")
            self.channel.peer_thread = self.worker
            self.worker.start()
            return
        if dist.is_initialized():
            raise InvalidConfigError("a torch.distributed group is already running in this process")
        if source is None:
            source = ModelSource.of(split.model)
        port = _free_port()
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback: both stages on this machine
        self.worker = mp.get_context("spawn").Process(
            target=_deep_process, args=(source, self.k, port, cfg.deep_threads or threads, split.backend, cfg.timeout),
            daemon=True)
        self.worker.start()
        self._join_group(port, cfg.timeout)
        self.channel = ProcessChannel(0)

    def _join_group(self, port: int, timeout: float) -> None:
        """Rank 0 hosts the group's store and waits for the deep process to say it is ready (its model loaded),
        watching it meanwhile: one that dies while starting is a PipelineError now, not a wait for the
        group's timeout."""
        store = dist.TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=timeout), wait_for_workers=False)
        deadline = time.monotonic() + timeout
        while not store.check(["ready"]):
            if not self.worker.is_alive():
                self.closed = True
                raise PipelineError(f"the deep stage exited while starting (exit code {self.worker.exitcode})")
            if time.monotonic() > deadline:
                self.worker.kill()
                self.closed = True
                raise PipelineError(f"the deep stage did not start within {timeout:.0f} s")
            time.sleep(0.05)
        dist.init_process_group("gloo", store=store, rank=0, world_size=2, timeout=timedelta(seconds=timeout))

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

    # ---- messages ---------------------------------------------------------------------
    def _send(self, msg: Message) -> None:
        self._check_alive()
        try:
            self.channel.send(msg)
        except PipelineError as e:
            self._fail(e)

    def _recv(self, kind: int) -> Message:
        t0 = time.perf_counter()
        msg, self._stash = self._stash, None
        try:
            msg = msg or self.channel.recv()
        except PipelineError as e:
            self._fail(e)
        self.stats.wait_time += time.perf_counter() - t0
        if msg.kind == ERROR:
            self._fail(PipelineError(error_text(msg)))
        if msg.kind != kind:
            self._fail(PipelineError(f"the deep stage answered {msg.kind}, expected {kind}"))
        return msg

    def _verdict(self) -> tuple[int, int, torch.Tensor | None]:
        msg = self._recv(VERDICT)
        m, x = msg.tensors[0].tolist()
        finals = msg.tensors[1].to(self.split.dtype) if len(msg.tensors) > 1 else None
        return m, x, finals

    def _worker_alive(self) -> bool:
        return self.worker.is_alive()

    def _check_alive(self) -> None:
        if self.closed or not self._worker_alive():
            code = getattr(self.worker, "exitcode", None)
            raise PipelineError(f"the deep stage is not running{'' if code is None else f' (exit code {code})'}")

    def _fail(self, e: PipelineError) -> None:
        """A stage is gone: close this pipeline (a new one is needed) and raise."""
        if not isinstance(self.worker, threading.Thread):
            self.worker.join(1)
            code = self.worker.exitcode
            e = PipelineError(f"the deep stage failed{'' if code is None else f' (exit code {code})'}: {e}")
        self.close(stop=False)
        raise e

    # ---- supposing a verdict (drafting ahead) ----------------------------------------------
    def _snapshot(self, seq: SequenceState) -> _Snapshot:
        head = self.drafter.head
        seen = head.seen(seq.head_state) if head.stateful else 0
        return _Snapshot(seq.length, seq.pending, len(seq.tokens), seq.head_backlog, seq.depth, seen)

    def _restore(self, seq: SequenceState, snap: _Snapshot) -> None:
        seq.length, seq.pending, seq.head_backlog, seq.depth = snap.length, snap.pending, snap.backlog, snap.depth
        seq.tokens = seq.tokens[: snap.n_tokens]  # a new list: the lookup index is rebuilt from it
        head = self.drafter.head
        if head.stateful:  # entries past p + 1 may come from a supposed verdict; accepted() redoes them
            head.rollback(seq.head_state, min(head.seen(seq.head_state), snap.seen, snap.length + 1))

    def _suppose(self, seq: SequenceState, snap: _Snapshot, block: DraftBlock, m: int, x: int) -> None:
        """Put ``seq`` in the state the verdict (m, x) on ``block`` would leave it in."""
        self._restore(seq, snap)
        p = block.start
        seq.cache.truncate(p + 1 + m)
        finals = None
        if self.drafter.head.needs_context:
            finals = seq.cache.keys[0].new_zeros(1, m + 1, self.split.hidden_size)
            if block.predicted_finals is not None:
                n = min(m + 1, block.predicted_finals.shape[1])
                finals[:, :n] = block.predicted_finals[:, :n]
        self.drafter.accepted(seq, block, m, finals, observe=False)
        seq.length, seq.pending = p + 1 + m, x
        seq.tokens = seq.tokens + block.tokens[:m] + [x]

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
        b = self.drafter.propose(seq, min(self.config.gamma, left - 1) + 1, gen)
        if not b.tokens:
            return {}
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
            if gen.greedy and (msg := getattr(self.channel, "poll", lambda: None)()) is not None:
                self._stash = msg
                return
            self._suppose(seq, snap, block, m, c)
            ahead[(m, c)] = self._keep(seq, self.drafter.propose(seq, min(self.config.gamma, left - 1), gen), True)
            self.stats.branches += 1

    # ---- generation ------------------------------------------------------------------------
    @torch.inference_mode()
    def stream(self, prompt_ids: list[int], gen: GenerateConfig | None = None) -> Iterator[list[int]]:
        """New tokens as the verdicts come in (chunks; an ending EOS included); ``self.stats`` counts."""
        gen = gen or GenerateConfig()
        if not prompt_ids or gen.max_new_tokens < 1:
            raise InvalidConfigError("the pipeline needs a non-empty prompt and max_new_tokens >= 1")
        self._check_alive()
        split, d, k, cfg = self.split, self.drafter, self.k, self.config
        st = self.stats = PipelineStats()
        t0 = time.perf_counter()
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
        rows = getattr(d.head, "vocab_ids", torch.empty(0, dtype=torch.long))
        params = RequestParams(gen.temperature, gen.top_k, gen.top_p, gen.seed, d.head.needs_context,
                               self.signal_layer, cfg.mirror_top_k if self.signal_layer else 0)
        self._send(Message(PREFILL, [h, params.encode(), rows.cpu()]))
        _, x, finals = self._verdict()
        d.start(seq, h, finals)
        seq.length, seq.pending, seq.tokens = P, x, [*prompt_ids, x]
        emitted, nxt = 1, None
        yield [x]
        while emitted < limit and x not in eos:
            budget = limit - emitted
            p = seq.length
            if nxt is None or len(nxt.tokens) > budget - 1:
                seq.cache.truncate(p)
                nxt = d.propose(seq, min(cfg.gamma, budget - 1), gen)
            block = nxt
            msg = [torch.tensor([p, len(block.tokens)], dtype=torch.long), block.exit_states,
                   torch.tensor([block.tokens], dtype=torch.long)]
            self._send(Message(BLOCK, msg + ([block.probs.float()] if block.probs is not None else [])))
            snap = self._snapshot(seq)
            own = seq.cache.save(p, p + len(block.tokens) + 1, k)  # branches overwrite this block's rows
            ahead = self._draft_ahead(seq, snap, block, gen, budget)
            if self.signal_layer:
                self._branches(seq, snap, block, gen, budget, self._recv(SIGNAL).tensors[0], ahead)
            m, x, finals = self._verdict()
            self._restore(seq, snap)
            seq.cache.restore(p, own)
            seq.cache.truncate(p + 1 + m)
            seq.length, seq.pending = p + 1 + m, x
            d.accepted(seq, block, m, finals)
            new = block.tokens[:m] + [x]
            seq.tokens = seq.tokens + new
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
            out = []
            for t in new[:budget]:
                out.append(t)
                if t in eos:
                    break
            emitted += len(out)
            x = out[-1]
            st.wall_time = time.perf_counter() - t0
            yield out
        st.wall_time = time.perf_counter() - t0

    def generate(self, prompt_ids: list[int], gen: GenerateConfig | None = None, **overrides: Any,
                 ) -> tuple[list[int], PipelineStats]:
        """New tokens (an ending EOS included) and the stats. ``overrides``: GenerateConfig fields."""
        from dataclasses import replace

        gen = replace(gen or GenerateConfig(), **overrides)
        out: list[int] = []
        for chunk in self.stream(prompt_ids, gen):
            out += chunk
        return out, self.stats

    def close(self, stop: bool = True) -> None:
        """Stop the deep stage (and leave the process group)."""
        if self.closed:
            return
        self.closed = True
        if stop and self._worker_alive():
            try:
                self.channel.send(Message(STOP))
            except PipelineError:
                pass
        if isinstance(self.worker, threading.Thread):
            self.worker.join(10)
            return
        self.worker.join(10)
        if self.worker.is_alive():
            self.worker.kill()
            self.worker.join(5)
        if dist.is_initialized():
            dist.destroy_process_group()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
