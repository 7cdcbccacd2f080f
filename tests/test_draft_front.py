"""A greedy round's first draft in one compiled call (``DeepContextHead.draft_or_step``): the pending token's exit
state, the deep head over its backlog and that state, the draft's confidence against the policy's bar, and when the
draft is refused (a blank round) the rest of the pending token's plain step. Bit for bit the Python path's states,
drafts and verdicts; declined wherever it does not apply."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import ARCHS, hf_greedy
from test_deep_head import deep_ss
from test_engine_equality import NEW, prompt_of

from selfspec.drafting.chain import Chain
from selfspec.drafting.policies import ConfidencePolicy, FixedPolicy, ThompsonPolicy, make_policy
from selfspec.sampling import greedy

pytestmark = pytest.mark.usefixtures("one_thread")

FRONT_ARCHS = [a for a in ARCHS if a != "gemma3_text"]  # Gemma 3 has no one-call plan (scaled embedding, sandwich norms)


def trimmed(arch: str, k: int, quantize: str | None = "Q4_0", seed: int = 1):
    """A deep head at exit layer ``k`` drafting a trimmed vocabulary (what its compiled calls need), prepared."""
    ss, head = deep_ss(arch, k, quantize=quantize, seed=seed)
    head.trim_vocab(torch.arange(0, ss.split.vocab_size, 2))
    head.prepare()
    return ss, head


@pytest.mark.parametrize("arch", FRONT_ARCHS)
@pytest.mark.parametrize("quantize", [None, "Q4_0"])
@pytest.mark.parametrize("k", [0, 2])
def test_draft_or_step_is_the_python_path_bit_for_bit(arch, quantize, k):
    """Drafted (bar -inf) and blank (bar +inf), with and without a backlog: the exit state, f^, the confidence, the
    draft or the target's next token and final state, and every key, value and length of the target's and the head's
    caches equal the Python path's (layers [0, k), ``draft_step``, softmax and argmax, layers [k, L) and
    ``greedy_ids``). A drafted call leaves layers [k, L) of the target's cache as they were."""
    ss, head = trimmed(arch, k, quantize)
    with torch.inference_mode():
        compare_one_call(ss.split, head, k)


def compare_one_call(split, head, k: int) -> None:
    hidden, L = split.hidden_size, split.num_layers
    g = torch.Generator().manual_seed(7)
    prompt = torch.tensor([prompt_of(6, 3)])
    for bar in (-math.inf, math.inf):
        for b in (0, 3):
            caches = [split.new_cache(32), split.new_cache(32)]
            for cache in caches:
                split.forward_all(prompt, torch.arange(6)[None], cache)
            states = [head.new_state(32), head.new_state(32)]
            backlog = torch.randn(1, b, hidden, generator=g)
            ctx = torch.randn(1, b + 1, hidden, generator=g)
            pos_h = torch.arange(2, 3 + b)[None]
            seen = torch.randn(1, 2, hidden, generator=g), torch.randn(1, 2, hidden, generator=g)
            for s in states:  # the head has seen positions 0, 1
                head.draft_step(*seen, torch.arange(2)[None], s)
            tok, p = 11, 6
            front = head.draft_or_step(tok, p, caches[0], k, backlog, ctx, pos_h, states[0], bar)
            assert front is not None
            cache = caches[1]
            pos = torch.arange(p, p + 1)[None]
            h = split.run_layers(split.embed(torch.tensor([[tok]])), 0, k, pos, cache)
            f_hat, logits, ids = head.draft_step(torch.cat([backlog, h], 1), ctx, pos_h, states[1])
            conf = float(torch.softmax(logits, -1).max())
            assert torch.equal(front.exit_state, h) and torch.equal(front.f_hat, f_hat) and front.confidence == conf
            if bar < 0:
                assert front.drafted and front.final is None and front.token == int(ids[int(greedy(logits))])
            else:
                final = split.run_layers(h, k, L, pos, cache)
                assert not front.drafted and torch.equal(front.final, final)
                assert front.token == int(split.greedy_ids(final)[0, -1])
            assert caches[0].lengths == cache.lengths
            assert caches[0].lengths == ([p + 1] * k + [p] * (L - k) if bar < 0 else [p + 1] * L)
            for got, want in ((caches[0], cache), (states[0], states[1])):
                for a, c in ((got.keys, want.keys), (got.values, want.values)):
                    assert all(torch.equal(x[:, :, :n], y[:, :, :n]) for x, y, n in zip(a, c, want.lengths))
            assert states[0].lengths == states[1].lengths


def count_fronts(monkeypatch) -> dict[str, int]:
    """Counts of ``Chain.first_draft`` calls that drafted, that ended blank (with the verdict), and of rounds that
    drafted nothing in one call (``Chain.plain_step``: ``SplitModel.step`` with a tap)."""
    counts = {"drafted": 0, "blank": 0, "nothing": 0}

    def spy_on(name: str) -> None:
        real = getattr(Chain, name)

        def spy(self):
            n = len(self.states)
            real(self)
            if len(self.states) > n:
                counts["nothing" if self.max_drafts < 1 else "blank" if self.verdict is not None else "drafted"] += 1

        monkeypatch.setattr(Chain, name, spy)

    spy_on("plain_step")
    spy_on("first_draft")
    return counts


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3"])
@pytest.mark.parametrize("k", [0, 2])
def test_rounds_through_the_one_call_are_the_rounds_in_parts(arch, k, monkeypatch):
    """The engine's greedy rounds with the first draft in one call, drafted and blank ones both, give the tokens,
    drafts, acceptances and blank rounds of the same rounds in parts (``front_ready`` off), and transformers' greedy;
    with lookup blocks in between (a backlog for the head to catch up on)."""
    counts = count_fronts(monkeypatch)
    prompt = prompt_of(9, 11) + [5, 6, 7, 5, 6, 7, 5, 6]
    for lookup in (0, 4):
        ss, head = trimmed(arch, k)
        ss.engine.drafter.sources.lookup = lookup
        ref = hf_greedy(ss.model, prompt, NEW)
        confs: list[float] = []
        real = head.draft_or_step

        def record(*args, real=real, confs=confs):
            front = real(*args)
            confs.append(front.confidence)
            return front

        head.draft_or_step = record
        ss.engine.drafter.policy = FixedPolicy()
        assert ss.generate(prompt, max_new_tokens=NEW).token_ids == ref
        del head.draft_or_step
        bar = sorted(confs)[len(confs) // 2]  # about half the first drafts refused
        runs = []
        for one_call in (True, False):
            ss.engine.drafter.policy = ConfidencePolicy(bar)
            if not one_call:
                head.front_ready = lambda rows: False
            out = ss.generate(prompt, max_new_tokens=NEW)
            assert out.token_ids == ref, (lookup, one_call)
            s = out.stats
            runs.append((s.proposed_per_position, s.accepted_per_position, s.blank_steps, s.lookup_steps))
            if not one_call:
                del head.front_ready
        assert runs[0] == runs[1], lookup
        assert runs[0][2] > 0 and sum(runs[0][0]) > 0
    assert counts["drafted"] > 0 and counts["blank"] > 0


def test_the_one_call_is_declined_where_it_does_not_apply(monkeypatch):
    """No one-call front for: a sampled request, a policy whose first decision is not a confidence bar (a go_on of its
    own), a nested head, more than 16 rows, gradients on, Gemma 3's layers. Output stays lossless throughout."""
    counts = count_fronts(monkeypatch)
    ss, head = trimmed("llama", 0)
    prompt = prompt_of(9, 11)

    class Own(FixedPolicy):
        def go_on(self, index: int, top1_prob: float) -> bool:
            return index % 2 == 0

    ss.engine.drafter.policy = Own()
    assert ss.generate(prompt, max_new_tokens=NEW).token_ids == hf_greedy(ss.model, prompt, NEW)
    ss.engine.drafter.policy = FixedPolicy()
    ss.generate(prompt, max_new_tokens=NEW, temperature=0.8, seed=1)
    assert counts["drafted"] == counts["blank"] == 0  # (a last round with no room for a draft is one call still)
    ss.generate(prompt, max_new_tokens=NEW)
    assert counts["drafted"] > 0
    with torch.inference_mode():
        assert head.front_ready(16) and not head.front_ready(17)
    with torch.enable_grad():
        assert not head.front_ready(1)
    nested, nhead = deep_ss("llama", 1, quantize="Q4_0")
    from selfspec.heads.io import new_head

    nested_head = new_head("nested", nested.split, 1, depths=[1, 2])
    assert not nested_head.front_ready(1)
    _, ghead = trimmed("gemma3_text", 0)
    with torch.inference_mode():
        assert not ghead.front_ready(1)


def test_first_bar_is_exactly_go_on_at_the_first_draft():
    """Each policy's ``first_bar``: go_on(0, c) == (c >= bar) for every confidence; -inf drafts on at all; None where
    go_on is a subclass's own; Thompson's (with a draft cap) and the cost-aware base's are their base's."""
    from selfspec.costs import DraftCosts

    costs = DraftCosts(0, 0.0, 0.001, {1: 0.01, 2: 0.012, 4: 0.016})
    policies = [FixedPolicy(), ConfidencePolicy(0.4), make_policy("confidence", 0.9)]
    for base in (FixedPolicy(), ConfidencePolicy(0.3)):
        t = ThompsonPolicy(base, costs, prior=0.9).for_request(0)
        while t.max_drafts(3) == 0:
            pass
        policies.append(t)
    for policy in policies:
        bar = policy.first_bar()
        assert bar is not None
        for c in (0.0, 0.1, 0.3, 0.2999, 0.4, 0.9, 1.0):
            assert policy.go_on(0, c) == (c >= bar), (policy, c)
    assert FixedPolicy().first_bar() == -math.inf

    class Own(ConfidencePolicy):
        def go_on(self, index: int, top1_prob: float) -> bool:
            return True

    assert Own(0.5).first_bar() is None


def test_a_blank_round_with_the_one_call_pays_the_head_not_the_round_overhead():
    """The economics price a blank round at a plain step plus the head, plus the round's measured overhead only
    where the head has no one-call front (``DraftCosts.blank_overhead``, ``tuning.for_head``): in the Thompson
    policy's expected speed and in the calibration's replay."""
    from dataclasses import replace

    from selfspec.calibration import simulate
    from selfspec.costs import DraftCosts, speedup_with_blanks
    from selfspec.tuning import for_head

    costs = DraftCosts(0, 0.0, 0.001, {1: 0.010, 2: 0.013, 4: 0.018}, t_round=0.002)
    free = replace(costs, blank_overhead=False)
    assert costs.blank_cost() == pytest.approx(0.013) and free.blank_cost() == pytest.approx(0.011)
    assert speedup_with_blanks(free, [0.8], 1, 0.3) > speedup_with_blanks(costs, [0.8], 1, 0.3)
    assert speedup_with_blanks(free, [0.8], 1, 1.0) == speedup_with_blanks(costs, [0.8], 1, 1.0)
    rounds = [([0.1, 0.9], 1), ([0.9, 0.9], 2)]  # one refused at the first draft, one drafted
    assert simulate(free, rounds, 0.5, 2) > simulate(costs, rounds, 0.5, 2)
    assert DraftCosts.from_dict(free.to_dict()) == free and DraftCosts.from_dict(costs.to_dict()) == costs
    _, head = trimmed("llama", 0)
    assert not for_head(costs, head).blank_overhead
    _, untrimmed = deep_ss("llama", 0, quantize="Q4_0")
    assert for_head(costs, untrimmed).blank_overhead  # no drafted vocabulary: no one-call draft


@pytest.mark.parametrize("arch", FRONT_ARCHS)
@pytest.mark.parametrize("quantize", [None, "Q4_0"])
@pytest.mark.parametrize("k", [0, 2])
def test_a_step_with_a_tap_is_the_round_in_parts_bit_for_bit(arch, quantize, k):
    """A round that drafts nothing in one call (``SplitModel.step`` tapping layer k): the exit state, the final state, the
    next token and every key, value and length of the cache equal the parts' (layers [0, k), then [k, L) over that
    state and ``greedy_ids``)."""
    ss, _ = trimmed(arch, k, quantize)
    split, L = ss.split, ss.split.num_layers
    prompt = torch.tensor([prompt_of(6, 3)])
    with torch.inference_mode():
        caches = [split.new_cache(32), split.new_cache(32)]
        for cache in caches:
            split.forward_all(prompt, torch.arange(6)[None], cache)
        tok, p = 11, 6
        found = split.step(tok, p, caches[0], taps=(k,))
        assert found is not None
        pos = torch.arange(p, p + 1)[None]
        h = split.run_layers(split.embed(torch.tensor([[tok]])), 0, k, pos, caches[1])
        final = split.run_layers(h, k, L, pos, caches[1])
        assert torch.equal(found.tapped[0], h) and torch.equal(found.final, final)
        assert found.token == int(split.greedy_ids(final)[0, -1])
        assert caches[0].lengths == caches[1].lengths == [p + 1] * L
        for a, c in ((caches[0].keys, caches[1].keys), (caches[0].values, caches[1].values)):
            assert all(torch.equal(x[:, :, : p + 1], y[:, :, : p + 1]) for x, y in zip(a, c))
        with pytest.raises(IndexError, match="out of range"):
            split.step(tok, p + 1, caches[0], taps=(L + 1,))


class EveryOther(FixedPolicy):
    """Two drafts every other round, none in the others (rounds that draft nothing among drafting ones)."""

    def __init__(self) -> None:
        self.rounds = 0

    def max_drafts(self, gamma: int) -> int:
        self.rounds += 1
        return 2 if self.rounds % 2 else 0


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("k", [0, 2])
def test_rounds_that_draft_nothing_in_one_call_are_the_rounds_in_parts(arch, k):
    """Greedy rounds with no draft through ``step`` with a tap give the tokens, drafts, acceptances and the head's
    later drafts of the same rounds in parts (the call switched off), and transformers' greedy."""
    prompt = prompt_of(9, 11) + [5, 6, 7, 5, 6, 7, 5, 6]
    ss, _ = trimmed(arch, k)
    split = ss.split
    ref = hf_greedy(ss.model, prompt, NEW)
    runs, calls = [], []
    real = split.step
    for one_call in (True, False):
        ss.engine.drafter.policy = EveryOther()
        split.step = ((lambda *a, **kw: calls.append(1) or real(*a, **kw)) if one_call
                      else (lambda *a, **kw: None if kw.get("taps") else real(*a, **kw)))
        out = ss.generate(prompt, max_new_tokens=NEW)
        del split.step
        assert out.token_ids == ref, one_call
        s = out.stats
        runs.append((s.proposed_per_position, s.accepted_per_position, s.accept_lengths))
    assert runs[0] == runs[1]
    assert calls and sum(runs[0][0]) > 0
