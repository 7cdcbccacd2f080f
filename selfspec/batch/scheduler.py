"""Continuous batching: a pool of live requests that step together, joining and leaving between steps.

    sched = Scheduler(engine, BatchConfig(max_batch=8), eos_token_ids=[2])
    a = sched.add(prompt_ids, GenerateConfig(max_new_tokens=64))     # waits for the next step
    while sched.busy:
        for req, block in sched.step():   # admitted requests are prefilled, running ones take a round
            ...                            # block: the tokens req accepted this step (EOS cut, length cut)
        b = sched.add(...)                 # joins at the next step; sched.cancel(a) leaves now

Each step is one batched round (``selfspec.batch.step``): newcomers' prompts, plain steps and every speculative
sequence's own draft block (chain, lookup match or token tree) go through the layers together,
each sequence over its own KV cache, so any mix of lengths, block sizes and acceptance steps
together with no padding and no realignment (EXSPEC's "pool of sequences that can step
together" is every live sequence here). SpecEE requests (methods 'specee', 'specee-verified')
have their own loop and step alone, one round per batch step.

How much a greedy sequence drafts depends on the batch (``BatchConfig``): a draft row is nearly
free at batch 1, where one step reads all the weights for one token, and costs its full share at
batch 8, where a step already carries 8 tokens. A sampled request drafts as it would alone, so its
seed gives the same text at any load. See docs/BATCHING.md for the measurements.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from selfspec import round as core
from selfspec.batch.step import BatchEntry, step
from selfspec.config import GenerateConfig, opt
from selfspec.engine import Engine, validate_request
from selfspec.errors import InvalidConfigError
from selfspec.outputs import RequestOutput, StreamEvent
from selfspec.specee.decode import SPECEE_METHODS
from selfspec.state import SequenceState
from selfspec.stats import GenerationStats


@dataclass
class BatchConfig:
    """How requests are batched."""

    max_batch: int = opt(8, "Most requests decoding at once; more wait for a free slot (FIFO).")
    draft_batch: int = opt(
        1, "Largest batch in which sequences draft from the exit head (above it they verify lookup matches "
        "only); at batch 1 a draft row is nearly free, in a batch of B it costs about 1/B of a step.")
    lookup_rows: int = opt(
        0, "Lookup drafts a batched step may carry in all, shared by its sequences (each gets at most "
        "lookup_rows // batch, and never more than DraftConfig.lookup); 0 (measured best here, "
        "docs/BATCHING.md): no lookup in batches of 2 or more.")

    def caps(self, batch: int) -> tuple[int, int]:
        """(exit-head drafts, lookup drafts) a sequence may draft in a step of ``batch`` sequences."""
        if batch <= 1:
            return 1 << 30, 1 << 30
        return (1 << 30 if batch <= self.draft_batch else 0), self.lookup_rows // batch

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class BatchRequest:
    """One request in the scheduler: its settings, its sequence and what it has emitted."""

    prompt_ids: list[int]
    gen: GenerateConfig
    eos: frozenset[int]
    tag: Any = None  # the caller's handle (e.g. the server's job)
    stats: GenerationStats = field(default_factory=GenerationStats)
    seq: SequenceState | None = None
    out: list[int] = field(default_factory=list)  # new tokens so far (an ending EOS included)
    solo: Generator[list[int], None, None] | None = None  # a SpecEE or pipelined request's own loop (closed when it leaves)
    pipelined: bool = False  # decoded by the engine's pipeline (selfspec.pipeline.service), one at a time
    done: bool = False  # max_new_tokens reached, EOS emitted, or cancelled
    submitted: float = field(default_factory=time.perf_counter)
    started: float | None = None  # when it was admitted (prefilled)
    output: RequestOutput | None = None  # its text side (TextScheduler)

    @property
    def remaining(self) -> int:
        return self.gen.max_new_tokens - len(self.out)


class Scheduler:
    """The pool of live requests of one engine; only one thread may call it."""

    def __init__(self, engine: Engine, config: BatchConfig | None = None, eos_token_ids: list[int] | None = None,
                 pipeline: Any = None) -> None:
        self.engine, self.config = engine, config or BatchConfig()
        self.pipeline = pipeline  # a PipelineService: 'selfspec' requests go through it, one at a time
        if self.config.max_batch < 1:
            raise InvalidConfigError(f"max_batch must be >= 1, got {self.config.max_batch}")
        self.eos = frozenset(eos_token_ids or [])
        self.waiting: list[BatchRequest] = []
        self.running: list[BatchRequest] = []
        self.steps = 0  # batched steps run
        self.step_sizes: dict[int, int] = {}  # sequences in a step -> steps of that size

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, prompt_ids: list[int], gen: GenerateConfig, tag: Any = None) -> BatchRequest:
        """Queue a request; it is checked now (bad settings, empty prompt, too long raise here, the batch
        untouched) and prefilled at the next step with a free slot."""
        validate_request(len(prompt_ids), gen, self.engine.split.context_length)
        self.engine.check_method(gen.method)
        eos = frozenset() if gen.ignore_eos else frozenset(gen.eos_token_ids) if gen.eos_token_ids is not None else self.eos
        req = BatchRequest(list(prompt_ids), gen, eos, tag)
        self.waiting.append(req)
        return req

    def add_all(self, prompts: list[list[int]], gens: list[GenerateConfig]) -> list[BatchRequest]:
        """Queue several requests, every one checked before any is added (one bad request leaves the pool
        untouched)."""
        if len(prompts) != len(gens):
            raise InvalidConfigError(f"{len(prompts)} prompts but {len(gens)} generation configs")
        for ids, gen in zip(prompts, gens):
            validate_request(len(ids), gen, self.engine.split.context_length)
            self.engine.check_method(gen.method)
        return [self.add(ids, gen) for ids, gen in zip(prompts, gens)]

    def cancel(self, req: BatchRequest) -> None:
        """Take a request out now (a client gone, a stop string found by the caller); frees its slot."""
        req.done = True
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        if req.solo is not None:
            req.solo.close()

    def _admit(self) -> list[BatchRequest]:
        new = []
        while self.waiting and len(self.running) < self.config.max_batch:
            req = self.waiting[0]
            if self.pipeline is not None and req.gen.method == "selfspec":
                if any(r.pipelined for r in self.running):  # the pipeline is busy: wait (FIFO)
                    break
                req.pipelined = True
                req.solo = self.pipeline.tokens(req.prompt_ids, req.gen, req.stats)
            self.waiting.pop(0)
            req.started = time.perf_counter()
            if req.gen.method in SPECEE_METHODS:
                req.solo = self.engine.generate_tokens(req.prompt_ids, req.gen, req.stats)
            elif not req.pipelined:
                req.seq = self.engine.new_sequence(len(req.prompt_ids), req.gen)
                speculative = self.engine.speculative(req.gen.method)
                if speculative:
                    self.engine.need_drafter().begin(req.seq, req.gen.seed)
                req.stats.prompt_tokens = len(req.prompt_ids)
                req.stats.cached_tokens = self.engine.reuse_prefix(req.seq, req.prompt_ids, req.gen, speculative)
            self.running.append(req)
            new.append(req)
        return new

    def step(self) -> list[tuple[BatchRequest, list[int]]]:
        """Admit waiting requests into free slots (their prefill is this step's round for them), run one
        round for every running request, and return each one's new tokens. Finished requests leave."""
        new = set(map(id, self._admit()))
        if not self.running:
            return []
        t0 = time.perf_counter()
        batch = [r for r in self.running if r.solo is None]
        caps = self.config.caps(len(self.running))
        # A sampled request drafts as it would alone: what it draws from its seeded generator depends on its
        # drafts, so this keeps its text the same at any load. Greedy output never depends on the drafts.
        entries = []
        for r in batch:
            assert r.seq is not None  # admitted without a loop of its own: _admit gave it a sequence
            entries.append(BatchEntry(r.seq, r.gen, r.stats, r.remaining, self.engine.speculative(r.gen.method),
                                      r.prompt_ids if id(r) in new else None,
                                      *(caps if r.gen.greedy else self.config.caps(1)), first=r.stats.cached_tokens))
        with torch.inference_mode():
            blocks = dict(zip(map(id, batch), step(self.engine, entries))) if entries else {}
            for r in self.running:
                if r.solo is not None:
                    blocks[id(r)] = next(r.solo, [])
        self.steps += 1
        self.step_sizes[len(self.running)] = self.step_sizes.get(len(self.running), 0) + 1
        out = []
        elapsed = time.perf_counter() - t0
        for r in list(self.running):
            block, finished = core.cut(blocks[id(r)], r.remaining, r.eos)
            r.out.extend(block)
            if id(r) in new and r.solo is None:
                r.stats.prefill_time = elapsed
            r.stats.new_tokens = len(r.out)
            r.stats.wall_time = time.perf_counter() - (r.started or t0)
            if not block or finished:
                r.done = True
                self.running.remove(r)
                if r.solo is not None:
                    r.solo.close()
            out.append((r, block))
        return out

    def run(self) -> None:
        """Step until every request added so far has finished."""
        while self.busy:
            self.step()


def decode_batch(engine: Engine, prompts: list[list[int]], gens: list[GenerateConfig],
                 eos_token_ids: list[int] | None = None, method: str | None = "plain",
                 stats: list[GenerationStats] | None = None, batch: BatchConfig | None = None) -> list[list[int]]:
    """Several requests decoded together (all admitted at once unless ``batch.max_batch`` is smaller), each with
    its own prompt length, settings and seed, each until its ``max_new_tokens`` or, unless it ignores EOS, an
    EOS token. ``method`` decodes every request that way (None: each its own ``gen.method``). Each output
    equals that request's own batch-1 output. -> new token ids per request, EOS included (``stats``, when
    given, gets one entry per request)."""
    sched = Scheduler(engine, batch or BatchConfig(max_batch=max(1, len(prompts))), eos_token_ids)
    reqs = sched.add_all(prompts, [g if method is None else replace(g, method=method) for g in gens])
    sched.run()
    if stats is not None:
        stats.extend(r.stats for r in reqs)
    return [r.out for r in reqs]


class TextScheduler(Scheduler):
    """The scheduler with each request's text side: steps give ``StreamEvent``s, cut at EOS and stop strings
    exactly as ``SelfSpec.stream`` cuts them (a request whose stop string appears leaves the batch at once);
    a request's last event carries its ``GenerationResult``."""

    def __init__(self, engine: Engine, tokenizer: Any, config: BatchConfig | None = None,
                 eos_token_ids: list[int] | None = None, pipeline: Any = None) -> None:
        super().__init__(engine, config, eos_token_ids, pipeline)
        self.tokenizer = tokenizer

    def add(self, prompt_ids: list[int], gen: GenerateConfig, tag: Any = None) -> BatchRequest:
        if gen.eos_token_ids is None:  # the model's EOS tokens, for the text side as for the engine
            gen = replace(gen, eos_token_ids=sorted(self.eos))
        req = super().add(prompt_ids, gen, tag)
        req.output = RequestOutput(self.tokenizer, gen, req.stats)
        return req

    def step_events(self) -> list[tuple[BatchRequest, StreamEvent]]:
        """One step; the events it produced, in order (a request that ends gets its final event last)."""
        events = []
        for req, block in self.step():
            output = req.output
            assert output is not None  # add() gave it one
            ev = output.push(block)
            if ev.text or ev.token_ids or ev.result is not None:
                events.append((req, ev))
            if ev.result is None and req.done:  # the engine stopped it: max_new_tokens
                events.append((req, output.end()))
            elif ev.result is not None and not req.done:  # a stop string: leave the batch now
                self.cancel(req)
        return events
