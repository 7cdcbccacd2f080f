"""Drafting policies: how many draft tokens to propose in a round.

A policy is asked before each draft token whether to go on, given the draft's confidence, and is
told afterwards how the round went (adaptive policies such as EESD's Thompson sampling learn
from that). The drafter calls:

    n_max = policy.max_drafts(gamma)            # at the start of a round
    policy.keep(i, top1_prob)                   # before proposing draft token i (0-based)
    policy.observe(proposed, accepted)          # after verification
"""

from __future__ import annotations

from typing import Protocol

from selfspec.errors import InvalidConfigError


class DraftPolicy(Protocol):
    name: str

    def max_drafts(self, gamma: int) -> int: ...

    def keep(self, index: int, top1_prob: float) -> bool: ...

    def observe(self, proposed: int, accepted: int) -> None: ...


class FixedPolicy:
    """Always propose gamma draft tokens."""

    name = "fixed"
    needs_confidence = False

    def max_drafts(self, gamma: int) -> int:
        return gamma

    def keep(self, index: int, top1_prob: float) -> bool:
        return True

    def observe(self, proposed: int, accepted: int) -> None:
        return None


class ConfidencePolicy(FixedPolicy):
    """Kangaroo's second early exit: stop drafting as soon as the draft's top-1 probability falls
    below ``threshold`` (a low-confidence token is likely rejected; verify now instead)."""

    name = "confidence"
    needs_confidence = True

    def __init__(self, threshold: float = 0.6) -> None:
        if not 0.0 <= threshold <= 1.0:
            raise InvalidConfigError(f"confidence threshold must be in [0, 1], got {threshold}")
        self.threshold = threshold

    def keep(self, index: int, top1_prob: float) -> bool:
        return top1_prob >= self.threshold


class CostAwarePolicy:
    """Chooses how many drafts a round gets from measured costs (selfspec.costs) and the acceptance
    observed so far, then defers the per-token decision to a base policy (fixed or confidence).

    Acceptance at draft position i is estimated as (accepted_i + prior * weight) / (proposed_i + weight):
    a pessimistic start never drafts where it cannot pay, and ``observe`` learns from every round.
    When no draft length beats plain decoding it proposes 0 drafts (a plain step), but every
    ``explore_every``-th round tries one draft so the estimate can recover.
    """

    def __init__(self, base: FixedPolicy, costs, prior: float = 0.35, weight: float = 4.0,
                 explore_every: int = 16) -> None:
        self.base, self.costs = base, costs
        self.name = f"{base.name}+costs"
        self.needs_confidence = base.needs_confidence
        self.prior, self.weight, self.explore_every = prior, weight, explore_every
        self.proposed: list[int] = []
        self.accepted: list[int] = []
        self.rounds = 0
        self.last_choice: tuple[int, float] = (0, 1.0)

    def acceptance(self, n: int) -> list[float]:
        out = []
        for i in range(n):
            p = self.proposed[i] if i < len(self.proposed) else 0
            a = self.accepted[i] if i < len(self.accepted) else 0
            out.append((a + self.prior * self.weight) / (p + self.weight))
        return out

    def max_drafts(self, gamma: int) -> int:
        from selfspec.costs import best_gamma

        self.rounds += 1
        g, gain = best_gamma(self.costs, self.acceptance(gamma), gamma)
        self.last_choice = (g, gain)
        if g == 0 and self.rounds % self.explore_every == 0:
            return 1
        return g

    def keep(self, index: int, top1_prob: float) -> bool:
        return self.base.keep(index, top1_prob)

    def observe(self, proposed: int, accepted: int) -> None:
        self.base.observe(proposed, accepted)
        while len(self.proposed) < proposed:
            self.proposed.append(0)
            self.accepted.append(0)
        for i in range(proposed):
            self.proposed[i] += 1
            self.accepted[i] += int(i < accepted)


def make_policy(name: str, threshold: float = 0.6) -> FixedPolicy:
    if name == "fixed":
        return FixedPolicy()
    if name == "confidence":
        return ConfidencePolicy(threshold)
    raise InvalidConfigError(f"unknown drafting policy '{name}' (known: fixed, confidence)")
