"""The predictor's input: a few candidate tokens' logits at an intermediate layer, computed from only
their rows of the LM head (a few dot products, not the whole vocabulary).

Features of one token at one layer, for c candidates (c = 4 by default), sorted by the candidate
logits at this layer (so the predictor never depends on where a candidate came from):

    logits  # [c]  final_norm(h_i) . W_lm[cand]      (soft-capped as the model's own logits)
    probs   # [c]  softmax over the candidates only
    delta   # [c]  probs - probs at the last checked layer (zeros at the first check)
    draft   # [c]  the exit head's own probability of each candidate (over the whole vocabulary): how sure
                   the cheap source was (an addition to the published features; it is already computed)

Worked example, c = 2, candidates [17, 5]: at layer 10 logits [3.0, 4.0] -> sorted [4.0, 3.0], probs
[0.73, 0.27]; if layer 8 had probs [0.5, 0.5] (same token order), delta [0.23, -0.23]; draft probs
[0.6, 0.1] -> sorted [0.1, 0.6]. The exit token at
layer 10 would be 5, the best candidate.
"""

from __future__ import annotations

import math

import torch


def num_features(candidates: int) -> int:
    return 4 * candidates


def candidate_logits(
    split,  # selfspec.models.split.SplitModel
    h: torch.Tensor,  # [n, hidden] states after some layers (before the final norm)
    cands: torch.Tensor,  # [n, c] candidate token ids
) -> torch.Tensor:  # [n, c] float32, equal to split.logits(h)[..., cands]
    x = split.final_norm(h)
    rows = split.lm_rows(cands.reshape(-1)).view(*cands.shape, -1)  # [n, c, hidden]
    out = torch.einsum("nh,nch->nc", x.to(rows.dtype), rows).float()
    if split.softcap is not None:
        out = torch.tanh(out / split.softcap) * split.softcap
    return out


def candidate_features(
    logits: torch.Tensor,  # [n, c] candidate logits at this layer
    prev_probs: torch.Tensor | None,  # [n, c] candidate probs at the last checked layer (same order), or None
    draft_probs: torch.Tensor,  # [n, c] the exit head's probability of each candidate
) -> tuple[torch.Tensor, torch.Tensor]:  # features [n, 4c] (sorted by logit), probs [n, c] (candidate order)
    probs = torch.softmax(logits, dim=-1)
    delta = probs - prev_probs if prev_probs is not None else torch.zeros_like(probs)
    order = logits.argsort(dim=-1, descending=True)
    parts = (logits, probs, delta, draft_probs.to(logits.dtype))
    feats = torch.cat([x.gather(-1, order) for x in parts], dim=-1)
    return feats, probs


class CandidateScorer:
    """The candidate logits of one token at any layer, cheaply (the decoding path; ``candidate_logits``
    is the batched reference). The final norm's weight is folded into the candidates' LM-head rows once
    per token, so each layer costs one mean of squares and one [c, hidden] x [hidden] product:

        logits = rsqrt(mean(h^2) + eps) * (W_lm[cand] * w_norm) . h
    """

    def __init__(self, norm_weight: torch.Tensor, eps: float, lm_rows: torch.Tensor,
                 softcap: float | None) -> None:  # lm_rows [c, hidden]: the candidates' LM-head rows
        self.rows = (lm_rows.float() * norm_weight.float()).contiguous()  # [c, hidden]
        self.eps, self.softcap = eps, softcap

    def __call__(self, h: torch.Tensor) -> list[float]:  # h [hidden] -> c logits
        x = h.float()
        r = torch.rsqrt(x.dot(x) / x.shape[0] + self.eps)
        out = (torch.mv(self.rows, x) * r).tolist()
        if self.softcap is not None:
            out = [math.tanh(v / self.softcap) * self.softcap for v in out]
        return out


def features_list(logits: list[float], prev_probs: list[float] | None,
                  draft_probs: list[float]) -> tuple[list[float], list[float]]:
    """``candidate_features`` for one token in plain Python (c is tiny: no tensor ops)."""
    m = max(logits)
    e = [math.exp(v - m) for v in logits]
    s = sum(e)
    probs = [v / s for v in e]
    delta = [a - b for a, b in zip(probs, prev_probs)] if prev_probs is not None else [0.0] * len(probs)
    order = sorted(range(len(logits)), key=lambda i: -logits[i])
    feats = [x[i] for x in (logits, probs, delta, draft_probs) for i in order]
    return feats, probs
