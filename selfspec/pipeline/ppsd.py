"""PPSD, verify while drafting: the shallow and the deep stage as two processes over torch.distributed.

    pipe = Pipeline(ModelSource.of(ModelConfig()), exit_layer=24, gamma=2)   # starts the deep stage
    tokens, stats = pipe.generate(prompt_ids, max_new_tokens=64, eos_token_ids=[2])
    pipe.close()

Rank 0 (this process) is the shallow stage: layers [0, k) with their KV cache and a stateless exit
head. Rank 1 (a child process) is the deep stage: layers [k, L), their KV cache and the LM head.
They talk over a gloo process group (NCCL would carry the same messages between GPUs):

    shallow                                   deep
    prefill: states of the prompt at k  --->  layers [k, L) -> first token
    round:   block (pending, d_1..d_g)  --->  verify (greedy): accepted m, next token x, cache -> p + 1 + m
             draft the next block as if  <---  verdict (m, x)
             all were accepted (its first
             token: the head's guess of x)
             verdict: guess right -> the next block is ready; wrong -> roll back to p + 1 + m, draft from x

While the deep stage verifies block t, the shallow stage drafts block t + 1, so when the guess is
right the draft costs nothing. Output is the target's greedy output, token for token: every token
emitted is an accepted draft or the deep stage's own argmax. ``selfspec.pipeline.costs`` predicts
the speed. A stage that dies makes ``generate`` raise ``PipelineError`` (no hang: every wait
polls on the other process fails when it dies, or times out).
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from selfspec.errors import InvalidConfigError, SelfSpecError

STOP, PREFILL, BLOCK = 0, 1, 2
HEADER = 4  # int64 header: kind, start position, rows, drafts


class PipelineError(SelfSpecError):
    """A pipeline stage failed or stopped answering."""


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
    accept_lengths: list[int] = field(default_factory=list)
    wait_time: float = 0.0  # seconds the shallow stage waited for verdicts
    wall_time: float = 0.0

    @property
    def mean_accepted_length(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _deep_main(source: ModelSource, exit_layer: int, port: int, threads: int, backend: str, timeout: float) -> None:
    """Rank 1: layers [k, L) and the LM head; answers every block with a verdict until STOP."""
    from selfspec.models.split import SplitModel
    from selfspec.verify import greedy_verify

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2,
                            timeout=timedelta(seconds=timeout))
    split = SplitModel(source.load(), backend)
    k, L, hidden = exit_layer, split.num_layers, split.hidden_size
    cache = split.new_cache(256)
    header = torch.zeros(HEADER, dtype=torch.long)
    with torch.inference_mode():
        while True:
            dist.recv(header, src=0)
            kind, start, rows, g = header.tolist()
            if kind == STOP:
                break
            states = torch.empty(1, rows, hidden, dtype=split.dtype)
            dist.recv(states, src=0)
            drafts = torch.empty(1, g, dtype=torch.long)
            if g:
                dist.recv(drafts, src=0)
            if kind == PREFILL:
                cache = split.new_cache(rows + 256)
            h = split.run_layers(states, k, L, torch.arange(start, start + rows)[None], cache)
            if kind == PREFILL:
                m, nxt = 0, int(split.logits(h[:, -1:])[0, -1].argmax())
            else:
                res = greedy_verify(drafts, split.logits(h))
                m, nxt = int(res.num_accepted[0]), int(res.next_token[0])
                for i in range(len(cache.lengths)):
                    cache.lengths[i] = min(cache.lengths[i], start + 1 + m)
            dist.send(torch.tensor([m, nxt], dtype=torch.long), dst=0)
    dist.destroy_process_group()


class Pipeline:
    """The shallow stage here, the deep stage in a child process; one pipeline per process at a time."""

    def __init__(self, source: ModelSource, exit_layer: int, gamma: int = 2, head: Any = "lm",
                 threads: int = 1, backend: str = "fast", timeout: float = 120.0) -> None:
        from selfspec.heads.io import new_head
        from selfspec.models.split import SplitModel

        if gamma < 1:
            raise InvalidConfigError(f"gamma must be >= 1, got {gamma}")
        if dist.is_initialized():
            raise InvalidConfigError("a torch.distributed group is already running in this process")
        torch.set_num_threads(threads)
        self.split = SplitModel(source.load(), backend)
        if not 1 <= exit_layer < self.split.num_layers:
            raise InvalidConfigError(f"exit_layer must be in [1, {self.split.num_layers}), got {exit_layer}")
        self.head = new_head("lm", self.split, exit_layer) if head == "lm" else head
        if self.head.stateful or self.head.needs_context:
            raise InvalidConfigError(f"the pipeline drafts with a stateless exit head, not '{self.head.kind}'")
        self.k, self.gamma, self.timeout = exit_layer, gamma, timeout
        port = _free_port()
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback: both stages on this machine
        self.proc = mp.get_context("spawn").Process(
            target=_deep_main, args=(source, exit_layer, port, threads, backend, timeout), daemon=True)
        self.proc.start()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2,
                                timeout=timedelta(seconds=timeout))
        self.stats = PipelineStats()

    # ---- messages -------------------------------------------------------------------------
    def _send(self, kind: int, start: int, states: torch.Tensor, drafts: list[int]) -> None:
        try:
            self._send_now(kind, start, states, drafts)
        except RuntimeError as e:
            self.proc.join(1)
            raise PipelineError(f"the deep stage is gone (exit code {self.proc.exitcode}): {e}") from e

    def _send_now(self, kind: int, start: int, states: torch.Tensor, drafts: list[int]) -> None:
        dist.send(torch.tensor([kind, start, states.shape[1], len(drafts)], dtype=torch.long), dst=1)
        if kind != STOP:
            dist.send(states.contiguous(), dst=1)
            if drafts:
                dist.send(torch.tensor([drafts], dtype=torch.long), dst=1)

    def _verdict(self) -> tuple[int, int]:
        """(accepted, next token) from the deep stage. A dead stage closes its connection and the receive
        fails at once; a stuck one runs into the group's timeout: either way a PipelineError, no hang."""
        out = torch.zeros(2, dtype=torch.long)
        t0 = time.perf_counter()
        try:
            dist.recv(out, src=1)
        except RuntimeError as e:
            self.proc.join(1)
            raise PipelineError(f"the deep stage stopped answering (exit code {self.proc.exitcode}): {e}") from e
        self.stats.wait_time += time.perf_counter() - t0
        return int(out[0]), int(out[1])

    # ---- the shallow stage --------------------------------------------------------------------
    def _draft(self, cache: Any, tok: int, p: int, g: int) -> tuple[list[int], torch.Tensor, int]:
        """Exit states of tok (at p) and g drafts after it, the drafts, and the head's guess after the last."""
        split, states, drafts = self.split, [], []
        ids = torch.empty(1, 1, dtype=torch.long)
        for i in range(g + 1):
            ids[0, 0] = tok
            pos = torch.tensor([[p + i]])
            h = split.run_layers(split.embed(ids), 0, self.k, pos, cache)
            states.append(h)
            tok = int(self.head(h, pos)[0, -1].argmax())
            if i < g:
                drafts.append(tok)
        return drafts, torch.cat(states, dim=1), tok

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int,
                 eos_token_ids: list[int] | None = None) -> tuple[list[int], PipelineStats]:
        """Greedy generation, pipelined: -> new tokens (an ending EOS included), stats."""
        if not prompt_ids or max_new_tokens < 1:
            raise InvalidConfigError("the pipeline needs a non-empty prompt and max_new_tokens >= 1")
        if not self.proc.is_alive():
            raise PipelineError(f"the deep stage is not running (exit code {self.proc.exitcode})")
        st = self.stats = PipelineStats()
        t0 = time.perf_counter()
        split, eos = self.split, set(eos_token_ids or [])
        P = len(prompt_ids)
        cache = split.new_cache(P + max_new_tokens + 2 * self.gamma + 4)
        h = split.run_layers(split.embed(torch.tensor([prompt_ids])), 0, self.k, torch.arange(P)[None], cache)
        self._send(PREFILL, 0, h, [])
        _, pending = self._verdict()
        out, p, ahead = [pending], P, None
        while len(out) < max_new_tokens and pending not in eos:
            g = min(self.gamma, max_new_tokens - len(out) - 1)
            if ahead is not None and ahead[0] == (pending, p, g):
                drafts, states, guess = ahead[1]
                st.ahead_used += 1
            else:
                for i in range(len(cache.lengths)):
                    cache.lengths[i] = min(cache.lengths[i], p)
                drafts, states, guess = self._draft(cache, pending, p, g)
            self._send(BLOCK, p, states, drafts)
            nxt_p = p + g + 1  # where the block after this one starts if all of it is accepted
            g2 = min(self.gamma, max_new_tokens - len(out) - g - 2)
            ahead = ((guess, nxt_p, g2), self._draft(cache, guess, nxt_p, g2)) if g2 >= 0 else None
            m, x = self._verdict()
            new = drafts[:m] + [x]
            st.rounds += 1
            st.accept_lengths.append(len(new))
            for t in new:
                out.append(t)
                if t in eos or len(out) >= max_new_tokens:
                    break
            pending, p = x, p + 1 + m
        st.wall_time = time.perf_counter() - t0
        return out[:max_new_tokens], st

    def close(self) -> None:
        """Stop the deep stage and leave the process group."""
        if dist.is_initialized():
            try:
                if self.proc.is_alive():
                    self._send(STOP, 0, torch.zeros(1, 0, 1), [])
            finally:
                dist.destroy_process_group()
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
