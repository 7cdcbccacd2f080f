"""``selfspec train`` and ``selfspec eval-draft``: train an exit head for a model and measure how well
a head drafts (acceptance per draft position, mean accepted length) through the real engine."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from itertools import islice
from pathlib import Path
from typing import Any

from selfspec.api import SelfSpec
from selfspec.cli_options import add_command, config_from_args
from selfspec.config import DraftConfig, ModelConfig, opt
from selfspec.progress import progress
from selfspec.stats import GenerationStats
from selfspec.train.data import generate_data, load_seed_prompts, read_sequences
from selfspec.train.prompts import default_prompts
from selfspec.train.sharegpt import conversations
from selfspec.train.trainer import TrainConfig, train_head


@dataclass
class EvalDraftConfig:
    """Settings of ``selfspec eval-draft``."""

    prompts: str = opt("default", "Prompts: 'default' (project prompts not used by the default training "
                       "recipe), 'sharegpt-heldout' (first user turns of the held-out ShareGPT conversations, "
                       "disjoint from collect-features' training side and from Spec-Bench), a .jsonl or .txt file.")
    num_prompts: int = opt(8, "How many prompts to run.")
    max_new_tokens: int = opt(128, "New tokens per prompt (greedy).")
    out: str = opt("", "Write the result as JSON here (optional).")


def eval_prompts(source: str, n: int) -> list[Any]:
    if source in ("", "default"):
        return default_prompts(10_000)[-n:]  # the tail of the task x topic mix: not in the training set
    if source == "sharegpt-heldout":
        return [m[0]["content"][:2000] for _, m in islice(conversations("sharegpt", "heldout"), n)]
    return load_seed_prompts(source, n)


def eval_draft(ss: Any, prompts: list[Any], max_new_tokens: int) -> dict[str, Any]:
    """Greedy generation over ``prompts``; acceptance per position and MAL pooled over all steps."""
    total = GenerationStats()
    for p in progress(prompts, desc="eval-draft", unit="prompt"):
        ids = ss.encode([{"role": "user", "content": p}] if isinstance(p, str) else p)
        total.merge(ss.generate(ids, max_new_tokens=max_new_tokens).stats)
    drafted = sum(total.proposed_per_position)
    return {
        "draft": asdict(ss.draft_config), "head_kind": ss.head.kind, "prompts": len(prompts),
        "mean_accepted_length": total.mean_accepted_length,
        "acceptance_rate_per_position": total.acceptance_rate_per_position,
        "acceptance_rate": sum(total.accepted_per_position) / drafted if drafted else 0.0,
        "tokens_per_second": total.tokens_per_second, "new_tokens": total.new_tokens, "steps": total.steps,
    }


def load_target(args: argparse.Namespace, exit_layer: int | None = 1) -> Any:
    """The target for a training command: ModelConfig from ``args``, the untrained exit, a fixed gamma
    (no draft costs are measured: these commands never decode speculatively)."""
    return SelfSpec.load(config_from_args(args, ModelConfig), DraftConfig(head="lm", exit_layer=exit_layer, gamma=1))


def cmd_train(args: argparse.Namespace) -> int:
    cfg = config_from_args(args, TrainConfig)
    ss = load_target(args, cfg.exit_layer)
    data = Path(cfg.data or Path(cfg.out).with_name(Path(cfg.out).name + "-data.jsonl"))
    seqs = read_sequences(data)
    if len(seqs) < cfg.num_prompts:
        prompts = load_seed_prompts(cfg.prompts, cfg.num_prompts, cfg.seed)
        seqs = generate_data(ss, prompts, data, cfg.gen_tokens, cfg.gen_batch)
    _, report = train_head(ss.split, seqs[: cfg.num_prompts], cfg)
    print(json.dumps({k: report[k] for k in ("steps", "heldout_before", "heldout_after")}, indent=2))
    print(f"head written to {cfg.out}")
    return 0


def cmd_eval_draft(args: argparse.Namespace) -> int:
    ss = SelfSpec.load(config_from_args(args, ModelConfig), config_from_args(args, DraftConfig))
    cfg = config_from_args(args, EvalDraftConfig)
    res = eval_draft(ss, eval_prompts(cfg.prompts, cfg.num_prompts), cfg.max_new_tokens)
    res["config"] = asdict(cfg)
    text = json.dumps(res, indent=2)
    if cfg.out:
        Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.out).write_text(text)
    print(text)
    return 0


def add_parsers(sub: Any) -> None:
    add_command(sub, "train", (ModelConfig, TrainConfig), cmd_train,
                "Train an exit head by self-distillation (target frozen).")
    add_command(sub, "eval-draft", (ModelConfig, DraftConfig, EvalDraftConfig), cmd_eval_draft,
                "Acceptance per draft position and mean accepted length of a head.")
