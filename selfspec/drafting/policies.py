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


def make_policy(name: str, threshold: float = 0.6) -> FixedPolicy:
    if name == "fixed":
        return FixedPolicy()
    if name == "confidence":
        return ConfidencePolicy(threshold)
    raise InvalidConfigError(f"unknown drafting policy '{name}' (known: fixed, confidence)")
