"""``selfspec train-predictors``: SpecEE's per-layer exit predictors for an exit head (selfspec/specee).

1. Collect: teacher-force the target over target-generated chat text (``answer-prompts`` output, or any
   ShareGPT-format source). For every answer token: the head's top-c candidates (as at generation), the
   candidates' logits at every layer k..L-1 from their LM-head rows only, and the full model's token.
   Label at layer i: the best candidate at layer i already is the full model's token.
2. Offline schedule: the oracle exit layer of a token is the first layer from which its label stays 1
   through the last layer; predictors are kept only at the ``keep_layers`` most frequent ones.
3. Train one MLP per kept layer (features: candidates.py, the change measured since the previous kept
   layer), with progress; report held-out precision and recall per layer, and a simulation over
   thresholds (token agreement and mean exit layer when every token exits at its first firing layer).
   The default thresholds saved with the predictors: the lowest with >= 99% simulated agreement for the
   lossy ``specee``, and the one with the best simulated cost per emitted token for ``specee-verified``.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from selfspec.api import SelfSpec
from selfspec.cli_options import add_command, config_from_args
from selfspec.config import DraftConfig, ModelConfig, opt
from selfspec.errors import InvalidConfigError
from selfspec.progress import progress
from selfspec.specee.candidates import candidate_features, candidate_logits
from selfspec.specee.predictors import ExitPredictors
from selfspec.train.features import encode_conversation
from selfspec.train.sharegpt import ConversationSource

THRESHOLDS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.97, 0.98, 0.99, 0.995)


@dataclass
class PredictorConfig(ConversationSource):
    """Settings of ``selfspec train-predictors`` (``source``: target-generated text, e.g. answer-prompts' file)."""

    head: str = opt("auto", "Exit head whose top candidates feed the predictors: a head directory, or 'auto' "
                    "(the bundled head of the default model).")
    out: str = opt("", "Where to write the predictors (default: beside the head, in its directory).")
    max_conversations: int = opt(400, "Conversations to collect from (the last heldout_conversations are held out).")
    heldout_conversations: int = opt(40, "Conversations kept out of training for the report.")
    max_tokens: int = opt(640, "Longest conversation prefix, in tokens (first turn only).")
    candidates: int = opt(4, "Candidate tokens per position (the head's top-c).")
    hidden: int = opt(512, "Hidden width of each predictor MLP.")
    keep_layers: int = opt(12, "Offline schedule: keep predictors at this many layers, the most frequent oracle "
                           "exit layers (0: every layer from the head's exit layer on).")
    epochs: int = opt(6, "Training epochs per predictor.")
    lr: float = opt(2e-3, "Adam learning rate.")
    seed: int = opt(0, "Seed of the training shuffles.")


@torch.inference_mode()
def collect(split: Any, head: Any, tokenizer: Any, cfg: PredictorConfig) -> dict[str, torch.Tensor]:
    """Candidate logits ``# [T, L - k, c]``, labels ``# [T, L - k]`` and conversation index ``# [T]`` of
    every answer token."""
    k, L, c = head.exit_layer, split.num_layers, cfg.candidates
    logits_all, labels_all, conv_all, draft_all = [], [], [], []
    convs = cfg.conversations(max_turns=2)
    bar = progress(total=cfg.max_conversations, desc="predictor features", unit="conv")
    n = 0
    for _cid, msgs in convs:
        if n >= cfg.max_conversations:
            break
        ids, mask = encode_conversation(tokenizer, msgs[:2], cfg.max_tokens)
        if len(ids) < 8 or not any(mask):
            continue
        t = torch.tensor([ids], device=split.device)
        pos = torch.arange(len(ids), device=split.device)[None]
        cache = split.new_cache(len(ids))
        h = split.run_layers(split.embed(t), 0, k, pos, cache)
        states = [h[0]]
        for i in range(k, L):
            h = split.run_layers(h, i, i + 1, pos, cache)
            states.append(h[0])
        final = states.pop()  # [T, hidden] after every layer
        full = torch.cat([split.logits(final[j : j + 128]).argmax(-1) for j in range(0, len(ids), 128)])
        if head.needs_context:
            ctx = torch.cat([torch.zeros_like(final[:1]), final[:-1]])[None]
            f_hat = head.features(states[0][None], ctx, pos, head.new_state(len(ids)))
            draft = head.logits_of(f_hat)[0]
        else:
            draft = head(states[0][None], pos, head.new_state(len(ids)))[0]
        cands = draft.topk(c).indices  # [T, c]
        dprobs = torch.softmax(draft.float(), -1).gather(1, cands)  # [T, c]
        sel = torch.tensor(mask, device=split.device)
        sel[-1] = False  # the last token's full-model choice is not part of the text
        cl = torch.stack([candidate_logits(split, s[sel], cands[sel]) for s in states], dim=1)  # [T', L - k, c]
        best = cands[sel].gather(1, cl.argmax(-1))  # [T', L - k] best candidate per layer
        logits_all.append(cl.cpu())
        draft_all.append(dprobs[sel].cpu())
        labels_all.append((best == full[sel, None]).cpu())
        conv_all.append(torch.full((int(sel.sum()),), n))
        n += 1
        bar.update()
    bar.close()
    if n == 0:
        raise InvalidConfigError(f"no usable conversations in '{cfg.source}'")
    return {"logits": torch.cat(logits_all), "labels": torch.cat(labels_all), "conv": torch.cat(conv_all),
            "draft_probs": torch.cat(draft_all)}


def oracle_exits(labels: torch.Tensor, k: int, L: int) -> torch.Tensor:
    """``# [T]`` the first layer from which each token's label stays 1 through L - 1 (L: never)."""
    ok_after = labels.flip(1).cumprod(1).flip(1).bool()  # [T, L - k] label stays 1 from here on
    any_ok = ok_after.any(1)
    first = ok_after.float().argmax(1) + k
    return torch.where(any_ok, first, torch.full_like(first, L))


def layer_features(logits: torch.Tensor, draft_probs: torch.Tensor, layers: list[int], k: int) -> list[torch.Tensor]:
    """Features ``# [T, 4c]`` at each kept layer, the change measured since the previous kept layer."""
    out, prev = [], None
    for i in layers:
        feats, prev = candidate_features(logits[:, i - k], prev, draft_probs)
        out.append(feats)
    return out


def simulate(probs: list[torch.Tensor], labels: torch.Tensor, layers: list[int], k: int, L: int,
             thresholds: tuple[float, ...] = THRESHOLDS) -> list[dict[str, float]]:
    """Every token exits at its first kept layer whose predictor probability reaches the threshold."""
    out = []
    P = torch.stack(probs, 1)  # [T, layers]
    lab = torch.stack([labels[:, i - k] for i in layers], 1)  # [T, layers]
    for t in thresholds:
        fire = P >= t
        has = fire.any(1)
        first = fire.float().argmax(1)
        exit_layer = torch.where(has, torch.tensor(layers)[first], torch.full_like(first, L))
        correct = torch.where(has, lab.gather(1, first[:, None])[:, 0], torch.ones_like(has))
        out.append({"threshold": t, "agreement": float(correct.float().mean()), "exit_rate": float(has.float().mean()),
                    "mean_exit_layer": float(exit_layer.float().mean()),
                    "exit_precision": float(correct[has].float().mean()) if has.any() else 1.0})
    return out


def verified_cost(row: dict[str, float], L: int) -> float:
    """Rough forwards per emitted token of specee-verified at a simulated threshold: a draft costs its
    layers, a run ends at the first wrong or non-exiting token (geometric), which runs every layer."""
    a = row["exit_precision"] * row["exit_rate"]  # a draft token exits and is right
    drafts = a / max(1e-6, 1 - a)  # expected accepted drafts per round
    return (drafts * row["mean_exit_layer"] / L + 1.0) / (drafts + 1.0)


def train_predictors(split: Any, head: Any, tokenizer: Any, cfg: PredictorConfig) -> tuple[ExitPredictors, dict]:
    k, L = head.exit_layer, split.num_layers
    t0 = time.perf_counter()
    data = collect(split, head, tokenizer, cfg)
    logits, labels, conv = data["logits"], data["labels"].float(), data["conv"]
    held = conv >= conv.max() + 1 - cfg.heldout_conversations
    if held.all() or not held.any():
        raise InvalidConfigError("need more conversations than heldout_conversations (and at least one held out)")
    exits = oracle_exits(labels[~held], k, L)
    hist = torch.bincount(exits - k, minlength=L - k + 1).tolist()
    by_layer = {k + i: n for i, n in enumerate(hist[:-1])}
    if cfg.keep_layers > 0:
        layers = sorted(sorted(by_layer, key=lambda i: -by_layer[i])[: cfg.keep_layers])
    else:
        layers = list(range(k, L))
    feats = layer_features(logits, data["draft_probs"], layers, k)
    preds = ExitPredictors(layers, cfg.candidates, cfg.hidden)
    g = torch.Generator().manual_seed(cfg.seed)
    report: dict[str, Any] = {"layers": {}}
    held_probs = []
    for j, i in enumerate(progress(layers, desc="train predictors", unit="layer")):
        x, y = feats[j][~held], labels[~held, i - k]
        net = preds[i]
        net.mean.copy_(x.mean(0))
        net.std.copy_(x.std(0).clamp_min(1e-3))
        opt_ = torch.optim.Adam(net.mlp.parameters(), lr=cfg.lr)
        for _ in range(cfg.epochs):
            for b in torch.randperm(len(x), generator=g).split(512):
                loss = F.binary_cross_entropy_with_logits(net(x[b]), y[b])
                opt_.zero_grad()
                loss.backward()
                opt_.step()
        with torch.no_grad():
            p = torch.sigmoid(net(feats[j][held]))
        held_probs.append(p)
        yh = labels[held, i - k].bool()
        pred = p >= 0.5
        tp = int((pred & yh).sum())
        report["layers"][i] = {
            "positives": float(yh.float().mean()), "precision@0.5": tp / max(1, int(pred.sum())),
            "recall@0.5": tp / max(1, int(yh.sum())), "oracle_exits": by_layer[i],
        }
    sim = simulate(held_probs, labels[held], layers, k, L)
    lossy = next((r["threshold"] for r in sim if r["agreement"] >= 0.99), THRESHOLDS[-1])
    verified = min(sim, key=lambda r: verified_cost(r, L))["threshold"]
    preds.meta = {
        "exit_layer": k, "num_layers": L, "head_kind": head.kind,
        "thresholds": {"specee": lossy, "specee-verified": verified},
        "oracle_exit_distribution": {str(i): n for i, n in by_layer.items()} | {str(L): hist[-1]},
        "heldout_simulation": sim, "report": report,
        "data": {"tokens": int((~held).sum()), "heldout_tokens": int(held.sum()),
                 "label_rate_last_layer": float(labels[:, -1].mean())},
        "config": asdict(cfg), "seconds": round(time.perf_counter() - t0, 1),
    }
    return preds.eval().requires_grad_(False), preds.meta


def add_parser(sub: Any) -> None:
    add_command(sub, "train-predictors", (ModelConfig, PredictorConfig), cmd_train_predictors,
                "Train SpecEE's per-layer exit predictors for an exit head.")


def cmd_train_predictors(args: Any) -> int:
    cfg = config_from_args(args, PredictorConfig)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    ss = SelfSpec.load(config_from_args(args, ModelConfig), DraftConfig(head=cfg.head, gamma=1, predictors="none"))
    if ss.head.source is None and not cfg.out:
        raise InvalidConfigError("the head has no directory to save the predictors beside: give --out")
    preds, meta = train_predictors(ss.split, ss.head, ss.tokenizer, cfg)
    out = preds.save(cfg.out or ss.head.source)
    print(json.dumps({k: meta[k] for k in ("thresholds", "data", "seconds")}, indent=1))
    for row in meta["heldout_simulation"]:
        print(json.dumps(row))
    print(f"predictors written to {out}")
    return 0

