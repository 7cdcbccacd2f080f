"""What a request gives back, and how a stream of accepted token blocks becomes it.

``RequestOutput`` is one request's text side: it takes the engine's blocks of accepted tokens one
at a time, cuts them at the first EOS or stop string (exactly where plain decoding would stop),
detokenizes incrementally (``TextStream``) and hands out ``StreamEvent``s; the last one carries the
``GenerationResult``. ``SelfSpec.stream`` runs one of these per call, a batch (``selfspec.batch``)
and the server one per request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

from selfspec.config import GenerateConfig
from selfspec.stats import GenerationStats
from selfspec.textstream import TextStream

FinishReason = Literal["stop", "length"]  # "length": max_new_tokens; "stop": EOS or stop string


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # new tokens (an EOS that ended generation included)
    finish_reason: FinishReason
    stats: GenerationStats = field(default_factory=GenerationStats)


@dataclass
class StreamEvent:
    text: str  # new final text since the previous event
    token_ids: list[int]  # tokens accepted since the previous event
    result: GenerationResult | None = None  # set on the last event only


class RequestOutput:
    """One request's output: ``push`` each accepted block, ``end`` when the engine stops (length).

    Worked example (stop=["."]): blocks [" Hi"], [" there", ".", " Bye"] give the events (" Hi", [Hi]),
    then (" there", [there, "."], result: text " Hi there", finish "stop"); " Bye" is never emitted."""

    def __init__(self, tokenizer: Any, config: GenerateConfig, stats: GenerationStats | None = None,
                 incremental: bool = True) -> None:
        self.eos = set() if config.ignore_eos else set(config.eos_token_ids or [])
        self.text = TextStream(tokenizer, config.stop)
        # ``incremental`` False (nobody reads the events' text: ``SelfSpec.generate``) and no stop string to look
        # for: the text is decoded once at the end, not a window per token (each run cold, after a step)
        self.lazy = not incremental and not self.text.stop
        self.stats = stats if stats is not None else GenerationStats()
        self.token_ids: list[int] = []
        self.result: GenerationResult | None = None
        self.t0 = time.perf_counter()

    @property
    def finished(self) -> bool:
        return self.result is not None

    def push(self, block: list[int]) -> StreamEvent:
        """The event for one accepted block; it ends the request (``result`` set) at an EOS or stop string."""
        delta_ids: list[int] = []
        delta = ""
        for tok in block:
            self.token_ids.append(tok)
            delta_ids.append(tok)
            if tok in self.eos:
                return self._final(delta + self.text.flush(), delta_ids, "stop")
            if self.lazy:
                self.text.add(tok)  # decoded in one piece by the final flush
                continue
            delta += self.text.push(tok)
            if self.text.stopped:
                return self._final(delta + self.text.flush(), delta_ids, "stop")
        return StreamEvent(delta, delta_ids)

    def end(self, finish: FinishReason = "length") -> StreamEvent:
        """The last event when the engine stopped by itself (``max_new_tokens``): the held-back text."""
        return self._final(self.text.flush(), [], finish)

    def _final(self, text: str, ids: list[int], finish: FinishReason) -> StreamEvent:
        self.stats.new_tokens = len(self.token_ids)
        self.stats.wall_time = time.perf_counter() - self.t0
        self.result = GenerationResult(self.text.text, self.token_ids, finish, self.stats)
        return StreamEvent(text, ids, self.result)
