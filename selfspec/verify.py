"""Pure accept/reject functions for speculative decoding (batch first; the engine uses batch 1).

Vocabulary (docs/ARCHITECTURE.md): the draft proposes tokens d_1..d_g; *accepted* tokens are the prefix
the target agrees with; at the first rejection the target emits a *recovered* token; when all g are
accepted it emits a *bonus* token from its distribution after d_g. Either way a step emits
``num_accepted + 1`` tokens.

Worked example (greedy, g = 3): drafts [5, 9, 2]; target argmax per position [5, 9, 7, 4]
(position i is the target's choice after the pending token and d_1..d_i):
    5 == 5 accept, 9 == 9 accept, 2 != 7 reject -> num_accepted = 2, next_token = 7 (recovered)
    output [5, 9, 7]. Had the drafts been [5, 9, 7]: all accepted, next_token = 4 (bonus).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class VerifyResult:
    num_accepted: torch.Tensor  # [batch] long
    next_token: torch.Tensor  # [batch] long: recovered (after a rejection) or bonus token
    draft_tokens: torch.Tensor  # [batch, gamma]


def _first_false(ok: torch.Tensor) -> torch.Tensor:  # ok [batch, gamma] -> [batch] length of the all-true prefix
    return ok.long().cumprod(dim=1).sum(dim=1)


def greedy_verify(
    draft_tokens: torch.Tensor,  # [batch, gamma]
    target_logits: torch.Tensor,  # [batch, gamma + 1, vocab]
) -> VerifyResult:
    """Accept the longest prefix equal to the target's argmax; next = target argmax right after it."""
    target_ids = target_logits.argmax(-1)  # [batch, gamma + 1]
    g = draft_tokens.shape[1]
    ok = draft_tokens == target_ids[:, :g]  # [batch, gamma]
    m = _first_false(ok)
    nxt = target_ids.gather(1, m[:, None]).squeeze(1)
    return VerifyResult(m, nxt, draft_tokens)


def speculative_verify(
    draft_tokens: torch.Tensor,  # [batch, gamma]
    draft_probs: torch.Tensor,  # [batch, gamma, vocab]  q, the distributions the drafts were drawn from
    target_probs: torch.Tensor,  # [batch, gamma + 1, vocab]  p, processed like q
    generator: torch.Generator | None,
) -> VerifyResult:
    """Speculative sampling (Leviathan et al., 2023; Chen et al., 2023): accept d_i with probability
    min(1, p_i(d_i) / q_i(d_i)); at the first rejection draw the recovered token from
    normalize(max(0, p_i - q_i)); after full acceptance draw the bonus from p_g. The output has
    exactly the target's distribution, for any q (one-hot greedy drafts included)."""
    b, g = draft_tokens.shape
    p_d = target_probs[:, :g].gather(2, draft_tokens[..., None]).squeeze(-1)  # [batch, gamma]
    q_d = draft_probs.gather(2, draft_tokens[..., None]).squeeze(-1)  # [batch, gamma]
    u = torch.rand(b, g, generator=generator, device=draft_tokens.device)
    ok = u * q_d < p_d  # u < p/q without dividing by 0
    m = _first_false(ok)
    p_next = target_probs.gather(1, m[:, None, None].expand(-1, 1, target_probs.shape[-1])).squeeze(1)
    padded_q = torch.cat([draft_probs, draft_probs.new_zeros(b, 1, draft_probs.shape[-1])], dim=1)  # [batch, gamma + 1, vocab]
    q_next = padded_q.gather(1, m[:, None, None].expand(-1, 1, padded_q.shape[-1])).squeeze(1)
    full = m == g  # [batch] all drafts accepted: the bonus comes from p itself
    residual = torch.where(full[:, None], p_next, (p_next - q_next).clamp_min(0))
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_next)  # p == q numerically: use p
    nxt = torch.multinomial(residual, 1, generator=generator).squeeze(1)
    return VerifyResult(m, nxt, draft_tokens)


# ---- token trees (selfspec.drafting.tree) ------------------------------------------------------
# A tree's nodes: ``parents[i]`` (-1 for the root, the pending token), ``tokens[i]``; parents come
# before children. Verification accepts a root-to-node ``path`` (node indices, root first) and
# emits its drafts plus one more token: len(path) - 1 accepted, then recovered or bonus.


def greedy_tree_verify(
    parents: list[int], tokens: list[int], target_ids: torch.Tensor,  # [nodes] the target's argmax after each node
) -> tuple[list[int], int]:
    """The longest path whose every draft equals the target's argmax after its parent; next = the
    target's argmax after the path's last node. Worked example: parents [-1, 0, 0, 1], tokens
    [x, a, b, c], target argmax [b, ., 7, .]: a != b, b == b accepted, no child of b -> path [0, 2],
    next 7 (recovered)."""
    ids = target_ids.tolist()
    best = [0] * len(tokens)  # accepted drafts below each node
    nxt_child = [-1] * len(tokens)
    for c in range(len(tokens) - 1, 0, -1):
        p = parents[c]
        if tokens[c] == ids[p] and best[c] + 1 > best[p]:
            best[p], nxt_child[p] = best[c] + 1, c
    path = [0]
    while nxt_child[path[-1]] >= 0:
        path.append(nxt_child[path[-1]])
    return path, ids[path[-1]]


def tree_sample_verify(
    parents: list[int], tokens: list[int],
    target_probs: torch.Tensor,  # [nodes, vocab] the target's (processed) distribution after each node
    generator: torch.Generator | None,
) -> tuple[list[int], int]:
    """Multi-candidate speculative sampling (SpecInfer, Miao et al., 2024) for deterministic drafts: at a
    node whose target distribution is p, try its children in order; child token t is accepted with
    probability p(t) (its draft is one-hot, so min(1, p/q) = p(t)); after a rejection p loses t and is
    renormalized, and the next child is tried against it. When no child is accepted the next token is
    drawn from what is left of p. Every step is an exact rejection sampler, so the output has exactly
    the target's distribution."""
    path = [0]
    while True:
        node = path[-1]
        p = target_probs[node]
        chosen = -1
        for c in (c for c, q in enumerate(parents) if q == node):
            t = tokens[c]
            u = float(torch.rand((), generator=generator, device=p.device))
            if u < float(p[t]):
                chosen = c
                break
            p = p.clone()
            p[t] = 0.0
            mass = p.sum()
            if mass <= 0:  # p was one-hot on t and t was still rejected: numerically impossible
                p = target_probs[node]
                break
            p = p / mass
        if chosen < 0:
            return path, int(torch.multinomial(p, 1, generator=generator))
        path.append(chosen)
