"""PPSD and Mirror-SD on Spec-Bench, next to the sequential engine: ``selfspec bench-pipeline``.

    python -m selfspec bench-pipeline --per-group 2 --max-new-tokens 48 --out runs/pipeline

Every question's first turn (chat template, greedy, until EOS or ``max_new_tokens``) is decoded by every
method in turn, the order rotating question by question, after an untimed warm-up:

    plain          selfspec's plain decoding, one process, ``--threads`` threads (default: all cores)
    selfspec       the sequential engine with the default draft (what ``generate`` does), same threads
    ppsd           the pipeline over two processes (torch.distributed, gloo), one thread each
    mirror         Mirror-SD over the same two processes
    ppsd-1dev      the one-device variant: both stages as two threads of this process, sharing its threads
    mirror-1dev    Mirror-SD on one device

All pipelines draft with the default draft's head (the bundled deep-context head) at ``gamma`` drafts
per block. Reported per method: tokens/s (ratio of sums), the speed over plain, MAL, the per-draft
acceptance, how often the block drafted ahead (or a Mirror-SD branch) was the next one, the share of
time the shallow stage waited, and outputs identical to plain. Next to them, the cost model
(selfspec.pipeline.costs) from stage costs measured here: its prediction for one thread per stage (this
machine) and for two devices (each stage with ``threads`` threads, as the sequential engine has).
Results: ``OUT/pipeline.json`` (config and machine included) and ``OUT/pipeline.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from selfspec.api import SelfSpec
from selfspec.bench.manifest import machine_info
from selfspec.bench.questions import DEFAULT_QUESTIONS, load_questions, select_questions, turn_prompt
from selfspec.cli_options import add_command, config_from_args
from selfspec.config import (
    GenerateConfig,
    ModelConfig,
    PipelineConfig,
    opt,
)
from selfspec.costs import measure_draft_costs
from selfspec.errors import InvalidConfigError
from selfspec.pipeline import Pipeline
from selfspec.pipeline.costs import predict
from selfspec.progress import progress

METHODS = ("plain", "selfspec", "ppsd", "mirror", "ppsd-1dev", "mirror-1dev")


@dataclass
class PipelineBenchConfig:
    """Settings of ``selfspec bench-pipeline``."""

    questions: str = opt(DEFAULT_QUESTIONS, "Spec-Bench question file (JSONL).")
    per_group: int = opt(2, "Questions per Spec-Bench group (first turns), evenly spaced.")
    max_new_tokens: int = opt(48, "Most new tokens per question (each stops at its EOS too).")
    methods: list[str] = opt(list(METHODS), f"Methods to time, of {', '.join(METHODS)}.")
    gamma: int = opt(3, "Most drafts per pipeline block.")
    mirror_top_k: int = opt(2, "Mirror-SD: candidates per early signal (branches).")
    out: str = opt("runs/pipeline", "Output directory.")

    def to_dict(self) -> dict:
        return asdict(self)


class Runner:
    def __init__(self, ss: Any, cfg: PipelineBenchConfig, model_cfg: ModelConfig | None, threads: int) -> None:
        self.ss, self.cfg, self.threads = ss, cfg, threads
        base = PipelineConfig(gamma=cfg.gamma, mirror_top_k=cfg.mirror_top_k)
        self.pipes: dict[str, Any] = {}
        if {"ppsd", "mirror"} & set(cfg.methods):
            self.pipes["process"] = Pipeline.of(ss, base, model_cfg)
        if {"ppsd-1dev", "mirror-1dev"} & set(cfg.methods):
            self.pipes["thread"] = Pipeline.of(ss, PipelineConfig(**{**base.to_dict(), "transport": "thread",
                                                                     "threads": threads}))

    def run(self, method: str, prompt: list[int], n: int) -> tuple[list[int], float, dict]:
        gen = GenerateConfig(max_new_tokens=n, method="plain" if method == "plain" else "selfspec")
        if method in ("plain", "selfspec"):
            torch.set_num_threads(self.threads)
            self.ss.prefix_cache.clear()  # the pipeline prefills whole: so do these
            t0 = time.perf_counter()
            res = self.ss.generate(prompt, gen)
            wall = time.perf_counter() - t0
            return res.token_ids, wall, {"accept_lengths": res.stats.accept_lengths}
        pipe = self.pipes["thread" if method.endswith("1dev") else "process"]
        pipe.set_mode(method.split("-")[0])
        torch.set_num_threads(self.threads if method.endswith("1dev") else 1)  # one device: both stages share them
        t0 = time.perf_counter()
        out, st = pipe.generate(prompt, gen)
        wall = time.perf_counter() - t0
        return out, wall, {"accept_lengths": st.accept_lengths, "drafted": st.drafted, "ahead_used": st.ahead_used,
                           "branch_used": st.branch_used, "branches": st.branches, "wait": st.wait_time}

    def close(self) -> None:
        for p in self.pipes.values():
            p.close()


def predictions(ss: Any, cfg: PipelineBenchConfig, acceptance: float, threads: int, p_ahead: float) -> dict:
    """The cost model for the default head at ``acceptance``: stage costs measured with one thread (two
    processes on this machine) and with ``threads`` (each stage on a device of its own)."""
    out = {}
    for label, n in (("one_thread_per_stage", 1), ("two_devices", threads)):
        torch.set_num_threads(n)
        costs = measure_draft_costs(ss.split, ss.head)
        out[label] = {"threads": n, "costs": asdict(costs), **predict(costs, acceptance, cfg.gamma).to_dict(),
                      "with_measured_p_ahead": predict(costs, acceptance, cfg.gamma, p_ahead).to_dict()}
    torch.set_num_threads(threads)
    return out


def run(cfg: PipelineBenchConfig, model_cfg: ModelConfig | None = None, ss: Any = None) -> dict:
    """The benchmark over ``model_cfg`` (the deep process loads it too), or over a loaded ``ss`` (the deep
    process gets a copy of its weights; tests)."""
    bad = sorted(set(cfg.methods) - set(METHODS))
    if bad or not cfg.methods or "plain" not in cfg.methods:
        raise InvalidConfigError(f"methods must include plain and be among {', '.join(METHODS)} (got {cfg.methods})")
    if ss is None:
        model_cfg = model_cfg or ModelConfig()
        ss = SelfSpec.load(model_cfg)
    threads = torch.get_num_threads()  # ModelConfig.threads, else torch's default
    qs = select_questions(load_questions(cfg.questions), [], cfg.per_group)
    prompts = [(q, turn_prompt(ss, q, [], 0)) for q in qs]
    runner = Runner(ss, cfg, model_cfg, threads)
    try:
        for m in cfg.methods:  # warm-up, untimed
            runner.run(m, prompts[0][1], 8)
        acc: dict[str, dict[str, Any]] = {m: {"tokens": 0, "wall": 0.0, "same": 0, "rounds": [], "extra": [], "per_q": []} for m in cfg.methods}
        with progress(total=len(prompts) * len(cfg.methods), desc="bench-pipeline") as bar:
            for i, (q, prompt) in enumerate(prompts):
                order = cfg.methods[i % len(cfg.methods):] + cfg.methods[: i % len(cfg.methods)]
                outs = {}
                for m in order:
                    outs[m], wall, extra = runner.run(m, prompt, cfg.max_new_tokens)
                    a = acc[m]
                    a["tokens"] += len(outs[m])
                    a["wall"] += wall
                    a["extra"].append(extra)
                    a["per_q"].append({"question_id": q.question_id, "group": q.group, "tokens": len(outs[m]),
                                       "wall": wall})
                    bar.update(1)
                for m in cfg.methods:
                    acc[m]["same"] += outs[m] == outs["plain"]
    finally:
        runner.close()
    plain_speed = acc["plain"]["tokens"] / acc["plain"]["wall"]
    rows = []
    for m, a in acc.items():
        lens = [x for e in a["extra"] for x in e["accept_lengths"]]
        row = {"method": m, "tokens": a["tokens"], "wall": a["wall"], "tokens_per_s": a["tokens"] / a["wall"],
               "vs_plain": a["tokens"] / a["wall"] / plain_speed, "identical": a["same"], "questions": len(prompts),
               "mal": statistics.mean(lens) if lens and m != "plain" else 1.0,
               "speed_spread": _spread([p["tokens"] / p["wall"] for p in a["per_q"]])}
        if m not in ("plain", "selfspec"):
            drafted = sum(e["drafted"] for e in a["extra"])
            rounds = len(lens)
            row.update(acceptance=(sum(lens) - rounds) / drafted if drafted else 0.0,
                       ahead_used=sum(e["ahead_used"] for e in a["extra"]) / rounds,
                       branch_used=sum(e["branch_used"] for e in a["extra"]) / rounds,
                       branches_per_round=sum(e["branches"] for e in a["extra"]) / rounds,
                       wait_share=sum(e["wait"] for e in a["extra"]) / a["wall"])
        rows.append(row)
    piped = [r for r in rows if "acceptance" in r]
    ref = next((r for r in piped if r["method"] == "ppsd"), piped[0] if piped else {"acceptance": 0.3, "ahead_used": 0.0})
    result = {"config": cfg.to_dict(), "model_config": asdict(model_cfg) if model_cfg else None, "machine": machine_info(),
              "model": ss.model_id, "draft": asdict(ss.draft_config), "rows": rows,
              "cost_model": predictions(ss, cfg, ref["acceptance"], threads, ref["ahead_used"]), "per_question": {m: a["per_q"] for m, a in acc.items()}}
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pipeline.json").write_text(json.dumps(result, indent=2, default=str))
    (out / "pipeline.md").write_text(format_table(result))
    return result


def _spread(xs: list[float]) -> list[float]:
    """Quartiles of the per-question speeds (25%, median, 75%)."""
    if len(xs) < 2:
        return [xs[0]] * 3 if xs else []
    q = statistics.quantiles(xs, n=4)
    return [q[0], statistics.median(xs), q[2]]


def format_table(result: dict) -> str:
    out = ["| method | tokens/s | vs plain | per-question tok/s (25/50/75%) | MAL | acceptance | next block ready "
           "(ahead / branch) | shallow waited | identical |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        ready = f"{100 * r['ahead_used']:.0f}% / {100 * r['branch_used']:.0f}%" if "ahead_used" in r else "-"
        acc = f"{r['acceptance']:.2f}" if "acceptance" in r else "-"
        wait = f"{100 * r['wait_share']:.0f}%" if "wait_share" in r else "-"
        spread = "/".join(f"{x:.1f}" for x in r["speed_spread"])
        out.append(f"| {r['method']} | {r['tokens_per_s']:.1f} | {r['vs_plain']:.2f}x | {spread} | {r['mal']:.2f} | "
                   f"{acc} | {ready} | {wait} | {r['identical']}/{r['questions']} |")
    out += ["", "Cost model (selfspec.pipeline.costs) at the measured acceptance:", "",
            "| stage costs measured with | acceptance | sequential vs plain | pipelined vs plain, P = a^(g+1) | "
            "pipelined vs plain, P measured |", "|---|---|---|---|---|"]
    for label, p in result["cost_model"].items():
        m = p["with_measured_p_ahead"]
        out.append(f"| {label.replace('_', ' ')} ({p['threads']} thread{'s' if p['threads'] > 1 else ''}) | "
                   f"{p['acceptance']:.2f} | {p['speedup_sequential']:.2f}x | {p['speedup_pipelined']:.2f}x "
                   f"(P {p['p_ahead']:.2f}) | {m['speedup_pipelined']:.2f}x (P {m['p_ahead']:.2f}) |")
    return "\n".join(out) + "\n"


def cmd(args: argparse.Namespace) -> int:
    cfg = config_from_args(args, PipelineBenchConfig)
    result = run(cfg, config_from_args(args, ModelConfig))
    print(format_table(result))
    print(f"results in {cfg.out}/pipeline.json, .md")
    return 0


def add_parser(sub: Any) -> None:
    add_command(sub, "bench-pipeline", (ModelConfig, PipelineBenchConfig), cmd,
                "PPSD and Mirror-SD on Spec-Bench next to the sequential engine.")
