"""Train an exit head by self-distillation (Kangaroo adapter or the light linear head; EESD-style).

The target stays frozen: its layers [0, k) give the exit states h_k, its full forward gives the
teacher distribution p at every position, and only the head learns, with

    loss = kl_weight * KL(p || q) + ce_weight * CE(q, target's next token)

over the positions whose next token the target generated (the answer part of each sequence).

Reproducible and interruptible: a fixed seed decides the held-out split and the batch order of every
epoch, a checkpoint (head + optimizer + step) is written atomically every ``checkpoint_every`` steps,
and ``resume`` continues from it to the same result as an uninterrupted run.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from selfspec.config import opt
from selfspec.heads.base import ExitHead
from selfspec.heads.io import new_head, save_head
from selfspec.models.split import SplitModel
from selfspec.progress import progress


@dataclass
class TrainConfig:
    """Settings of ``selfspec train`` (written into the head's config and the run's report)."""

    exit_layer: int = opt(6, "Exit layer k: the head reads the hidden state after target layers [0, k).")
    kind: str = opt("kangaroo", "Head kind: 'kangaroo' (attention adapter), 'linear' (light residual map) or "
                    "'layer' (a trainable copy of target layer k).", choices=["kangaroo", "linear", "layer"])
    rank: int = opt(64, "Rank of the 'linear' head's residual map (0: a full hidden x hidden matrix).")
    out: str = opt("runs/head", "Output directory of the trained head (safetensors + head_config.json).")
    data: str = opt("", "Self-distillation data JSONL (default: <out>-data.jsonl beside the head, generated when missing or short).")
    prompts: str = opt("default", "Seed prompts: 'default' (the project's set), a .jsonl/.txt file, or hf:NAME.")
    num_prompts: int = opt(240, "How many seed prompts to generate data from.")
    gen_tokens: int = opt(160, "New tokens the target generates per seed prompt.")
    gen_batch: int = opt(16, "Prompts per batched generate call when making data.")
    epochs: int = opt(4, "Passes over the training sequences.")
    batch_size: int = opt(4, "Sequences per optimizer step.")
    lr: float = opt(1e-3, "Peak learning rate (AdamW, linear warm-up then cosine decay).")
    weight_decay: float = opt(0.0, "AdamW weight decay.")
    warmup: int = opt(20, "Warm-up steps.")
    kl_weight: float = opt(1.0, "Weight of KL(target || draft).")
    ce_weight: float = opt(0.1, "Weight of cross-entropy to the target's own next token.")
    heldout: float = opt(0.1, "Share of sequences held out for evaluation.")
    seed: int = opt(0, "Seed of the split, the batch order and the head's initialization.")
    checkpoint_every: int = opt(50, "Write a checkpoint every this many steps.")
    resume: bool = opt(True, "Continue from <out>/checkpoint.pt when it exists.")
    max_steps: int = opt(0, "Stop after this many steps in all (0: run every epoch); for tests and smoke runs.")
    vocab_trim: int = opt(0, "VocabTrim: keep the draft LM head to the N tokens most frequent in the data (0: off).")


@dataclass
class Features:
    """Per sequence: exit states ``# [T, hidden]``, the target's normed final states ``# [T, hidden]``,
    the token ids ``# [T]`` and where the answer starts."""

    exit_states: torch.Tensor
    final_normed: torch.Tensor
    ids: torch.Tensor
    answer_start: int


@torch.inference_mode()
def compute_features(split: SplitModel, seqs: list[dict[str, list[int]]], exit_layer: int) -> list[Features]:
    out = []
    for s in progress(seqs, desc=f"target features (exit layer {exit_layer})", unit="seq", inner=True):
        ids = s["prompt_ids"] + s["output_ids"]
        t = torch.tensor([ids], device=split.device)
        cache = split.new_cache(len(ids))
        pos = torch.arange(len(ids), device=split.device)[None]
        h_k = split.run_layers(split.embed(t), 0, exit_layer, pos, cache)
        h_l = split.run_layers(h_k, exit_layer, split.num_layers, pos, cache)
        out.append(Features(h_k[0].clone(), split.norm(h_l)[0].clone(), t[0].clone(), len(s["prompt_ids"])))
    return out


def split_heldout(n: int, share: float, seed: int) -> tuple[list[int], list[int]]:
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    k = max(1, round(n * share)) if share > 0 and n > 1 else 0
    return sorted(order[k:]), sorted(order[:k])


def _batch(feats: list[Features]) -> tuple[torch.Tensor, ...]:
    """Right-padded batch: h [B, T, hidden], teacher states [B, T, hidden], next ids [B, T], mask [B, T]."""
    T = max(len(f.ids) for f in feats) - 1
    B, H = len(feats), feats[0].exit_states.shape[-1]
    h = feats[0].exit_states.new_zeros(B, T, H)
    teacher = h.new_zeros(B, T, H)
    nxt = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for i, f in enumerate(feats):
        n = len(f.ids) - 1
        h[i, :n], teacher[i, :n], nxt[i, :n] = f.exit_states[:n], f.final_normed[:n], f.ids[1:]
        mask[i, max(f.answer_start - 1, 0) : n] = True  # positions whose next token the target generated
    return h, teacher, nxt, mask


def head_loss(head: ExitHead, feats: list[Features], cfg: TrainConfig) -> tuple[torch.Tensor, dict[str, float]]:
    h, teacher, nxt, mask = _batch(feats)
    pos = torch.arange(h.shape[1], device=h.device)[None].expand(h.shape[0], -1)
    q_logits = head(h, pos)[mask]  # [n, vocab]
    with torch.no_grad():
        p_logits = head.split.head_logits(teacher[mask])  # [n, vocab]
        p_log = F.log_softmax(p_logits, -1)
    q_log = F.log_softmax(q_logits, -1)
    kl = F.kl_div(q_log, p_log, log_target=True, reduction="batchmean")
    ce = F.nll_loss(q_log, p_logits.argmax(-1))
    loss = cfg.kl_weight * kl + cfg.ce_weight * ce
    agree = float((q_logits.argmax(-1) == p_logits.argmax(-1)).float().mean())
    return loss, {"kl": float(kl.detach()), "ce": float(ce.detach()), "top1_agreement": agree, "tokens": int(mask.sum())}


@torch.no_grad()
def evaluate(head: ExitHead, feats: list[Features], cfg: TrainConfig) -> dict[str, float]:
    """Held-out KL and top-1 agreement (the per-token greedy acceptance), token-weighted."""
    tot = {"kl": 0.0, "ce": 0.0, "top1_agreement": 0.0}
    n: float = 0  # tokens
    for i in range(0, len(feats), cfg.batch_size):
        _, m = head_loss(head, feats[i : i + cfg.batch_size], cfg)
        for k in tot:
            tot[k] += m[k] * m["tokens"]
        n += m["tokens"]
    return {k: v / max(n, 1) for k, v in tot.items()} | {"tokens": n}


def cosine_lr(step: int, total: int, lr: float, warmup: int, floor: float = 0.0) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to ``floor * lr`` at ``total``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    frac = min((step - warmup) / max(1, total - warmup), 1.0)
    return lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac)))


def _save_checkpoint(path: Path, head: ExitHead, opt: torch.optim.Optimizer, step: int, history: list) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "step": step, "history": history}, tmp)
    os.replace(tmp, path)


def train_head(split: SplitModel, seqs: list[dict[str, list[int]]], cfg: TrainConfig,
               interrupt_at: int | None = None, features: list[Features] | None = None,
               inner: bool = False) -> tuple[ExitHead, dict[str, Any]]:
    """Train a head on ``seqs``; returns it and a report (held-out metrics before and after).
    ``features``: precomputed ``compute_features(split, seqs, cfg.exit_layer)``.
    ``inner``: this training is one step of a larger task (its progress bar is cleared when done).
    ``interrupt_at`` stops after that step as a crash would (tests of resume)."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    args = {"rank": cfg.rank} if cfg.kind == "linear" else {}
    head = new_head(cfg.kind, split, cfg.exit_layer, **args)
    head.init_from_target()
    head.train().requires_grad_(True)
    feats = features if features is not None else compute_features(split, seqs, cfg.exit_layer)
    train_idx, held_idx = split_heldout(len(feats), cfg.heldout, cfg.seed)
    train_f, held_f = [feats[i] for i in train_idx], [feats[i] for i in held_idx]
    steps_per_epoch = math.ceil(len(train_f) / cfg.batch_size)
    total = steps_per_epoch * cfg.epochs if cfg.max_steps <= 0 else min(cfg.max_steps, steps_per_epoch * cfg.epochs)
    params = list(head.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    before = evaluate(head, held_f, cfg) if held_f else {}
    step, history = 0, []
    ckpt = out / "checkpoint.pt"
    if cfg.resume and ckpt.is_file():
        state = torch.load(ckpt, map_location=split.device)
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        step, history = state["step"], state["history"]
    bar = progress(total=total, initial=step, desc=f"train {cfg.kind} head @ layer {cfg.exit_layer}", unit="step",
                   inner=inner)
    t0 = time.perf_counter()
    seen: float = 0  # tokens trained on
    while step < total:
        epoch, within = divmod(step, steps_per_epoch)
        order = torch.randperm(len(train_f), generator=torch.Generator().manual_seed(cfg.seed * 1000 + epoch)).tolist()
        batch = [train_f[i] for i in order[within * cfg.batch_size : (within + 1) * cfg.batch_size]]
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, total, cfg.lr, cfg.warmup)
        loss, m = head_loss(head, batch, cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        seen += m["tokens"]
        history.append({"step": step, "loss": float(loss.detach()), **m})
        bar.set_postfix(loss=f"{float(loss.detach()):.3f}", agree=f"{m['top1_agreement']:.2f}",
                        tok_s=f"{seen / (time.perf_counter() - t0):.0f}")
        bar.update()
        if step % cfg.checkpoint_every == 0 or step == total:
            _save_checkpoint(ckpt, head, opt, step, history)
        if interrupt_at is not None and step >= interrupt_at and step < total:
            bar.close()
            raise KeyboardInterrupt(f"interrupted after step {step}")
    bar.close()
    head.eval().requires_grad_(False)
    after = evaluate(head, held_f, cfg) if held_f else {}
    report = {"config": asdict(cfg), "steps": step, "train_sequences": len(train_f),
              "heldout_sequences": len(held_f), "heldout_before": before, "heldout_after": after,
              "heldout_indices": held_idx}
    if cfg.vocab_trim > 0:
        head.trim_vocab(frequent_tokens([seqs[i] for i in train_idx], cfg.vocab_trim))
    save_head(head, out, extra={"training": report})
    (out / "train_report.json").write_text(json.dumps(report | {"history": history}, indent=1))
    return head, report


def frequent_tokens(seqs: list[dict[str, list[int]]], n: int) -> torch.Tensor:
    """VocabTrim: the ``n`` token ids the target generated most often (``# [n]``)."""
    counts: dict[int, int] = {}
    for s in seqs:
        for t in s["output_ids"]:
            counts[t] = counts.get(t, 0) + 1
    return torch.tensor(sorted(counts, key=lambda t: -counts[t])[:n])
