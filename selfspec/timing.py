"""Timing a call on a shared machine: a quantile of repeated timings (selfspec.costs, the prefill probe in
selfspec.quant.weight, the benchmarks). A leaf module: the kernels' own probes use it without importing the model."""

from __future__ import annotations

import time


def time_call(fn, reps: int = 10, warmup: int = 2, quantile: float = 0.25, budget: float | None = None) -> float:
    """A quantile (default the lower quartile, robust to a shared machine's spikes) of ``reps`` timings
    of ``fn()``, in seconds; with a ``budget`` (seconds, warm-up included) fewer once it is spent (at least one)."""
    start = time.perf_counter()
    for _ in range(warmup):
        fn()
    ts: list[float] = []
    while len(ts) < reps and not (ts and budget is not None and time.perf_counter() - start > budget):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[int(len(ts) * quantile)]
