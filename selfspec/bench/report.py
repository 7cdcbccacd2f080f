"""Spec-Bench results: read answer files, summarize per group, render tables and a bar chart, compare
two runs, and explain divergences from the baseline.

Definitions (Spec-Bench's): per question, tokens/s = new tokens / wall time (all turns summed);
per group, speedup = mean tokens/s of the method / mean tokens/s of the baseline (a ratio of means),
reported next to the median per-question ratio. Mean accepted length (MAL) = tokens emitted per
target verification step, bonus included, pooled over every step of the group (plain decoding: 1.0).
Only questions answered by every method of the run are counted, so all methods see the same set.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from selfspec.bench.pareto import agreement_metrics, format_agreement, plot_exit_layers, plot_pareto
from selfspec.costs import DraftCosts
from selfspec.errors import InvalidConfigError

GROUPS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
SELFSPEC_KINDS = ("selfspec",)


def group_of(question_id: int, category: str) -> str:
    """Spec-Bench's reporting group: MT-bench (ids 81-160, eight categories) or the category itself."""
    if category in MT_BENCH_CATEGORIES or 81 <= question_id <= 160:
        return "mt_bench"
    return category


# ---- reading ---------------------------------------------------------------------------------
def read_answers(path: Path, repair: bool = False) -> dict[int, dict]:
    """question_id -> answer record. A torn last line (a run killed mid-write) is ignored, and with
    ``repair`` cut from the file; any other bad line is an error naming the line."""
    data = path.read_bytes() if path.exists() else b""
    lines = data.split(b"\n")
    tail = lines.pop()  # the text after the last newline: b"" for a well-formed file
    out: dict[int, dict] = {}
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            out.setdefault(int(rec["question_id"]), rec)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise InvalidConfigError(f"{path}, line {i}: not an answer record ({e})") from e
    if tail.strip():
        try:
            rec = json.loads(tail)
            out.setdefault(int(rec["question_id"]), rec)
            fix = b"\n"  # complete record, only its newline missing
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            fix = None
        if repair:
            with open(path, "r+b") as f:
                if fix is None:
                    f.truncate(len(data) - len(tail))
                else:
                    f.seek(0, 2)
                    f.write(fix)
    return out


@dataclass
class Run:
    """A run directory: manifest.json, answers/<method>.jsonl, divergences.json."""

    path: Path
    manifest: dict[str, Any]
    answers: dict[str, dict[int, dict]]
    divergences: list[dict] = field(default_factory=list)

    def kind(self, method: str) -> str:
        info = self.manifest.get("methods", {}).get(method)
        if info:
            return info["kind"]
        return method if method in ("hf", "plain") or method.startswith("hf-") else "selfspec"


def load_run(path: str | Path) -> Run:
    path = Path(path)
    folder = path / "answers"
    if not folder.is_dir():
        raise InvalidConfigError(f"'{path}' is not a bench run directory (no answers/ folder)")
    manifest = json.loads((path / "manifest.json").read_text()) if (path / "manifest.json").is_file() else {}
    order = list(manifest.get("method_order", []))
    names = order + sorted(p.stem for p in folder.glob("*.jsonl") if p.stem not in order)
    answers = {n: read_answers(folder / f"{n}.jsonl") for n in names if (folder / f"{n}.jsonl").is_file()}
    div = path / "divergences.json"
    divergences = json.loads(div.read_text()) if div.is_file() else []
    return Run(path, manifest, answers, divergences)


# ---- per question and per group ------------------------------------------------------------
def _choice(rec: dict) -> dict:
    return rec["choices"][0]


def question_tps(rec: dict) -> float:
    c = _choice(rec)
    wall = sum(c["wall_time"])
    return sum(c["new_tokens"]) / wall if wall > 0 else 0.0


def prefill_seconds(rec: dict) -> list[float] | None:
    """Each turn's seconds of prompt forward and first token: the record's ``prefill_time`` (selfspec methods), else
    llama.cpp's own ``prompt_ms``; None when a turn's is unknown (transformers' generate, older runs)."""
    c = _choice(rec)
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
    c = _choice(rec)
    secs = sum(w - p for w, p in zip(c["wall_time"], pre))
    toks = sum(max(0, n - 1) for n in c["new_tokens"])
    return toks / secs if secs > 0 else None


def steps_and_tokens(rec: dict) -> tuple[int, int]:
    """(verification steps, tokens they emitted) of one answer: from accept_lengths when recorded,
    else decoding_steps with new_tokens - 1 (the prefill's token is not a step's)."""
    c = _choice(rec)
    steps = tokens = 0
    for t in range(len(c["new_tokens"])):
        acc = (c.get("accept_lengths") or [[]] * len(c["new_tokens"]))[t] or []
        if acc:
            steps, tokens = steps + len(acc), tokens + sum(acc)
        elif c["decoding_steps"][t]:
            steps, tokens = steps + c["decoding_steps"][t], tokens + c["new_tokens"][t] - 1
    return steps, tokens


def same_tokens(a: dict, b: dict) -> bool:
    ca, cb = _choice(a), _choice(b)
    if "token_ids" in ca and "token_ids" in cb:
        return ca["token_ids"] == cb["token_ids"]
    return ca["turns"] == cb["turns"]


def round_mix(recs: list[dict], steps: int) -> dict[str, Any] | None:
    """Where a method's verification steps came from: shares of lookup blocks (of them, the token store's, with
    its drafts' acceptance), early-exit drafts (and their exit depths, e.g. the depth bandit's picks), blank steps
    (the head ran, its first draft refused) and plain steps (the head did not run); None without records."""
    turns = [t for r in recs for t in (_choice(r).get("rounds") or []) if t is not None]
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
            "store": store / steps,
            "store_acceptance": sum(t.get("store_accepted", 0) for t in turns) / proposed if proposed else None,
            "depths": {d: n / head for d, n in sorted(depths.items(), key=lambda kv: int(kv[0]))} if head else {}}


def method_metrics(run: Run, method: str, qids: list[int], baseline: str | None) -> dict[str, Any]:
    recs = [run.answers[method][q] for q in qids]
    tps = [question_tps(r) for r in recs]
    out: dict[str, Any] = {
        "questions": len(recs),
        "new_tokens": sum(sum(_choice(r)["new_tokens"]) for r in recs),
        "wall_time": sum(sum(_choice(r)["wall_time"]) for r in recs),
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
    drafted = [sum(x or 0 for x in _choice(r).get("draft_tokens") or []) for r in recs]
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
        ids = _choice(base[q]).get("token_ids")
        if ids is None:
            return None
        turns += [(q, t, repeated_share(tids) > REPEAT_SHARE, len(tids)) for t, tids in enumerate(ids)]
    if not turns:
        return None

    def tps(method: str, sel: list[tuple[int, int]]) -> float:
        cs = [(_choice(run.answers[method][q]), t) for q, t in sel]
        secs = sum(c["wall_time"][t] for c, t in cs)
        return sum(c["new_tokens"][t] for c, t in cs) / secs if secs > 0 else 0.0

    sets = {key: [(q, t) for q, t, r, _ in turns if r == flag] for key, flag in (("repeating", True), ("other", False))}
    base_tps = {key: tps(baseline, sel) if sel else 0.0 for key, sel in sets.items()}
    speedup = {m: {key: tps(m, sel) / base_tps[key] if base_tps[key] > 0 else None for key, sel in sets.items()}
               for m in run.answers}
    tokens = sum(n for *_, n in turns)
    return {"ngram": REPEAT_NGRAM, "threshold": REPEAT_SHARE, "turns": len(turns), "repeating_turns": len(sets["repeating"]),
            "repeating_token_share": sum(n for *_, r, n in turns if r) / tokens if tokens else 0.0, "speedup": speedup}


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


def divergence_summary(divergences: list[dict], methods: list[str]) -> dict[str, dict]:
    out = {}
    for m in methods:
        ds = [d for d in divergences if d["method"] == m]
        if ds:
            out[m] = {"answers": len(ds), "near_ties": sum(d["near_tie"] for d in ds),
                      "max_margin": max(d["margin"] for d in ds),
                      "not_near_ties": [d for d in ds if not d["near_tie"]]}
    return out


# ---- rendering --------------------------------------------------------------------------------
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


def plot_speedup(summary: dict[str, Any], path: Path) -> Path | None:
    """A grouped bar chart of speedup by group and method (Agg canvas, no display needed)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    groups = summary["groups"]
    methods = [m for m in summary["methods"] if m != summary["baseline"]]
    if not summary["baseline"] or not methods or not groups:
        return None
    names = list(groups)
    width = 0.8 / len(methods)
    fig = Figure(figsize=(max(6.0, 1.2 * len(names) + 0.25 * len(methods) * len(names)) + 2.5, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for i, m in enumerate(methods):
        xs = [j + (i - (len(methods) - 1) / 2) * width for j in range(len(names))]
        bars = ax.bar(xs, [groups[g][m].get("speedup") or 0.0 for g in names], width, label=m)
        ax.bar_label(bars, fmt="%.2f", fontsize=6, padding=1)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel(f"speedup vs {summary['baseline']} (ratio of mean tokens/s)")
    ax.set_title(f"Spec-Bench, {summary['questions']} questions")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    # The legend sits outside the axes: a tight bounding box keeps it whole at any method count.
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path


def write_report(run_dir: str | Path, baseline: str | None = None) -> str:
    """Re-render summary.json, summary.md and speedup.png of a run directory; returns the markdown."""
    run = load_run(run_dir)
    summary = summarize(run, baseline)
    text = format_summary(summary)
    (run.path / "summary.json").write_text(json.dumps(summary, indent=2))
    (run.path / "summary.md").write_text(text + "\n")
    plot_speedup(summary, run.path / "speedup.png")
    if any("mean_exit_layer" in s for s in summary["groups"].get("overall", {}).values()):
        plot_pareto(summary, run.path / "pareto.png")
        layers = next((m.get("info", {}).get("num_layers") for m in run.manifest.get("methods", {}).values()
                       if m.get("info", {}).get("num_layers")), 30)
        plot_exit_layers(run.answers, layers, run.path / "exit_layers.png")
    return text


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


# ---- divergences ------------------------------------------------------------------------------
def first_difference(ref: dict, rec: dict) -> tuple[int, int] | None:
    """(turn, position) of the first token where rec differs from ref, or None if identical."""
    for t, (x, y) in enumerate(zip(_choice(ref)["token_ids"], _choice(rec)["token_ids"])):
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
            ref, got = _choice(base[qid])["token_ids"][turn], _choice(recs[qid])["token_ids"][turn]
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
