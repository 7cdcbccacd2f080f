"""The self-tuning calibration's measurements (selfspec.tuning chooses from them): greedy decodes of built-in
prompts with fixed drafts, every round recorded (each draft's confidence, how many were accepted) so that any
confidence stop and draft cap can be replayed afterwards at the measured costs (``simulate``), and the cost of a
drafting round beyond its layers and head calls, timed on real rounds (``round_overhead``).
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import torch

from selfspec.config import GenerateConfig
from selfspec.costs import DraftCosts
from selfspec.drafting.early_exit import EarlyExitDrafter
from selfspec.drafting.policies import FixedPolicy
from selfspec.engine import MAX_TREE_NODES, Engine
from selfspec.heads.base import ExitHead
from selfspec.models.split import SplitModel

# short, varied: chat, code, math, extraction, and the kinds where drafts fail (another language, a short fact):
# a calibration on easy prompts alone promised the Thompson prior an acceptance the translation group never saw
# (Spec-Bench's own questions are never used to tune)
CALIBRATION_PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a hash map works and write a Python function that counts word frequencies.",
    "A train travels 120 km in 1.5 hours. What is its average speed? Show your steps.",
    "Summarize the main causes of the French Revolution in five bullet points.",
    "Translate into German: 'The weather was cold, so we stayed inside and read books all afternoon.'",
    "Who painted the ceiling of the Sistine Chapel, and in which years?",
]
CHAIN_CAP = 5  # the fixed draft length acceptance is measured with (positions beyond it repeat the last)
TREE_CAP = 4  # ... and the depth of the trees
OVERHEAD_PROMPTS = 4  # prompts decoded in rounds of alternating draft lengths to measure the round overhead


class _Recorder(FixedPolicy):
    """Fixed-length drafts at one depth; records every round: the draft's confidence at each position and
    how many drafts were accepted (so any confidence stop can be simulated afterwards, ``simulate``)."""

    needs_confidence = True

    def __init__(self, depth: int, n: int) -> None:
        self.depth, self.n = depth, n
        self.rounds: list[tuple[list[float], int]] = []
        self.seconds: list[float] = []  # each round's wall time (round_overhead), aligned with ``rounds``
        self._confs: list[float] = []

    def max_drafts(self, gamma: int) -> int:
        self._confs = []
        return gamma

    def go_on(self, index: int, top1_prob: float) -> bool:
        self._confs.append(top1_prob)
        return True

    def first_bar(self) -> float | None:
        return -math.inf  # makes every draft (go_on is still called with the first draft's confidence: recorded)

    def observe(self, proposed: int, accepted: int) -> None:
        self.rounds.append((self._confs[:proposed] or [1.0] * proposed, accepted))

    def acceptance(self, threshold: float = 0.0, prior: float = 0.35, weight: float = 2.0) -> list[float]:
        """Conditional acceptance per position of the drafts a confidence stop at ``threshold`` lets through."""
        hits, trials = [0] * self.n, [0] * self.n
        for confs, accepted in self.rounds:
            for i in range(min(_drafted(confs, threshold, self.n), accepted + 1)):
                trials[i] += 1
                hits[i] += int(i < accepted)
        return [(h + prior * weight) / (t + weight) for h, t in zip(hits, trials)]


def _drafted(confs: list[float], threshold: float, cap: int) -> int:
    """Drafts a round keeps under a confidence stop: up to the first one below ``threshold``, at most ``cap``."""
    n = min(len(confs), cap)
    return next((i for i in range(n) if confs[i] < threshold), n)


def simulate(costs: DraftCosts, rounds: list[tuple[list[float], int]], threshold: float, cap: int) -> float:
    """Speed over plain decoding of chains cut by a confidence stop at ``threshold`` and at ``cap`` drafts,
    replayed on recorded rounds at the measured costs. A round stopped early still paid the head on the
    token it stopped at (and, stopped before its first draft, the round overhead: the head's path ran, unless its
    call ran the step too, ``DraftCosts.blank_overhead``);
    cap 0 is plain decoding (1.0)."""
    if cap == 0 or not rounds:
        return 1.0
    tokens = seconds = 0.0
    for confs, accepted in rounds:
        n = _drafted(confs, threshold, cap)
        tokens += min(accepted, n) + 1
        stopped = n < min(cap, len(confs))
        blank = n == 0 and costs.blank_overhead
        seconds += costs.round_cost(n) + ((costs.t_head + (costs.t_round if blank else 0.0)) if stopped else 0.0)
    return tokens * costs.t_plain / seconds


def calibration_prompts(tokenizer: Any, vocab_size: int) -> list[list[int]]:
    """The built-in prompts as ids (through the chat template when there is one); random ids without a tokenizer."""
    if tokenizer is None:
        g = torch.Generator().manual_seed(0)
        return [torch.randint(3, vocab_size, (12,), generator=g).tolist() for _ in CALIBRATION_PROMPTS]
    out = []
    for text in CALIBRATION_PROMPTS:
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        else:
            ids = tokenizer(text)["input_ids"]
        out.append([int(t) % vocab_size for t in ids])
    return out


def _decode(engine: Engine, ids: list[int], new_tokens: int, seconds: list[float] | None = None) -> None:
    """Decode ``ids`` greedily (``new_tokens``, past EOS); with ``seconds``, append each round's wall time (not the
    prefill's)."""
    gen = GenerateConfig(max_new_tokens=new_tokens, ignore_eos=True)
    room = engine.split.context_length - new_tokens - 1
    t = None
    for _ in engine.generate_tokens(ids[-room:], gen):
        now = time.perf_counter()
        if t is not None and seconds is not None:
            seconds.append(now - t)
        t = now


@torch.inference_mode()
def record_rounds(split: SplitModel, head: ExitHead, depth: int, width: int, prompts: list[list[int]],
                  new_tokens: int) -> _Recorder:
    """Decode ``prompts`` greedily with fixed drafts at ``depth`` (chains, or trees of ``width``), recording
    every round's confidences and accepted count."""
    cap = CHAIN_CAP if width <= 1 else min(TREE_CAP, max(1, (MAX_TREE_NODES - 1) // width))
    rec = _Recorder(depth, cap)
    engine = Engine(split, EarlyExitDrafter(split, head, rec, lookup=0), gamma=cap, tree_width=width)
    for ids in prompts:
        _decode(engine, ids, new_tokens)
    return rec


class _Alternating(_Recorder):
    """A recorder whose rounds draft ``pattern[i % len(pattern)]`` tokens in turn (``round_overhead``)."""

    def __init__(self, depth: int, pattern: tuple[int, ...]) -> None:
        super().__init__(depth, max(pattern))
        self.pattern, self.count = pattern, 0

    def max_drafts(self, gamma: int) -> int:
        self._confs = []
        self.count += 1
        return self.pattern[(self.count - 1) % len(self.pattern)]


def _paired_excess(rec: _Recorder, costs: DraftCosts, more: int, fewer: int) -> list[float]:
    """Per pair of neighbouring rounds of ``more`` and ``fewer`` drafts: how much more the first cost than the
    second beyond what ``costs`` model for each (seconds)."""
    rounds = [(len(confs), t) for (confs, _), t in zip(rec.rounds, rec.seconds)]
    out = []
    for (n1, t1), (n2, t2) in zip(rounds, rounds[1:]):
        if {n1, n2} == {more, fewer}:
            t_more, t_fewer = (t1, t2) if n1 == more else (t2, t1)
            out.append((t_more - costs.round_cost(more)) - (t_fewer - costs.round_cost(fewer)))
    return out


@torch.inference_mode()
def round_overhead(split: SplitModel, head: ExitHead, costs: DraftCosts, prompts: list[list[int]],
                   new_tokens: int) -> dict[str, float]:
    """What a drafting round costs beyond its layers and head calls (``costs``, timed on their own), in ms, split
    into a part per round ('round': the head catching up on the tokens verified since its last call, the draft's
    and the verdict's Python) and one per draft token ('per_draft'), both >= 0.

    Measured in pairs of neighbouring rounds of one decode, so that a shared machine's drift (seconds long, often
    larger than the overhead itself) hits both alike: rounds drafting 1 and 0 tokens in turn give 'round' (the
    1-draft round's cost beyond its model, less the 0-draft round's beyond a plain step), rounds of 2 and 1 in turn
    'per_draft'. Medians over the pairs. On a small model the overhead is a sizeable part of a step, which is
    why a drafting round costs more plain steps than its layers and head add up to."""
    base = costs.layers_only()
    pairs: dict[tuple[int, int], list[float]] = {}
    for more, fewer in ((1, 0), (2, 1)):
        rec = _Alternating(base.exit_layer, (more, fewer))
        engine = Engine(split, EarlyExitDrafter(split, head, rec, lookup=0), gamma=more)
        for ids in prompts:
            _decode(engine, ids, new_tokens, rec.seconds)
        pairs[more, fewer] = _paired_excess(rec, base, more, fewer)

    def median(xs: list[float]) -> float:
        return statistics.median(xs) if xs else 0.0

    one, step = median(pairs[1, 0]), median(pairs[2, 1])
    per_draft = max(0.0, step)
    ms = {"round": max(0.0, one - per_draft), "per_draft": per_draft, "excess_1_vs_0": one, "excess_2_vs_1": step,
          "pairs": float(len(pairs[1, 0]) + len(pairs[2, 1]))}
    return {k: round(v * 1e3, 3) if k != "pairs" else v for k, v in ms.items()}
