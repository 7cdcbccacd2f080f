"""Measured draft costs, cached on disk beside the calibration, so a load does not measure them again.

``measure_draft_costs`` (selfspec.costs) takes one to a few seconds per exit depth; the adaptive draft needs
the costs of every depth its head drafts from at every load. They are written once to
``cache_root()/costs/<digest>.json`` (one file per head and depth) and read back at later loads as long as
what they were measured on is the same. The key (``cost_key``) holds:

  - the machine: the CPU's model name and flags, its architecture, torch's intra-op thread count, the device;
  - the model's shape (``model_fingerprint`` + intermediate size + attention windows), weight dtype and
    quantization (the GGUF block types, int8 numerics), backend and kernel path;
  - the head: where it came from (+ its weights file's size), its kind, parameter count and drafted vocabulary
    size, and the depth drafted from;
  - the kernels' source hash (``selfspec.kernels.build.kernel_source_hash``), ``SELFSPEC_KERNEL``, the matrix
    unit the exact kernels use (``matrix_unit``: AMX or FMA), torch's
    version, and COSTS_VERSION (bumped when the measurement changes).

The weights' values are not in it: they do not change a forward's cost. A key that differs, a missing,
unreadable or corrupt entry are measured again (and written, atomically).

The key cannot see everything (a CPU throttled or sped up, a busier or quieter machine, a kernel built with
other flags by hand), so a load also times one plain decoding step (every layer + LM head, one token over
CHECK_CONTEXT cached ones: short, as every load pays it) and compares it with the same step timed when the
costs were measured: off by more than CHECK_FACTOR either way, the step is timed once more (a spike on a
shared machine), and if it is still off, the costs are measured again. The decisions the costs feed (draft
length, depth, tree width) depend on their ratios, which a uniformly slower or faster machine keeps, so the
factor is loose on purpose: 1.5x.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

from selfspec.costs import DraftCosts, measure_draft_costs, time_layers
from selfspec.heads.base import ExitHead
from selfspec.heads.identity import head_identity, model_fingerprint
from selfspec.kernels.build import cpu_flags, kernel_source_hash, matrix_unit
from selfspec.machine import cpu_name
from selfspec.models.split import SplitModel
from selfspec.paths import atomic_write_text, cache_root

COSTS_VERSION = 6  # bump when measure_draft_costs measures differently (context, block sizes, reps; 2: monotone;
# 3: blocks of 3 too: on AVX2 a block of 4 costs far more than one of 3, and interpolating priced t(3) far too high;
# 4: a deep head's fuse drafts with Q8_0 weights on quantized targets; 5: deep blocks end in the greedy argmax,
# split.greedy_ids, the LM head's int8 screen; 6: the screen from 3 rows, not 5)
CHECK_FACTOR = 1.5  # the load-time plain step may differ this much (either way) from the cached one
CHECK_CONTEXT = 8  # cached tokens the check's plain step attends to (prefilled first, at every load: kept short)
CHECK_REPS = 8  # timed steps (the fastest counts) ...
CHECK_BUDGET = 0.3  # ... or fewer once this many seconds are spent (a contended machine: each step is slow)


def cost_key(split: SplitModel, head: ExitHead, depth: int) -> dict[str, Any]:
    """What the costs of ``head``'s draft at ``depth`` are valid for (the module docstring)."""
    c = split.config
    return {
        "version": COSTS_VERSION,
        "machine": {"cpu": cpu_name(), "flags": hashlib.sha256(cpu_flags().encode()).hexdigest()[:12],
                    "arch": platform.machine(), "threads": torch.get_num_threads(), "device": str(split.device)},
        "model": {**model_fingerprint(split), "intermediate_size": getattr(c, "intermediate_size", None),
                  "windows": split.windows, "dtype": str(split.dtype), "quantization": split.block_types,
                  "backend": split.backend, "kernel": split.kernel},
        "head": {"id": head_identity(head), "kind": head.kind, "params": head.num_params(),
                 "vocab_drafted": len(head.vocab_ids), "depth": depth,
                 "draft_weights": head.draft_weights},
        "kernels": {"source": kernel_source_hash(), "env": os.environ.get("SELFSPEC_KERNEL", ""),
                    "matrix_unit": matrix_unit()},
        "torch": torch.__version__,
    }


def cost_path(key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "costs" / f"{digest}.json"


def read_entry(key: dict[str, Any]) -> tuple[DraftCosts, float] | None:
    """(costs, the check's plain step when they were measured) cached for ``key``; None when there is no
    entry, or it is unreadable, corrupt or for another key."""
    try:
        data = json.loads(cost_path(key).read_text())
        if data.get("key") != key:
            return None
        check = float(data["check_s"])
        return (DraftCosts.from_dict(data["costs"]), check) if check > 0 else None
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def write_entry(key: dict[str, Any], costs: DraftCosts, check_s: float) -> None:
    entry = {"key": key, "costs": costs.to_dict(), "check_s": check_s, "measured_at": round(time.time())}
    atomic_write_text(cost_path(key), json.dumps(entry, indent=1))


def plain_step(split: SplitModel) -> float:
    """Seconds of one plain decoding step (every layer and the LM head, one token over CHECK_CONTEXT cached):
    the fastest of CHECK_REPS, after one warm-up, within CHECK_BUDGET."""
    return time_layers(split, 0, split.num_layers, 1, CHECK_CONTEXT, CHECK_REPS, lm_head=True, warmup=1,
                       quantile=0.0, budget=CHECK_BUDGET)


def implausible_costs(costs: DraftCosts, step: float) -> bool:
    """Whether ``costs`` were timed in a busy moment (OpenMP threads waiting for time slices): their shallow pass,
    k of the L layers, dearer than CHECK_FACTOR x a whole plain step timed beside them (``step`` seconds). Such
    costs switch drafting off, and the step check alone can pass them (a tiny model's shallow pass, timed in such a
    moment, can come out far dearer than its whole plain step)."""
    return costs.t_shallow > CHECK_FACTOR * step


class CostCache:
    """The draft costs of one loaded model (``SelfSpec.draft_costs``): in memory, else on disk when the
    key matches and the load's plain step agrees (module docstring), else measured now and written."""

    def __init__(self, split: SplitModel) -> None:
        self.split = split
        self._memory: dict[str, DraftCosts] = {}
        self._step: float | None = None  # this load's plain step (timed once, when first needed)
        self._rechecked = False
        self.log: list[str] = []  # per lookup: "<depth>: cached" or "<depth>: measured (<why>)"

    def _check(self, cached: float) -> bool:
        """Whether this load's plain step is within CHECK_FACTOR of ``cached``; timed again once if not."""
        def within() -> bool:
            assert self._step is not None
            return 1 / CHECK_FACTOR <= self._step / cached <= CHECK_FACTOR

        if self._step is None:
            self._step = plain_step(self.split)
        if not within() and not self._rechecked:
            self._rechecked = True
            self._step = min(self._step, plain_step(self.split))
        return within()

    def get(self, head: ExitHead, depth: int, refresh: bool = False) -> DraftCosts:
        """The costs of ``head``'s draft at ``depth``; ``refresh``: measured now whatever is cached."""
        key = cost_key(self.split, head, depth)
        mem = json.dumps(key, sort_keys=True)
        if not refresh and mem in self._memory:
            return self._memory[mem]
        found = None if refresh else read_entry(key)
        implausible = found is not None and implausible_costs(*found)
        if found is not None and not implausible and self._check(found[1]):
            self.log.append(f"{depth}: cached")
            self._memory[mem] = found[0]
            return found[0]
        why = "refresh" if refresh else "no entry" if found is None else \
            f"implausible: shallow pass {found[0].t_shallow:.4f} s, step {found[1]:.4f} s" if implausible else \
            f"plain step {self._step:.4f} s, cached {found[1]:.4f} s"
        costs = measure_draft_costs(self.split, head, exit_layer=depth)
        if self._step is None or found is not None:  # time the step beside these costs (again after a failed check)
            self._step = plain_step(self.split)
        if implausible_costs(costs, self._step):  # measured in a busy moment itself: once more, the step beside it
            costs = measure_draft_costs(self.split, head, exit_layer=depth)
            self._step = plain_step(self.split)
            why += "; implausible, measured again"
        write_entry(key, costs, self._step)
        self.log.append(f"{depth}: measured ({why})")
        self._memory[mem] = costs
        return costs
