"""Building the early-exit drafter from a ``DraftConfig``: its head, its policies (fixed, confidence, cost-aware,
Thompson, the depth bandit), its lookup drafts, the calibration it follows, and SpecEE's predictors over it.
Registered as the drafter 'early-exit' (``selfspec.drafting.registry``)."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from selfspec.config import DraftConfig
from selfspec.costs import DraftCosts
from selfspec.drafting.early_exit import EarlyExitDrafter
from selfspec.drafting.policies import CostAwarePolicy, DraftPolicy, ThompsonPolicy, make_policy
from selfspec.drafting.policy_tables import MATCH_BOUNDS, ByMatchLength, DepthBandit
from selfspec.drafting.store import resolve_store
from selfspec.engine import MAX_TREE_NODES
from selfspec.errors import InvalidConfigError
from selfspec.heads.base import ExitHead
from selfspec.models.split import SplitModel
from selfspec.specee.decode import DEFAULT_THRESHOLDS, SpecEERunner, SpecEESettings
from selfspec.specee.predictors import has_predictors, load_predictors
from selfspec.tuning import Tuning, for_head, head_depths

MAX_AUTO_GAMMA = 8  # the longest draft the cost-aware choice considers
LOOKUP_PRIOR = 0.5  # prior acceptance of lookup drafts per position (then learned from every lookup round)
LOOKUP_STREAK_PRIOR = 0.8  # ... of those right after a lookup block accepted whole (a copied span goes on)
STORE_PRIOR = 0.4  # ... of the token store's (text the target wrote for other prompts: a weaker match than its own)


def check(draft: DraftConfig) -> None:
    if draft.lookup < 0 or draft.lookup_ngram < 2:
        raise InvalidConfigError(f"lookup must be >= 0 and lookup_ngram >= 2, got {draft.lookup}, "
                                 f"{draft.lookup_ngram}")
    if draft.head_context is not None and draft.head_context < 1:
        raise InvalidConfigError(f"head_context must be >= 1 (or None: every row), got {draft.head_context}")
    if draft.tree_width is not None and draft.tree_width < 0:
        raise InvalidConfigError(f"tree_width must be >= 0, got {draft.tree_width}")
    if draft.lookup_only and draft.lookup == 0:
        raise InvalidConfigError("lookup_only drafts by lookup alone, but lookup is 0 (off): set lookup > 0")


def early_exit(ss: Any, draft: DraftConfig) -> tuple[EarlyExitDrafter, int, DraftConfig, Tuning | None]:
    """The early-exit drafter of ``draft`` over the loaded ``ss`` (a SelfSpec: its split, head resolution, cost
    measurements and calibration). With ``gamma=None`` the draft is adaptive: its shape comes from a cached
    calibration (``tune``, selfspec.tuning) and the length of each round from forward costs measured here and
    the acceptance seen so far (a Thompson posterior per request, or ``CostAwarePolicy``).
    -> (drafter, most drafts per round, the config as resolved, the calibration or None)."""
    head = ss.make_head(draft)
    check(draft)
    tuning = None
    if draft.gamma is None and draft.tune != "off":
        tuning = ss.tuning(head, refresh=draft.tune == "refresh")
        if draft.exit_layer is None and tuning.exit_layer in head_depths(head):
            head.exit_layer = tuning.exit_layer
        draft = replace(draft, tree_width=tuning.tree_width if draft.tree_width is None else draft.tree_width,
                        depth_policy=draft.depth_policy or tuning.depth_policy)
    if draft.tree_width is None:  # the head's measured best, else chains
        width = head.recommended_draft.get("tree_width", 0)
        draft = replace(draft, tree_width=width if head.supports_tree else 0)
    assert draft.tree_width is not None  # resolved above
    if draft.tree_width > 1 and (not head.supports_tree or not ss.split.numerics.trees):
        # e.g. the int8 numerics: tree blocks attend through SDPA, which does not give single steps' rows bitwise
        draft = replace(draft, tree_width=0)
    name = draft.policy if draft.policy != "auto" else ("thompson-confidence" if tuning else "confidence")
    threshold = draft.threshold
    if threshold is None:  # the calibration's confidence stop, else 0.5 (measured best for the bundled head)
        threshold = tuning.threshold if tuning is not None else 0.5
        draft = replace(draft, threshold=threshold)
    # the user asked for lookup alone; or a calibration found no early-exit draft paying: lookup alone, unless the
    # user wants exploration (the resolved config says lookup_only, and so do the results that record it)
    if tuning is not None and tuning.gamma == 0 and draft.gamma is None and not draft.explore and draft.lookup > 0:
        draft = replace(draft, lookup_only=True)
    policy, gamma, lookup_policy, streak_policy, store_policy = _policies(ss, head, draft, name, threshold, tuning)
    if not draft.lookup_only:
        head.prepare()  # its draft kernels built now, not in the first request
        if head.source is not None:  # a head loaded from its directory to draft with: its packed copies suffice
            head.release_float()
    else:  # it never runs: none of its weights kept (loaded again should something run it, ExitHead.unload)
        head.unload()
    limit = math.inf  # with a calibration, a stateful head drafts only where its catch-up can pay
    if tuning is not None and head.stateful:
        limit = catch_up_limit(ss.draft_costs(head, draft, head.exit_layer), tuning, ss.split.num_layers - head.exit_layer)
    drafter = EarlyExitDrafter(ss.split, head, policy, draft.lookup, draft.lookup_ngram, lookup_policy,
                               lookup_only=draft.lookup_only, catch_up_limit=limit, head_context=draft.head_context,
                               lookup_streak_policy=streak_policy, lookup_longest=draft.lookup_match,
                               store=resolve_store(draft.store) if draft.lookup > 0 else None,
                               store_policy=store_policy)
    return drafter, gamma, replace(draft, exit_layer=head.exit_layer, policy=name), tuning


def catch_up_limit(costs: DraftCosts, tuning: Tuning | None, deep_layers: int) -> float:
    """The most rows of backlog per wanted token for which a stateful head's draft may still pay
    (``EarlyExitDrafter.catch_up_limit``). Catching up costs about one target layer per row (the head is one
    decoder layer), priced from the measured deep blocks: (t_deep(n) - t_deep(1)) / (n - 1) per row over
    ``deep_layers`` layers (the LM head's share included, so the price is high rather than low). The head's
    drafts can save at most the calibration's predicted gain, 1 - 1 / speedup of a plain step per token.
    Without a calibration, or when it found no draft that pays (its cap 0: the head is off, or exploring by the
    user's choice), no limit. E.g. a row at 1/70 of a step and a predicted speedup of 1.08 (a gain of 0.074
    steps a token): about 5 rows a token. With ``DraftConfig.head_context`` (32 by default) the rows a catch-up runs are
    bounded, so this only stops the head in a request's last few tokens; without it (None) a 64-token answer to a
    700-token prompt (summaries, RAG) drafts by lookup alone."""
    n = max(costs.t_deep, default=1)
    if tuning is None or tuning.gamma == 0 or n <= 1 or deep_layers <= 0:
        return math.inf
    gain = 1.0 - 1.0 / tuning.predicted_speedup if tuning.predicted_speedup > 0 else 0.0
    per_row = max((costs.t_deep[n] - costs.t_deep[1]) / (n - 1) / deep_layers, 1e-9)
    return max(gain, 0.0) * costs.t_plain / per_row


def _policies(ss: Any, head: ExitHead, draft: DraftConfig, name: str, threshold: float,
              tuning: Tuning | None) -> tuple[DraftPolicy, int, ByMatchLength | None, ByMatchLength | None,
                                              ByMatchLength | None]:
    """(the drafts' policy, most drafts per round, the lookup drafts' policy or None, the policy of lookup blocks
    after one accepted whole or None, the token store's blocks' or None) of ``draft`` (its tree width resolved:
    ``early_exit``). ``draft.lookup_only``: the head never runs, so nothing of it is built to price its rounds."""
    assert draft.tree_width is not None
    base = make_policy(name, threshold)
    policy: DraftPolicy = base
    gamma = draft.gamma
    lookup_policy: ByMatchLength | None = None
    if not (name.startswith("thompson") or gamma is None):
        return policy, gamma, None, None, None
    thompson = name.startswith("thompson")  # only a Thompson policy drafts at other depths (the bandit)
    costs = {d: ss.draft_costs(head, draft, d) for d in (head_depths(head) if thompson else [head.exit_layer])}
    if tuning is not None:  # what real rounds cost beyond their layers (measured by the calibration)
        costs = {d: tuning.with_overhead(c) for d, c in costs.items()}
    if not draft.lookup_only:  # a blank round's price (its one call, or not; ``front_ready`` builds the head's plan)
        costs = {d: for_head(c, head) for d, c in costs.items()}
    shaped = {d: replace(c, tree_width=draft.tree_width) if draft.tree_width > 1 else c for d, c in costs.items()}
    k = head.exit_layer
    if thompson:
        arms = {d: ThompsonPolicy(base, shaped[d], tuning.prior(d) if tuning else 0.35,
                                  price_blanks=draft.price_blanks) for d in shaped}
        policy = DepthBandit(arms, k) if draft.depth_policy == "bandit" and len(arms) > 1 else arms[k]
    else:
        policy = CostAwarePolicy(base, shaped[k])
    streak_policy = store_policy = None
    if gamma is None:  # lookup blocks as long as the measured block costs and the lookup acceptance seen pay for,
        # learned apart per bucket of match lengths (a long match is a copied span that goes on)
        lookup_costs, bounds = costs[k].for_lookup(), MATCH_BOUNDS if draft.lookup_match else ()
        lookup_policy = ByMatchLength(lambda: CostAwarePolicy(make_policy("fixed"), lookup_costs, prior=LOOKUP_PRIOR),
                                      bounds)
        streak_policy = ByMatchLength(
            lambda: CostAwarePolicy(make_policy("fixed"), lookup_costs, prior=LOOKUP_STREAK_PRIOR), bounds)
        store_policy = ByMatchLength(lambda: CostAwarePolicy(make_policy("fixed"), lookup_costs, prior=STORE_PRIOR),
                                     bounds)
    if gamma is None:
        gamma = MAX_AUTO_GAMMA
        if draft.tree_width > 1:
            gamma = max(1, min(MAX_AUTO_GAMMA, (MAX_TREE_NODES - 1) // draft.tree_width))
        if tuning is not None:  # the calibrated cap (the replayed optimum; 1 when nothing paid, to explore)
            gamma = min(gamma, max(tuning.gamma, 1))
    return policy, gamma, lookup_policy, streak_policy, store_policy


def specee_runner(split: SplitModel, drafter: EarlyExitDrafter, draft: DraftConfig) -> SpecEERunner | None:
    """SpecEE over ``head``'s candidates, when predictors are found (``DraftConfig.predictors``)."""
    if draft.specee_threshold is not None and not 0.0 <= draft.specee_threshold <= 1.0:
        raise InvalidConfigError(f"specee_threshold must be in [0, 1], got {draft.specee_threshold}")
    if draft.specee_window < 0 or draft.specee_radius < 0:
        raise InvalidConfigError(f"specee_window and specee_radius must be >= 0, got {draft.specee_window}, "
                                 f"{draft.specee_radius}")
    if draft.predictors == "none":
        return None
    head = drafter.head
    where = head.source if draft.predictors == "auto" else draft.predictors
    if where is None or (draft.predictors == "auto" and not has_predictors(where)):
        return None
    preds = load_predictors(where, head.exit_layer, split.num_layers)
    thresholds = {**DEFAULT_THRESHOLDS, **preds.meta.get("thresholds", {})}
    if draft.specee_threshold is not None:
        thresholds = dict.fromkeys(thresholds, draft.specee_threshold)
    max_layer = draft.specee_max_layer if draft.specee_max_layer is not None else preds.meta.get("max_layer")
    settings = SpecEESettings(thresholds, draft.specee_window, draft.specee_radius,
                              draft.gamma if draft.gamma is not None else SpecEESettings.max_drafts,
                              max_layer=max_layer)
    return SpecEERunner(split, drafter, preds, settings)
