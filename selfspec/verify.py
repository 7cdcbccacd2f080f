"""Pure accept/reject functions for speculative decoding (batch first; the engine uses batch 1).

Vocabulary (see METHODS.md): the draft proposes tokens d_1..d_g; *accepted* tokens are the prefix
the target agrees with; at the first rejection the target emits a *recovered* token; when all g are
accepted it emits a *bonus* token from its distribution after d_g. Either way a step emits
``num_accepted + 1`` tokens.

Worked example (greedy, g = 3): drafts [5, 9, 2]; target argmax per position [5, 9, 7, 4]
(position i is the target's choice after the pending token and d_1..d_i):
    5 == 5 accept, 9 == 9 accept, 2 != 7 reject -> num_accepted = 2, next_token = 7 (recovered)
    output [5, 9, 7]. Had the drafts been [5, 9, 7]: all accepted, next_token = 4 (bonus).

Ragged drafts: ``num_draft`` ``# [batch]`` says how many draft positions of each row are real;
the rest is padding and is never accepted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class VerifyResult:
    num_accepted: torch.Tensor  # [batch] long
    next_token: torch.Tensor  # [batch] long: recovered (after a rejection) or bonus token
    draft_tokens: torch.Tensor  # [batch, gamma]

    def output_tokens(self, i: int) -> list[int]:
        m = int(self.num_accepted[i])
        return self.draft_tokens[i, :m].tolist() + [int(self.next_token[i])]


def _valid(draft_tokens: torch.Tensor, num_draft: torch.Tensor | None) -> torch.Tensor:  # [batch, gamma] bool
    b, g = draft_tokens.shape
    if num_draft is None:
        return torch.ones(b, g, dtype=torch.bool, device=draft_tokens.device)
    return torch.arange(g, device=draft_tokens.device)[None, :] < num_draft[:, None]


def _first_false(ok: torch.Tensor) -> torch.Tensor:  # ok [batch, gamma] -> [batch] length of the all-true prefix
    return ok.long().cumprod(dim=1).sum(dim=1)


def greedy_verify(
    draft_tokens: torch.Tensor,  # [batch, gamma]
    target_logits: torch.Tensor,  # [batch, gamma + 1, vocab]
    num_draft: torch.Tensor | None = None,  # [batch]
) -> VerifyResult:
    """Accept the longest prefix equal to the target's argmax; next = target argmax right after it."""
    target_ids = target_logits.argmax(-1)  # [batch, gamma + 1]
    g = draft_tokens.shape[1]
    ok = (draft_tokens == target_ids[:, :g]) & _valid(draft_tokens, num_draft)
    m = _first_false(ok)
    nxt = target_ids.gather(1, m[:, None]).squeeze(1)
    return VerifyResult(m, nxt, draft_tokens)


def speculative_verify(
    draft_tokens: torch.Tensor,  # [batch, gamma]
    draft_probs: torch.Tensor,  # [batch, gamma, vocab]  q, the distributions the drafts were drawn from
    target_probs: torch.Tensor,  # [batch, gamma + 1, vocab]  p, processed like q
    generator: torch.Generator | None,
    num_draft: torch.Tensor | None = None,  # [batch]
) -> VerifyResult:
    """Speculative sampling (Leviathan et al., 2023; Chen et al., 2023): accept d_i with probability
    min(1, p_i(d_i) / q_i(d_i)); at the first rejection draw the recovered token from
    normalize(max(0, p_i - q_i)); after full acceptance draw the bonus from p_g. The output has
    exactly the target's distribution, for any q (one-hot greedy drafts included)."""
    b, g = draft_tokens.shape
    p_d = target_probs[:, :g].gather(2, draft_tokens[..., None]).squeeze(-1)  # [batch, gamma]
    q_d = draft_probs.gather(2, draft_tokens[..., None]).squeeze(-1)  # [batch, gamma]
    u = torch.rand(b, g, generator=generator, device=draft_tokens.device)
    ok = (u * q_d < p_d) & _valid(draft_tokens, num_draft)  # u < p/q without dividing by 0
    m = _first_false(ok)
    p_next = target_probs.gather(1, m[:, None, None].expand(-1, 1, target_probs.shape[-1])).squeeze(1)
    padded_q = torch.cat([draft_probs, draft_probs.new_zeros(b, 1, draft_probs.shape[-1])], dim=1)  # [batch, gamma + 1, vocab]
    q_next = padded_q.gather(1, m[:, None, None].expand(-1, 1, padded_q.shape[-1])).squeeze(1)
    full = m >= (num_draft if num_draft is not None else torch.full_like(m, g))
    residual = torch.where(full[:, None], p_next, (p_next - q_next).clamp_min(0))
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_next)  # p == q numerically: use p
    nxt = torch.multinomial(residual, 1, generator=generator).squeeze(1)
    return VerifyResult(m, nxt, draft_tokens)
