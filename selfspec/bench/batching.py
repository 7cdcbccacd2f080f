"""Throughput of batched decoding on Spec-Bench prompts: ``selfspec bench-batch``.

    python -m selfspec bench-batch --prompts 8 --max-new-tokens 48 --out runs/batching   # batch sizes 1, 2, 4, 8

For each batch size B the prompts are cut into groups of B, and every group is decoded by every
method in turn (the order rotates group by group; one untimed warm-up first), greedy, each request
until its EOS or ``max_new_tokens``:

    hf          transformers' generate on the left-padded group (its own batching)
    plain       selfspec's batched plain decoding (``Scheduler``, one ragged step per token)
    exspec      selfspec's batched speculative decoding with the default draft and the batch rule
                (``BatchConfig``): every sequence over its own cache, no realignment
    exspec-lm   the same ragged batching with EQSPEC's draft (the untrained exit at ``exit_layer``,
                ``gamma`` drafts every step in every batch): the like-for-like comparison
    eqspec      EQSPEC (``PaddedBatch``): one left-padded cache, ``gamma`` drafts per row in lockstep,
                realigned after every verification; its realignment share is reported

Reported per method and B: tokens/s (new tokens of the group / its wall time, prefill included),
mean per-sequence latency (from the group's start to that request's last token; a padded method
returns all at once), and how many outputs equal plain batch-1 decoding token for token. Results:
``OUT/batching.json`` (config and machine included), ``OUT/batching.md``, ``OUT/batching.png``.
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
from selfspec.batch.scheduler import BatchConfig, Scheduler
from selfspec.bench.eqspec import PaddedBatch
from selfspec.bench.manifest import machine_info
from selfspec.bench.questions import DEFAULT_QUESTIONS, load_questions, select_questions, turn_prompt
from selfspec.cli_options import add_command, config_from_args
from selfspec.config import GenerateConfig, ModelConfig, opt
from selfspec.drafting.early_exit import EarlyExitDrafter
from selfspec.drafting.policies import make_policy
from selfspec.engine import Engine
from selfspec.errors import InvalidConfigError
from selfspec.heads.io import new_head
from selfspec.progress import progress

METHODS = ("hf", "plain", "exspec", "exspec-lm", "eqspec")


@dataclass
class BatchBenchConfig:
    """Settings of ``selfspec bench-batch``."""

    questions: str = opt(DEFAULT_QUESTIONS, "Spec-Bench question file (JSONL).")
    prompts: int = opt(8, "Prompts (first turns, chat template), spread evenly over Spec-Bench's groups.")
    batch_sizes: list[int] = opt([1, 2, 4, 8], "Batch sizes to measure.")
    max_new_tokens: int = opt(48, "Most new tokens per request (each stops at its EOS too).")
    methods: list[str] = opt(list(METHODS), f"Methods to time, of {', '.join(METHODS)}.")
    exit_layer: int = opt(8, "Exit layer of EQSPEC's draft (the untrained exit, a stateless head) and exspec-lm.")
    gamma: int = opt(2, "Drafts per step of eqspec and exspec-lm.")
    out: str = opt("runs/batching", "Output directory.")

    def to_dict(self) -> dict:
        return asdict(self)


def _prompts(ss: Any, cfg: BatchBenchConfig) -> list[list[int]]:
    qs = load_questions(cfg.questions)
    groups = len({q.group for q in qs})
    chosen = select_questions(qs, [], -(-cfg.prompts // groups))
    step = len(chosen) / cfg.prompts
    return [turn_prompt(ss, chosen[int(i * step)], [], 0) for i in range(cfg.prompts)]


class Runner:
    """The methods over one loaded model; each ``run`` decodes one group -> (outputs, wall, latencies, extra)."""

    def __init__(self, ss: Any, cfg: BatchBenchConfig) -> None:
        self.ss, self.cfg = ss, cfg
        head = new_head("lm", ss.split, cfg.exit_layer)
        self.padded = PaddedBatch(ss.split, head, cfg.gamma)
        self.lm_engine = Engine(ss.split, EarlyExitDrafter(ss.split, head, make_policy("fixed")), gamma=cfg.gamma)
        self.eos = ss.eos_token_ids

    def run(self, method: str, group: list[list[int]], n: int) -> tuple[list[list[int]], float, list[float], dict]:
        if method == "hf":
            return self._hf(group, n)
        if method == "eqspec":
            t0 = time.perf_counter()
            outs = self.padded.generate(group, [n] * len(group), self.eos)
            wall = time.perf_counter() - t0
            st = self.padded.stats
            return outs, wall, [wall] * len(group), {"realign": st.realign_time, "draft": st.draft_time,
                                                     "verify": st.verify_time, "mal": st.mean_accepted_length}
        engine, batch, meth = self.ss.engine, BatchConfig(max_batch=len(group)), "selfspec"
        if method == "plain":
            meth = "plain"
        elif method == "exspec-lm":
            engine, batch = self.lm_engine, BatchConfig(max_batch=len(group), draft_batch=1 << 20, lookup_rows=0)
        sched = Scheduler(engine, batch, self.eos)
        t0 = time.perf_counter()
        reqs = [sched.add(p, GenerateConfig(max_new_tokens=n, method=meth)) for p in group]
        done: dict[int, float] = {}
        while sched.busy:
            sched.step()
            for r in reqs:
                if r.done and id(r) not in done:
                    done[id(r)] = time.perf_counter() - t0
        wall = time.perf_counter() - t0
        steps = sum(len(r.stats.accept_lengths) for r in reqs)
        mal = sum(sum(r.stats.accept_lengths) for r in reqs) / steps if steps else 0.0
        return [r.out for r in reqs], wall, [done[id(r)] for r in reqs], {"mal": mal}

    def _hf(self, group: list[list[int]], n: int) -> tuple[list[list[int]], float, list[float], dict]:
        model, dev = self.ss.model, self.ss.split.device
        pad = self.eos[0] if self.eos else 0
        width = max(len(p) for p in group)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in group], device=dev)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group], device=dev)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n, min_new_tokens=0,
                                 eos_token_id=self.eos or None, pad_token_id=pad, top_k=None, top_p=None,
                                 temperature=None)
        wall = time.perf_counter() - t0
        eos, outs = set(self.eos), []
        for row in out[:, width:].tolist():
            cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
            outs.append(row[:cut])
        return outs, wall, [wall] * len(group), {}


def run(cfg: BatchBenchConfig, model_cfg: ModelConfig | None = None, ss: Any = None) -> dict:
    bad = sorted(set(cfg.methods) - set(METHODS))
    if bad or not cfg.methods:
        raise InvalidConfigError(f"unknown methods {bad} (known: {', '.join(METHODS)})")
    if not cfg.batch_sizes or min(cfg.batch_sizes) < 1 or cfg.prompts < 1:
        raise InvalidConfigError("batch sizes and prompts must be >= 1")
    ss = ss or SelfSpec.load(model_cfg or ModelConfig())
    prompts = _prompts(ss, cfg)
    runner = Runner(ss, cfg)
    n = cfg.max_new_tokens
    for m in cfg.methods:  # warm-up, untimed
        runner.run(m, prompts[:2], 8)
    ref = [runner.run("plain", [p], n)[0][0] for p in prompts]  # plain batch 1: the outputs every method must give
    rows: list[dict] = []
    total = sum(-(-len(prompts) // b) for b in cfg.batch_sizes) * len(cfg.methods)
    with progress(total=total, desc="bench-batch") as bar:
        for b in cfg.batch_sizes:
            acc: dict[str, dict[str, Any]] = {m: {"tokens": 0, "wall": 0.0, "lat": [], "same": 0, "extra": []}
                                              for m in cfg.methods}
            for gi, start in enumerate(range(0, len(prompts), b)):
                group = prompts[start : start + b]
                order = cfg.methods[gi % len(cfg.methods):] + cfg.methods[: gi % len(cfg.methods)]
                for m in order:
                    outs, wall, lat, extra = runner.run(m, group, n)
                    a = acc[m]
                    a["tokens"] += sum(len(o) for o in outs)
                    a["wall"] += wall
                    a["lat"] += lat
                    a["same"] += sum(o == r for o, r in zip(outs, ref[start : start + b]))
                    a["extra"].append({**extra, "wall": wall})
                    bar.update(1)
            for m, a in acc.items():
                row = {"method": m, "batch": b, "tokens": a["tokens"], "wall": a["wall"],
                       "tokens_per_s": a["tokens"] / a["wall"], "latency_mean": statistics.mean(a["lat"]),
                       "latency_max": max(a["lat"]), "identical": a["same"], "requests": len(prompts)}
                if m == "eqspec":
                    realign = sum(e["realign"] for e in a["extra"])
                    row.update(realign_s=realign, realign_share=realign / a["wall"],
                               draft_share=sum(e["draft"] for e in a["extra"]) / a["wall"],
                               verify_share=sum(e["verify"] for e in a["extra"]) / a["wall"])
                if any("mal" in e for e in a["extra"]):
                    row["mal"] = statistics.mean(e["mal"] for e in a["extra"])
                rows.append(row)
    result = {"config": cfg.to_dict(), "machine": machine_info(), "model": ss.model_id,
              "draft": asdict(ss.draft_config), "rows": rows}
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "batching.json").write_text(json.dumps(result, indent=2, default=str))
    (out / "batching.md").write_text(format_table(rows))
    plot(rows, out / "batching.png")
    return result


def format_table(rows: list[dict]) -> str:
    base = {r["batch"]: r["tokens_per_s"] for r in rows if r["method"] == "plain"}
    out = ["| method | batch | tokens/s | vs plain batched | mean latency (s) | MAL | identical | realignment share |",
           "|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["batch"], METHODS.index(r["method"]))):
        rel = f"{r['tokens_per_s'] / base[r['batch']]:.2f}x" if r["batch"] in base else "-"
        share = f"{100 * r['realign_share']:.1f}%" if "realign_share" in r else "-"
        mal = f"{r['mal']:.2f}" if "mal" in r else "-"
        out.append(f"| {r['method']} | {r['batch']} | {r['tokens_per_s']:.1f} | {rel} | {r['latency_mean']:.2f} | "
                   f"{mal} | {r['identical']}/{r['requests']} | {share} |")
    return "\n".join(out) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib  # lazy: a heavy import, needed only when a plot is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for m in METHODS:
        rs = sorted((r for r in rows if r["method"] == m), key=lambda r: r["batch"])
        if rs:
            a.plot([r["batch"] for r in rs], [r["tokens_per_s"] for r in rs], marker="o", label=m)
            b.plot([r["batch"] for r in rs], [r["latency_mean"] for r in rs], marker="o", label=m)
    for ax, title in ((a, "throughput (tokens/s, higher is better)"), (b, "mean latency per request (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cmd(args: argparse.Namespace) -> int:
    cfg = config_from_args(args, BatchBenchConfig)
    result = run(cfg, config_from_args(args, ModelConfig))
    print(format_table(result["rows"]))
    print(f"results in {cfg.out}/batching.json, .md, .png")
    return 0


def add_parser(sub: Any) -> None:
    add_command(sub, "bench-batch", (ModelConfig, BatchBenchConfig), cmd,
                "Batched decoding throughput: plain, EXSPEC, EQSPEC, hf padded generate.")
