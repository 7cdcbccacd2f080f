"""A run's report (``selfspec bench report``): ``summary.json``, ``summary.md`` (selfspec.bench.tables) and the
speedup chart ``speedup.png`` rendered again from the run's answer files; SpecEE runs add ``pareto.png`` and
``exit_layers.png`` (selfspec.bench.pareto)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from selfspec.bench.answers import load_run
from selfspec.bench.pareto import plot_exit_layers, plot_pareto
from selfspec.bench.summary import summarize
from selfspec.bench.tables import format_summary


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
