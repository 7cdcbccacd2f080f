"""``selfspec bench-rounds``: what each kind of decoding round really costs, in plain steps, on real prompts.

A drafting round's price decides whether speculation pays, and a calibration's parts (a block's forward timed on its
own, the head timed hot in cache) can miss what a real decode pays (the head read cold from memory after the
target's step, its catch-up rows, the proposal's and the verdict's Python). This times every round of real decodes,
plain and the default alternating prompt by prompt (Spec-Bench questions, first turns, each prompt's cache emptied
first), and sorts the speculative rounds by what they drafted:

    kind        drafted   what the round did
    blank       0         the head ran and the confidence stop refused its first draft
    no draft    0         the drafter proposed nothing, the head did not run (the policy chose a plain step): one
                          row verified
    head        g         an early-exit chain (or tree) of g drafts
    lookup      g         a lookup block of g drafts (no head)

and reports each kind's rounds in plain steps of the same prompt (``steps``: a round's wall time over the plain
method's median step on that prompt, so kinds that happen more in long prompts are not priced against short ones'
steps; the median over the kind's rounds), the drafts it got accepted, and ``value`` = (1 + accepted) / steps:
tokens per plain step's time (> 1: the kind pays; results in docs/BENCHMARKS.md). Batch-1 engine only
(``Engine.round_log``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from selfspec.api import SelfSpec
from selfspec.bench.questions import DEFAULT_QUESTIONS, load_questions, select_questions
from selfspec.cli_options import add_command, config_from_args
from selfspec.config import GenerateConfig, ModelConfig, opt
from selfspec.errors import InvalidConfigError
from selfspec.paths import atomic_write_text
from selfspec.progress import progress
from selfspec.stats import RoundRecord


@dataclass
class RoundsBenchConfig:
    """Settings of ``selfspec bench-rounds``."""

    questions: str = opt(DEFAULT_QUESTIONS, "Spec-Bench question file (JSONL: question_id, category, turns).")
    categories: list[str] = opt([], "Only these groups (mt_bench, translation, ...) or categories; default all.")
    limit: int = opt(4, "Questions per group (evenly spaced); their first turns are the prompts.")
    max_new_tokens: int = opt(64, "New tokens per prompt.")
    out: str = opt("runs/bench-rounds.json", "Where to write the results (JSON: settings, records, summary).")

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(records: list[RoundRecord]) -> dict[str, Any]:
    """Per kind of speculative round (``"<kind> <drafted>"``): rounds, median ms, ``steps`` (the median of each
    round's time over its prompt's median plain step), mean accepted drafts and ``value`` = (1 + accepted) / steps;
    and both methods' ms per token over all their rounds."""
    by_prompt: dict[int, list[float]] = defaultdict(list)  # plain steps per prompt
    groups: dict[str, list[RoundRecord]] = defaultdict(list)  # speculative rounds per kind
    for r in records:
        if r.kind == "plain step":
            by_prompt[r.prompt].append(r.seconds)
        else:
            groups[f"{r.kind} {r.drafted}"].append(r)
    plain = [t for ts in by_prompt.values() for t in ts]
    if not plain:
        raise InvalidConfigError("no plain steps recorded: bench-rounds prices rounds in plain steps")
    step = statistics.median(plain)
    prompt_step = {p: statistics.median(ts) for p, ts in by_prompt.items()}
    kinds = {}
    for name, rs in sorted(groups.items(), key=lambda kv: (kv[1][0].kind, kv[1][0].drafted)):
        steps = statistics.median(r.seconds / prompt_step.get(r.prompt, step) for r in rs)
        acc = sum(r.accepted for r in rs) / len(rs)
        kinds[name] = {"rounds": len(rs), "median_ms": 1e3 * statistics.median(r.seconds for r in rs),
                       "steps": steps, "mean_accepted": acc, "value": (1 + acc) / steps}
    per_token = {}
    for method in sorted({r.method for r in records}):
        rs = [r for r in records if r.method == method]
        per_token[method] = 1e3 * sum(r.seconds for r in rs) / sum(r.accepted + 1 for r in rs)
    return {"plain_step_ms": 1e3 * step, "plain_steps": len(plain), "kinds": kinds, "ms_per_token": per_token}


def format_table(summary: dict[str, Any]) -> str:
    lines = [f"plain step: median {summary['plain_step_ms']:.2f} ms over {summary['plain_steps']} steps",
             "", "| round | rounds | median | plain steps (of its prompt) | mean accepted | value (tokens per step's time) |",
             "|---|---|---|---|---|---|"]
    for name, k in summary["kinds"].items():
        lines.append(f"| {name} | {k['rounds']} | {k['median_ms']:.2f} ms | {k['steps']:.3f} | "
                     f"{k['mean_accepted']:.2f} | {k['value']:.3f} |")
    lines.append("")
    lines += [f"{m}: {ms:.2f} ms per token" for m, ms in summary["ms_per_token"].items()]
    return "\n".join(lines)


def run(model_cfg: ModelConfig, cfg: RoundsBenchConfig, ss: SelfSpec | None = None) -> dict[str, Any]:
    """Decode each chosen question's first turn with the plain method and the default in turn (after a warm-up of
    both), every round recorded; -> {settings, summary, records} (also written to ``cfg.out``)."""
    if cfg.limit < 1 or cfg.max_new_tokens < 2:
        raise InvalidConfigError("limit must be >= 1 and max_new_tokens >= 2")
    questions = select_questions(load_questions(cfg.questions), cfg.categories, cfg.limit)
    ss = ss if ss is not None else SelfSpec.load(model_cfg)
    prompts = [ss.encode([{"role": "user", "content": q.turns[0]}]) for q in questions]
    gens = {m: GenerateConfig(max_new_tokens=cfg.max_new_tokens, method=m) for m in ("plain", "selfspec")}
    for gen in gens.values():  # warm-up, not recorded
        ss.generate(prompts[0], gen)
    log: list[RoundRecord] = []
    ss.engine.round_log = log
    try:
        for i, ids in enumerate(progress(prompts, desc="rounds", unit="prompt")):
            for gen in gens.values():
                ss.prefix_cache.clear()  # each prompt prefilled whole by both methods
                start = len(log)
                ss.generate(ids, gen)
                for r in log[start:]:
                    r.prompt = i
    finally:
        ss.engine.round_log = None
    summary = summarize(log)
    out = {"settings": {"model": model_cfg.to_dict(),
                        "bench": cfg.to_dict(), "cpu": platform.processor() or platform.machine(),
                        "draft": asdict(ss.draft_config)},
           "summary": summary, "records": [asdict(r) for r in log]}
    atomic_write_text(Path(cfg.out), json.dumps(out, indent=1))  # never a half-written results file
    return out


def cmd(args: argparse.Namespace) -> int:
    res = run(config_from_args(args, ModelConfig), config_from_args(args, RoundsBenchConfig))
    print(format_table(res["summary"]))
    return 0


def add_parser(sub: Any) -> None:
    add_command(sub, "bench-rounds", (ModelConfig, RoundsBenchConfig), cmd,
                "What each kind of decoding round costs in plain steps, on real prompts "
                "(plain and the default alternating).")
