"""Spec-Bench results summarized: per question and per group, over the questions every method of a run answered.

Definitions (Spec-Bench's): per question, tokens/s = new tokens / wall time (all turns summed);
per group, speedup = mean tokens/s of the method / mean tokens/s of the baseline (a ratio of means),
reported next to the median per-question ratio. Mean accepted length (MAL) = tokens emitted per
target verification step, bonus included, pooled over every step of the group (plain decoding: 1.0).
Only questions answered by every method of the run are counted, so all methods see the same set.
"""

from __future__ import annotations

import statistics
from typing import Any

from selfspec.bench.answers import Run, choice
from selfspec.bench.divergences import divergence_summary
from selfspec.bench.pareto import agreement_metrics
from selfspec.bench.questions import GROUPS, group_of
from selfspec.bench.repetition import repetition_split
from selfspec.costs import DraftCosts
from selfspec.stats import GenerationStats

SELFSPEC_KINDS = ("selfspec",)


def question_tps(rec: dict) -> float:
    c = choice(rec)
    wall = sum(c["wall_time"])
    return sum(c["new_tokens"]) / wall if wall > 0 else 0.0


def prefill_seconds(rec: dict) -> list[float] | None:
    """Each turn's seconds of prompt forward and first token: the record's ``prefill_time`` (selfspec methods), else
    llama.cpp's own ``prompt_ms``; None when a turn's is unknown (transformers' generate, older runs)."""
    c = choice(rec)
    turns = len(c["new_tokens"])
    out = []
    for own, peer in zip(c.get("prefill_time") or [None] * turns, c.get("peer") or [None] * turns):
        if own is None and peer and "prompt_ms" in peer:
            own = peer["prompt_ms"] / 1e3
        if own is None:
            return None
        out.append(own)
    return out


def question_decode_tps(rec: dict) -> float | None:
    """Tokens/s of decoding alone: the tokens after each turn's first, over the wall time after its prefill."""
    pre = prefill_seconds(rec)
    if pre is None:
        return None
    c = choice(rec)
    secs = sum(w - p for w, p in zip(c["wall_time"], pre))
    toks = sum(max(0, n - 1) for n in c["new_tokens"])
    return toks / secs if secs > 0 else None


def steps_and_tokens(rec: dict) -> tuple[int, int]:
    """(verification steps, tokens they emitted) of one answer: from accept_lengths when recorded,
    else decoding_steps with new_tokens - 1 (the prefill's token is not a step's)."""
    c = choice(rec)
    steps = tokens = 0
    for t in range(len(c["new_tokens"])):
        acc = (c.get("accept_lengths") or [[]] * len(c["new_tokens"]))[t] or []
        if acc:
            steps, tokens = steps + len(acc), tokens + sum(acc)
        elif c["decoding_steps"][t]:
            steps, tokens = steps + c["decoding_steps"][t], tokens + c["new_tokens"][t] - 1
    return steps, tokens


def same_tokens(a: dict, b: dict) -> bool:
    ca, cb = choice(a), choice(b)
    if "token_ids" in ca and "token_ids" in cb:
        return ca["token_ids"] == cb["token_ids"]
    return ca["turns"] == cb["turns"]


def round_mix(recs: list[dict], steps: int) -> dict[str, Any] | None:
    """Where a method's verification steps came from: shares of lookup blocks (of them, the token store's, with
    its drafts' acceptance), early-exit drafts (and their exit depths, e.g. the depth bandit's picks), blank steps
    (the head ran, its first draft refused) and plain steps (the head did not run); None without records."""
    turns = [t for r in recs for t in (choice(r).get("rounds") or []) if t is not None]
    if not turns or not steps:
        return None
    lookup = sum(t["lookup"] for t in turns)
    depths: dict[str, int] = {}
    for t in turns:
        for d, n in t["depths"].items():
            depths[d] = depths.get(d, 0) + n
    head = sum(depths.values())
    store, proposed = sum(t.get("store", 0) for t in turns), sum(t.get("store_proposed", 0) for t in turns)
    blank = sum(t.get("blank", 0) for t in turns)  # answer records without a 'blank' count have none
    return {"lookup": lookup / steps, "head": head / steps, "plain": max(0.0, 1.0 - (lookup + head + blank) / steps),
            "blank": blank / steps,
            "head_acceptance": head_acceptance(turns),
            "store": store / steps,
            "store_acceptance": sum(t.get("store_accepted", 0) for t in turns) / proposed if proposed else None,
            "depths": {d: n / head for d, n in sorted(depths.items(), key=lambda kv: int(kv[0]))} if head else {}}


def head_acceptance(turns: list[dict]) -> list[float]:
    """The head's drafts accepted per chain position, pooled over ``turns`` as GenerationStats.merge pools them:
    entry i is the share of rounds that drafted at least i + 1 tokens whose first i + 1 drafts were all accepted
    ([] without records)."""
    total = GenerationStats()
    for t in turns:
        total.merge(GenerationStats(proposed_per_position=list(t.get("head_proposed", [])),
                                    accepted_per_position=list(t.get("head_accepted", []))))
    return total.acceptance_rate_per_position


def method_metrics(run: Run, method: str, qids: list[int], baseline: str | None) -> dict[str, Any]:
    recs = [run.answers[method][q] for q in qids]
    tps = [question_tps(r) for r in recs]
    out: dict[str, Any] = {
        "questions": len(recs),
        "new_tokens": sum(sum(choice(r)["new_tokens"]) for r in recs),
        "wall_time": sum(sum(choice(r)["wall_time"]) for r in recs),
        "tokens_per_s": statistics.mean(tps) if tps else 0.0,
    }
    st = [steps_and_tokens(r) for r in recs]
    steps, toks = sum(s for s, _ in st), sum(t for _, t in st)
    out["mal"] = toks / steps if steps else None
    if baseline is not None and baseline in run.answers:
        base = [run.answers[baseline][q] for q in qids]
        btps = statistics.mean(question_tps(b) for b in base) if base else 0.0
        ratios = [t / question_tps(b) for t, b in zip(tps, base) if question_tps(b) > 0]
        out["speedup"] = out["tokens_per_s"] / btps if btps > 0 else None
        out["median_ratio"] = statistics.median(ratios) if ratios else None
        out["identical"] = sum(same_tokens(r, b) for r, b in zip(recs, base))
        dec = [x for x in (question_decode_tps(r) for r in recs) if x is not None]
        bdec = [x for x in (question_decode_tps(b) for b in base) if x is not None]
        if dec and len(dec) == len(bdec) == len(recs):  # every question's prefill known, on both sides
            out["decode_tokens_per_s"] = statistics.mean(dec)
            out["decode_speedup"] = out["decode_tokens_per_s"] / statistics.mean(bdec)
        out.update(agreement_metrics(recs, base))
    mix = round_mix(recs, steps)
    if mix is not None:
        out["rounds"] = mix
    info = run.manifest.get("methods", {}).get(method, {}).get("info", {})
    drafted = [sum(x or 0 for x in choice(r).get("draft_tokens") or []) for r in recs]
    if run.kind(method) in SELFSPEC_KINDS and "exit_layer" in info and steps and out["mal"]:
        c = info["exit_layer"] / info["num_layers"]
        d = sum(drafted) / steps  # draft tokens per step
        out["drafts_per_step"] = d
        if "costs" in info:  # measured on the running machine (selfspec.costs): real block costs, heads included
            costs = info["costs"]
            dc = DraftCosts(costs["exit_layer"], costs["t_shallow"], costs["t_head"],
                            {int(n): t for n, t in costs["t_deep"].items()})
            step = (d + 1) * dc.t_shallow + d * dc.t_head + dc.deep(max(1, round(d + 1)))
            out["bound"] = out["mal"] * dc.t_plain / step
        else:
            # Leviathan et al.'s ideal, c = k/L: a step is d + 1 shallow passes (pending token + drafts) and
            # one deep pass over d + 1 positions, counted as one token's; exit heads free
            out["bound"] = out["mal"] / (d * c + 1)
    return out


def summarize(run: Run, baseline: str | None = None) -> dict[str, Any]:
    """{"groups": {group: {method: metrics}}, ...} over the questions every method answered."""
    baseline = baseline or run.manifest.get("baseline", "hf")
    methods = list(run.answers)
    common = set.intersection(*(set(a) for a in run.answers.values())) if methods else set()
    some = next(iter(run.answers.values()), {})
    by_group: dict[str, list[int]] = {}
    for q in sorted(common):
        by_group.setdefault(group_of(q, some[q]["category"]), []).append(q)
    order = [g for g in GROUPS if g in by_group] + sorted(g for g in by_group if g not in GROUPS)
    groups = {g: by_group[g] for g in order}
    groups["overall"] = sorted(common)
    base = baseline if baseline in run.answers else None
    summary = {g: {m: method_metrics(run, m, qids, base) for m in methods} for g, qids in groups.items()}
    lossy = [m for m in methods if run.manifest.get("methods", {}).get(m, {}).get("info", {}).get("lossy")]
    return {"baseline": base, "methods": methods, "questions": len(common), "groups": summary, "lossy": lossy,
            "divergences": divergence_summary([d for d in run.divergences if d["question_id"] in common], methods),
            "repetition": repetition_split(run, base, sorted(common)) if base else None}
