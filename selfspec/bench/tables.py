"""The Markdown tables of a run's summary (selfspec.bench.summary): speedups by group, one table per group, steps
by draft source, repeating turns, agreement and divergences; and two runs compared."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from selfspec.bench.answers import load_run
from selfspec.bench.pareto import format_agreement
from selfspec.bench.summary import summarize


def _f(x: Any, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def format_summary(summary: dict[str, Any]) -> str:
    """Markdown: speedup overview (methods x groups), then one table per group, then divergences."""
    groups, base = summary["groups"], summary["baseline"]
    names = list(groups)
    lines = [f"Questions answered by every method: {summary['questions']}; baseline: {base or '(none)'}", "",
             "Speedup vs baseline (ratio of mean tokens/s):", "",
             "| method | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for m in summary["methods"]:
        lines.append(f"| {m} | " + " | ".join(_f(groups[g][m].get("speedup")) for g in names) + " |")
    decoding = [m for m in summary["methods"] if any("decode_speedup" in groups[g][m] for g in names)]
    if decoding:  # the same answers, the prompt's forward taken out of every method's time
        lines += ["", "Decoding alone, prefill excluded (ratio of mean tokens/s after each turn's first token):", "",
                  "| method | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        for m in decoding:
            lines.append(f"| {m} | " + " | ".join(_f(groups[g][m].get("decode_speedup")) for g in names) + " |")
    for g in names:
        n = next(iter(groups[g].values()))["questions"] if groups[g] else 0
        lines += ["", f"### {g} ({n} questions)", "",
                  "| method | tok/s | speedup | median ratio | MAL | bound | identical to baseline |",
                  "|---|---|---|---|---|---|---|"]
        for m, s in groups[g].items():
            ident = f"{s['identical']}/{s['questions']}" if "identical" in s else "-"
            lines.append(f"| {m} | {s['tokens_per_s']:.2f} | {_f(s.get('speedup'))} | {_f(s.get('median_ratio'))} "
                         f"| {_f(s['mal'])} | {_f(s.get('bound'))} | {ident} |")
    lines += format_rounds(summary)
    lines += format_repetition(summary)
    lines += format_agreement(summary)
    if summary.get("divergences"):
        lines += ["", "Divergences from the baseline (first differing token; target's top-2 logit margin there):",
                  "", "| method | answers | near-ties | largest margin |", "|---|---|---|---|"]
        for m, d in summary["divergences"].items():
            lines.append(f"| {m} | {d['answers']} | {d['near_ties']} | {d['max_margin']:.2e} |")
        lossy = set(summary.get("lossy", []))
        if lossy:
            lines += ["", f"Lossy by design (their divergences are expected): {', '.join(sorted(lossy))}"]
        real = [x for m, d in summary["divergences"].items() if m not in lossy for x in d["not_near_ties"]]
        if real:
            lines += ["", "Not near-ties (a margin this large should not flip: look for a bug):", "",
                      "| method | question | turn | position | margin | token gap |", "|---|---|---|---|---|---|"]
            lines += [f"| {x['method']} | {x['question_id']} | {x['turn']} | {x['position']} | {x['margin']:.2e} | "
                      f"{_f(x.get('token_gap'), '.2e')} |" for x in real[:50]]
    return "\n".join(lines)


def format_rounds(summary: dict[str, Any]) -> list[str]:
    """Overall shares of each method's steps by draft source (lookup, early exit by depth, none)."""
    overall = summary["groups"].get("overall", {})
    rows = [(m, s["rounds"]) for m, s in overall.items() if s.get("rounds")]
    if not rows:
        return []
    lines = ["", "Steps by draft source (overall): lookup block, early-exit draft (share of those per exit depth), "
             "blank (the head ran, the confidence stop refused its draft), plain step (the head did not run):", "",
             "| method | lookup | early exit | exit depths | blank | plain |", "|---|---|---|---|---|---|"]
    for m, r in rows:
        depths = ", ".join(f"{d}: {x:.0%}" for d, x in r["depths"].items()) or "-"
        lines.append(f"| {m} | {r['lookup']:.0%} | {r['head']:.0%} | {depths} | {r['blank']:.0%} | "
                     f"{r['plain']:.0%} |")
    return lines + format_head_acceptance(summary)


def format_head_acceptance(summary: dict[str, Any]) -> list[str]:
    """Per group, the head's drafts accepted at chain positions 1 and 2 (both drafts accepted at 2)."""
    groups = summary["groups"]
    acc = {m: [(groups[g].get(m, {}).get("rounds") or {}).get("head_acceptance") or [] for g in groups]
           for m in summary["methods"]}
    methods = [m for m, per_group in acc.items() if any(per_group)]
    if not methods:
        return []
    lines = ["", "Head drafts accepted at chain positions 1 / 2 (position 2: both drafts accepted, of the rounds that "
             "drafted two):", "", "| method | " + " | ".join(groups) + " |", "|---" * (len(groups) + 1) + "|"]
    for m in methods:
        cells = [" / ".join(f"{x:.2f}" for x in a[:2]) or "-" for a in acc[m]]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return lines


def format_repetition(summary: dict[str, Any]) -> list[str]:
    """The repeating turns apart (``repetition_split``): shown only when some turn repeats."""
    r = summary.get("repetition")
    if not r or not r["repeating_turns"]:
        return []
    lines = ["", f"Turns whose baseline answer repeats itself (over {r['threshold']:.0%} of its tokens close a "
                 f"{r['ngram']}-token sequence it already held: a greedy loop, which lookup copies almost for free): "
                 f"{r['repeating_turns']} of {r['turns']}, {r['repeating_token_share']:.0%} of the baseline's tokens. "
                 "Speed over the baseline on those turns and on the rest (tokens over seconds, summed over the turns):",
             "", "| method | repeating turns | other turns |", "|---|---|---|"]
    lines += [f"| {m} | {_f(x['repeating'])} | {_f(x['other'])} |" for m, x in r["speedup"].items()]
    return lines


def compare_runs(run_a: str | Path, run_b: str | Path, baseline: str | None = None) -> str:
    """Markdown: speedup, tokens/s and MAL of the methods both runs have, per group, A vs B."""
    a, b = summarize(load_run(run_a), baseline), summarize(load_run(run_b), baseline)
    lines = [f"A = {run_a} ({a['questions']} questions), B = {run_b} ({b['questions']} questions)", "",
             "| group | method | speedup A | speedup B | tok/s A | tok/s B | B/A tok/s | MAL A | MAL B |",
             "|---|---|---|---|---|---|---|---|---|"]
    for g in a["groups"]:
        for m in a["groups"][g]:
            sb = b["groups"].get(g, {}).get(m)
            if sb is None:
                continue
            sa = a["groups"][g][m]
            ratio = sb["tokens_per_s"] / sa["tokens_per_s"] if sa["tokens_per_s"] else None
            lines.append(f"| {g} | {m} | {_f(sa.get('speedup'))} | {_f(sb.get('speedup'))} | {sa['tokens_per_s']:.2f} "
                         f"| {sb['tokens_per_s']:.2f} | {_f(ratio)} | {_f(sa['mal'])} | {_f(sb['mal'])} |")
    return "\n".join(lines)
