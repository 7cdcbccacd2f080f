"""Measured forward costs and the economics of a draft built on them.

Speculation pays when the tokens a verification accepts are worth more than what drafting and
verifying cost, and on a CPU a block of n tokens costs far from what one token costs (docs/
BENCHMARKS.md). So the engine decides from costs measured on the running machine, not from the
ratio of layer counts:

    t_shallow(n)  layers [0, k) for n tokens       t_deep(n)  layers [k, L) + LM head for n tokens
    t_head        the exit head for one token       t_plain   = t_shallow(1) + t_deep(1)

One round with g drafts costs  g * (t_shallow(1) + t_head) + t_shallow(1) + t_deep(g + 1) + overhead(g)  and
emits E[accepted] + 1 tokens, so its speed relative to plain decoding is

    speedup(g) = (E[accepted | g] + 1) * t_plain / round_cost(g)

with E[accepted | g] = sum_{i <= g} prod_{j <= i} a_j for per-position acceptance rates a_j. The
engine picks the g with the best speedup, and g = 0 (plain decoding) when no g beats 1.

overhead(g) = t_round + g * t_per_draft (0 at g = 0) is what a drafting round costs beyond its layers and head
calls, measured by the calibration on real rounds against real plain steps (``selfspec.calibration.round_overhead``):
the head catching up on the tokens verified since its last call, the drafts' and the verdict's Python. Left out,
the model prices a drafting round below what the engine spends on it, and drafts where drafts lose.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from selfspec.memory import trim_heap
from selfspec.models.split import SplitModel
from selfspec.timing import time_call


def layer_call(split: SplitModel, start: int, end: int, n: int, context: int, lm_head: bool = False,
               greedy: bool = False):
    """A call running ``n`` new tokens through layers [start, end) (+ final norm and LM head: the logits, or with
    ``greedy`` each row's argmax as a greedy verification takes it, ``split.greedy_ids``) over a cache already
    holding ``context`` tokens, rolling the cache back after itself (so it can be timed again and again)."""
    cache = split.new_cache(context + n)
    g = torch.Generator().manual_seed(0)
    ctx_ids = torch.randint(0, split.vocab_size, (1, context), generator=g, device=split.device)
    if context:
        split.forward_all(ctx_ids, torch.arange(context, device=split.device)[None], cache)
    h0 = split.embed(torch.randint(0, split.vocab_size, (1, n), generator=g, device=split.device))
    pos = torch.arange(context, context + n, device=split.device)[None]
    if start > 0:  # the cache of layers [0, start) must already hold the new tokens
        split.run_layers(h0, 0, start, pos, cache)

    def call() -> None:
        with torch.inference_mode():
            h = split.run_layers(h0, start, end, pos, cache)
            if lm_head:
                split.greedy_ids(h) if greedy else split.logits(h)
        cache.truncate(context)
        for i in range(start):
            cache.lengths[i] = context + n

    return call


@torch.inference_mode()
def time_layers(split: SplitModel, start: int, end: int, n: int, context: int, reps: int = 10,
                lm_head: bool = False, **timing: Any) -> float:
    """Seconds for ``n`` new tokens through layers [start, end) (+ final norm and LM head) over a cache
    already holding ``context`` tokens (``layer_call``). ``timing``: ``time_call``'s warmup, quantile, budget."""
    return time_call(layer_call(split, start, end, n, context, lm_head), reps, **timing)


@torch.inference_mode()
def time_blocks(split: SplitModel, start: int, end: int, sizes: tuple[int, ...], context: int, reps: int = 6,
                lm_head: bool = False, greedy: bool = False) -> dict[int, float]:
    """``time_layers`` for every block size in ``sizes``, their timings interleaved (each pass times every size
    once): a shared machine's slow spells, seconds long, then fall on all sizes alike instead of on one (timed one
    size after another, the ratios between sizes swing from one run to the next). The lower quartile per size, as
    ``time_call``."""
    calls = {n: layer_call(split, start, end, n, context, lm_head, greedy) for n in sizes}
    for call in calls.values():  # warm-up
        call()
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(reps):
        for n, call in calls.items():
            t0 = time.perf_counter()
            call()
            times[n].append(time.perf_counter() - t0)
    return {n: sorted(ts)[len(ts) // 4] for n, ts in times.items()}


@torch.inference_mode()
def time_head(head, split: SplitModel, reps: int = 10, n: int = 1) -> float:
    """Seconds for the exit head on ``n`` rows (one draft token at n = 1; a stateful head catching up
    on n exit states at once for n > 1), its state starting empty."""
    h = torch.randn(1, n, split.hidden_size, dtype=split.dtype, device=split.device)
    pos = torch.arange(n, device=split.device)[None]
    if not head.stateful:
        return time_call(lambda: head(h, pos), reps)
    state = head.new_state(max(64, n))

    def call() -> None:
        head(h, pos, state)
        head.rollback(state, 0)

    return time_call(call, reps)


@dataclass
class DraftCosts:
    """Measured costs (seconds) of one exit layer's draft on the running machine."""

    exit_layer: int
    t_shallow: float  # layers [0, k), one token
    t_head: float  # exit head, one token
    t_deep: dict[int, float] = field(default_factory=dict)  # n -> layers [k, L) + LM head for n tokens
    t_shallow_block: dict[int, float] = field(default_factory=dict)  # n -> layers [0, k) for n tokens at once
    tree_width: int = 1  # > 1: rounds draft token trees of this many nodes per depth (drafting.tree)
    t_round: float = 0.0  # a drafting round's measured cost beyond its layers and head calls (calibration.round_overhead)
    t_per_draft: float = 0.0  # ... and beyond them per draft token
    # Whether a blank round (the head ran, its first draft refused) pays t_round too; not when the head's first draft
    # and the rest of the step are one compiled call (``DeepContextHead.draft_or_step``): then only the head's cost
    blank_overhead: bool = True

    @property
    def t_plain(self) -> float:
        return self.t_shallow + self.t_deep[1]

    def round_cost(self, g: int) -> float:
        """One round of g drafts (a chain), or of a tree g levels deep: each level's ``tree_width`` nodes
        take one shallow block and one head call (the head's few rows cost about one row: its weights
        are read once), and the deep layers verify all 1 + width * g nodes at once."""
        w = self.tree_width
        if w <= 1:
            return g * (self.t_shallow + self.t_head) + self.t_shallow + self.deep(g + 1) + self.overhead(g)
        level = _interpolate(self.t_shallow_block or {1: self.t_shallow}, w) + self.t_head
        return g * level + self.t_shallow + self.t_head + self.deep(1 + w * g) + self.overhead(g)

    def overhead(self, g: int) -> float:
        """The measured cost of a round of g drafts beyond its layers and head calls (0 for a plain step)."""
        return self.t_round + g * self.t_per_draft if g > 0 else 0.0

    def blank_cost(self) -> float:
        """A blank round: one token for a plain step, the head's call, and the round overhead where it is paid."""
        return self.t_plain + self.t_head + (self.t_round if self.blank_overhead else 0.0)

    def layers_only(self) -> DraftCosts:
        """These costs without the measured round overhead (what the calibration measures the overhead against)."""
        return replace(self, t_round=0.0, t_per_draft=0.0)

    def deep(self, n: int) -> float:
        """t_deep(n), interpolated linearly between measured block sizes."""
        return _interpolate(self.t_deep, n)

    def for_lookup(self) -> DraftCosts:
        """The costs of lookup drafts: nothing to propose, one shallow pass over the whole block; as a
        DraftCosts whose 'deep' range is the full forward of n tokens (shallow block + deep). No round overhead:
        a lookup round runs no head, and its real cost stays close to these."""
        full = {n: _interpolate(self.t_shallow_block or {1: self.t_shallow}, n) + t for n, t in self.t_deep.items()}
        return DraftCosts(self.exit_layer, 0.0, 0.0, full)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> DraftCosts:
        """The inverse of ``to_dict``, also after a JSON round trip (which turns the block sizes into strings).
        Raises KeyError / TypeError / ValueError on anything else."""
        def table(t: dict) -> dict[int, float]:
            return {int(n): float(v) for n, v in t.items()}

        costs = cls(int(data["exit_layer"]), float(data["t_shallow"]), float(data["t_head"]), table(data["t_deep"]),
                    table(data.get("t_shallow_block", {})), int(data.get("tree_width", 1)),
                    float(data.get("t_round", 0.0)), float(data.get("t_per_draft", 0.0)),
                    bool(data.get("blank_overhead", True)))
        if 1 not in costs.t_deep:
            raise ValueError("draft costs without t_deep[1]")
        return costs


def _interpolate(table: dict[int, float], n: int) -> float:
    """table[n], linear between measured sizes, proportional beyond the largest."""
    if n in table:
        return table[n]
    ns = sorted(table)
    lo = max((m for m in ns if m < n), default=ns[0])
    hi = min((m for m in ns if m > n), default=ns[-1])
    if hi == lo:
        return table[lo] * n / lo
    return table[lo] + (table[hi] - table[lo]) * (n - lo) / (hi - lo)


def monotone(table: dict[int, float]) -> dict[int, float]:
    """A block-cost table made non-decreasing in n: each entry the least cost measured for a block at least as
    large. A block of n rows does part of the work of a larger one, so a larger block measured cheaper means the
    smaller one's timing caught a spike of the shared machine. Left high, such a t(1) makes every draft look
    cheap beside a plain step, and the calibration predicts a speedup that decoding does not reach."""
    out: dict[int, float] = {}
    low = float("inf")
    for n in sorted(table, reverse=True):
        low = min(low, table[n])
        out[n] = low
    return dict(sorted(out.items()))


def measure_draft_costs(split: SplitModel, head, context: int = 256, block_sizes: tuple[int, ...] = (1, 2, 3, 4, 8, 16),
                        reps: int = 8, exit_layer: int | None = None) -> DraftCosts:
    """Measure what the economics need for ``head`` at its exit layer, or at ``exit_layer`` (one of a nested
    head's depths), in a second or two. A block's deep range ends in a greedy verification's argmax
    (``split.greedy_ids``: with a quantized LM head, 5-8 rows cost less than their logits); sampling's blocks
    compute the logits, so for sampling these costs are a little low."""
    k, L = exit_layer or head.exit_layer, split.num_layers
    deep = monotone(time_blocks(split, k, L, block_sizes, context, reps, lm_head=True, greedy=True))
    shallow = monotone(time_blocks(split, 0, k, block_sizes, context, reps))
    costs = DraftCosts(k, shallow[1], time_head(head, split, reps), deep, shallow)
    trim_heap()  # the timed forwards' caches and activations, freed: their pages back to the system
    return costs


def expected_accepted(acceptance: list[float], g: int) -> float:
    """E[accepted drafts] for g drafts with per-position acceptance rates (the last rate repeats)."""
    total, run = 0.0, 1.0
    for i in range(g):
        a = acceptance[min(i, len(acceptance) - 1)] if acceptance else 0.0
        run *= a
        total += run
    return total


def speedup(costs: DraftCosts, acceptance: list[float], g: int) -> float:
    """Expected speed of rounds of g drafts relative to plain decoding (g = 0 is plain: 1.0)."""
    if g == 0:
        return 1.0
    return (expected_accepted(acceptance, g) + 1.0) * costs.t_plain / costs.round_cost(g)


def speedup_with_blanks(costs: DraftCosts, acceptance: list[float], g: int, pass_rate: float) -> float:
    """``speedup`` when only a share ``pass_rate`` of the rounds get past a confidence stop at the first draft: the
    others are blank (the head ran, no draft: one token for a plain step plus the head, and the round's overhead
    unless the head's call ran the step too, ``DraftCosts.blank_cost``).
    At pass_rate 1 it is ``speedup``, bit for bit."""
    if g == 0:
        return 1.0
    blank = costs.blank_cost()
    tokens = 1.0 + pass_rate * expected_accepted(acceptance, g)
    return tokens * costs.t_plain / (pass_rate * costs.round_cost(g) + (1.0 - pass_rate) * blank)


def best_gamma(costs: DraftCosts, acceptance: list[float], max_gamma: int = 8) -> tuple[int, float]:
    """(gamma, expected speedup over plain) maximising the speedup; gamma 0 means decode plainly."""
    return max(((g, speedup(costs, acceptance, g)) for g in range(max_gamma + 1)), key=lambda t: t[1])


def acceptance_needed(costs: DraftCosts, target: float, max_gamma: int = 8) -> float | None:
    """The least acceptance a (the same at every draft position) at which chains of some length 1..max_gamma reach
    ``target`` times plain decoding's speed at these costs (``speedup``); None when even drafts that are always right
    do not. What a head must reach on this machine before training it further can pay (``tuning.acceptance_needed``
    lists it per target speedup; figures in docs/ADAPTIVE.md, "What a head must reach")."""
    def best(a: float) -> float:
        return max(speedup(costs, [a], g) for g in range(1, max_gamma + 1))

    if best(1.0) < target:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(40):  # best(a) grows with a: bisect
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if best(mid) >= target else (mid, hi)
    return hi
