"""The deep stage of the pipeline: layers [k, L), their KV cache and the LM head; it verifies blocks.

It answers each message of the shallow stage (selfspec.pipeline.ppsd):

    PREFILL [states # [1, P, hidden], params, signal vocabulary]   -> VERDICT [(0, first token), finals?]
    BLOCK   [(start, g), states # [1, g + 1, hidden], drafts # [1, g], draft probs # [g, vocab]?]
            -> SIGNAL [top-k ids # [g + 1, kappa]]   (Mirror-SD: from layer e, before layers [e, L) run)
            -> VERDICT [(accepted m, next token x), final states # [1, m + 1, hidden]?]
    STOP

Verification is the engine's (selfspec.verify): greedy, or speculative sampling with this stage's own
generator, so the output is the target's greedy output or has exactly its distribution. After each
verdict the cache is rolled back to start + 1 + m: the pending token and the accepted drafts.
"""

from __future__ import annotations

import math
import traceback
from dataclasses import dataclass
from typing import Any

import torch

from selfspec.config import GenerateConfig
from selfspec.pipeline.transport import PREFILL, SIGNAL, STOP, VERDICT, Message, error_message
from selfspec.round import verify_chain
from selfspec.sampling import make_generator, pick


@dataclass
class RequestParams:
    """What the deep stage needs to know of a request, sent with its prefill as float64 numbers."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    want_finals: bool = False  # the draft head reads final states (heads.deep): send them with each verdict
    signal_layer: int = 0  # Mirror-SD: the layer e whose top-k the stage sends before finishing (0: none)
    signal_k: int = 0  # Mirror-SD: how many candidates per row

    def encode(self) -> torch.Tensor:  # [7] float64
        seed = math.nan if self.seed is None else float(self.seed)
        return torch.tensor([self.temperature, self.top_k, self.top_p, seed, float(self.want_finals),
                             self.signal_layer, self.signal_k], dtype=torch.float64)

    @classmethod
    def decode(cls, t: torch.Tensor) -> RequestParams:
        v = t.tolist()
        return cls(v[0], int(v[1]), v[2], None if math.isnan(v[3]) else int(v[3]), bool(v[4]), int(v[5]), int(v[6]))


class DeepStage:
    def __init__(self, split: Any, exit_layer: int) -> None:
        self.split, self.k = split, exit_layer
        self.cache = split.new_cache(256)
        self.params = RequestParams()
        self.gen = GenerateConfig()
        self.generator: torch.Generator | None = None
        self.signal_rows: torch.Tensor | None = None  # [n] the vocabulary the early signal ranks
        self.signal_weight: torch.Tensor | None = None  # [n, hidden] those rows of the LM head

    def serve(self, channel: Any, reraise: bool = True) -> None:
        """Answer messages until STOP; an exception is sent to the shallow stage (then raised: a process
        exits with an error; a thread, ``reraise=False``, just ends)."""
        try:
            with torch.inference_mode():
                while (msg := channel.recv()).kind != STOP:
                    for reply in (self.prefill(msg) if msg.kind == PREFILL else self.verify(msg, channel)):
                        channel.send(reply)
        except Exception:
            channel.send(error_message(f"the deep stage failed: {traceback.format_exc(limit=4)}"))
            if reraise:
                raise

    def prefill(self, msg: Message) -> list[Message]:
        states, params, rows = msg.tensors
        split, P = self.split, states.shape[1]
        self.params = p = RequestParams.decode(params)
        self.gen = GenerateConfig(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p)
        self.generator = None if self.gen.greedy else make_generator(None if p.seed is None else p.seed + 1)
        if p.signal_layer:
            self.signal_rows = rows if rows.numel() else None
            rows = self.signal_rows if self.signal_rows is not None else torch.arange(split.vocab_size)
            self.signal_weight = split.lm_rows(rows)
        self.cache = split.new_cache(P + 256)
        h = split.run_layers(states.to(split.dtype), self.k, split.num_layers, torch.arange(P)[None], self.cache)
        x = pick(split.logits(h[:, -1:])[0, -1], self.gen, self.generator)
        return [self._verdict(0, x, h)]

    def verify(self, msg: Message, channel: Any) -> list[Message]:
        header, states, drafts = msg.tensors[:3]
        probs = msg.tensors[3] if len(msg.tensors) > 3 else None
        split, (start, g), p = self.split, header.tolist(), self.params
        self.cache.truncate(start)
        pos = torch.arange(start, start + g + 1)[None]
        h = states.to(split.dtype)
        if p.signal_layer:  # Mirror-SD: tell the draft where the target is heading before finishing
            h = split.run_layers(h, self.k, p.signal_layer, pos, self.cache)
            channel.send(Message(SIGNAL, [self._signal(h[0])]))
            h = split.run_layers(h, p.signal_layer, split.num_layers, pos, self.cache)
        else:
            h = split.run_layers(h, self.k, split.num_layers, pos, self.cache)
        logits = split.logits(h)  # [1, g + 1, vocab]
        m, x = verify_chain(self.gen, drafts[0].tolist(), probs, logits, self.generator)
        self.cache.truncate(start + 1 + m)
        return [self._verdict(m, x, h[:, : m + 1])]

    def _signal(self, h: torch.Tensor) -> torch.Tensor:  # h [n, hidden] at layer e -> [n, kappa] token ids
        assert self.signal_weight is not None  # set up with the signal layer
        scores = self.split.final_norm(h[None])[0].float() @ self.signal_weight.float().T  # [n, rows]
        top = scores.topk(self.params.signal_k, dim=-1).indices
        return top if self.signal_rows is None else self.signal_rows[top]

    def _verdict(self, m: int, x: int, finals: torch.Tensor) -> Message:
        out = [torch.tensor([m, x], dtype=torch.long)]
        if self.params.want_finals:
            out.append(finals.float().contiguous())
        return Message(VERDICT, out)

