"""Drafting policies: how many draft tokens to propose in a round.

A policy is asked before each draft token whether to go on, given the draft's confidence, and is
told afterwards how the round went (adaptive policies such as EESD's Thompson sampling learn
from that). The drafter calls:

    n_max = policy.max_drafts(gamma)            # at the start of a round
    policy.go_on(i, top1_prob)                  # before proposing draft token i (0-based): go on drafting?
    policy.observe(proposed, accepted)          # after verification

Adaptive policies keep per-request state: the engine asks ``policy.for_request(seed)`` for a fresh one
at the start of every request (stateless policies return themselves), so a request's draft decisions
depend only on its own seed and tokens.

Policies made of these, one per lookup match length or per exit depth: ``selfspec.drafting.policy_tables``.
"""

from __future__ import annotations

import math
import random
from typing import TYPE_CHECKING, Protocol

from selfspec.costs import DraftCosts, best_gamma, speedup, speedup_with_blanks
from selfspec.errors import InvalidConfigError


class DraftPolicy(Protocol):
    """What a drafter asks of a policy (the module's docstring). The attributes are read-only here: a
    policy may keep them as plain attributes, class attributes or properties."""

    @property
    def name(self) -> str: ...

    @property
    def needs_confidence(self) -> bool:
        """go_on() reads the draft's top-1 probability (else the drafter passes 1.0)."""

    @property
    def depth(self) -> int | None:
        """The exit depth this round drafts at (a depth bandit), None: the head's own."""

    def for_request(self, seed: int | None) -> DraftPolicy: ...

    def max_drafts(self, gamma: int) -> int: ...

    def go_on(self, index: int, top1_prob: float) -> bool: ...

    def first_bar(self) -> float | None:
        """The draft confidence ``go_on(0, ·)`` asks for in a round that may draft (``max_drafts`` > 0): go_on(0, c)
        is exactly ``c >= first_bar()`` (-inf: every first draft made), so a compiled call can take the first draft's
        decision before go_on is asked (``DeepContextHead.draft_or_step``; go_on is still called, with the same
        confidence, and must agree); None when go_on(0) is not such a test."""

    def observe(self, proposed: int, accepted: int) -> None: ...


class FixedPolicy:
    """Always propose gamma draft tokens."""

    name = "fixed"
    needs_confidence = False
    depth: int | None = None

    def max_drafts(self, gamma: int) -> int:
        return gamma

    def go_on(self, index: int, top1_prob: float) -> bool:
        return True

    def first_bar(self) -> float | None:
        return -math.inf if type(self).go_on is FixedPolicy.go_on else None  # a subclass's own go_on: not known

    def observe(self, proposed: int, accepted: int) -> None:
        return None

    def for_request(self, seed: int | None) -> FixedPolicy:
        return self


class ConfidencePolicy(FixedPolicy):
    """Kangaroo's second early exit: stop drafting as soon as the draft's top-1 probability falls
    below ``threshold`` (a low-confidence token is likely rejected; verify now instead)."""

    name = "confidence"
    needs_confidence = True

    def __init__(self, threshold: float = 0.6) -> None:
        if not 0.0 <= threshold <= 1.0:
            raise InvalidConfigError(f"confidence threshold must be in [0, 1], got {threshold}")
        self.threshold = threshold

    def go_on(self, index: int, top1_prob: float) -> bool:
        return top1_prob >= self.threshold

    def first_bar(self) -> float | None:
        return self.threshold if type(self).go_on is ConfidencePolicy.go_on else None


class CostAwarePolicy:
    """Chooses how many drafts a round gets from measured costs (selfspec.costs) and the acceptance
    observed so far, then defers the per-token decision to a base policy (fixed or confidence).

    Acceptance at draft position i is estimated as (accepted_i + prior * weight) / (proposed_i + weight):
    a pessimistic start never drafts where it cannot pay, and ``observe`` learns from every round.
    When no draft length beats plain decoding it proposes 0 drafts (a plain step), but every
    ``explore_every``-th round tries one draft so the estimate can recover.
    """

    depth: int | None = None

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

    def for_request(self, seed: int | None) -> CostAwarePolicy:
        return self  # one policy learns across requests: its acceptance counts pool them all

    def max_drafts(self, gamma: int) -> int:
        self.rounds += 1
        g, gain = best_gamma(self.costs, self.acceptance(gamma), gamma)
        self.last_choice = (g, gain)
        if g == 0 and self.rounds % self.explore_every == 0:
            return 1
        return g

    def go_on(self, index: int, top1_prob: float) -> bool:
        return self.base.go_on(index, top1_prob)

    def first_bar(self) -> float | None:
        return self.base.first_bar()

    def observe(self, proposed: int, accepted: int) -> None:
        self.base.observe(proposed, accepted)
        while len(self.proposed) < proposed:
            self.proposed.append(0)
            self.accepted.append(0)
        for i in range(proposed):
            self.proposed[i] += 1
            self.accepted[i] += int(i < accepted)


# Prior counts (passed, blank) of the pass rate: a mean of 0.7 worth two rounds, so a request learns its own rate
# within a few rounds (0.7: near the pass rate of the tuned threshold on most Spec-Bench groups, translation's
# lower; docs/ADAPTIVE.md)
PASS_PRIOR = (1.4, 0.6)


class ThompsonPolicy:
    """EESD's Thompson-sampled draft length (Liu et al., 2024, "Speculative Decoding via Early-exiting for
    Faster LLM Inference with Thompson Sampling Control Mechanism").

    The acceptance of draft position i, given that positions < i were accepted, has a Beta(alpha_i, beta_i)
    posterior. Before each draft token (``go_on``) and at the start of a round (``max_drafts``) the policy
    draws one acceptance rate per position from the posteriors and acts as if the draws were true: it
    drafts on while some longer round has a better expected speed over plain decoding at the measured
    costs (selfspec.costs.speedup) than stopping here. Uncertain positions are sometimes drawn high, so
    the policy keeps exploring; positions that keep failing are drawn low, so it drafts less, down to no
    drafts at all (plain decoding) when drafting does not pay.

    Worked example (costs where one draft token costs 15% of a plain forward): posteriors Beta(8, 2) at
    position 0 and Beta(1, 3) at position 1 draw, say, 0.78 and 0.21: one draft gives (1 + 0.78) / 1.2
    = 1.48x, two give (1 + 0.78 + 0.16) / 1.37 = 1.42x, so the round stops after one draft token.
    After verification, ``observe(proposed=1, accepted=1)`` adds a success at position 0 (alpha_0 += 1);
    ``observe(2, 0)`` would add a failure at position 0 and leave position 1 unobserved (it was not
    reached).

    With a confidence stop as the base, a round may also end blank: the head ran for the first draft and
    its confidence refused it, so the round cost a plain step plus the head and emitted one token. How often
    that happens is a Beta posterior of its own (the pass rate pi, per request like the rest), and a round
    of g drafts is priced as what it is on average: pi * (its drafts' tokens and cost) + (1 - pi) * (a
    blank round's). Without it, blank rounds teach the policy nothing: where the stop refuses most first
    drafts (as on translation prompts), every round pays the head for no token gained and the request runs
    slower than plain decoding (docs/ADAPTIVE.md).

    The policy defers to ``base`` first (the confidence stop, when that is the base), and works for
    token trees too (a tree's depth is its draft length; its per-depth acceptance is the path's).
    Per-request state: ``for_request(seed)`` returns a fresh posterior from the prior and an RNG seeded by
    the request's seed (0 when it has none), so decisions are reproducible.
    """

    name = "thompson"
    depth: int | None = None

    def __init__(self, base: FixedPolicy, costs: DraftCosts, prior: float | list[float] = 0.35,
                 strength: float = 4.0, seed: int | None = 0, positions: int = 16,
                 pass_prior: tuple[float, float] = PASS_PRIOR, price_blanks: bool = True) -> None:
        if not 0.0 < strength:
            raise InvalidConfigError(f"thompson prior strength must be > 0, got {strength}")
        if not (pass_prior[0] > 0 and pass_prior[1] > 0):
            raise InvalidConfigError(f"thompson pass prior must be two counts > 0, got {pass_prior}")
        self.base, self.costs, self.strength = base, costs, strength
        self.prior = [min(max(p, 0.01), 0.99) for p in (prior if isinstance(prior, list) else [prior])]
        means = [self.prior[min(i, len(self.prior) - 1)] for i in range(positions)]
        self.alpha = [m * strength for m in means]
        self.beta = [(1.0 - m) * strength for m in means]
        self.needs_confidence = base.needs_confidence
        self.pass_prior, self.price_blanks = pass_prior, price_blanks
        # Beta posterior of the pass rate (the first draft's confidence clears the stop): counts of drafted and
        # blank rounds; only a confidence stop makes blank rounds, so without one pi is 1 and never drawn
        self.blanks_priced = price_blanks and self.needs_confidence
        self.passes, self.blanks = pass_prior
        self.rng = random.Random(0 if seed is None else seed)
        self.cap = 0  # this round's longest draft (max_drafts); 0 again once its verdict is observed

    def for_request(self, seed: int | None) -> ThompsonPolicy:
        return ThompsonPolicy(self.base, self.costs, self.prior, self.strength, seed, len(self.alpha),
                              self.pass_prior, self.price_blanks)

    def draw_pass(self) -> float:
        """A pass rate drawn from its posterior (1.0 without a confidence stop, no round being blank, or with
        ``price_blanks`` off)."""
        return self.rng.betavariate(self.passes, self.blanks) if self.blanks_priced else 1.0

    def draw(self, n: int) -> list[float]:
        """One acceptance rate per position 0..n-1, drawn from the posteriors."""
        return [self.rng.betavariate(self.alpha[i], self.beta[i]) for i in range(min(n, len(self.alpha)))]

    def mean(self, n: int) -> list[float]:
        return [self.alpha[i] / (self.alpha[i] + self.beta[i]) for i in range(min(n, len(self.alpha)))]

    def choose(self, gamma: int) -> tuple[int, float]:
        """(draft length, its expected speedup over plain) for one round, from fresh draws of the posteriors."""
        theta, pi, n = self.draw(gamma), self.draw_pass(), min(gamma, len(self.alpha))
        return max(((g, speedup_with_blanks(self.costs, theta, g, pi)) for g in range(n + 1)), key=lambda t: t[1])

    def max_drafts(self, gamma: int) -> int:
        self.cap = self.choose(gamma)[0]
        return self.cap

    def go_on(self, index: int, top1_prob: float) -> bool:
        if not self.base.go_on(index, top1_prob):
            return False
        if index == 0 or index >= self.cap:
            return index < max(self.cap, 1)  # max_drafts just drew for this round's first token
        theta = self.draw(self.cap)  # fresh draws: go on while some longer round (up to the cap) pays more
        here = speedup(self.costs, theta, index)
        return any(speedup(self.costs, theta, g) > here for g in range(index + 1, self.cap + 1))

    def first_bar(self) -> float | None:
        return self.base.first_bar()  # go_on(0) with a cap >= 1: the base's test, no draw

    def observe(self, proposed: int, accepted: int) -> None:
        self.base.observe(proposed, accepted)
        if self.cap > 0 and self.blanks_priced:  # the head ran for this round: drafted, or blank
            if proposed > 0:
                self.passes += 1.0
            else:
                self.blanks += 1.0
        self.cap = 0
        for i in range(min(proposed, accepted + 1, len(self.alpha))):
            if i < accepted:
                self.alpha[i] += 1.0
            else:
                self.beta[i] += 1.0


POLICIES = ("fixed", "confidence", "thompson", "thompson-confidence")


def make_policy(name: str, threshold: float = 0.6) -> FixedPolicy:
    """The per-token base policy of ``name`` (thompson variants are built over it with costs, selfspec.drafting.setup)."""
    if name in ("fixed", "thompson"):
        return FixedPolicy()
    if name in ("confidence", "thompson-confidence"):
        return ConfidencePolicy(threshold)
    raise InvalidConfigError(f"unknown drafting policy '{name}' (known: {', '.join(POLICIES)})")


if TYPE_CHECKING:  # `make test` runs mypy: a policy that no longer implements DraftPolicy fails it here

    def _fixed_is_a_policy(p: FixedPolicy) -> DraftPolicy:
        return p

    def _confidence_is_a_policy(p: ConfidencePolicy) -> DraftPolicy:
        return p

    def _cost_aware_is_a_policy(p: CostAwarePolicy) -> DraftPolicy:
        return p

    def _thompson_is_a_policy(p: ThompsonPolicy) -> DraftPolicy:
        return p
