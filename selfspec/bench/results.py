"""Kept results: one JSON file per (CPU kind, model, answer length) under ``results/<cpu>/``, and the tables and
plots the README and docs/BENCHMARKS.md show, rendered from those files alone.

    selfspec bench QUESTIONS --limit 5 --max-new-tokens 64 --out runs/sb --results results   # writes the file
    selfspec bench report results --write-docs                                              # renders the docs

A results file holds what a reader needs to trust a table: the machine (CPU kind, flags, threads), the versions
and commit, the command that produced it, every method's settings, and the run's summary (per group: tokens/s,
speedup over the baseline, median ratio, MAL, token identity; the loops apart). A rerun of the same CPU kind,
model and answer length replaces its file (the date is in the file name): a table shows the latest run, and
history lives in git.
"""

from __future__ import annotations

import json
import re
import shlex
import time
from pathlib import Path
from typing import Any

from selfspec.bench.answers import load_run
from selfspec.bench.summary import summarize
from selfspec.errors import InvalidConfigError
from selfspec.machine import cpu_info
from selfspec.paths import atomic_write_text

FORMAT = "selfspec-results/1"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
DEFAULT_METHOD = "selfspec-default"


# ---- writing -----------------------------------------------------------------------------------
def slug(text: str) -> str:
    """A file-name-safe lower-case form of a model id ('Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf' -> ...)."""
    name = Path(text).name.removesuffix(".gguf")
    return re.sub(r"[^a-z0-9.]+", "-", name.lower()).strip("-") or "model"


def record(run_dir: str | Path, command: list[str] | None = None) -> dict[str, Any]:
    """The results record of a finished bench run directory."""
    run = load_run(run_dir)
    summary = summarize(run)
    if not summary["questions"]:
        raise InvalidConfigError(f"'{run_dir}' has no question that every method answered: nothing to keep")
    m = run.manifest
    last = (m.get("sessions") or [{}])[-1]
    machine = last.get("machine", {})
    cpu = cpu_info()
    finished = last.get("finished") or time.strftime("%Y-%m-%d %H:%M:%S")
    return {
        "format": FORMAT,
        "date": finished[:10],
        "finished": finished,
        "cpu": {"name": cpu.name, "kind": cpu.kind, "family": cpu.family, "model": cpu.model,
                "describe": cpu.describe(), "amx": cpu.has_amx},
        "threads": machine.get("torch_threads"),
        "cpu_count": machine.get("cpu_count"),
        "load_average": machine.get("load_average"),
        "versions": machine.get("versions", {}),
        "git": machine.get("git", ""),
        "command": shlex.join(command) if command else None,
        "model": m.get("model", {}),
        "model_config": m.get("model_config"),
        "generate": m.get("generate", {}),
        "bench": last.get("bench", {}),
        "methods": {k: {"kind": v.get("kind"), "spec": v.get("spec"), "draft": v.get("draft"),
                        "options": v.get("options"), "failed": v.get("failed")}
                    for k, v in m.get("methods", {}).items()},
        "summary": summary,
        "vs_plain": _vs_plain(run),
    }


def _vs_plain(run: Any) -> dict[str, Any] | None:
    """Every method's overall speed over selfspec's own plain decoding (end to end, decoding alone, median ratio)."""
    plain = next((m for m in run.answers if run.kind(m) == "plain"), None)
    if plain is None:
        return None
    overall = summarize(run, plain)["groups"]["overall"]
    return {"baseline": plain, **{m: {k: o.get(k) for k in ("speedup", "decode_speedup", "median_ratio")}
                                  for m, o in overall.items()}}


def results_path(root: str | Path, rec: dict[str, Any]) -> Path:
    tokens = rec["generate"].get("max_new_tokens", 0)
    return Path(root) / rec["cpu"]["kind"] / f"{rec['date']}-{slug(rec['model'].get('model_id', ''))}-{tokens}.json"


def write_results(run_dir: str | Path, root: str | Path, command: list[str] | None = None) -> Path:
    """Write the run's results file under ``root/<cpu>/``, replacing any earlier one of the same CPU kind, model
    and answer length (written to a temporary name first: an interrupted write leaves the old file whole)."""
    rec = record(run_dir, command)
    path = results_path(root, rec)
    atomic_write_text(path, json.dumps(rec, indent=1, default=str) + "\n")
    same = path.name.removeprefix(rec["date"])  # -<model>-<tokens>.json
    for old in path.parent.glob(f"*{same}"):
        if old != path and re.fullmatch(r"\d{4}-\d{2}-\d{2}" + re.escape(same), old.name):
            old.unlink()
    return path


# ---- reading -----------------------------------------------------------------------------------
def load_results(root: str | Path) -> list[tuple[Path, dict[str, Any]]]:
    """Every results file under ``root`` (sorted by CPU kind, model, answer length); a bad file is an error."""
    root = Path(root)
    if not root.is_dir():
        raise InvalidConfigError(f"results directory '{root}' does not exist")
    out = []
    for p in sorted(root.glob("*/*.json")):
        try:
            rec = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise InvalidConfigError(f"{p}: not a results file ({e.msg})") from e
        if not isinstance(rec, dict) or rec.get("format") != FORMAT:
            raise InvalidConfigError(f"{p}: not a results file (format {rec.get('format')!r}, want {FORMAT!r})"
                                     if isinstance(rec, dict) else f"{p}: not a results file")
        out.append((p, rec))
    if not out:
        raise InvalidConfigError(f"'{root}' holds no results files (<cpu>/<date>-<model>-<tokens>.json)")
    return out


def is_results_dir(path: str | Path) -> bool:
    """A directory of results files (not a bench run directory)."""
    p = Path(path)
    return p.is_dir() and not (p / "answers").is_dir() and any(p.glob("*/*.json"))


# ---- rendering ---------------------------------------------------------------------------------
def _x(v: Any) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _kinds(rec: dict[str, Any]) -> dict[str, str]:
    return {k: v.get("kind") or "" for k, v in rec["methods"].items()}


def headline(rec: dict[str, Any]) -> dict[str, Any]:
    """The README row of one results file: each peer's overall speed over transformers' generate."""
    overall = rec["summary"]["groups"]["overall"]
    kinds = _kinds(rec)
    base = rec["summary"]["baseline"]
    plain = next((m for m, k in kinds.items() if k == "plain" and m in overall), None)
    default = DEFAULT_METHOD if DEFAULT_METHOD in overall else None
    llama = [m for m, k in kinds.items() if k == "llama-cpp" and m in overall]
    best = max(llama, key=lambda m: overall[m].get("speedup") or 0.0, default=None)
    n = rec["summary"]["questions"]

    def ident(m: str | None) -> str:
        s = overall.get(m or "", {})
        return f"{s['identical']}/{s['questions']}" if "identical" in s else "-"

    d, p = overall.get(default or "", {}), overall.get(plain or "", {})
    vs = (rec.get("vs_plain") or {}).get(default or "", {})
    return {
        "model": rec["model"].get("model_id", "?"),
        "baseline_tps": overall[base]["tokens_per_s"] if base in overall else None,
        "plain": p.get("speedup"), "default": d.get("speedup"), "mal": d.get("mal"),
        "default_over_plain": vs.get("speedup"), "default_decode_over_plain": vs.get("decode_speedup"),
        "llama": overall[best].get("speedup") if best else None, "llama_method": best,
        "default_over_llama": (d["speedup"] / overall[best]["speedup"])
        if best and d.get("speedup") and overall[best].get("speedup") else None,
        "identical": ident(default), "plain_identical": ident(plain), "llama_identical": ident(best), "questions": n,
        "failed": [m for m, v in rec["methods"].items() if v.get("failed")],
    }


def provenance(rec: dict[str, Any]) -> str:
    b = rec.get("bench", {})
    per = f"{b.get('limit')} per group" if b.get("limit") else "every question"
    return (f"{rec['cpu']['describe']}, {rec.get('threads')} threads, {rec['date']}, selfspec "
            f"{rec['versions'].get('selfspec', '?')} ({rec.get('git') or 'no commit'}); Spec-Bench {per} "
            f"({rec['summary']['questions']} questions), {rec['generate'].get('max_new_tokens')} new tokens")


def main_table(results: list[tuple[Path, dict[str, Any]]]) -> list[str]:
    """One row per results file: transformers' generate = 1.00, every other method as a ratio of its speed."""
    lines = ["| model (file) | CPU | new tokens | transformers `generate` | selfspec plain | selfspec default (MAL) "
             "| default / plain (decoding alone) | llama.cpp's best (which) | identical: default / plain / llama.cpp |",
             "|---|---|---|---|---|---|---|---|---|"]
    for _, rec in results:
        h = headline(rec)
        base = f"1.00 ({h['baseline_tps']:.1f} tok/s)" if h["baseline_tps"] else "-"
        which = (h["llama_method"] or "").removeprefix("llama-cpp").lstrip(":-").removeprefix("spec=") or "plain"
        llama = f"{_x(h['llama'])} ({which})" if h["llama_method"] else "not run"
        mal = f" ({h['mal']:.2f})" if h["mal"] else ""
        lines.append(f"| {Path(h['model']).name} | {rec['cpu']['kind']} | {rec['generate'].get('max_new_tokens')} "
                     f"| {base} | {_x(h['plain'])} | **{_x(h['default'])}**{mal} | {_x(h['default_over_plain'])} "
                     f"({_x(h['default_decode_over_plain'])}) | {llama} "
                     f"| {h['identical']} / {h['plain_identical']} / {h['llama_identical']} |")
    return lines


def commands(results: list[tuple[Path, dict[str, Any]]], root: Path) -> list[str]:
    lines = []
    for path, rec in results:
        rel = (Path(root.name) / path.relative_to(root)).as_posix()
        lines.append(f"- `{rel}`: {provenance(rec)}. Command: `{rec.get('command') or '(not recorded)'}`")
        h = headline(rec)
        if h["default_over_llama"]:
            lines.append(f"  selfspec's default is {h['default_over_llama']:.2f}x llama.cpp's best here "
                         f"({h['llama_method']}).")
        if h["failed"]:
            lines.append(f"  Did not run here: {', '.join(h['failed'])} (see the file's methods.*.failed).")
    return lines


def group_table(rec: dict[str, Any]) -> list[str]:
    """Speedup over the baseline per group (and decoding alone), MAL and identity, every method of one file."""
    groups = rec["summary"]["groups"]
    names = list(groups)
    methods = [m for m in rec["summary"]["methods"] if m != rec["summary"]["baseline"]]
    lines = ["| method | " + " | ".join(names) + " | MAL | identical |", "|---" * (len(names) + 3) + "|"]
    for m in methods:
        o = groups["overall"][m]
        ident = f"{o['identical']}/{o['questions']}" if "identical" in o else "-"
        cells = []
        for g in names:
            s = groups[g][m]
            dec = f" ({s['decode_speedup']:.2f})" if s.get("decode_speedup") else ""
            cells.append(f"{_x(s.get('speedup'))}{dec}")
        mal = f"{o['mal']:.2f}" if o.get("mal") else "-"
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {mal} | {ident} |")
    rep = rec["summary"].get("repetition")
    if rep and rep.get("repeating_turns"):
        lines += ["", f"Turns whose baseline answer loops (over {rep['threshold']:.0%} of its tokens close a "
                      f"{rep['ngram']}-token sequence it already held): {rep['repeating_turns']} of {rep['turns']}, "
                      f"{rep['repeating_token_share']:.0%} of the baseline's tokens. Speed over the baseline there / "
                      "on the other turns: " + "; ".join(f"{m} {_x(x['repeating'])} / {_x(x['other'])}"
                                                         for m, x in rep["speedup"].items()
                                                         if m != rec["summary"]["baseline"]) + "."]
    return lines


def vs_plain(rec: dict[str, Any]) -> list[str]:
    """One line: each selfspec method's overall speed over selfspec's own plain decoding."""
    vs = rec.get("vs_plain")
    if not vs:
        return []
    kinds = _kinds(rec)
    parts = [f"{m} {_x(v.get('speedup'))} end to end, {_x(v.get('decode_speedup'))} decoding alone (median ratio "
             f"{v['median_ratio']:.2f})" for m, v in vs.items()
             if m != "baseline" and kinds.get(m) == "selfspec" and v.get("speedup") and v.get("median_ratio")]
    return ["", f"Over selfspec's plain decoding ({vs['baseline']}): " + "; ".join(parts) + "."] if parts else []


def plot(results: list[tuple[Path, dict[str, Any]]], path: Path) -> Path | None:
    """Bars: each method's overall speedup over transformers' generate, one group of bars per results file."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not results:
        return None
    rows = [(f"{Path(r['model'].get('model_id', '?')).name.removesuffix('.gguf')}\n"
             f"{r['generate'].get('max_new_tokens')} tokens", headline(r)) for _, r in results]
    series = [("selfspec plain", "plain"), ("selfspec default", "default"), ("llama.cpp's best", "llama")]
    fig = Figure(figsize=(2.2 * len(rows) + 3, 4.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    width = 0.8 / len(series)
    for i, (label, key) in enumerate(series):
        xs = [j + (i - 1) * width for j in range(len(rows))]
        bars = ax.bar(xs, [h[key] or 0.0 for _, h in rows], width, label=label)
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=1)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)), [n for n, _ in rows], fontsize=8)
    ax.set_ylabel("speed over transformers' generate (x)")
    ax.set_title(f"Spec-Bench on {results[0][1]['cpu']['kind']}, {results[0][1].get('threads')} threads")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def render(root: str | Path, full: bool = True) -> str:
    """Markdown for every CPU kind under ``root``: the main table, where each row comes from, and (``full``)
    each file's per-group table and a plot (written beside the files as ``<cpu>/speedup.png``)."""
    root = Path(root)
    results = load_results(root)
    by_cpu: dict[str, list[tuple[Path, dict[str, Any]]]] = {}
    for p, r in results:
        by_cpu.setdefault(r["cpu"]["kind"], []).append((p, r))
    lines: list[str] = []
    if not full:
        lines += main_table(results) + [""] + commands(results, root)
        return "\n".join(lines)
    for kind, recs in by_cpu.items():
        lines += [f"### {kind}", ""] + main_table(recs) + [""] + commands(recs, root) + [""]
        png = plot(recs, root / kind / "speedup.png")
        if png is not None:
            lines += [f"![speed over transformers' generate on {kind}](../{root.name}/{kind}/speedup.png)", ""]
        for p, r in recs:
            lines += [f"#### {Path(r['model'].get('model_id', '?')).name}, {r['generate'].get('max_new_tokens')} new "
                      f"tokens ({p.name})", "", "Speed over transformers' generate per group, end to end (decoding "
                      "alone in brackets where the baseline's prefill is known):", ""]
            lines += group_table(r) + vs_plain(r) + [""]
    return "\n".join(lines).rstrip() + "\n"


def replace_block(text: str, block: str, where: str) -> str:
    """``text`` with what lies between the results markers replaced by ``block``; an error if they are missing."""
    i, j = text.find(BEGIN), text.find(END)
    if i < 0 or j < i:
        raise InvalidConfigError(f"{where} has no '{BEGIN}' ... '{END}' block to fill")
    return text[: i + len(BEGIN)] + "\n" + block.rstrip() + "\n" + text[j:]


def write_docs(root: str | Path, readme: str | Path = "README.md",
               benchmarks: str | Path = "docs/BENCHMARKS.md") -> list[Path]:
    """Fill the results blocks of the README (the main table) and docs/BENCHMARKS.md (everything) from ``root``.
    Both texts are made before either file is written: a missing block leaves both files as they were."""
    texts = {}
    for path, full in ((Path(readme), False), (Path(benchmarks), True)):
        texts[path] = replace_block(path.read_text(encoding="utf-8"), render(root, full), str(path))
    for path, text in texts.items():
        atomic_write_text(path, text)
    return list(texts)


__all__ = ["FORMAT", "load_results", "record", "render", "write_docs", "write_results"]
