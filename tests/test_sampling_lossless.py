"""Speculative sampling keeps the target's distribution exactly (statistical tests on a small vocabulary).

Each test draws many independent verification rounds at once (the batch dimension of the pure
``speculative_verify``), reads the first two output tokens of every round, and compares their joint
empirical distribution with the exact target distribution p_1(x) * p_2(y) by total-variation
distance. The bound is calibrated so that plain sampling from p passes and deliberately wrong samplers
fail, which shows the test can fail.
"""

from __future__ import annotations

import torch

from selfspec.sampling import logits_to_probs
from selfspec.verify import speculative_verify

V, G, N = 6, 3, 200_000  # vocabulary, draft tokens per round, rounds
BOUND = 0.01  # TV distance; sampling noise at N rounds over V*V cells is ~0.004


def _dists(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # position t of the output has target p[t] and draft q[t] (independent of history here, so the
    # exact joint of the first two output tokens is p[0] x p[1])
    p = torch.softmax(torch.randn(G + 2, V, generator=g) * 1.5, -1)  # [gamma + 2, vocab] target
    q = torch.softmax(torch.randn(G + 1, V, generator=g) * 1.5, -1)  # [gamma + 1, vocab] draft
    return p, q


def _first_two(draft_tokens, m, nxt) -> torch.Tensor:  # -> [N, 2] the first two output tokens
    out = torch.cat([draft_tokens, torch.zeros_like(nxt)[:, None]], dim=1)
    out.scatter_(1, m[:, None], nxt[:, None])  # position m holds the recovered / bonus token
    out[:, 1] = torch.where(m >= 1, out[:, 1], torch.full_like(m, -1))  # -1: the round emitted one token
    return out[:, :2]


def _tv(pairs: torch.Tensor, p: torch.Tensor) -> float:
    exact = (p[0][:, None] * p[1][None, :]).flatten()
    counts = torch.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V).float() / pairs.shape[0]
    return 0.5 * float((counts - exact).abs().sum())


def _round(p, q, t: int, n: int, one_hot: bool, g, wrong: str | None) -> tuple[torch.Tensor, ...]:
    """One verification round starting at output position t, for n independent rows."""
    pt, qt = p[t : t + G + 1], q[t : t + G]  # [gamma + 1, vocab], [gamma, vocab]
    if one_hot:  # greedy drafts: q is one-hot at the draft's argmax
        drafts = qt.argmax(-1).expand(n, G).clone()
        qt = torch.nn.functional.one_hot(qt.argmax(-1), V).float()
    else:
        drafts = torch.multinomial(qt, n, replacement=True, generator=g).T.contiguous()  # [n, gamma]
    if wrong == "accept-all":
        return drafts, torch.full((n,), G), torch.multinomial(pt[G], n, replacement=True, generator=g)
    res = speculative_verify(drafts, qt.expand(n, G, V), pt.expand(n, G + 1, V), g)
    m, nxt = res.num_accepted, res.next_token
    if wrong == "resample-from-p":  # rejection ok, but recovered token drawn from p, not max(0, p - q)
        fix = torch.multinomial(pt, n, replacement=True, generator=g).T  # [n, gamma + 1]
        nxt = torch.where(m < G, fix.gather(1, m[:, None]).squeeze(1), nxt)
    return drafts, m, nxt


def _speculative(p, q, one_hot: bool, seed: int, wrong: str | None = None) -> torch.Tensor:
    """First two output tokens of N generations: rounds whose first round emitted one token (a
    rejection at draft 1) continue with a second round from position 1."""
    g = torch.Generator().manual_seed(seed)
    pairs = _first_two(*_round(p, q, 0, N, one_hot, g, wrong))
    short = (pairs[:, 1] < 0).nonzero().squeeze(1)
    if len(short):
        d2, m2, n2 = _round(p, q, 1, len(short), one_hot, g, wrong)
        pairs[short, 1] = _first_two(d2, m2, n2)[:, 0]
    return pairs


def test_plain_sampling_passes_the_bound():
    p, _ = _dists(0)
    g = torch.Generator().manual_seed(1)
    pairs = torch.stack([torch.multinomial(p[i], N, replacement=True, generator=g) for i in (0, 1)], dim=1)
    assert _tv(pairs, p) < BOUND


def test_speculative_sampling_full_draft_distribution():
    for seed in (0, 1, 2):
        p, q = _dists(seed)
        assert _tv(_speculative(p, q, one_hot=False, seed=10 + seed), p) < BOUND


def test_speculative_sampling_greedy_one_hot_drafts():
    for seed in (0, 3):
        p, q = _dists(seed)
        assert _tv(_speculative(p, q, one_hot=True, seed=20 + seed), p) < BOUND


def test_wrong_samplers_fail_the_bound():
    p, q = _dists(0)
    assert _tv(_speculative(p, q, one_hot=False, seed=5, wrong="accept-all"), p) > 5 * BOUND
    assert _tv(_speculative(p, q, one_hot=False, seed=6, wrong="resample-from-p"), p) > 3 * BOUND


def test_processing_is_applied_identically():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0, 0.0]])
    probs = logits_to_probs(logits, temperature=0.7, top_k=3, top_p=0.9)
    assert torch.allclose(probs.sum(-1), torch.ones(1))
    assert (probs[0, 3:] == 0).all()  # top-k cut
    assert torch.equal(logits_to_probs(logits, 0.0), torch.nn.functional.one_hot(torch.tensor([0]), 6).float())
