"""Policies made of policies, one per case: a lookup block's by its match length (``ByMatchLength``), and S2D's
choice of the exit depth, one Thompson policy per depth (``DepthBandit``). Their members are the policies of
``selfspec.drafting.policies``."""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import TYPE_CHECKING

from selfspec.drafting.policies import DraftPolicy, ThompsonPolicy

MATCH_BOUNDS = (2, 3, 5, 8, 16)  # lookup match lengths per bucket: 2 | 3 | 4-5 | 6-8 | 9-16 | 17+ (ByMatchLength)


class ByMatchLength:
    """One policy per bucket of lookup match lengths (``MATCH_BOUNDS``), each made by ``make`` when first
    needed and learning on its own: a block copied after a long match is sized by what long matches did.

    The first lookup draft is accepted far more often after a long match than after a short one (docs/ADAPTIVE.md,
    lookup by match length); one policy for all would average them. Not a DraftPolicy itself: the drafter asks
    ``of(length)`` for the block's policy."""

    def __init__(self, make: Callable[[], DraftPolicy], bounds: tuple[int, ...] = MATCH_BOUNDS) -> None:
        self.make, self.bounds = make, bounds
        self.policies: dict[int, DraftPolicy] = {}

    def bucket(self, length: int) -> int:
        return bisect.bisect_left(self.bounds, length)

    def of(self, length: int) -> DraftPolicy:
        """The policy of blocks whose match reached ``length`` tokens back."""
        b = self.bucket(length)
        if b not in self.policies:
            self.policies[b] = self.make()
        return self.policies[b]


class DepthBandit:
    """S2D's depth choice as a bandit over a nested head's depths, with the Thompson machinery: each
    depth has its own costs and per-position posteriors; at the start of a round every depth draws its
    acceptance rates, and the round drafts at the depth (and length) whose draws promise the best speed
    over plain decoding. ``depth`` is read by the drafter; verification starts from it."""

    def __init__(self, arms: dict[int, ThompsonPolicy], default: int) -> None:
        self.arms, self.depth = arms, default
        self.name = "thompson-depth"
        self.needs_confidence = any(a.needs_confidence for a in arms.values())
        self.picks: dict[int, int] = dict.fromkeys(arms, 0)

    def for_request(self, seed: int | None) -> DepthBandit:
        return DepthBandit({d: a.for_request(None if seed is None else seed + d) for d, a in self.arms.items()},
                           self.depth)

    def max_drafts(self, gamma: int) -> int:
        best = (-1.0, self.depth, 0)
        for d, arm in self.arms.items():
            g, gain = arm.choose(gamma)
            if gain > best[0]:
                best = (gain, d, g)
        _, self.depth, g = best
        self.arms[self.depth].cap = g
        self.picks[self.depth] += 1
        return g

    def go_on(self, index: int, top1_prob: float) -> bool:
        return self.arms[self.depth].go_on(index, top1_prob)

    def first_bar(self) -> float | None:
        return self.arms[self.depth].first_bar()

    def observe(self, proposed: int, accepted: int) -> None:
        self.arms[self.depth].observe(proposed, accepted)


if TYPE_CHECKING:  # `make test` runs mypy: a DepthBandit that no longer implements DraftPolicy fails it here

    def _depth_bandit_is_a_policy(p: DepthBandit) -> DraftPolicy:
        return p
