"""Train a deep-context head (heads.deep) from stored target features (``selfspec train-deep``).

Input: feature shards from ``selfspec collect-features`` (the target teacher-forced over chat text):
exit states h_k, final states f and the target's own argmax label per token. The target stays frozen
and nothing of it runs here, so training costs only the head:

    pass 1  f^1 = head(h_k(t), f(t - 1))          true previous final states: the first draft position
    pass j  f^j = head(h_k(t), f^(j-1)(t - 1))    the head's own predictions: draft position j (j <= rollout)
    loss = CE(pass 1) + unroll_weight * sum_j CE(pass j) + reg_weight * MSE(rms(f^1), rms(f))

with the CE over the draft's trimmed vocabulary (VocabTrim: the most frequent labels) against the
target's argmax. Passes 2 .. rollout (EAGLE-3's training-time test) train the head on its own predicted
features, which is what it reads from the second draft token on: pass j at position t has read its own outputs at
t - j + 1 .. t - 1, as the j-th token of a draft does. Resumable (checkpoint + fixed batch order), time-boxed (``minutes``).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from selfspec.cli_options import add_command, config_from_args
from selfspec.config import ModelConfig, int_set
from selfspec.errors import InvalidConfigError
from selfspec.heads.deep import DeepContextHead
from selfspec.heads.io import load_head, new_head, save_head
from selfspec.heads.kangaroo import RMSNorm
from selfspec.models.split import SplitModel
from selfspec.train.cli import load_target
from selfspec.train.deep_config import DeepTrainConfig
from selfspec.train.features import FeatureSet, load_exit_features
from selfspec.train.loop import autocast_dtype, batches, resume, train_steps, training_device


def _collate(fs: FeatureSet, idx: list[int], k: int, label_map: torch.Tensor | None,
             assistant_only: bool, context_layers: list[int] | None = None) -> dict[str, torch.Tensor]:
    """Right-padded batch: h [B, T, H], ctx [B, T, H * (1 + C)] (f of the previous token, then its states after
    each of the C ``context_layers``), final [B, T, H], labels [B, T] (trimmed-vocab index, -100 = not trained)."""
    seqs = [fs.sequence(i) for i in idx]
    T, H, B = max(len(s["label"]) for s in seqs), fs.tensors["final"].shape[1], len(seqs)
    keys = ["final", *(f"h{c}" for c in context_layers or [])]
    h, states = torch.zeros(B, T, H), torch.zeros(B, T, H * len(keys))
    labels = torch.full((B, T), -100, dtype=torch.long)
    for b, s in enumerate(seqs):
        n = len(s["label"])
        h[b, :n] = s[f"h{k}"].float()
        for j, key in enumerate(keys):
            states[b, :n, H * j : H * (j + 1)] = s[key].float()
        lab = s["label"].long()
        if label_map is not None:
            lab = label_map[lab]
        if assistant_only:
            lab = torch.where(s["assistant"], lab, torch.full_like(lab, -100))
        labels[b, :n] = lab
    ctx = torch.cat([torch.zeros_like(states[:, :1]), states[:, :-1]], dim=1)
    return {"h": h, "ctx": ctx, "final": states[..., :H], "labels": labels}


class DeepFeatures(Protocol):
    """What the loss and the evaluation use of a deep head: a ``DeepContextHead``, or a nested head at one
    depth (``selfspec.train.nested.DepthView``)."""

    norm_out: RMSNorm

    def features(self, h: torch.Tensor, context: torch.Tensor, positions: torch.Tensor, /) -> torch.Tensor: ...

    def eval(self) -> object: ...

    def train(self) -> object: ...


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def deep_loss(head: DeepFeatures, lm_rows: torch.Tensor, batch: dict[str, torch.Tensor], cfg: DeepTrainConfig,
              ) -> tuple[torch.Tensor, dict[str, float]]:
    h, ctx, final, labels = batch["h"], batch["ctx"], batch["final"], batch["labels"]
    pos = torch.arange(h.shape[1])[None].expand(h.shape[0], -1)
    valid = labels >= 0
    f1 = head.features(h, ctx, pos)
    logits1 = (head.norm_out(f1)[valid] @ lm_rows.T).float()  # [n, vocab_trim] (float32 losses under autocast)
    ce1 = F.cross_entropy(logits1, labels[valid])
    # [n, vocab_trim] the target's probabilities at the valid positions: set by training when cfg.soft_weight > 0
    soft = batch.get("soft")

    def classify(logits: torch.Tensor, ce: torch.Tensor) -> torch.Tensor:  # the hard CE, mixed with the soft one
        if soft is None:
            return ce
        return (1 - cfg.soft_weight) * ce - cfg.soft_weight * (soft * logits.log_softmax(-1)).sum(-1).mean()

    reg = F.mse_loss(_rms(f1.float()), _rms(final))
    loss, m = classify(logits1, ce1) + cfg.reg_weight * reg, {}
    m["top1"] = float((logits1.argmax(-1) == labels[valid]).float().mean())
    f_prev = f1
    for j in range(2, cfg.rollout + 1 if cfg.unroll_weight > 0 else 2):
        ctx_j = torch.cat([ctx[:, :1, : f_prev.shape[-1]], f_prev[:, :-1]], dim=1)  # draft positions: f^ only
        f_prev = head.features(h, ctx_j, pos)
        logits_j = (head.norm_out(f_prev)[valid] @ lm_rows.T).float()
        ce_j = F.cross_entropy(logits_j, labels[valid])
        loss = loss + cfg.unroll_weight * classify(logits_j, ce_j)
        top1 = float((logits_j.argmax(-1) == labels[valid]).float().mean())
        if j == 2:
            m["top1_unrolled"], m["ce2"] = top1, float(ce_j.detach())
        else:
            m[f"top1_pass{j}"] = top1
    m.update(ce=float(ce1.detach()), reg=float(reg.detach()), tokens=int(valid.sum()))
    return loss, m


@torch.no_grad()
def evaluate_deep(head: DeepFeatures, lm_rows: torch.Tensor, fs: FeatureSet, cfg: DeepTrainConfig,
                  label_map: torch.Tensor | None) -> dict[str, float]:
    """Held-out top-1 agreement with the target's next token: pass 1 (first draft position, true
    previous final state), pass 2 (reading the head's own prediction: top1_unrolled) and passes 3 .. rollout
    (top1_pass<j>), token-weighted. Labels outside
    the draft vocabulary count as misses."""
    head.eval()
    tot: dict[str, float] = {}
    n = 0
    context_layers = _context_layers(cfg)
    for idx in batches(fs, cfg.batch_tokens, 0, 0):
        batch = _collate(fs, idx, cfg.exit_layer, None, cfg.assistant_only, context_layers)
        full = batch["labels"]
        valid = full >= 0
        if label_map is not None:
            batch["labels"] = torch.where(valid, label_map[full.clamp_min(0)], full)
        _, m = deep_loss(head, lm_rows, to_device(batch, lm_rows.device), cfg)
        kept = int((batch["labels"] >= 0).sum())
        for key in ("top1", "top1_unrolled", *(f"top1_pass{j}" for j in range(3, cfg.rollout + 1)), "ce", "reg"):
            if key in m:
                tot[key] = tot.get(key, 0.0) + m[key] * kept
        tot["kept"] = tot.get("kept", 0.0) + kept
        n += int(valid.sum())
    out = {k: v / max(tot["kept"], 1) for k, v in tot.items() if k != "kept"}
    share = tot["kept"] / max(n, 1)  # agreement among kept labels times the share the vocabulary holds
    for key in out:
        if key.startswith("top1"):
            out[key] *= share
    head.train()
    return out | {"tokens": n, "label_in_vocab": share}


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """A collated batch on the training device (a no-op on the CPU)."""
    return batch if device.type == "cpu" else {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def _context_layers(cfg: DeepTrainConfig) -> list[int]:
    return int_set(cfg.context_layers, "context layers")


def save_trained(head: DeepContextHead, split: SplitModel, vocab_ids: torch.Tensor | None, out: Path,
                 report: dict[str, Any], history: list[dict[str, Any]]) -> None:
    """Save a trained head in the target's dtype, over its draft vocabulary, with its training report
    (in head_config.json, and with the per-step history in train_report.json)."""
    head.to(dtype=split.dtype)
    if vocab_ids is not None:
        head.trim_vocab(vocab_ids)
    save_head(head, out, extra={"training": report})
    (out / "train_report.json").write_text(json.dumps(report | {"history": history}, indent=1))


def label_order(labels: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Token ids ``# [vocab]`` by how often the target chose them (``labels # [T]``), most frequent first: the
    draft vocabulary (VocabTrim) is a prefix of this order."""
    return torch.bincount(labels.long(), minlength=vocab_size).argsort(descending=True)


def vocab_label_map(vocab_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Token id -> its index in ``vocab_ids`` ``# [N]``, -100 (not trained) for every other id."""
    label_map = torch.full((vocab_size,), -100, dtype=torch.long)
    label_map[vocab_ids] = torch.arange(len(vocab_ids))
    return label_map


@torch.no_grad()
def target_probs(split: SplitModel, final: torch.Tensor, lm_rows: torch.Tensor, top_k: int = 0) -> torch.Tensor:
    """The target's next-token distribution over the draft vocabulary ``# [n, vocab_trim]`` from its final states
    ``# [n, hidden]`` (as stored: before the final norm) and those rows of its LM head, in float32; with ``top_k``,
    only its k most probable tokens, renormalized (HASS's top-K distillation), zeros elsewhere."""
    with torch.autocast("cpu", enabled=False):
        logits = split.final_norm(final.float()) @ lm_rows.T
        if split.softcap is not None:
            logits = torch.tanh(logits / split.softcap) * split.softcap
        if 0 < top_k < logits.shape[-1]:
            kept = logits.topk(top_k, dim=-1)
            logits = torch.full_like(logits, float("-inf")).scatter_(-1, kept.indices, kept.values)
        return logits.softmax(-1)


def train_deep_head(split: SplitModel, cfg: DeepTrainConfig) -> tuple[DeepContextHead, dict[str, Any]]:
    device = training_device(cfg)
    key, context_layers = f"h{cfg.exit_layer}", _context_layers(cfg)
    extra = [f"h{c}" for c in context_layers]
    train = load_exit_features(cfg.features, cfg.exit_layer, split, cfg.max_tokens, extra)
    held_sets = {d.strip(): load_exit_features(d.strip(), cfg.exit_layer, split, 0, extra)
                 for d in cfg.heldout_features.split(",") if d.strip()}
    for where, fs in [(cfg.features, train), *held_sets.items()]:
        missing = [k for k in [key, *extra] if k not in fs.tensors]
        if missing:
            stored = sorted(k for k in fs.tensors if k.startswith("h"))
            raise InvalidConfigError(f"states {missing} are not stored in {where} (stored: {stored}): collect them "
                                     "with collect-features --layers")
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    head = new_head("deep", split, cfg.exit_layer, context_layers=context_layers, head_layers=cfg.head_layers)
    assert isinstance(head, DeepContextHead)
    head.init_from_target()
    if cfg.init:
        start = load_head(cfg.init, split)  # its own exit layer: the weights fit a head at any layer
        if start.kind != "deep":
            raise InvalidConfigError(f"--init '{cfg.init}' is a '{start.kind}' head, not a deep one")
        weights = {k: v for k, v in start.state_dict().items() if k != "vocab_ids"}
        fuse = weights.pop("fuse.weight")  # its first columns (h_k, f); context layers it lacks start unread
        head.load_state_dict(weights, strict=False)
        with torch.no_grad():
            head.fuse.weight.zero_()
            head.fuse.weight[:, : fuse.shape[1]].copy_(fuse[:, : head.fuse.weight.shape[1]])
    head.float().to(device).train().requires_grad_(True)
    vocab_ids, label_map = None, None
    if cfg.vocab_trim > 0:
        vocab_ids = label_order(train.tensors["label"], split.vocab_size)[: cfg.vocab_trim]
        label_map = vocab_label_map(vocab_ids, split.vocab_size)
    # only the kept rows (a quantized LM head dequantizes just those)
    lm_rows = split.lm_rows(vocab_ids) if vocab_ids is not None else split.lm_head.weight.detach().float()
    lm_cpu, lm_rows = lm_rows, lm_rows.to(device)  # the target's (CPU) final norm forms the soft labels
    ckpt = out.with_name(out.name + ".checkpoint.pt")  # beside the head: saving the head replaces its directory
    step, history = resume(head, ckpt, cfg)
    before = ({d: evaluate_deep(head, lm_rows, fs, cfg, label_map) for d, fs in held_sets.items()}
              if step == 0 else {})

    def step_loss(idx: list[int]) -> tuple[torch.Tensor, dict[str, float]]:
        batch = _collate(train, idx, cfg.exit_layer, label_map, cfg.assistant_only, context_layers)
        if cfg.soft_weight > 0:
            batch["soft"] = target_probs(split, batch["final"][batch["labels"] >= 0], lm_cpu, cfg.soft_top_k)
        return deep_loss(head, lm_rows, to_device(batch, device), cfg)

    step, history, t0, total, schedule = train_steps(head, train, cfg, ckpt, step, history, step_loss,
                                           f"train deep head @ layer {cfg.exit_layer}")
    trained = time.perf_counter() - t0  # the whole run's training clock (a resumed run's includes the killed one's)
    head.eval().requires_grad_(False)
    after = {d: evaluate_deep(head, lm_rows, fs, cfg, label_map) for d, fs in held_sets.items()}
    head.cpu()  # the saved head is a CPU head whichever device trained it
    first = next(iter(held_sets), "")  # heldout_before / _after: the first set ("": none); heldout_sets: every one
    report = {"config": asdict(cfg), "steps": step, "total_steps": total, "schedule_steps": schedule,
              "autocast": str(autocast_dtype(cfg.precision, device.type) or "none"), "device": str(device), "train_tokens": train.num_tokens,
              "train_conversations": len(train), "heldout_before": before.get(first), "heldout_after": after.get(first),
              "heldout_sets": {d: {"before": before.get(d), "after": after[d]} for d in held_sets},
              "seconds": round(trained, 3), "eval_seconds": round(time.perf_counter() - t0 - trained, 3)}
    save_trained(head, split, vocab_ids, out, report, history)
    return head, report


def add_parser(sub: Any) -> None:
    add_command(sub, "train-deep", (ModelConfig, DeepTrainConfig), cmd_train_deep,
                "Train a deep-context head from stored target features.",
                skip={ModelConfig: ("device",)})  # --device is where the head trains; the target stays on the CPU


def cmd_train_deep(args: Any) -> int:
    ss = load_target(args)
    _, report = train_deep_head(ss.split, config_from_args(args, DeepTrainConfig))
    print(json.dumps({k: report[k] for k in ("steps", "seconds", "heldout_sets")}, indent=2))
    return 0
