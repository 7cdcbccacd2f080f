"""Sorted training of a nested exit head (heads.nested, S2D) from stored features (``selfspec train-nested``).

Every step trains all depths on the same batch, so each depth is usable alone while they share the
decoder-layer copy, the fuse and the LM head:

    loss = sum_d deep_loss(head at depth d)            # each depth alone (pass 1 + the unrolled pass 2)
         + mixed_weight * deep_loss(random depth per position, no unroll)   # what per-step switching reads

deep_loss is train-deep's (selfspec.train.deep). Starting from a trained deep head (``init``) keeps its
depth exactly as it was at step 0 (A_d = I) and teaches the other depths to map into its input space.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from selfspec.cli_options import add_command, config_from_args
from selfspec.config import ModelConfig, int_set, opt
from selfspec.errors import InvalidConfigError
from selfspec.heads.io import load_head, new_head
from selfspec.heads.nested import NestedDeepHead
from selfspec.models.split import SplitModel
from selfspec.train.cli import load_target
from selfspec.train.deep import (
    DeepTrainConfig,
    _collate,
    deep_loss,
    evaluate_deep,
    label_order,
    save_trained,
    target_probs,
    vocab_label_map,
)
from selfspec.train.features import load_features
from selfspec.train.loop import resume, train_steps


@dataclass
class NestedTrainConfig(DeepTrainConfig):
    """Settings of ``selfspec train-nested`` (train-deep's, plus the depths)."""

    depths: str = opt("1,2,4", "Exit depths the nested head drafts from (comma-separated; each must be stored in "
                      "the features). `exit_layer` is the default depth and must be one of them.")
    mixed_weight: float = opt(0.5, "Weight of the pass where each position reads a random depth (per-step switching).")


class DepthView:
    """The nested head at one depth, with the interface train-deep's loss and evaluation use."""

    def __init__(self, head: NestedDeepHead, depth: int | None) -> None:
        self.head, self.depth = head, depth
        self.norm_out = head.norm_out

    def features(self, h: torch.Tensor, ctx: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        u = h if self.depth is None else self.head.project(h, self.depth)
        return self.head.features(u, ctx, pos)

    def eval(self) -> None:
        self.head.eval()

    def train(self) -> None:
        self.head.train()


def parse_depths(text: str) -> list[int]:
    return int_set(text, "depths")


def nested_loss(head: NestedDeepHead, lm_rows: torch.Tensor, batches: dict[int, dict[str, torch.Tensor]],
                cfg: NestedTrainConfig, gen: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:
    """``batches``: depth -> collated batch (same conversations; only ``h`` differs)."""
    total: torch.Tensor | float = 0.0
    metrics: dict[str, float] = {}
    for d, batch in batches.items():
        loss, m = deep_loss(DepthView(head, d), lm_rows, batch, cfg)
        total = total + loss
        metrics[f"top1_d{d}"] = m["top1"]
    metrics["tokens"] = m["tokens"]
    if cfg.mixed_weight > 0:
        depths = list(batches)
        first = batches[depths[0]]
        pick = torch.randint(len(depths), first["h"].shape[:2], generator=gen)  # [B, T] depth index per position
        u = torch.stack([head.project(batches[d]["h"], d) for d in depths])  # [D, B, T, H]
        mixed = dict(first, h=u.gather(0, pick[None, ..., None].expand(1, *u.shape[1:]))[0])
        loss, m = deep_loss(DepthView(head, None), lm_rows, mixed, replace(cfg, unroll_weight=0.0))
        total = total + cfg.mixed_weight * loss
        metrics["top1_mixed"] = m["top1"]
    assert isinstance(total, torch.Tensor)  # batches holds at least one depth
    return total, metrics


def train_nested_head(split: SplitModel, cfg: NestedTrainConfig) -> tuple[NestedDeepHead, dict[str, Any]]:
    depths = parse_depths(cfg.depths)
    if cfg.device != "cpu":
        raise InvalidConfigError(f"train-nested trains on the CPU only (device '{cfg.device}'); train-deep takes --device cuda")
    if cfg.exit_layer not in depths:
        raise InvalidConfigError(f"exit_layer {cfg.exit_layer} must be one of the depths {depths}")
    keys = [f"h{d}" for d in depths]
    train = load_features(cfg.features, [*keys, "final"], cfg.max_tokens)
    missing = [k for k in keys if k not in train.tensors]
    if missing:
        raise InvalidConfigError(f"depths {missing} are not stored in {cfg.features} (collect-features --layers)")
    held_sets = {d.strip(): load_features(d.strip(), [*keys, "final"]) for d in cfg.heldout_features.split(",")
                 if d.strip()}
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    head = new_head("nested", split, cfg.exit_layer, depths=depths)
    assert isinstance(head, NestedDeepHead)
    head.init_from_target()
    vocab_ids = None
    if cfg.init:
        start = load_head(cfg.init, split)
        if start.kind not in ("deep", "nested"):
            raise InvalidConfigError(f"--init '{cfg.init}' is a '{start.kind}' head, not a deep or nested one")
        head.load_state_dict({k: v for k, v in start.state_dict().items() if k != "vocab_ids"}, strict=False)
        vocab_ids = start.vocab_ids if len(start.vocab_ids) else None
    head.float().train().requires_grad_(True)
    if vocab_ids is None and cfg.vocab_trim > 0:
        vocab_ids = label_order(train.tensors["label"], split.vocab_size)[: cfg.vocab_trim]
    label_map = vocab_label_map(vocab_ids, split.vocab_size) if vocab_ids is not None else None
    lm_rows = split.lm_rows(vocab_ids) if vocab_ids is not None else split.lm_head.weight.detach().float()

    def evaluate() -> dict[str, dict[int, dict[str, float]]]:
        return {name: {d: evaluate_deep(DepthView(head, d), lm_rows, fs, replace(cfg, exit_layer=d), label_map)
                       for d in depths} for name, fs in held_sets.items()}

    ckpt = out.with_name(out.name + ".checkpoint.pt")
    step, history = resume(head, ckpt, cfg)
    before = evaluate() if step == 0 else {}
    gen = torch.Generator().manual_seed(cfg.seed)

    def step_loss(idx: list[int]) -> tuple[torch.Tensor, dict[str, float]]:
        batches = {d: _collate(train, idx, d, label_map, cfg.assistant_only) for d in depths}
        if cfg.soft_weight > 0:  # one distribution per position: every depth predicts the same token
            first = batches[depths[0]]
            soft = target_probs(split, first["final"][first["labels"] >= 0], lm_rows, cfg.soft_top_k)
            for batch in batches.values():
                batch["soft"] = soft
        return nested_loss(head, lm_rows, batches, cfg, gen)

    step, history, t0, total, _ = train_steps(head, train, cfg, ckpt, step, history, step_loss,
                                           f"train nested head @ depths {depths}")
    trained = time.perf_counter() - t0  # the whole run's training clock (a resumed run's includes the killed one's)
    head.eval().requires_grad_(False)
    after = evaluate()
    report = {"config": asdict(cfg), "depths": depths, "steps": step, "total_steps": total,
              "train_tokens": train.num_tokens, "heldout_before": before, "heldout_after": after,
              "seconds": round(trained, 3), "eval_seconds": round(time.perf_counter() - t0 - trained, 3)}
    save_trained(head, split, vocab_ids, out, report, history)
    return head, report


def add_parser(sub: Any) -> None:
    add_command(sub, "train-nested", (ModelConfig, NestedTrainConfig), cmd_train_nested,
                "Sorted training of a nested (multi-depth) exit head from stored features.",
                skip={ModelConfig: ("device",)})  # --device is the training's (the CPU only here)


def cmd_train_nested(args: Any) -> int:
    ss = load_target(args)
    _, report = train_nested_head(ss.split, config_from_args(args, NestedTrainConfig))
    print(json.dumps({k: report[k] for k in ("steps", "seconds", "heldout_after")}, indent=2))
    return 0
