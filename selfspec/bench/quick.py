"""``selfspec bench-quick``: a small side-by-side timing on a few prompts (the full Spec-Bench harness
is ``selfspec bench``). Methods alternate prompt by prompt after a warm-up so machine drift hits all
alike; reported: tokens/s (ratio of means vs transformers' generate, and the median per-prompt
ratio), mean accepted length, and whether each output is token-identical to generate's."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from selfspec.api import SelfSpec
from selfspec.cli_options import add_command, config_from_args
from selfspec.config import (
    DraftConfig,
    GenerateConfig,
    ModelConfig,
    opt,
)
from selfspec.progress import progress

PROMPTS = [
    "Explain in a few sentences why the sky is blue.",
    "Write a Python function that checks whether a number is prime.",
    "Translate into French: The weather is nice today and we are going to the beach.",
    "Summarize the plot of Romeo and Juliet in three sentences.",
    "What is 17 times 23? Show your reasoning step by step.",
    "Give me three tips for writing clear technical documentation.",
]


@dataclass
class QuickBenchConfig:
    """Settings of ``selfspec bench-quick``."""

    exit_layers: list[int] = opt([6, 12, 18, 24], "Exit layers to time with the untrained (lm) head.")
    gamma: int = opt(4, "Draft tokens per step for the selfspec methods.")
    max_new_tokens: int = opt(64, "New tokens per prompt.")
    num_prompts: int = opt(6, "How many of the built-in prompts to use.")
    out: str = opt("runs/bench-quick.json", "Where to write the results (JSON).")
    head: str = opt("lm", "Exit head for the selfspec methods ('lm' or a trained head directory).")


def run(model_cfg: ModelConfig, cfg: QuickBenchConfig) -> dict:
    ss = SelfSpec.load(model_cfg)
    tok = ss.tokenizer
    prompts = [ss.encode([{"role": "user", "content": p}]) for p in PROMPTS[: cfg.num_prompts]]
    gen = GenerateConfig(max_new_tokens=cfg.max_new_tokens)

    def hf(ids: list[int]) -> tuple[list[int], float, float]:
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = ss.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    do_sample=False, max_new_tokens=cfg.max_new_tokens,
                                    pad_token_id=tok.eos_token_id, top_k=None, top_p=None, temperature=None)
        new = out[0, len(ids):].tolist()
        return new, time.perf_counter() - t0, 1.0

    def ours(draft: DraftConfig | None):
        def f(ids: list[int]) -> tuple[list[int], float, float]:
            if draft is not None:
                ss.set_draft(draft)
            ss.prefix_cache.clear()  # every method prefills the prompt whole (another's prompt is no help)
            r = ss.generate(ids, gen, method="plain" if draft is None else "selfspec")
            return r.token_ids, r.stats.wall_time, r.stats.mean_accepted_length
        return f

    methods = {"hf": hf, "plain": ours(None)}
    for k in cfg.exit_layers:
        methods[f"selfspec-k{k}"] = ours(DraftConfig(exit_layer=k, head=cfg.head, gamma=cfg.gamma))
    ours(DraftConfig(exit_layer=cfg.exit_layers[0], head=cfg.head, gamma=cfg.gamma))(prompts[0][:8])  # warm-up
    hf(prompts[0][:8])
    rows: dict[str, list[dict]] = {m: [] for m in methods}
    for ids in progress(prompts, desc="bench-quick", unit="prompt"):
        for name, fn in methods.items():
            new, wall, mal = fn(ids)
            rows[name].append({"tokens": len(new), "wall": wall, "mal": mal, "ids": new})
    ref = rows["hf"]
    summary = {}
    for name, rs in rows.items():
        tps = sum(r["tokens"] for r in rs) / sum(r["wall"] for r in rs)
        ratios = [(r["tokens"] / r["wall"]) / (h["tokens"] / h["wall"]) for r, h in zip(rs, ref)]
        summary[name] = {
            "tokens_per_s": tps,
            "speedup_vs_hf": tps / (sum(h["tokens"] for h in ref) / sum(h["wall"] for h in ref)),
            "median_ratio": statistics.median(ratios),
            "min_ratio": min(ratios), "max_ratio": max(ratios),
            "mean_accepted_length": statistics.mean(r["mal"] for r in rs),
            "identical_to_hf": sum(r["ids"] == h["ids"] for r, h in zip(rs, ref)),
            "prompts": len(rs),
        }
    result = {
        "config": asdict(cfg), "model": asdict(model_cfg), "model_id": ss.model_id,
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "threads": torch.get_num_threads()},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "summary": summary,
    }
    Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
    Path(cfg.out).write_text(json.dumps(result, indent=2))
    return result


def format_table(summary: dict) -> str:
    lines = ["| method | tok/s | speedup vs hf (ratio of means) | median [min, max] per-prompt ratio | MAL | identical to hf |",
             "|---|---|---|---|---|---|"]
    for name, s in summary.items():
        lines.append(
            f"| {name} | {s['tokens_per_s']:.2f} | {s['speedup_vs_hf']:.2f} | {s['median_ratio']:.2f} "
            f"[{s['min_ratio']:.2f}, {s['max_ratio']:.2f}] | {s['mean_accepted_length']:.2f} | "
            f"{s['identical_to_hf']}/{s['prompts']} |"
        )
    return "\n".join(lines)


def cmd(args: argparse.Namespace) -> int:
    res = run(config_from_args(args, ModelConfig), config_from_args(args, QuickBenchConfig))
    print(format_table(res["summary"]))
    return 0


def add_parser(sub) -> None:
    add_command(sub, "bench-quick", (ModelConfig, QuickBenchConfig), cmd,
                "Time hf generate, plain and selfspec side by side on a few prompts.")
