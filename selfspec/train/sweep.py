"""``selfspec sweep-exit``: which exit layer pays best? For each candidate layer k it measures

    a(k)  draft acceptance: how often the head's top-1 equals the target's (answer positions of
          self-distillation data; the per-token greedy acceptance probability),
    c(k)  draft cost: one shallow pass (layers [0, k)) + head for one token, relative to one plain
          decoding step (all layers + LM head), timed on this machine,
    v(k, g)  verification cost: layers [k, L) + LM head over g + 1 tokens, relative to a plain step,

and reports, maximized over gamma, the bound of docs/ARCHITECTURE.md (Leviathan et al., 2023)
    bound = E(a, g) / (g * c + 1),   E(a, g) = (1 - a^(g+1)) / (1 - a)
next to an estimate with the measured costs of one step of this engine
    estimate = E(a, g) / ((g + 1) * shallow(k) + g * head + v(k, g))
(g + 1 shallow passes: the last draft token needs its layer-k state for verification). On a CPU,
verifying g + 1 tokens costs well over one plain step, so the estimate is the number to trust.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from selfspec.cli_options import add_command, config_from_args
from selfspec.config import ModelConfig, opt
from selfspec.errors import ModelNotFoundError
from selfspec.heads.io import check_exit_layer, new_head
from selfspec.models.split import SplitModel
from selfspec.progress import progress
from selfspec.timing import time_call
from selfspec.train.cli import load_target
from selfspec.train.data import read_sequences
from selfspec.train.trainer import Features, TrainConfig, evaluate, split_heldout, train_head


@dataclass
class SweepConfig:
    """Settings of ``selfspec sweep-exit``."""

    layers: list[int] = opt([2, 4, 6, 8, 10, 12, 16, 20, 24], "Candidate exit layers.")
    data: str = opt("runs/distill-data.jsonl", "Self-distillation data JSONL (see `selfspec train`).")
    num_seqs: int = opt(40, "Sequences of the data used to measure acceptance.")
    kind: str = opt("lm", "Head measured at each layer: 'lm' (untrained exit) or 'linear' / 'kangaroo' "
                    "(trained briefly per layer, `train_steps` steps).", choices=["lm", "linear", "kangaroo", "layer"])
    train_steps: int = opt(60, "Training steps per layer for a trained kind.")
    max_gamma: int = opt(8, "Largest gamma considered.")
    out: str = opt("runs/sweep-exit.json", "Result JSON (a PNG plot is written beside it).")


@torch.inference_mode()
def measure_costs(split: SplitModel, max_tokens: int, context: int = 128) -> dict[str, list[float]]:
    """Seconds per layer for n = 1..max_tokens new tokens over a ``context``-token cache, and of the
    LM head for n rows (medians)."""
    cache = split.new_cache(context + max_tokens + 1)
    ids = torch.randint(0, split.vocab_size, (1, context), device=split.device)
    split.forward_all(ids, torch.arange(context)[None], cache)
    layer, head = [], []
    for n in range(1, max_tokens + 1):
        h = torch.randn(1, n, split.hidden_size, dtype=split.dtype, device=split.device)
        pos = torch.arange(context, context + n)[None]

        def run(h=h, pos=pos):
            split.run_layers(h, 0, split.num_layers, pos, cache)
            cache.truncate(context)

        layer.append(time_call(run, reps=7, warmup=1, quantile=0.5) / split.num_layers)
        head.append(time_call(lambda h=h: split.logits(h), reps=7, warmup=1, quantile=0.5))
    return {"layer": layer, "head": head}


def estimate(a: float, k: int, L: int, costs: dict[str, list[float]], max_gamma: int) -> dict[str, Any]:
    lay, head = costs["layer"], costs["head"]
    plain = L * lay[0] + head[0]
    c = (k * lay[0] + head[0]) / plain
    best: dict[str, Any] = {"bound": 0.0, "estimate": 0.0}
    for g in range(1, max_gamma + 1):
        e = (1 - a ** (g + 1)) / (1 - a) if a < 1 else g + 1.0
        bound = e / (g * c + 1)
        step = (g + 1) * k * lay[0] + g * head[0] + (L - k) * lay[g] + head[g]
        est = e / (step / plain)
        if bound > best["bound"]:
            best.update(bound=bound, bound_gamma=g)
        if est > best["estimate"]:
            best.update(estimate=est, estimate_gamma=g, expected_tokens_per_step=e)
    return best | {"draft_cost": c}


@torch.inference_mode()
def multi_layer_features(split: SplitModel, seqs: list[dict], layers: list[int]) -> dict[int, list[Features]]:
    """Exit states at every layer in ``layers`` from one forward per sequence."""
    out: dict[int, list[Features]] = {k: [] for k in layers}
    for s in progress(seqs, desc="target features (all layers)", unit="seq", inner=True):
        ids = s["prompt_ids"] + s["output_ids"]
        t = torch.tensor([ids], device=split.device)
        cache = split.new_cache(len(ids))
        pos = torch.arange(len(ids), device=split.device)[None]
        h, states, prev = split.embed(t), {}, 0
        for k in sorted(layers):
            h = split.run_layers(h, prev, k, pos, cache)
            states[k], prev = h[0].clone(), k
        final = split.norm(split.run_layers(h, prev, split.num_layers, pos, cache))[0]
        for k in layers:
            out[k].append(Features(states[k], final, t[0], len(s["prompt_ids"])))
    return out


def sweep(split: SplitModel, seqs: list[dict], cfg: SweepConfig) -> dict[str, Any]:
    for k in cfg.layers:
        check_exit_layer(k, split)
    costs = measure_costs(split, cfg.max_gamma + 1)
    feats = multi_layer_features(split, seqs, cfg.layers)
    rows = []
    for k in progress(cfg.layers, desc="sweep exit layers", unit="layer"):
        tcfg = TrainConfig(exit_layer=k, kind=cfg.kind if cfg.kind != "lm" else "linear", batch_size=4,
                           max_steps=cfg.train_steps, epochs=100, heldout=0.25, resume=False,
                           out=str(Path(cfg.out).with_suffix("")) + f"-k{k}")
        if cfg.kind == "lm":
            head, held = new_head("lm", split, k), feats[k]
        else:
            head, _ = train_head(split, seqs, tcfg, features=feats[k], inner=True)
            held = [feats[k][i] for i in split_heldout(len(seqs), tcfg.heldout, tcfg.seed)[1]]
        m = evaluate(head, held, tcfg)
        rows.append({"exit_layer": k, "acceptance": m["top1_agreement"], "kl": m["kl"],
                     **estimate(m["top1_agreement"], k, split.num_layers, costs, cfg.max_gamma)})
    best = max(rows, key=lambda r: r["estimate"])
    return {"config": asdict(cfg), "rows": rows, "recommended_exit_layer": best["exit_layer"],
            "costs_seconds": costs}


def plot(result: dict[str, Any], path: str | Path) -> None:
    import matplotlib  # lazy: a heavy import, needed only when a plot is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    ks = [r["exit_layer"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(ks, [r["acceptance"] for r in rows], "o-", label="acceptance a(k)")
    ax.plot(ks, [r["draft_cost"] for r in rows], "s--", label="draft cost c(k)")
    ax.plot(ks, [r["bound"] for r in rows], "^-", label="speedup bound (Leviathan et al.)")
    ax.plot(ks, [r["estimate"] for r in rows], "v-", label="speedup estimate (measured costs)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("exit layer k")
    ax.set_title(f"exit-layer sweep ({result['config']['kind']} head)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_acceptance(results: dict[str, dict[str, Any]], path: str | Path, points: dict[str, tuple] | None = None) -> None:
    """Acceptance by exit layer for several sweeps (e.g. untrained vs trained heads) on one PNG;
    ``points``: extra labelled (exit_layer, acceptance) markers, such as a fully trained head."""
    import matplotlib  # lazy: as in plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, res in results.items():
        rows = res["rows"]
        ax.plot([r["exit_layer"] for r in rows], [r["acceptance"] for r in rows], "o-", label=name)
    for name, (k, a) in (points or {}).items():
        ax.plot([k], [a], "*", markersize=14, label=name)
    ax.set_xlabel("exit layer k")
    ax.set_ylabel("top-1 agreement with the target (held-out)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cmd_sweep(args: argparse.Namespace) -> int:
    cfg = config_from_args(args, SweepConfig)
    ss = load_target(args, None)
    seqs = read_sequences(cfg.data)[: cfg.num_seqs]
    if not seqs:
        raise ModelNotFoundError(f"no self-distillation data at '{cfg.data}' (make it with `selfspec train`)")
    res = sweep(ss.split, seqs, cfg)
    Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
    Path(cfg.out).write_text(json.dumps(res, indent=2))
    plot(res, Path(cfg.out).with_suffix(".png"))
    print("| exit layer | acceptance | draft cost | bound (gamma) | estimate (gamma) |\n|---|---|---|---|---|")
    for r in res["rows"]:
        print(f"| {r['exit_layer']} | {r['acceptance']:.3f} | {r['draft_cost']:.3f} | {r['bound']:.2f} "
              f"({r['bound_gamma']}) | {r['estimate']:.2f} ({r['estimate_gamma']}) |")
    print(f"recommended exit layer: {res['recommended_exit_layer']}")
    return 0


def add_parser(sub: Any) -> None:
    add_command(sub, "sweep-exit", (ModelConfig, SweepConfig), cmd_sweep,
                "Measure acceptance and cost per exit layer; recommend one.")
