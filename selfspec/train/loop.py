"""The optimizer loop of the heads trained from stored features (train-deep, train-nested): batches of whole
conversations in a fixed order per epoch, warm-up + cosine learning rate, the matmul precision (bfloat16 autocast
where the CPU multiplies it natively), checkpoints to resume from, and a time box the schedule is fitted to.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from selfspec.errors import InvalidConfigError
from selfspec.machine import cpu_info
from selfspec.progress import progress
from selfspec.train.deep_config import PRECISIONS, DeepTrainConfig
from selfspec.train.features import FeatureSet
from selfspec.train.trainer import cosine_lr


def batches(fs: FeatureSet, batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """An epoch's batches of conversation indices: a fixed order per (seed, epoch), each batch as many
    conversations as fit in ``batch_tokens`` padded to its longest."""
    order = torch.randperm(len(fs), generator=torch.Generator().manual_seed(seed * 1000 + epoch)).tolist()
    lengths = (fs.offsets[1:] - fs.offsets[:-1]).tolist()
    out: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    for i in order:
        if cur and max(longest, lengths[i]) * (len(cur) + 1) > batch_tokens:
            out.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, lengths[i])
    if cur:
        out.append(cur)
    return out


def training_device(cfg: DeepTrainConfig) -> torch.device:
    """``cfg.device`` as a torch device; 'cuda' where torch sees none is an error naming the fix."""
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidConfigError("device 'cuda': torch sees no CUDA device here (torch.cuda.is_available() is False; "
                                 "the CPU wheel has no CUDA): train with --device cpu")
    return device


def resume(head: torch.nn.Module, ckpt: Path, cfg: DeepTrainConfig) -> tuple[int, list[dict[str, Any]]]:
    """(step, history) of a killed run's checkpoint, loaded into ``head`` (the optimizer state is loaded by
    ``train_steps``); (0, []) for a fresh run. A checkpoint written on another device loads onto ``head``'s."""
    if cfg.resume and ckpt.is_file():
        state = torch.load(ckpt, map_location=next(head.parameters()).device)
        head.load_state_dict(state["head"])
        return state["step"], state["history"]
    return 0, []


FIT_AFTER = 10  # steps timed (after the first) before a time-boxed run fits its schedule to the time box


def bf16_native() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX-512 BF16 or AMX: oneDNN's bf16 GEMM then does twice
    the multiply-adds of float32 per instruction; docs/TRAINING.md). Elsewhere bf16 is emulated and no faster."""
    supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)  # absent from builds without oneDNN
    return bool(supported is not None and supported() and cpu_info().flags & {"avx512_bf16", "amx_bf16"})


def autocast_dtype(precision: str, device: str = "cpu") -> torch.dtype | None:
    """The autocast dtype of ``DeepTrainConfig.precision`` on ``device`` (None: float32 throughout): under 'auto',
    bfloat16 on a CUDA device and on a CPU that multiplies it natively."""
    if precision not in PRECISIONS:
        raise InvalidConfigError(f"unknown training precision '{precision}' (known: {', '.join(PRECISIONS)})")
    native = torch.device(device).type == "cuda" or bf16_native()
    if precision == "bfloat16" or (precision == "auto" and native):
        return torch.bfloat16
    return None


def fitted_schedule(step: int, pace: float, left: float, total: int) -> int:
    """The steps a time-boxed schedule spans: those done (``step``) and those that fit in the ``left`` seconds at
    ``pace`` seconds a step, at least one more and at most ``total``. E.g. step 11, 6.3 s a step, 800 s left:
    11 + 126 = 137 steps (of the 560 that 4 epochs would take)."""
    return min(total, step + max(1, int(left / max(pace, 1e-9))))


def train_steps(head: torch.nn.Module, train: FeatureSet, cfg: DeepTrainConfig, ckpt: Path, step: int,
                history: list[dict[str, Any]], step_loss: Any, desc: str) -> tuple[int, list, float, int, int]:
    """The optimizer loop shared by train-deep and train-nested: a fixed batch order per epoch (so a resumed
    run continues the same way), warm-up + cosine learning rate, clipping, a checkpoint every
    ``checkpoint_every`` steps, stop at ``epochs`` or ``minutes``; the matmuls in ``cfg.precision``.
    ``step_loss(conversation indices)`` -> (loss, metrics). Returns (step, history, start time, total steps, steps the
    learning-rate schedule spanned).

    With a time box and ``fit_schedule``, the cosine ends with the time box: from FIT_AFTER steps on, the pace so far
    (timed from the run's second step) gives the steps that fit, and the schedule spans those (at most ``epochs``'
    worth) instead of the epochs' steps a time box would cut off at a high learning rate. It is refitted every step,
    so a pace that drifts (a first epoch's slower steps, a busier machine) still ends the cosine at the time box.
    A checkpoint keeps the schedule's length and the seconds trained so far for a resumed run to start from: the
    time box is the whole training's, so a run killed and resumed trains ``minutes`` in all (plus the steps after its
    last checkpoint, which are done again), not ``minutes`` more. The returned start time is the whole run's."""
    per_epoch = len(batches(train, cfg.batch_tokens, cfg.seed, 0))
    total = max(1, int(per_epoch * cfg.epochs))
    device = next(head.parameters()).device
    cast = autocast_dtype(cfg.precision, device.type)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    schedule = total  # steps the learning-rate schedule spans
    spent = 0.0  # seconds earlier runs trained (up to their last checkpoint): the time box counts them
    if step > 0:
        state = torch.load(ckpt, map_location=device)
        opt.load_state_dict(state["opt"])
        schedule = state.get("schedule", total)
        spent = float(state.get("seconds", 0.0))
    bar = progress(total=total, initial=step, desc=desc, unit="step")
    start, seen = time.perf_counter(), 0
    t0 = start - spent  # the run's clock: a resumed run continues the killed one's time box, not a fresh one
    order: tuple[int, list[list[int]]] = (-1, [])
    budget = cfg.minutes * 60 if cfg.minutes > 0 else float("inf")
    fit = cfg.fit_schedule and cfg.minutes > 0
    paced: tuple[int, float] | None = None  # (step, time) after this run's first step: the pace is timed from there
    while step < total and time.perf_counter() - t0 < budget:
        epoch, within = divmod(step, per_epoch)
        if epoch != order[0]:  # the epoch's batch order, drawn once
            order = (epoch, batches(train, cfg.batch_tokens, cfg.seed, epoch))
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, schedule, cfg.lr, cfg.warmup, floor=0.05)
        # another epoch's order can pack into a batch or two fewer than epoch 0's (whose count sets the schedule)
        with torch.autocast(device.type, dtype=cast or torch.bfloat16, enabled=cast is not None):
            loss, m = step_loss(order[1][within % len(order[1])])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        step += 1
        seen += m["tokens"]
        now = time.perf_counter()
        if fit and paced is None:
            paced = (step, now)
        elif fit and paced is not None and step - paced[0] >= FIT_AFTER:  # refitted every step: the pace may drift
            schedule = fitted_schedule(step, (now - paced[1]) / (step - paced[0]), budget - (now - t0), total)
        history.append({"step": step, "loss": float(loss.detach()), "lr": opt.param_groups[0]["lr"], **m})
        bar.set_postfix(loss=f"{float(loss.detach()):.3f}", tok_s=f"{seen / (now - start):.0f}",
                        **{k: f"{v:.2f}" for k, v in m.items() if k.startswith("top1")})
        bar.update()
        if step % cfg.checkpoint_every == 0 or step == total:
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "step": step, "history": history,
                        "schedule": schedule, "seconds": now - t0}, tmp)
            os.replace(tmp, ckpt)
    bar.close()
    return step, history, t0, total, schedule
