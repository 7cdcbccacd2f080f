"""Answers caught in a loop: a greedy answer that repeats itself, which lookup drafts copy almost for free, so a
run reports its speed on such turns apart from the others."""

from __future__ import annotations

from typing import Any

from selfspec.bench.answers import Run, choice

REPEAT_NGRAM = 16  # a token "repeats" when it closes a sequence of this many tokens its answer already held
REPEAT_SHARE = 0.2  # a turn whose baseline answer has more repeating tokens than this is counted as repeating


def repeated_share(ids: list[int], n: int = REPEAT_NGRAM) -> float:
    """Share of an answer's tokens that close an n-token sequence the answer already held (0 below n tokens). A greedy
    answer caught in a loop scores near 1; lookup drafts copy such text almost for free, so long runs report their
    speed on these turns apart (``repetition_split``)."""
    seen: set[tuple[int, ...]] = set()
    repeated = 0
    for i in range(n, len(ids) + 1):
        gram = tuple(ids[i - n:i])
        repeated += gram in seen
        seen.add(gram)
    return repeated / len(ids) if ids else 0.0


def repetition_split(run: Run, baseline: str, qids: list[int]) -> dict[str, Any] | None:
    """The turns whose baseline answer repeats itself (``repeated_share`` > REPEAT_SHARE) against the others: how many,
    their share of the baseline's tokens, and each method's speed over the baseline on each set (tokens over seconds,
    both summed over the set's turns). None when the baseline recorded no token ids."""
    base = run.answers[baseline]
    turns: list[tuple[int, int, bool, int]] = []  # (question, turn, repeating, tokens)
    for q in qids:
        ids = choice(base[q]).get("token_ids")
        if ids is None:
            return None
        turns += [(q, t, repeated_share(tids) > REPEAT_SHARE, len(tids)) for t, tids in enumerate(ids)]
    if not turns:
        return None

    def tps(method: str, sel: list[tuple[int, int]]) -> float:
        cs = [(choice(run.answers[method][q]), t) for q, t in sel]
        secs = sum(c["wall_time"][t] for c, t in cs)
        return sum(c["new_tokens"][t] for c, t in cs) / secs if secs > 0 else 0.0

    sets = {key: [(q, t) for q, t, r, _ in turns if r == flag] for key, flag in (("repeating", True), ("other", False))}
    base_tps = {key: tps(baseline, sel) if sel else 0.0 for key, sel in sets.items()}
    speedup = {m: {key: tps(m, sel) / base_tps[key] if base_tps[key] > 0 else None for key, sel in sets.items()}
               for m in run.answers}
    tokens = sum(n for *_, n in turns)
    return {"ngram": REPEAT_NGRAM, "threshold": REPEAT_SHARE, "turns": len(turns), "repeating_turns": len(sets["repeating"]),
            "repeating_token_share": sum(n for *_, r, n in turns if r) / tokens if tokens else 0.0, "speedup": speedup}
