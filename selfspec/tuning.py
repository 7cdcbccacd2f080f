"""Self-tuning: a short calibration that chooses the draft's shape for the running machine.

On first use of a model + exit head on a machine (``DraftConfig.tune="auto"``), selfspec measures

  - forward costs at every depth the head drafts from (selfspec.costs: shallow and deep blocks, the head;
    cached on their own, ``selfspec.cost_cache``, and checked at every load);
  - acceptance per draft position, at every depth and tree width, by decoding a few built-in prompts with
    a fixed long draft (conditional acceptance: position i counts only when positions < i were accepted;
    selfspec.calibration records those rounds);
  - what a drafting round really costs beyond its layers and head calls (``calibration.round_overhead``: rounds
    of one and of CHAIN_CAP drafts timed against plain steps of the same engine);

and chooses the (depth, tree width, draft cap) whose measured acceptance promises the best speed over
plain decoding at the measured costs (selfspec.costs.speedup). The result, with everything measured, is
cached as JSON under ``cache_root()/tuning`` (keyed by model, head, dtype, backend, threads, CPU and the kernels'
source hash, as the costs are: a calibration's overhead and choices were measured against the costs of its kernels,
so new kernels calibrate again; before, a cached calibration outlived its costs, e.g. Qwen2.5-0.5B's overhead stayed
0 where the costs it was measured against had changed, ``kernel_source_hash``) and
shown by ``selfspec tune`` (selfspec/cli.py). Fields a user sets in DraftConfig always win over it; the online policy
(Thompson, seeded per request) starts from the calibrated acceptance as its prior and keeps learning.

When nothing pays (an untrained exit that rarely agrees) the choice is a draft cap of 0 with a low prior:
the online policy then drafts only when its draws say so, i.e. it decodes (nearly) plainly.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from selfspec.calibration import (
    CHAIN_CAP,
    OVERHEAD_PROMPTS,
    calibration_prompts,
    record_rounds,
    round_overhead,
    simulate,
)
from selfspec.costs import DraftCosts, acceptance_needed, best_gamma, measure_draft_costs
from selfspec.heads.base import ExitHead
from selfspec.heads.identity import head_identity, model_fingerprint
from selfspec.kernels.build import kernel_source_hash
from selfspec.machine import cpu_name
from selfspec.memory import trim_heap
from selfspec.models.split import SplitModel
from selfspec.paths import atomic_write_text, cache_root
from selfspec.progress import announce, progress

TUNING_VERSION = 8  # 6: block costs made monotone in n (costs.monotone); 7: measured round overhead; 8: a blank round
# of a head whose first draft and step are one call (draft_or_step) pays no round overhead (DraftCosts.blank_overhead)
TREE_WIDTHS = (0, 2)  # tree widths tried for heads that support trees
NEAR = 0.03  # depths whose predicted speedups lie within this of the best share rounds (bandit)
THRESHOLDS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)  # confidence stops the calibration replays (0: none)


@dataclass
class Tuning:
    """What the calibration chose and measured (written to the cache and shown by ``selfspec tune``)."""

    exit_layer: int  # the depth to draft from (the head's own layer unless it is nested)
    tree_width: int  # 0: chains
    gamma: int  # the draft cap the online policy works under (0: drafting does not pay, decode plainly)
    depth_policy: str  # 'fixed' or 'bandit' (nested heads: per-round choice among near-equal depths)
    predicted_speedup: float  # over plain decoding, at the chosen shape
    threshold: float = 0.0  # the confidence stop that replayed best (0: none)
    acceptance: dict[str, list[float]] = field(default_factory=dict)  # "depth/width" -> per-position acceptance
    predicted: dict[str, list[float]] = field(default_factory=dict)  # "depth/width" -> [gamma, speedup, threshold]
    costs_ms: dict[str, dict[str, Any]] = field(default_factory=dict)  # depth -> measured costs (ms)
    seconds: float = 0.0  # how long the calibration took
    key: dict[str, Any] = field(default_factory=dict)  # what the cache entry is valid for
    # the measured round overhead (ms, ``round_overhead``): 'round' and 'per_draft' go into the policies' costs
    overhead_ms: dict[str, float] = field(default_factory=dict)

    def with_overhead(self, costs: DraftCosts) -> DraftCosts:
        """``costs`` with the round overhead this calibration measured (at the head's own depth, used for all)."""
        return with_overhead(costs, self.overhead_ms)

    def prior(self, depth: int, width: int | None = None) -> list[float]:
        return self.acceptance.get(f"{depth}/{self.tree_width if width is None else width}", [0.35])

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def head_depths(head: ExitHead) -> list[int]:
    return list(getattr(head, "depths", [head.exit_layer]))


def tuning_key(split: SplitModel, head: ExitHead) -> dict[str, Any]:
    head_id = head_identity(head)
    weights = round(float(split.lm_rows(torch.arange(4)).double().sum()), 6)  # tells random test models apart
    return {"version": TUNING_VERSION, "model": model_fingerprint(split), "weights": weights, "head": head_id, "kind": head.kind,
            "vocab_drafted": len(head.vocab_ids),
            "draft_weights": head.draft_weights, "dtype": str(split.dtype), "backend": split.backend, "kernel": split.kernel,
            "threads": torch.get_num_threads(), "cpu": cpu_name(),
            "device": str(split.device), "kernels": kernel_source_hash()}


def cache_path(key: dict[str, Any]) -> Path:
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


def with_overhead(costs: DraftCosts, overhead_ms: dict[str, float]) -> DraftCosts:
    """``costs`` with a measured round overhead (``round_overhead``'s ms: 'round' and 'per_draft')."""
    return replace(costs, t_round=overhead_ms.get("round", 0.0) / 1e3, t_per_draft=overhead_ms.get("per_draft", 0.0) / 1e3)


def for_head(costs: DraftCosts, head: ExitHead) -> DraftCosts:
    """``costs`` with ``blank_overhead`` as ``head`` drafts: False where its first draft and a blank round's step are
    one compiled call (``ExitHead.front_ready``), so a blank round pays the head and not the round's Python."""
    with torch.inference_mode():
        return replace(costs, blank_overhead=not head.front_ready(1))


def calibrate(split: SplitModel, head: ExitHead, tokenizer: Any = None, new_tokens: int = 32,
              costs: dict[int, DraftCosts] | None = None) -> Tuning:
    """Measure costs and acceptance at every depth and tree width the head offers; choose the best shape.
    Chains are replayed under every confidence threshold in THRESHOLDS and every draft cap (``simulate``);
    trees (which draft by path score) by their acceptance per depth (costs.best_gamma)."""
    t0 = time.perf_counter()
    depths = head_depths(head)
    widths = TREE_WIDTHS if head.supports_tree else (0,)
    announce("calibrating the draft for this machine (once per model and head, 10-40 s)")
    prompts = calibration_prompts(tokenizer, split.vocab_size)
    costs = dict(costs or {})
    for d in depths:
        if d not in costs:
            costs[d] = measure_draft_costs(split, head, exit_layer=d)
    acceptance: dict[str, list[float]] = {}
    predicted: dict[str, tuple[int, float, float]] = {}  # shape -> (draft cap, predicted speedup, threshold)
    bar = progress(total=len(depths) * len(widths) + 1, desc="calibrating the draft", unit="shape", inner=True)
    k = head.exit_layer if head.exit_layer in depths else depths[0]
    overhead = round_overhead(split, head, costs[k], prompts[:OVERHEAD_PROMPTS], new_tokens)
    bar.update()
    costs = {d: for_head(with_overhead(c, overhead), head) for d, c in costs.items()}
    for d in depths:
        for w in widths:
            rec = record_rounds(split, head, d, w, prompts, new_tokens)
            if w <= 1:
                g, th, gain = max(((g, th, simulate(costs[d], rec.rounds, th, g)) for th in THRESHOLDS
                                   for g in range(CHAIN_CAP + 1)), key=lambda t: t[2])
                acc = rec.acceptance(th)
            else:
                acc, th = rec.acceptance(), 0.0
                shaped = DraftCosts(**{**asdict(costs[d]), "tree_width": w})
                g, gain = best_gamma(shaped, acc, rec.n)
            acceptance[f"{d}/{w}"], predicted[f"{d}/{w}"] = acc, (g, gain, th)
            bar.update()
    bar.close()
    best = max(predicted, key=lambda s: predicted[s][1])
    depth, width = (int(x) for x in best.split("/"))
    g, gain, th = predicted[best]
    trim_heap()  # the calibration decodes' caches, freed: their pages back to the system
    near = [s for s in predicted if s.endswith(f"/{width}") and predicted[s][1] >= gain * (1 - NEAR)]
    return Tuning(
        exit_layer=depth, tree_width=width, gamma=g,
        depth_policy="bandit" if len(near) > 1 else "fixed", predicted_speedup=round(gain, 4), threshold=th,
        acceptance={s: [round(a, 4) for a in v] for s, v in acceptance.items()},
        predicted={s: [v[0], round(v[1], 4), v[2]] for s, v in predicted.items()},
        costs_ms={str(d): _costs_ms(c) for d, c in costs.items()},
        seconds=round(time.perf_counter() - t0, 2), key=tuning_key(split, head), overhead_ms=overhead,
    )


def _costs_ms(c: DraftCosts) -> dict[str, Any]:
    return {"shallow": round(c.t_shallow * 1e3, 3), "head": round(c.t_head * 1e3, 3),
            "plain": round(c.t_plain * 1e3, 3), "deep": {str(n): round(t * 1e3, 3) for n, t in c.t_deep.items()}}


def tuned(split: SplitModel, head: ExitHead, tokenizer: Any = None, refresh: bool = False,
          costs: dict[int, DraftCosts] | None = None) -> Tuning:
    """The cached calibration of this model + head on this machine, made now when missing (or ``refresh``)."""
    key = tuning_key(split, head)
    found = None if refresh else load_cached(key)
    if found is not None:
        return found
    result = calibrate(split, head, tokenizer, costs=costs)
    atomic_write_text(cache_path(key), json.dumps(result.to_dict(), indent=1))
    return result


def format_tuning(t: Tuning) -> str:
    """A readable table of a calibration (``selfspec tune``)."""
    lines = [f"chosen: exit depth {t.exit_layer}, tree width {t.tree_width}, draft cap {t.gamma}, "
             f"confidence stop {t.threshold:g}, depth policy {t.depth_policy}; predicted {t.predicted_speedup:.2f}x plain "
             f"(calibrated in {t.seconds:.1f} s)", "",
             "| depth/width | acceptance per position | best gamma | confidence stop | predicted vs plain |",
             "|---|---|---|---|---|"]
    for shape, acc in t.acceptance.items():
        g, gain, th = t.predicted[shape]
        lines.append(f"| {shape} | {' '.join(f'{a:.2f}' for a in acc)} | {g} | {th:g} | {gain:.2f}x |")
    lines += ["", "| depth | shallow ms | head ms | plain ms | deep ms (1 / 4 / 16 rows) |", "|---|---|---|---|---|"]
    for d, c in t.costs_ms.items():
        deep = " / ".join(str(c["deep"].get(n, "-")) for n in ("1", "4", "16"))
        lines.append(f"| {d} | {c['shallow']} | {c['head']} | {c['plain']} | {deep} |")
    if t.overhead_ms:
        o = t.overhead_ms
        lines += ["", f"round overhead (measured on real rounds, beyond layers and head): {o.get('round', 0):.2f} ms a "
                      f"drafting round + {o.get('per_draft', 0):.2f} ms a draft token"]
    needed = needed_acceptance(t)
    if needed:
        first = t.prior(t.exit_layer, 0)[0]
        lines += ["", "acceptance a chain's drafts need at these costs (the same at every position, no confidence stop): "
                      + ", ".join(f"{s:g}x plain {a:.2f}" if a is not None else f"{s:g}x plain out of reach"
                                  for s, a in needed.items())
                      + f"; this head's first draft position accepted {first:.2f} here (of drafts past its confidence stop, on "
                      "the calibration's prompts)"]
    return "\n".join(lines)


def needed_acceptance(t: Tuning, targets: tuple[float, ...] = (1.0, 1.3, 1.6)) -> dict[float, float | None]:
    """Per target speed over plain decoding, the acceptance chains need at the costs this calibration measured at its
    chosen depth (``costs.acceptance_needed``); {} when the calibration holds no costs for that depth."""
    c = t.costs_ms.get(str(t.exit_layer))
    if not c or "1" not in c.get("deep", {}):
        return {}
    costs = t.with_overhead(DraftCosts(t.exit_layer, c["shallow"] / 1e3, c["head"] / 1e3,
                                       {int(n): v / 1e3 for n, v in c["deep"].items()}))
    return {s: acceptance_needed(costs, s, CHAIN_CAP) for s in targets}
