"""Adaptive drafting: EESD's Thompson-sampled draft length, S2D's nested multi-depth heads and the
self-tuning calibration. Posteriors learn from verification, decisions are seeded per request, every
depth (and a switch of depth between rounds) stays lossless with every cache consistent."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
from conftest import ARCHS, VOCAB, hf_greedy, tiny_model, tiny_tokenizer
from test_engine_equality import NEW, prompt_of

from selfspec import DraftConfig, SelfSpec
from selfspec.costs import DraftCosts, acceptance_needed, speedup
from selfspec.drafting.policies import ConfidencePolicy, FixedPolicy, ThompsonPolicy
from selfspec.drafting.policy_tables import DepthBandit
from selfspec.errors import ExitLayerError, HeadMismatchError, InvalidConfigError
from selfspec.heads.io import load_head, new_head, save_head
from selfspec.kernels.build import cpu_extension
from selfspec.tuning import cache_path, format_tuning, load_cached

pytestmark = pytest.mark.usefixtures("one_thread")


def costs(draft_share: float = 0.1) -> DraftCosts:
    """Costs where one draft token costs ``draft_share`` of a plain forward and verifying a block is cheap."""
    return DraftCosts(2, t_shallow=draft_share * 0.5, t_head=draft_share * 0.5,
                      t_deep={1: 0.95, 2: 1.0, 4: 1.05, 8: 1.15, 16: 1.3})


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Tunings and costs in a fresh cache; the kernels loaded from the usual one first (built into an empty
    cache they take about two minutes, and every process a later test starts would build them again)."""
    cpu_extension()
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))


# ---- Thompson policy ---------------------------------------------------------------------------------
def test_thompson_posterior_updates_are_conditional():
    p = ThompsonPolicy(FixedPolicy(), costs(), prior=0.5, strength=2.0)
    p.observe(proposed=3, accepted=1)  # position 0 accepted, position 1 rejected, position 2 never reached
    assert p.alpha[:3] == [2.0, 1.0, 1.0] and p.beta[:3] == [1.0, 2.0, 1.0]
    p.observe(proposed=2, accepted=2)  # both accepted
    assert p.alpha[:2] == [3.0, 2.0] and p.beta[:2] == [1.0, 2.0]
    assert p.mean(2) == [0.75, 0.5]


def test_thompson_is_seeded_per_request():
    shared = ThompsonPolicy(FixedPolicy(), costs(), prior=0.5)
    a, b, c = shared.for_request(7), shared.for_request(7), shared.for_request(8)

    def decisions(p):
        out = []
        for i in range(40):
            g = p.max_drafts(6)
            out.append(g)
            p.observe(g, min(g, i % 3))
        return out

    assert decisions(a) == decisions(b)
    assert decisions(a) != decisions(c)
    assert shared.alpha == ThompsonPolicy(FixedPolicy(), costs(), prior=0.5).alpha  # requests never touch the shared one


def test_thompson_drafts_more_when_acceptance_is_high():
    def mean_drafts(rate: float) -> float:
        p = ThompsonPolicy(FixedPolicy(), costs(), prior=0.5).for_request(0)
        g = torch.Generator().manual_seed(0)
        total = 0
        for _ in range(200):
            n = p.max_drafts(8)
            kept = n
            for i in range(1, n):  # the per-token decision can end the round early
                if not p.go_on(i, 1.0):
                    kept = i
                    break
            accepted = 0
            while accepted < kept and float(torch.rand(1, generator=g)) < rate:
                accepted += 1
            p.observe(kept, accepted)
            total += kept
        return total / 200

    high, low = mean_drafts(0.9), mean_drafts(0.1)
    assert high > 3.0 and low < 0.6 and high > 4 * low


def test_thompson_defers_to_the_confidence_stop():
    p = ThompsonPolicy(ConfidencePolicy(0.5), costs(), prior=0.99, strength=1000.0)
    assert p.go_on(0, 0.9) and not p.go_on(0, 0.2) and p.needs_confidence


def test_thompson_prices_blank_rounds_and_stops_running_a_head_the_confidence_stop_refuses():
    """A round whose first draft the confidence stop refuses is blank: the head ran for nothing. Priced (the
    default), a request where 1 round in 10 passes stops running the head; unpriced, blank rounds teach the
    policy nothing and it runs the head every round. Where every round passes, pricing costs no drafting."""
    def head_rounds(pass_rate: float, price: bool) -> int:
        p = ThompsonPolicy(ConfidencePolicy(0.5), costs(0.3), prior=0.5, price_blanks=price).for_request(0)
        g = torch.Generator().manual_seed(1)
        ran = 0
        for _ in range(200):
            if p.max_drafts(4) == 0:
                p.observe(0, 0)  # a plain step: the head did not run, nothing learned about passing
                continue
            ran += 1
            passed = float(torch.rand(1, generator=g)) < pass_rate
            if not p.go_on(0, 0.9 if passed else 0.1):
                p.observe(0, 0)  # blank
                continue
            p.observe(1, int(float(torch.rand(1, generator=g)) < 0.6))
        return ran

    assert head_rounds(0.1, price=True) < 0.3 * head_rounds(0.1, price=False)
    assert head_rounds(0.1, price=False) > 120
    assert head_rounds(1.0, price=True) >= 0.9 * head_rounds(1.0, price=False) > 150
    p = ThompsonPolicy(ConfidencePolicy(0.5), costs(), prior=0.5).for_request(0)
    p.cap = 1  # max_drafts chose a draft, the stop refused it: blank
    p.observe(0, 0)
    p.observe(0, 0)  # a verdict without a max_drafts before it (the drafter skipped the policy): not a blank
    assert (p.passes, p.blanks) == (1.4, 1.6)
    assert ThompsonPolicy(FixedPolicy(), costs()).draw_pass() == 1.0  # no confidence stop: no blank rounds


def test_depth_bandit_prefers_the_depth_that_pays():
    cheap_bad = ThompsonPolicy(FixedPolicy(), costs(0.05), prior=0.05, strength=50.0)
    dear_good = ThompsonPolicy(FixedPolicy(), costs(0.15), prior=0.9, strength=50.0)
    bandit = DepthBandit({1: cheap_bad, 3: dear_good}, default=1).for_request(0)
    for _ in range(30):
        g = bandit.max_drafts(6)
        bandit.observe(g, g)
    assert bandit.picks[3] > 25


# ---- engine: lossless with the adaptive policies --------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_thompson_policies_are_lossless(arch):
    model = tiny_model(arch)
    ss = SelfSpec(model, None)
    drafted = 0
    for policy in ("thompson", "thompson-confidence"):
        for tree in (0, 2):
            ss.set_draft(DraftConfig(exit_layer=2, head="lm", gamma=4, policy=policy, threshold=0.1, tree_width=tree,
                                     lookup=0))
            ss.engine.drafter.policy.prior, ss.engine.drafter.policy.strength = [0.8], 20.0  # make it draft
            for plen in (1, 9):
                prompt = prompt_of(plen, plen + 3)
                out = ss.generate(prompt, max_new_tokens=NEW)
                assert out.token_ids == hf_greedy(model, prompt, NEW), (policy, tree, plen)
                drafted += sum(out.stats.proposed_per_position)
    assert drafted > 0


def nested_ss(arch: str, tmp_path, depths=(1, 2, 3), seed: int = 0) -> SelfSpec:
    """A tiny model with a saved nested head (random-ish maps, so depths draft differently)."""
    ss = SelfSpec(tiny_model(arch), None, DraftConfig(head="lm", exit_layer=1, gamma=1))
    head = new_head("nested", ss.split, 2, depths=list(depths))
    head.init_from_target()
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    save_head(head, tmp_path / f"nested-{arch}")
    return ss


@pytest.mark.parametrize("arch", ARCHS)
def test_nested_head_every_depth_and_the_bandit_are_lossless(arch, tmp_path):
    ss = nested_ss(arch, tmp_path)
    where = str(tmp_path / f"nested-{arch}")
    prompt = prompt_of(9, 5)
    ref = hf_greedy(ss.model, prompt, NEW)
    for depth in (1, 2, 3):
        ss.set_draft(DraftConfig(head=where, exit_layer=depth, gamma=3, lookup=0, policy="fixed"))
        assert ss.head.exit_layer == depth
        assert ss.generate(prompt, max_new_tokens=NEW).token_ids == ref, depth
    ss.set_draft(DraftConfig(head=where, gamma=3, lookup=4, policy="thompson", depth_policy="bandit"))
    assert isinstance(ss.engine.drafter.policy, DepthBandit)
    # a tiny model's step costs less than the head, so make the bandit draft: confident arms on synthetic costs
    ss.engine.drafter.policy = DepthBandit({d: ThompsonPolicy(FixedPolicy(), costs(), prior=0.9, strength=100.0)
                                           for d in (1, 2, 3)}, 2)
    out = ss.generate(prompt, max_new_tokens=NEW)
    assert out.token_ids == ref
    assert set(out.stats.draft_depths) <= {1, 2, 3} and sum(out.stats.draft_depths.values()) > 0


def test_nested_head_checks_its_depths(tmp_path):
    ss = nested_ss("llama", tmp_path)
    with pytest.raises(HeadMismatchError, match=r"its depths: \[1, 2, 3\]"):
        load_head(tmp_path / "nested-llama", ss.split, exit_layer=4)
    with pytest.raises(ExitLayerError):
        new_head("nested", ss.split, 2, depths=[1, 3])  # the default depth must be one of them
    head = load_head(tmp_path / "nested-llama", ss.split, exit_layer=3)
    assert head.exit_layer == 3 and head.depths == [1, 2, 3]
    with pytest.raises(ExitLayerError):
        head.project(torch.zeros(1, 1, ss.split.hidden_size), 4)


class SwitchEveryRound(FixedPolicy):
    """Cycles through depths round by round (what a bandit does at its most restless)."""

    def __init__(self, depths):
        self.depths, self.i, self.depth = list(depths), 0, depths[0]

    def max_drafts(self, gamma):
        self.depth = self.depths[self.i % len(self.depths)]
        self.i += 1
        return gamma


@pytest.mark.parametrize("tree", [0, 2])
def test_depth_switch_mid_generation_keeps_every_cache_consistent(tmp_path, tree):
    ss = nested_ss("llama", tmp_path, seed=3)
    ss.set_draft(DraftConfig(head=str(tmp_path / "nested-llama"), gamma=3, lookup=4, policy="fixed", tree_width=tree))
    ss.engine.drafter.policy = SwitchEveryRound([1, 3, 2])
    engine, split = ss.engine, ss.split
    prompt = [5, 6, 7, 5, 6, 7, 8, 9, 10]
    seqs = []
    inner = engine.new_sequence

    def keep(*a, **kw):
        seqs.append(inner(*a, **kw))
        return seqs[-1]

    engine.new_sequence = keep
    out = ss.generate(prompt, max_new_tokens=NEW, ignore_eos=True)
    assert out.token_ids == hf_greedy(ss.model, prompt, NEW)
    assert len(set(seqs[0].policy.depths)) == 3 and seqs[0].policy.i > 5
    assert len(out.stats.draft_depths) == 3 and "rounds per depth" in out.stats.summary()
    seq = seqs[0]
    ids = torch.tensor([prompt + out.token_ids[:-1]])  # every token but the pending one is in the cache
    assert all(n == ids.shape[1] for n in seq.cache.lengths[: split.num_layers])
    with torch.inference_mode():
        ref = split.new_cache(ids.shape[1])
        split.forward_all(ids, torch.arange(ids.shape[1])[None], ref)
    for layer in range(split.num_layers):
        n = ids.shape[1]
        torch.testing.assert_close(seq.cache.keys[layer][..., :n, :], ref.keys[layer][..., :n, :], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(seq.cache.values[layer][..., :n, :], ref.values[layer][..., :n, :],
                                   atol=1e-4, rtol=1e-4)


def _second_token_tv(ss: SelfSpec, prompt: list[int], n: int, seed: int) -> float:
    with torch.inference_mode():
        x = torch.tensor([prompt])
        p1 = torch.softmax(ss.model(x).logits[0, -1] / 0.8, -1)
        xs = torch.cat([x.expand(VOCAB, -1), torch.arange(VOCAB)[:, None]], 1)
        exact = p1 @ torch.softmax(ss.model(xs).logits[:, -1] / 0.8, -1)
    counts = torch.zeros(VOCAB)
    for s in range(n):
        out = ss.generate(prompt, max_new_tokens=2, temperature=0.8, seed=seed + s, ignore_eos=True)
        counts[out.token_ids[1]] += 1
    return 0.5 * float((counts / n - exact).abs().sum())


def test_nested_bandit_and_thompson_sampling_keep_the_distribution(tmp_path):
    ss = nested_ss("llama", tmp_path)
    prompt = [5, 6, 7, 8]
    n = 1200
    ss.set_draft(DraftConfig(head="lm", exit_layer=2, gamma=1, lookup=0))
    plain = _second_token_tv(ss, prompt, n, 0)
    ss.set_draft(DraftConfig(head=str(tmp_path / "nested-llama"), gamma=3, lookup=0, policy="thompson",
                             depth_policy="bandit"))
    ss.engine.drafter.policy = DepthBandit({d: ThompsonPolicy(FixedPolicy(), costs(), prior=0.9, strength=100.0)
                                           for d in (1, 2, 3)}, 2)  # always drafts, at every depth
    nested = _second_token_tv(ss, prompt, n, 10_000)
    assert nested < max(1.5 * plain, plain + 0.03)
    a = ss.generate(prompt, max_new_tokens=12, temperature=0.8, seed=3).token_ids
    assert a == ss.generate(prompt, max_new_tokens=12, temperature=0.8, seed=3).token_ids


# ---- self-tuning ---------------------------------------------------------------------------------------
def test_calibration_replays_confidence_stops_on_recorded_rounds():
    from selfspec.calibration import _Recorder, simulate

    c = costs()
    rounds = [([0.9, 0.2], 2), ([0.3, 0.9], 0)]  # (confidence per draft position, drafts accepted)
    # stop at 0.5: round 1 keeps one draft (accepted) and paid the head on the second; round 2 keeps none
    want = (2 + 1) * c.t_plain / (c.round_cost(1) + c.t_head + c.round_cost(0) + c.t_head)
    assert simulate(c, rounds, 0.5, 2) == pytest.approx(want)
    want = (3 + 1) * c.t_plain / (c.round_cost(2) + c.round_cost(2))  # no stop: both rounds draft two
    assert simulate(c, rounds, 0.0, 2) == pytest.approx(want)
    assert simulate(c, rounds, 0.0, 0) == 1.0
    rec = _Recorder(2, 2)
    rec.rounds = rounds
    # under the 0.5 stop only round 1's first draft is verified (accepted): 1 of 1 at position 0
    assert rec.acceptance(0.5, prior=0.0, weight=1.0)[0] == pytest.approx(1 / 2)
    assert rec.acceptance(0.0, prior=0.0, weight=1.0)[:2] == pytest.approx([1 / 3, 1 / 2])


def test_round_overhead_is_priced_in_every_drafting_round():
    """The measured overhead of a drafting round (calibration.round_overhead) counts in every round that drafts, chains and
    trees, never in a plain step; it survives the cost cache's JSON, and enough of it makes drafting not pay."""
    from selfspec.calibration import simulate
    from selfspec.costs import best_gamma

    c = replace(costs(), t_round=0.2, t_per_draft=0.05)
    base = c.layers_only()
    assert base.t_round == 0.0 and c.round_cost(0) == base.round_cost(0)
    assert c.round_cost(3) == pytest.approx(base.round_cost(3) + 0.2 + 3 * 0.05)
    tree = replace(c, tree_width=2)
    assert tree.round_cost(2) == pytest.approx(tree.layers_only().round_cost(2) + 0.2 + 2 * 0.05)
    assert DraftCosts.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    old = c.to_dict()
    del old["t_round"], old["t_per_draft"]  # an entry written before the overhead existed
    assert DraftCosts.from_dict(old) == base
    assert best_gamma(base, [0.6])[0] >= 1
    assert best_gamma(replace(base, t_round=base.t_plain), [0.6])[0] == 0
    # a confidence stop before the first draft: the head's path ran, so the round overhead was paid too
    assert simulate(c, [([0.1], 0)], 0.5, 1) == pytest.approx(c.t_plain / (c.round_cost(0) + c.t_head + 0.2))


def test_acceptance_needed_is_the_least_acceptance_that_reaches_the_target():
    free = DraftCosts(0, 0.0, 0.0, {1: 0.01, 16: 0.01})  # drafts and blocks cost nothing: speedup = 1 + a + ... + a^g
    assert acceptance_needed(free, 1.5, max_gamma=1) == pytest.approx(0.5, abs=1e-6)
    assert acceptance_needed(free, 1.0) == pytest.approx(0.0, abs=1e-6)
    assert acceptance_needed(free, 2.5, max_gamma=1) is None  # two tokens a round at most
    priced = DraftCosts(0, 0.0, 0.001, {1: 0.02, 2: 0.021, 3: 0.023, 4: 0.027, 8: 0.045}, t_round=0.002,
                        t_per_draft=0.001)
    a13, a16 = acceptance_needed(priced, 1.3), acceptance_needed(priced, 1.6)
    assert a13 is not None and a16 is not None and 0.0 < a13 < a16 < 1.0
    # the least: at it some chain reaches the target, just below it none does
    assert max(speedup(priced, [a16], g) for g in range(1, 9)) >= 1.6 - 1e-6
    assert max(speedup(priced, [a16 - 0.01], g) for g in range(1, 9)) < 1.6
    serial = DraftCosts(0, 0.0, 0.001, {1: 0.02, 2: 0.04, 4: 0.08, 8: 0.16})  # a block costs its rows' steps
    assert acceptance_needed(serial, 1.0) is None


def test_calibration_measures_the_round_overhead_and_the_policy_prices_it():
    ss = SelfSpec(tiny_model("llama"), tiny_tokenizer(), DraftConfig(head="lm", exit_layer=1, lookup=0))
    t = ss.tuning_result
    o = t.overhead_ms
    assert {"round", "per_draft", "excess_1_vs_0", "excess_2_vs_1"} <= set(o) and o["pairs"] > 10
    assert o["round"] >= 0 and o["per_draft"] >= 0 and all(math.isfinite(v) for v in o.values())
    policy = ss.engine.drafter.policy
    assert policy.costs.t_round == pytest.approx(o["round"] / 1e3)
    assert policy.costs.t_per_draft == pytest.approx(o["per_draft"] / 1e3)
    assert "round overhead" in format_tuning(t)
    assert "acceptance a chain's drafts need" in format_tuning(t)


def test_calibration_is_cached_shown_and_overridable(tmp_path):
    ss = nested_ss("llama", tmp_path)
    where = str(tmp_path / "nested-llama")
    ss.set_draft(DraftConfig(head=where))  # gamma=None, tune='auto': calibrates on first use
    t = ss.tuning_result
    assert t is not None and set(t.acceptance) == {f"{d}/{w}" for d in (1, 2, 3) for w in (0, 2)}
    assert ss.head.exit_layer == t.exit_layer and ss.draft_config.tree_width == t.tree_width
    assert ss.draft_config.policy == "thompson-confidence"
    path = cache_path(t.key)
    assert json.loads(path.read_text())["exit_layer"] == t.exit_layer
    assert load_cached(t.key) == t
    ss.set_draft(DraftConfig(head=where))  # cached: the very same result, no calibration
    assert ss.tuning_result == t
    ss.set_draft(DraftConfig(head=where, exit_layer=3, tree_width=0, depth_policy="fixed"))  # user settings win
    assert ss.head.exit_layer == 3 and ss.draft_config.tree_width == 0 and ss.draft_config.depth_policy == "fixed"
    ss.set_draft(DraftConfig(head=where, tune="off"))
    assert ss.tuning_result is None and ss.draft_config.policy == "confidence"
    assert "chosen: exit depth" in format_tuning(t)
    prompt = prompt_of(9, 2)
    ss.set_draft(DraftConfig(head=where))
    assert ss.generate(prompt, max_new_tokens=NEW).token_ids == hf_greedy(ss.model, prompt, NEW)


def test_an_exit_that_never_agrees_tunes_down_to_plain_decoding():
    """An untrained exit at layer 1 of a random model rarely agrees: the calibration finds nothing pays and
    the online policy then almost never drafts."""
    ss = SelfSpec(tiny_model("qwen2"), tiny_tokenizer(), DraftConfig(head="lm", exit_layer=1, lookup=0))
    t = ss.tuning_result
    assert t.gamma == 0 and t.predicted_speedup == 1.0
    out = ss.generate(prompt_of(9, 4), max_new_tokens=40, ignore_eos=True)
    assert sum(out.stats.proposed_per_position) <= 8  # a little exploration, then plain steps
    assert out.token_ids == hf_greedy(ss.model, prompt_of(9, 4), 40)


def test_when_no_early_exit_draft_pays_only_lookup_drafts_unless_exploring():
    """The same exit that never agrees, with lookup on: by default (explore=False) the head never drafts (every
    round is a lookup block or a plain step); explore=True lets Thompson try one-token drafts. Both lossless."""
    ss = SelfSpec(tiny_model("qwen2"), tiny_tokenizer(), DraftConfig(head="lm", exit_layer=1))
    assert ss.tuning_result.gamma == 0 and ss.engine.drafter.lookup_only and ss.draft_config.lookup_only
    prompt = prompt_of(9, 4) * 3  # repeats: lookup has matches
    ref = hf_greedy(ss.model, prompt, 40)
    # with the head off the prefill and every round (a plain step or a lookup block) are one pass through every
    # layer from the embeddings: no exit states are made (nothing would read them), no chain is drafted
    split, spans = ss.split, []
    run_layers = split.run_layers

    def spy(h, start, end, *a, **kw):
        spans.append((start, end))
        return run_layers(h, start, end, *a, **kw)

    split.run_layers = spy
    steps = []  # a round with nothing drafted is a plain step's one compiled call (split.step)
    one_call = split.step
    split.step = lambda *a, **k: steps.append(a[1]) or one_call(*a, **k)
    ss.engine.drafter.propose_chains = None  # calling it would raise
    assert not ss.engine.drafter.reads_final_states
    try:
        out = ss.generate(prompt, max_new_tokens=40, ignore_eos=True)
    finally:
        del split.run_layers, split.step, ss.engine.drafter.propose_chains
    assert out.token_ids == ref and out.stats.draft_depths == {} and out.stats.lookup_steps > 0
    assert len(steps) == out.stats.steps - out.stats.lookup_steps > 0
    L = split.num_layers
    assert set(spans) == {(0, L)}  # the prefill's pass too: it keeps no exit states (Engine.capture_depth)
    ss.set_draft(DraftConfig(head="lm", exit_layer=1, explore=True))
    assert not ss.engine.drafter.lookup_only and not ss.draft_config.lookup_only
    assert ss.generate(prompt, max_new_tokens=40, ignore_eos=True).token_ids == ref


def test_lookup_only_never_runs_the_head():
    """lookup_only: the head stays off even where the calibration would let it draft; lossless; lookup=0 refused."""
    ss = SelfSpec(tiny_model("llama"), tiny_tokenizer(), DraftConfig(head="lm", exit_layer=1, gamma=2, policy="fixed"))
    assert not ss.engine.drafter.lookup_only
    prompt = prompt_of(7, 4) * 3  # repeats: lookup has matches
    ref = hf_greedy(ss.model, prompt, 40)
    ss.set_draft(DraftConfig(head="lm", exit_layer=1, gamma=2, policy="fixed", lookup_only=True))
    assert ss.engine.drafter.lookup_only
    out = ss.generate(prompt, max_new_tokens=40, ignore_eos=True)
    assert out.token_ids == ref and out.stats.draft_depths == {} and out.stats.lookup_steps > 0
    before = ss.draft_config
    with pytest.raises(InvalidConfigError, match="lookup_only"):
        ss.set_draft(DraftConfig(head="lm", exit_layer=1, lookup=0, lookup_only=True))
    assert ss.draft_config == before and ss.generate(prompt, max_new_tokens=40, ignore_eos=True).token_ids == ref


def test_tune_command_prints_the_calibration(tmp_path, capsys):
    from selfspec.cli import main

    model_dir = tmp_path / "model"
    tiny_model("llama").save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    assert main(["tune", "--model", str(model_dir), "--head", "lm", "--exit-layer", "2"]) == 0
    out = capsys.readouterr().out
    assert "chosen: exit depth 2" in out and "| 2/0 |" in out and "cache:" in out


def test_block_costs_are_made_monotone_in_the_block_size(monkeypatch):
    """A spike in a small block's timing (t(1) above t(2), as a shared CPU's noise can give) is replaced by the least
    cost of a larger block, so a plain step never looks dearer than a verification block."""
    from selfspec import costs as costs_mod

    assert costs_mod.monotone({1: 44.4, 2: 37.3, 4: 81.4, 8: 131.3, 16: 296.0}) == {
        1: 37.3, 2: 37.3, 4: 81.4, 8: 131.3, 16: 296.0}
    assert costs_mod.monotone({1: 1.0, 2: 2.0}) == {1: 1.0, 2: 2.0}  # already monotone: unchanged
    spiky = {1: 0.044, 2: 0.037, 4: 0.081}
    monkeypatch.setattr(costs_mod, "time_blocks",
                        lambda split, start, end, sizes, *a, **k: {n: spiky.get(n, 0.1) if start else 0.001 for n in sizes})
    monkeypatch.setattr(costs_mod, "time_head", lambda *a, **k: 0.002)
    ss = SelfSpec(tiny_model("llama"), tiny_tokenizer(), DraftConfig(head="lm", exit_layer=1, tune="off"))
    c = costs_mod.measure_draft_costs(ss.split, ss.head, block_sizes=(1, 2, 4))
    assert c.t_deep == {1: 0.037, 2: 0.037, 4: 0.081}
    assert c.t_plain == pytest.approx(0.038)


def test_catch_up_limit_prices_the_heads_backlog():
    """How many rows a stateful head may have to catch up on per wanted token: the calibration's predicted gain of a
    step against the measured price of one layer over one more row (Qwen 0.5B's figures: about 5)."""
    from types import SimpleNamespace

    from selfspec.drafting.setup import catch_up_limit

    costs = DraftCosts(exit_layer=0, t_shallow=0.0, t_head=0.0008, t_deep={1: 0.0167, 4: 0.0297, 16: 0.1034})
    per_row = (0.1034 - 0.0167) / 15 / 24
    limit = catch_up_limit(costs, SimpleNamespace(predicted_speedup=1.08, gamma=3), 24)
    assert limit == pytest.approx((1 - 1 / 1.08) * 0.0167 / per_row) and 4 < limit < 6
    assert catch_up_limit(costs, SimpleNamespace(predicted_speedup=1.02, gamma=1), 24) < limit / 3  # less to gain
    assert catch_up_limit(costs, None, 24) == math.inf  # no calibration: no limit
    # a calibration that found nothing paying: the head is off, or explores by the user's choice (no limit)
    assert catch_up_limit(costs, SimpleNamespace(predicted_speedup=1.0, gamma=0), 24) == math.inf


def test_a_stateful_head_does_not_draft_past_its_catch_up_limit(tmp_path):
    """A deep-context head (its own KV cache, so it runs over the whole prompt before its first draft): with a limit
    below the prompt's rows per wanted token it never drafts in that request (lookup blocks and plain steps), and
    drafts again once the limit allows; lossless both ways."""
    ss = SelfSpec(tiny_model("llama"), tiny_tokenizer(), None)
    save_head(new_head("deep", ss.split, 2), tmp_path / "head")
    ss.set_draft(DraftConfig(head=str(tmp_path / "head"), gamma=2, policy="fixed", lookup=0))
    drafter = ss.engine.drafter
    assert ss.head.stateful and drafter.catch_up_limit == math.inf  # no calibration: no limit
    prompt = prompt_of(30, 3)
    ref = hf_greedy(ss.model, prompt, 12)
    drafter.catch_up_limit = (len(prompt) - 1) / 12  # the prompt's backlog is above it for every round
    out = ss.generate(prompt, max_new_tokens=12, ignore_eos=True)
    assert out.token_ids == ref and sum(out.stats.proposed_per_position) == 0
    drafter.catch_up_limit = 2 * len(prompt)
    out = ss.generate(prompt, max_new_tokens=12, ignore_eos=True)
    assert out.token_ids == ref and sum(out.stats.proposed_per_position) > 0


def test_a_head_the_calibration_turns_off_keeps_no_weights_until_run(tmp_path):
    """A head from a directory that the calibration turns off (a random model's exit never pays) drops its matrices
    at setup (``ExitHead.unload``): requests stay lossless and leave it so; running it afterwards (a cost
    benchmark, a new calibration) loads them again from the directory, giving a fresh load's logits."""
    from selfspec.quant.convert import quantize_model

    ss = SelfSpec(quantize_model(tiny_model("llama"), "Q4_0"), tiny_tokenizer(), None)
    save_head(new_head("deep", ss.split, 2), tmp_path / "head")
    ss.set_draft(DraftConfig(head=str(tmp_path / "head")))
    head, drafter = ss.head, ss.engine.drafter
    assert ss.tuning_result.gamma == 0 and drafter.lookup_only
    assert head.unloaded and head.fuse.weight.numel() == 0 and not head._packed and head._fast is None
    prompt = prompt_of(9, 4) * 3
    assert ss.generate(prompt, max_new_tokens=NEW).token_ids == hf_greedy(ss.model, prompt, NEW)
    assert head.unloaded  # (the drafter never ran it)
    fresh = load_head(tmp_path / "head", ss.split)
    fresh.release_float()
    h, ctx = torch.randn(1, 3, ss.split.hidden_size), torch.randn(1, 3, ss.split.hidden_size)
    pos = torch.arange(3)[None]
    with torch.inference_mode():
        got = head(h, pos, head.new_state(8), ctx)
        want = fresh(h, pos, fresh.new_state(8), ctx)
    assert not head.unloaded and head.released == fresh.released
    assert torch.equal(got, want)
