"""Self-tuning: a short calibration that chooses the draft's shape for the running machine.

On first use of a model + exit head on a machine (``DraftConfig.tune="auto"``), selfspec measures

  - forward costs at every depth the head drafts from (selfspec.costs: shallow and deep blocks, the head);
  - acceptance per draft position, at every depth and tree width, by decoding a few built-in prompts with
    a fixed long draft (conditional acceptance: position i counts only when positions < i were accepted);

and chooses the (depth, tree width, draft cap) whose measured acceptance promises the best speed over
plain decoding at the measured costs (selfspec.costs.speedup). The result, with everything measured, is
cached as JSON under ``cache_root()/tuning`` (keyed by model, head, dtype, backend, threads and CPU) and
shown by ``selfspec tune``. Fields a user sets in DraftConfig always win over it; the online policy
(Thompson, seeded per request) starts from the calibrated acceptance as its prior and keeps learning.

When nothing pays (an untrained exit that rarely agrees) the choice is a draft cap of 0 with a low prior:
the online policy then drafts only when its draws say so, i.e. it decodes (nearly) plainly.
"""

from __future__ import annotations

import hashlib
import json
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from selfspec.config import GenerateConfig
from selfspec.costs import DraftCosts, best_gamma, measure_draft_costs
from selfspec.drafting.early_exit import EarlyExitDrafter
from selfspec.drafting.policies import FixedPolicy
from selfspec.heads.base import ExitHead, model_fingerprint
from selfspec.models.split import SplitModel
from selfspec.progress import progress

TUNING_VERSION = 2
CALIBRATION_PROMPTS = [  # short, varied: chat, code, math, extraction (Spec-Bench's are never used to tune)
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a hash map works and write a Python function that counts word frequencies.",
    "A train travels 120 km in 1.5 hours. What is its average speed? Show your steps.",
    "Summarize the main causes of the French Revolution in five bullet points.",
]
CHAIN_CAP = 5  # the fixed draft length acceptance is measured with (positions beyond it repeat the last)
TREE_CAP = 4  # ... and the depth of the trees
TREE_WIDTHS = (0, 2)  # tree widths tried for heads that support trees
NEAR = 0.03  # depths whose predicted speedups lie within this of the best share rounds (bandit)


@dataclass
class Tuning:
    """What the calibration chose and measured (written to the cache and shown by ``selfspec tune``)."""

    exit_layer: int  # the depth to draft from (the head's own layer unless it is nested)
    tree_width: int  # 0: chains
    gamma: int  # the draft cap the online policy works under (0: drafting does not pay, decode plainly)
    depth_policy: str  # 'fixed' or 'bandit' (nested heads: per-round choice among near-equal depths)
    predicted_speedup: float  # over plain decoding, at the chosen shape
    acceptance: dict[str, list[float]] = field(default_factory=dict)  # "depth/width" -> per-position acceptance
    predicted: dict[str, list[float]] = field(default_factory=dict)  # "depth/width" -> [best gamma, speedup]
    costs_ms: dict[str, dict[str, Any]] = field(default_factory=dict)  # depth -> measured costs (ms)
    seconds: float = 0.0  # how long the calibration took
    key: dict[str, Any] = field(default_factory=dict)  # what the cache entry is valid for

    def prior(self, depth: int, width: int | None = None) -> list[float]:
        return self.acceptance.get(f"{depth}/{self.tree_width if width is None else width}", [0.35])

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def head_depths(head: ExitHead) -> list[int]:
    return list(getattr(head, "depths", [head.exit_layer]))


def tuning_key(split: SplitModel, head: ExitHead, threshold: float | None = None) -> dict[str, Any]:
    head_id = head.source or f"{head.kind}@{head.exit_layer}"
    if head.source and (Path(head.source) / "head.safetensors").is_file():
        head_id += f"#{(Path(head.source) / 'head.safetensors').stat().st_size}"
    weights = round(float(split.lm_head.weight[:4].double().sum()), 6)  # tells random test models apart
    return {"version": TUNING_VERSION, "model": model_fingerprint(split), "weights": weights, "head": head_id, "kind": head.kind,
            "vocab_drafted": len(head.vocab_ids), "threshold": threshold, "dtype": str(split.dtype), "backend": split.backend,
            "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
            "device": str(split.device)}


def cache_path(key: dict[str, Any]) -> Path:
    from selfspec.models.loading import cache_root

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "tuning" / f"{digest}.json"


def load_cached(key: dict[str, Any]) -> Tuning | None:
    path = cache_path(key)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        return Tuning(**data) if data.get("key") == key else None
    except (ValueError, TypeError):
        return None  # a corrupt or older entry: calibrate again


class _Recorder(FixedPolicy):
    """Fixed-length drafts at one depth (cut by the confidence stop when a threshold is given); records
    conditional acceptance per position."""

    def __init__(self, depth: int, n: int, threshold: float | None = None) -> None:
        self.depth, self.hits, self.trials = depth, [0] * n, [0] * n
        self.threshold, self.needs_confidence = threshold, threshold is not None

    def keep(self, index: int, top1_prob: float) -> bool:
        return self.threshold is None or top1_prob >= self.threshold

    def observe(self, proposed: int, accepted: int) -> None:
        for i in range(min(proposed, accepted + 1, len(self.hits))):
            self.trials[i] += 1
            self.hits[i] += int(i < accepted)

    def acceptance(self, prior: float = 0.35, weight: float = 2.0) -> list[float]:
        return [(h + prior * weight) / (t + weight) for h, t in zip(self.hits, self.trials)]


def calibration_prompts(tokenizer: Any, vocab_size: int) -> list[list[int]]:
    """The built-in prompts as ids (through the chat template when there is one); random ids without a tokenizer."""
    if tokenizer is None:
        g = torch.Generator().manual_seed(0)
        return [torch.randint(3, vocab_size, (12,), generator=g).tolist() for _ in CALIBRATION_PROMPTS]
    out = []
    for text in CALIBRATION_PROMPTS:
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        else:
            ids = tokenizer(text)["input_ids"]
        out.append([int(t) % vocab_size for t in ids])
    return out


@torch.inference_mode()
def measure_acceptance(split: SplitModel, head: ExitHead, depth: int, width: int, prompts: list[list[int]],
                       new_tokens: int, threshold: float | None = None) -> list[float]:
    """Conditional acceptance per draft position at ``depth`` (chains, or trees of ``width``), greedy; with
    ``threshold``, of the drafts the confidence stop lets through (what a confidence policy verifies)."""
    from selfspec.engine import MAX_TREE_NODES, Engine

    cap = CHAIN_CAP if width <= 1 else min(TREE_CAP, max(1, (MAX_TREE_NODES - 1) // width))
    rec = _Recorder(depth, cap, threshold if width <= 1 else None)
    engine = Engine(split, EarlyExitDrafter(split, head, rec, lookup=0), gamma=cap, tree_width=width)
    gen = GenerateConfig(max_new_tokens=new_tokens, ignore_eos=True)
    for ids in prompts:
        room = split.context_length - new_tokens - 1
        for _ in engine.generate_tokens(ids[-room:], gen):
            pass
    return rec.acceptance()


def calibrate(split: SplitModel, head: ExitHead, tokenizer: Any = None, new_tokens: int = 32,
              costs: dict[int, DraftCosts] | None = None, threshold: float | None = None) -> Tuning:
    """Measure costs and acceptance at every depth and tree width the head offers; choose the best shape.
    ``threshold``: the confidence stop the draft will run with (chains only; trees draft by path score)."""
    from selfspec.engine import MAX_TREE_NODES

    t0 = time.perf_counter()
    depths = head_depths(head)
    widths = TREE_WIDTHS if head.supports_tree else (0,)
    prompts = calibration_prompts(tokenizer, split.vocab_size)
    costs = dict(costs or {})
    for d in depths:
        if d not in costs:
            costs[d] = measure_draft_costs(split, head, exit_layer=d)
    acceptance, predicted = {}, {}
    bar = progress(total=len(depths) * len(widths), desc="calibrating the draft", unit="shape", inner=True)
    for d in depths:
        for w in widths:
            acc = measure_acceptance(split, head, d, w, prompts, new_tokens, threshold)
            cap = CHAIN_CAP if w <= 1 else min(TREE_CAP, max(1, (MAX_TREE_NODES - 1) // w))
            shaped = costs[d] if w <= 1 else DraftCosts(**{**asdict(costs[d]), "tree_width": w})
            g, gain = best_gamma(shaped, acc, cap)
            acceptance[f"{d}/{w}"], predicted[f"{d}/{w}"] = acc, [g, gain]
            bar.update()
    bar.close()
    best = max(predicted, key=lambda s: predicted[s][1])
    depth, width = (int(x) for x in best.split("/"))
    g, gain = predicted[best]
    near = [s for s in predicted if s.endswith(f"/{width}") and predicted[s][1] >= gain * (1 - NEAR)]
    return Tuning(
        exit_layer=depth, tree_width=width, gamma=min(g + 2, 8) if g > 0 else 0,
        depth_policy="bandit" if len(near) > 1 else "fixed", predicted_speedup=round(gain, 4),
        acceptance={s: [round(a, 4) for a in v] for s, v in acceptance.items()},
        predicted={s: [v[0], round(v[1], 4)] for s, v in predicted.items()},
        costs_ms={str(d): _costs_ms(c) for d, c in costs.items()},
        seconds=round(time.perf_counter() - t0, 2), key=tuning_key(split, head, threshold),
    )


def _costs_ms(c: DraftCosts) -> dict[str, Any]:
    return {"shallow": round(c.t_shallow * 1e3, 3), "head": round(c.t_head * 1e3, 3),
            "plain": round(c.t_plain * 1e3, 3), "deep": {str(n): round(t * 1e3, 3) for n, t in c.t_deep.items()}}


def tuned(split: SplitModel, head: ExitHead, tokenizer: Any = None, refresh: bool = False,
          costs: dict[int, DraftCosts] | None = None, threshold: float | None = None) -> Tuning:
    """The cached calibration of this model + head on this machine, made now when missing (or ``refresh``)."""
    key = tuning_key(split, head, threshold)
    found = None if refresh else load_cached(key)
    if found is not None:
        return found
    result = calibrate(split, head, tokenizer, costs=costs, threshold=threshold)
    path = cache_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result.to_dict(), indent=1))
    tmp.replace(path)
    return result


def format_tuning(t: Tuning) -> str:
    """A readable table of a calibration (``selfspec tune``)."""
    lines = [f"chosen: exit depth {t.exit_layer}, tree width {t.tree_width}, draft cap {t.gamma}, "
             f"depth policy {t.depth_policy}; predicted {t.predicted_speedup:.2f}x plain "
             f"(calibrated in {t.seconds:.1f} s)", "",
             "| depth/width | acceptance per position | best gamma | predicted vs plain |", "|---|---|---|---|"]
    for shape, acc in t.acceptance.items():
        g, gain = t.predicted[shape]
        lines.append(f"| {shape} | {' '.join(f'{a:.2f}' for a in acc)} | {g} | {gain:.2f}x |")
    lines += ["", "| depth | shallow ms | head ms | plain ms | deep ms (1 / 4 / 16 rows) |", "|---|---|---|---|---|"]
    for d, c in t.costs_ms.items():
        deep = " / ".join(str(c["deep"].get(n, "-")) for n in ("1", "4", "16"))
        lines.append(f"| {d} | {c['shallow']} | {c['head']} | {c['plain']} | {deep} |")
    return "\n".join(lines)


def add_parser(sub: Any) -> None:
    from selfspec.cli import add_config_args
    from selfspec.config import ModelConfig

    p = sub.add_parser("tune", help="Show (or make) the self-tuning calibration of a model + exit head on this "
                       "machine: costs, acceptance per depth and tree width, the chosen draft shape.")
    p.add_argument("--head", default="auto", help="Exit head: 'auto' (the bundled one), 'nested', 'lm' or a directory.")
    p.add_argument("--exit-layer", type=int, default=None, help="Exit layer of an 'lm' head (default L // 4).")
    p.add_argument("--refresh", action="store_true", help="Calibrate again even when a cached result exists.")
    p.add_argument("--json", action="store_true", help="Print the cached JSON instead of tables.")
    add_config_args(p, ModelConfig)
    p.set_defaults(func=cmd_tune)


def cmd_tune(args: Any) -> int:
    from selfspec.api import SelfSpec
    from selfspec.cli import config_from_args
    from selfspec.config import DraftConfig, ModelConfig

    draft = DraftConfig(head=args.head, exit_layer=args.exit_layer, tune="refresh" if args.refresh else "auto")
    ss = SelfSpec.load(config_from_args(args, ModelConfig), draft)
    t = ss.tuning_result
    print(json.dumps(t.to_dict(), indent=1) if args.json else format_tuning(t))
    print(f"\ncache: {cache_path(t.key)}")
    return 0
