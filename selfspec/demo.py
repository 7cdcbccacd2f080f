"""``selfspec demo`` (what ``make demo`` runs): one prompt decoded by transformers' ``generate``, by
selfspec's plain path and by selfspec's default (self-speculative) method, side by side: tokens/s,
speedup and whether each text is token-for-token transformers' own."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

import torch

from selfspec.api import SelfSpec
from selfspec.cli_options import add_config_args, config_from_args
from selfspec.config import ModelConfig, opt

DEMO_PROMPT = "Write a short poem about speculative decoding, then explain the idea in two sentences."


@dataclass
class DemoConfig:
    """Settings of ``selfspec demo``."""

    prompt: str = opt(DEMO_PROMPT, "The user message to answer.")
    max_new_tokens: int = opt(96, "New tokens per method.")


def run(model_cfg: ModelConfig, cfg: DemoConfig) -> list[dict]:
    ss = SelfSpec.load(model_cfg)
    ids = ss.encode([{"role": "user", "content": cfg.prompt}])

    def hf() -> tuple[list[int], float]:
        x = torch.tensor([ids], device=ss.split.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = ss.model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                    max_new_tokens=cfg.max_new_tokens, eos_token_id=ss.eos_token_ids,
                                    pad_token_id=ss.eos_token_ids[0], top_k=None, top_p=None, temperature=None)
        new = out[0, len(ids):].tolist()
        return new, time.perf_counter() - t0

    def ours(method: str) -> tuple[list[int], float]:
        ss.prefix_cache.clear()  # the same prompt each time: every run prefills it whole, as transformers does
        r = ss.generate(ids, max_new_tokens=cfg.max_new_tokens, method=method)
        return r.token_ids, r.stats.wall_time

    runs = {"transformers generate": hf, "selfspec plain": lambda: ours("plain"),
            "selfspec (default)": lambda: ours("selfspec")}
    for fn in runs.values():  # warm-up: first calls build caches and kernels
        fn()
    rows: list[dict[str, Any]] = []
    for name, fn in runs.items():
        tokens, secs = fn()
        rows.append({"method": name, "tokens": tokens, "seconds": secs, "tok_s": len(tokens) / secs})
    base = rows[0]
    for r in rows:
        r["speedup"] = r["tok_s"] / base["tok_s"]
        r["identical"] = r["tokens"] == base["tokens"]
    print(ss.tokenizer.decode(rows[-1]["tokens"], skip_special_tokens=True).strip(), "\n")
    d = ss.draft_config
    print(f"model {ss.model_id}, kernel {ss.split.kernel}, {torch.get_num_threads()} threads; selfspec draft: "
          f"exit layer {d.exit_layer}, head {ss.head.kind}, policy {d.policy}, gamma {d.gamma or 'auto'}")
    print(f"{'method':<24}{'tokens':>7}{'tok/s':>8}{'speedup':>9}  same text as transformers")
    for r in rows:
        print(f"{r['method']:<24}{len(r['tokens']):>7}{r['tok_s']:>8.1f}{r['speedup']:>8.2f}x  "
              f"{'yes' if r['identical'] else 'NO'}")
    return rows


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="One prompt through transformers' generate and selfspec, side by side.")
    add_config_args(p, ModelConfig)
    add_config_args(p, DemoConfig)
    p.set_defaults(func=lambda args: run(config_from_args(args, ModelConfig), config_from_args(args, DemoConfig))
                   and 0)
