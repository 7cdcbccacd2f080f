"""Token trees end to end: tree drafting is lossless under greedy decoding on every tiny architecture
(deep and untrained heads, with and without lookup branches), a perfect draft is accepted whole, the
pure tree verifiers pick the right path, and tree sampling keeps the target's distribution."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHS, LAYERS, hf_greedy, tiny_model
from test_deep_head import deep_ss
from test_engine_equality import NEW, prompt_of

from selfspec import DraftConfig, SelfSpec
from selfspec.drafting.tree import TokenTree
from selfspec.verify import greedy_tree_verify, tree_sample_verify

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("arch", ARCHS)
def test_tree_drafting_is_lossless(arch):
    drafted = accepted = 0
    for width, lookup in ((2, 0), (3, 4)):
        ss, _ = deep_ss(arch, 2, gamma=4, lookup=lookup)
        ss.engine.tree_width = width
        for plen in (1, 9):
            prompt = prompt_of(plen, plen) * (2 if lookup else 1)
            out = ss.generate(prompt, max_new_tokens=NEW)
            assert out.token_ids == hf_greedy(ss.model, prompt, NEW), (width, lookup, plen)
            assert out.stats.new_tokens == NEW
            drafted += sum(out.stats.proposed_per_position)
            accepted += sum(out.stats.accepted_per_position)
    assert 0 < accepted < drafted
    # the untrained exit (a stateless head) drafts trees too
    ss = SelfSpec(tiny_model(arch), None)
    ss.set_draft(DraftConfig(exit_layer=1, head="lm", gamma=3, tree_width=3, lookup=0))
    prompt = prompt_of(5, 2)
    assert ss.generate(prompt, max_new_tokens=NEW).token_ids == hf_greedy(ss.model, prompt, NEW)


def test_perfect_draft_tree_is_accepted_whole():
    """Drafting with all layers (k = L, the target's own head) makes the best branch the target's choice:
    every round accepts the full depth, which fails if the tree mask or positions are wrong."""
    ss = SelfSpec(tiny_model("llama"), None)
    ss.set_draft(DraftConfig(exit_layer=LAYERS, head="lm", gamma=3, policy="fixed", tree_width=2, lookup=0))
    prompt = prompt_of(6, 1)
    out = ss.generate(prompt, max_new_tokens=NEW + 1)
    assert out.token_ids == hf_greedy(ss.model, prompt, NEW + 1)
    assert out.stats.accept_lengths[:-1] == [4] * (len(out.stats.accept_lengths) - 1)


def test_greedy_tree_verify_takes_the_longest_agreeing_path():
    # nodes: 0 root, 1 'a', 2 'b' (children of 0); 3 'c' child of 1; 4 'c' child of 2; 5 'd' child of 4
    parents, tokens = [-1, 0, 0, 1, 2, 4], [9, 1, 2, 3, 3, 4]
    target = torch.tensor([2, 3, 3, 0, 4, 7])  # the target's argmax after each node
    assert greedy_tree_verify(parents, tokens, target) == ([0, 2, 4, 5], 7)  # bonus after the leaf
    target = torch.tensor([1, 5, 3, 0, 4, 7])
    assert greedy_tree_verify(parents, tokens, target) == ([0, 1], 5)  # a accepted, c rejected: recovered 5
    assert greedy_tree_verify(parents, tokens, torch.tensor([8, 0, 0, 0, 0, 0])) == ([0], 8)


def test_token_tree_trie_insert_and_attention():
    t = TokenTree.root(5)
    a = t.add(1, 0, -0.1)
    b = t.add(2, 0, -0.5)
    c = t.add(3, a, -0.2)
    assert t.insert_chain([1, 3, 4]) == [4] and t.parents[4] == c  # shares 1, 3; adds 4
    assert t.path(4) == [0, a, c, 4]
    att = t.attention([b, c], start=10)
    assert att.mask.tolist() == [[True, False, True, False], [True, True, False, True]]
    assert att.key_positions.tolist() == [10, 11, 11, 12]


V = 5
ROUNDS = 30_000
BOUND = 0.03  # TV over V * V cells; sampling noise at this many rounds is ~0.012


def _target(depth: int) -> torch.Tensor:  # the target's distribution at output position `depth`
    g = torch.Generator().manual_seed(100 + depth)
    return torch.softmax(torch.randn(V, generator=g) * 1.5, -1)


def _tree() -> TokenTree:
    t = TokenTree.root(0)  # children 1, 3 of the root; children 2, 0 of node 1; child 4 of node 2
    n1, _ = t.add(1, 0), t.add(3, 0)
    t.add(2, n1)
    t.add(0, n1)
    t.add(4, 2)
    return t


def _wrong_verify(parents, tokens, probs, g):  # forgets to remove rejected tokens from p
    keep = [0]
    while True:
        p = probs[keep[-1]]
        kids = [c for c, q in enumerate(parents) if q == keep[-1]]
        hit = next((c for c in kids if float(torch.rand((), generator=g)) < float(p[tokens[c]])), -1)
        if hit < 0:
            return keep, int(torch.multinomial(p, 1, generator=g))
        keep.append(hit)


def _joint(verify, seed: int) -> float:
    """TV distance between the first two output tokens' empirical joint and p_0 x p_1."""
    g = torch.Generator().manual_seed(seed)
    t = _tree()
    probs = torch.stack([_target(d) for d in t.depths])
    second_round = torch.stack([_target(d + 1) for d in t.depths])
    counts = torch.zeros(V, V)
    for _ in range(ROUNDS):
        keep, nxt = verify(t.parents, t.tokens, probs, g)
        out = [t.tokens[i] for i in keep[1:]] + [nxt]
        if len(out) < 2:  # one token emitted: the next round starts at output position 1
            keep2, nxt2 = verify(t.parents, t.tokens, second_round, g)
            out.append(t.tokens[keep2[1]] if len(keep2) > 1 else nxt2)
        counts[out[0], out[1]] += 1
    exact = _target(0)[:, None] * _target(1)[None, :]
    return 0.5 * float((counts / ROUNDS - exact).abs().sum())


@pytest.mark.slow
def test_tree_sampling_keeps_the_target_distribution():
    assert _joint(tree_sample_verify, 0) < BOUND
    assert _joint(_wrong_verify, 1) > 2 * BOUND  # the test can fail


def test_tree_round_cost_prices_every_node():
    from dataclasses import replace

    from selfspec.costs import DraftCosts

    chain = DraftCosts(2, t_shallow=1.0, t_head=1.0, t_deep={1: 10.0, 2: 11.0, 4: 13.0, 8: 17.0, 16: 25.0},
                       t_shallow_block={1: 1.0, 2: 1.1, 4: 1.3, 8: 1.7, 16: 2.5})
    tree = replace(chain, tree_width=3)
    assert chain.round_cost(3) == 3 * 2.0 + 1.0 + 13.0
    # 3 levels of 3 nodes: a shallow block of 3 and a head call each, then 10 nodes verified at once
    assert tree.round_cost(3) == pytest.approx(3 * (1.2 + 1.0) + 1.0 + 1.0 + (17.0 + 8.0 * 2 / 8))
    assert tree.round_cost(3) > chain.round_cost(3)


def test_tree_sampling_through_the_engine_is_seeded():
    ss, _ = deep_ss("llama", 2, gamma=3, lookup=4)
    ss.engine.tree_width = 3
    prompt = prompt_of(6, 3) * 2
    runs = [ss.generate(prompt, max_new_tokens=NEW, temperature=0.9, seed=s).token_ids for s in (7, 7, 8)]
    assert runs[0] == runs[1] and len(runs[0]) == NEW
    assert runs[0] != runs[2]


def test_tree_rounds_teach_the_policy_the_drafted_depth():
    """The policy learns from the depth each tree was drafted to, not from the accepted path's length
    (which would read as every draft accepted)."""
    ss, _ = deep_ss("llama", 2, gamma=3)
    ss.engine.tree_width = 2
    seen = []
    policy = ss.engine.drafter.policy
    inner = policy.observe
    policy.observe = lambda proposed, accepted: (seen.append((proposed, accepted)), inner(proposed, accepted))
    out = ss.generate(prompt_of(5, 9), max_new_tokens=NEW)
    assert seen and seen[0][0] == 3 and all(p <= 3 for p, _ in seen)  # the end is cut by max_new_tokens
    assert any(a < p for p, a in seen)  # with the path length as "proposed" every round would read a == p
    assert out.stats.proposed_per_position[0] == sum(p > 0 for p, _ in seen)  # stats count the same rounds


def test_a_heads_recommended_tree_width_is_the_default(tmp_path):
    """head_config.json "draft": {"tree_width": w} is what DraftConfig(tree_width=None) drafts with;
    an explicit width overrides it, and a head without a recommendation drafts chains."""
    from selfspec.heads.io import save_head

    ss, head = deep_ss("llama", 2)
    save_head(head, tmp_path / "rec", extra={"draft": {"tree_width": 2}})
    save_head(head, tmp_path / "plain")
    prompt = prompt_of(5, 4)
    ref = hf_greedy(ss.model, prompt, NEW)
    for path, width, want in (("rec", None, 2), ("rec", 0, 0), ("plain", None, 0)):
        ss.set_draft(DraftConfig(head=str(tmp_path / path), gamma=3, tree_width=width, lookup=0))
        assert ss.engine.tree_width == want and ss.draft_config.tree_width == want
        out = ss.generate(prompt, max_new_tokens=NEW)
        assert out.token_ids == ref, (path, width)
