"""Agreement with the full model, for lossy methods (SpecEE's ``specee``), and the Pareto view.

A lossless method agrees with the baseline (transformers' greedy generate) token for token. A lossy one
is measured three ways, over the same questions:

    token agreement   share of the baseline's tokens matched at the same position (per turn; once an
                      answer diverges it rarely re-aligns, so this is strict)
    math answers      math_reasoning questions whose last number in the answer equals the baseline's
    exit agreement    share of early exits whose token equals what the full model computes for the same
                      prefix (the engine learns it for free when an exited token's layers are completed)

The Pareto view plots speedup against token agreement, lossless methods at 1.0.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> str | None:
    found = NUMBER.findall(text)
    return found[-1].replace(",", "").rstrip(".") if found else None


def _choice(rec: dict) -> dict:
    return rec["choices"][0]


def token_agreement(rec: dict, base: dict) -> tuple[int, int]:
    """(tokens equal at the same position, baseline tokens) over every turn."""
    a, b = _choice(rec).get("token_ids"), _choice(base).get("token_ids")
    if a is None or b is None:
        return 0, 0
    same = sum(x == y for ta, tb in zip(a, b) for x, y in zip(ta, tb))
    return same, sum(len(t) for t in b)


def agreement_metrics(recs: list[dict], base: list[dict]) -> dict[str, Any]:
    pairs = [token_agreement(r, b) for r, b in zip(recs, base)]
    same, total = sum(p[0] for p in pairs), sum(p[1] for p in pairs)
    out: dict[str, Any] = {"token_agreement": same / total if total else None}
    math = [(r, b) for r, b in zip(recs, base) if r.get("category") == "math_reasoning"]
    if math:
        out["math_answers_same"] = sum(final_number(" ".join(_choice(r)["turns"])) ==
                                       final_number(" ".join(_choice(b)["turns"])) for r, b in math)
        out["math_questions"] = len(math)
    stats = [s for r in recs for s in (_choice(r).get("specee") or []) if s]
    if stats:
        layers = [e for s in stats for e in s["exit_layers"]]
        tokens = sum(sum(_choice(r)["new_tokens"]) for r in recs)
        compared = sum(s["exit_compared"] for s in stats)
        out["mean_exit_layer"] = sum(layers) / len(layers) if layers else None
        out["predictor_ms_per_token"] = 1000 * sum(s["predictor_time"] for s in stats) / max(1, tokens)
        out["checks_per_token"] = sum(s["predictor_checks"] for s in stats) / max(1, tokens)
        out["exit_agreement"] = sum(s["exit_agreed"] for s in stats) / compared if compared else None
    return out


def format_agreement(summary: dict[str, Any]) -> list[str]:
    """Markdown lines: the agreement table of every method, overall (empty when nothing is lossy)."""
    overall = summary["groups"].get("overall", {})
    if not any("mean_exit_layer" in s or (s.get("token_agreement") or 1.0) < 1.0 for s in overall.values()):
        return []
    math = summary["groups"].get("math_reasoning", {})
    lines = ["", "Agreement with the baseline and SpecEE exits (overall):", "",
             "| method | speedup | token agreement | math answers same | mean exit layer | exit agreement "
             "| predictor checks / token | predictor ms / token |", "|---|---|---|---|---|---|---|---|"]
    for m, s in overall.items():
        ms = math.get(m, {})
        mq = f"{ms['math_answers_same']}/{ms['math_questions']}" if "math_questions" in ms else "-"
        lines.append(f"| {m} | {_f(s.get('speedup'))} | {_f(s.get('token_agreement'), '.3f')} | {mq} "
                     f"| {_f(s.get('mean_exit_layer'), '.1f')} | {_f(s.get('exit_agreement'), '.3f')} "
                     f"| {_f(s.get('checks_per_token'), '.1f')} | {_f(s.get('predictor_ms_per_token'), '.2f')} |")
    return lines


def _f(x: Any, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def plot_pareto(summary: dict[str, Any], path: Path) -> Path | None:
    """Speedup vs token agreement (overall), one point per method."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    overall = summary["groups"].get("overall", {})
    pts = [(m, s.get("token_agreement"), s.get("speedup")) for m, s in overall.items()
           if s.get("token_agreement") is not None and s.get("speedup") is not None]
    if not pts:
        return None
    fig = Figure(figsize=(7.5, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for m, a, s in pts:
        ax.scatter([a], [s], color="tab:red" if a < 0.999 else "tab:blue")
        ax.annotate(m, (a, s), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel(f"token agreement with {summary['baseline']} (lossless = 1)")
    ax.set_ylabel(f"speedup vs {summary['baseline']}")
    ax.set_title(f"Spec-Bench, {summary['questions']} questions: speed vs agreement")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def plot_exit_layers(answers: dict[str, dict[int, dict]], num_layers: int, path: Path) -> Path | None:
    """Histogram of the layers SpecEE methods exited at (num_layers: ran every layer)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    series = {}
    for m, recs in answers.items():
        layers = [e for r in recs.values() for s in (_choice(r).get("specee") or []) if s for e in s["exit_layers"]]
        if layers:
            series[m] = layers
    if not series:
        return None
    fig = Figure(figsize=(8, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    bins = [b - 0.5 for b in range(num_layers + 2)]
    for m, layers in series.items():
        ax.hist(layers, bins=bins, histtype="step", density=True, label=m, linewidth=1.2)
    ax.set_xlabel(f"exit layer ({num_layers}: no exit, every layer ran)")
    ax.set_ylabel("share of tokens (lossy) / draft tokens (verified)")
    ax.set_title("SpecEE exit-layer distribution on Spec-Bench")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path
