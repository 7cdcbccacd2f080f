"""Divergences from the baseline: where an answer first differs from the baseline's token for token, and the
target's top-2 logit margin there (a near-tie can flip with the matmul shapes; a large margin points to a bug)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from selfspec.bench.answers import choice


def divergence_summary(divergences: list[dict], methods: list[str]) -> dict[str, dict]:
    out = {}
    for m in methods:
        ds = [d for d in divergences if d["method"] == m]
        if ds:
            out[m] = {"answers": len(ds), "near_ties": sum(d["near_tie"] for d in ds),
                      "max_margin": max(d["margin"] for d in ds),
                      "not_near_ties": [d for d in ds if not d["near_tie"]]}
    return out


def first_difference(ref: dict, rec: dict) -> tuple[int, int] | None:
    """(turn, position) of the first token where rec differs from ref, or None if identical."""
    for t, (x, y) in enumerate(zip(choice(ref)["token_ids"], choice(rec)["token_ids"])):
        if x != y:
            pos = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
            return t, pos
    return None


def compute_divergences(ss: Any, prompt_ids: Callable[[int, int], list[int]], answers: dict[str, dict[int, dict]],
                        baseline: str, near_tie: float = 1e-3, known: list[dict] | None = None) -> list[dict]:
    """For every answer not token-identical to the baseline's: where it first differs, and the target's
    top-2 logit margin there, from one forward of the model over the prompt + the baseline's tokens up
    to that point (``prompt_ids(question_id, turn)`` gives the turn's prompt). A near-tie (margin <=
    near_tie * max(1, |top-1 logit|)) can flip with the matmul shapes: it is not a bug."""
    import torch

    cache = {(d["method"], d["question_id"], d["turn"], d["position"]): d for d in known or []}
    base = answers.get(baseline, {})
    out = []
    for method, recs in answers.items():
        if method == baseline:
            continue
        for qid in sorted(set(recs) & set(base)):
            where = first_difference(base[qid], recs[qid])
            if where is None:
                continue
            turn, pos = where
            if (method, qid, turn, pos) in cache:
                out.append(cache[(method, qid, turn, pos)])
                continue
            ref, got = choice(base[qid])["token_ids"][turn], choice(recs[qid])["token_ids"][turn]
            ids = prompt_ids(qid, turn) + ref[:pos]
            with torch.inference_mode():
                x = torch.tensor([ids], dtype=torch.long, device=ss.split.device)
                logits = ss.model(x, logits_to_keep=1).logits[0, -1].float()
            top = torch.topk(logits, 2)
            t1, t2 = float(top.values[0]), float(top.values[1])
            b_tok = ref[pos] if pos < len(ref) else None
            m_tok = got[pos] if pos < len(got) else None
            entry = {"method": method, "question_id": qid, "category": recs[qid]["category"], "turn": turn,
                     "position": pos, "baseline_token": b_tok, "method_token": m_tok,
                     "top1_token": int(top.indices[0]), "top2_token": int(top.indices[1]),
                     "top1_logit": t1, "margin": t1 - t2, "margin_rel": (t1 - t2) / max(abs(t1), 1e-12),
                     "near_tie": (t1 - t2) <= near_tie * max(1.0, abs(t1))}
            if b_tok is not None and m_tok is not None:
                entry["token_gap"] = float(logits[b_tok] - logits[m_tok])  # baseline's token over the method's
            out.append(entry)
    return out
