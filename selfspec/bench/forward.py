"""``selfspec bench-forward``: the forward costs the engine's economics depend on (selfspec/costs.py).

For each backend, context length and block size n it times (``selfspec.costs``, lower quartile):

    full     layers [0, L) + final norm + LM head     (one plain decoding step at n = 1)
    greedy   full, ending in each row's argmax         (a greedy verification of n - 1 drafts: split.greedy_ids,
                                                        the LM head's int8 screen for 5-8 rows of a quantized head)
    shallow  layers [0, k)                            (one draft token's layers at n = 1)
    deep     layers [k, L) + final norm + LM head     (the verification of n - 1 drafts)
    head     the exit head on n rows                  (the draft head, one token at n = 1)

and reports each as ms, as the ratio t(n) / t(1), and as achieved GB/s: bytes of weights the range
reads (its decoder layers' parameters, plus the final norm and the LM head weight for full / deep,
counted even when tied to the embedding) over the time. The machine's memory read bandwidth is
measured here too (``measure_bandwidth``), so each figure is also a fraction of it and has a
"floor": the ms the range would take if it only streamed its weights at that bandwidth. On a CPU
at batch 1 a forward is bandwidth bound, so t(n) / t(1) well below n is what makes verifying a
block of drafts cheap; these figures show how far from that each backend is. The other bound is the
multiplies: ``measure_peaks`` times a register-only loop of each multiply instruction (kernels/peak.cpp),
so each figure's GFLOP/s is also a fraction of the float32 FMA peak the exact kernels sum on, and the
report names what float32-accurate limbs (three per activation) could reach on this CPU's int8, bf16 and
AMX units.

The report (selfspec.bench.forward_report) ends with the resident memory after load and what it is made of
(selfspec.bench.forward_memory: runtime, packed weights, float parameters, exit head, KV caches), checked against
issue 25's bound. The bytes each range reads are counted in selfspec.bench.forward_ranges.

    selfspec bench-forward --threads 2 --out runs/bench-forward.json    # the plot: runs/bench-forward.png
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from selfspec.api import SelfSpec
from selfspec.bench.forward_memory import MIB, memory_breakdown
from selfspec.bench.forward_ranges import RANGES, range_bytes, range_weights
from selfspec.bench.forward_report import format_tables, write_plot
from selfspec.bench.manifest import machine_info
from selfspec.cli_options import add_config_args, config_from_args
from selfspec.config import DraftConfig, ModelConfig, opt
from selfspec.costs import time_blocks, time_head
from selfspec.errors import InvalidConfigError
from selfspec.heads.io import bundled_head_dir, read_head_config
from selfspec.kernels.build import cpu_extension, matrix_unit
from selfspec.memory import resident_mb
from selfspec.models.split import BACKENDS, SplitModel
from selfspec.prefix_cache import MIN_ROWS
from selfspec.progress import announce, progress
from selfspec.timing import time_call

FORMAT = "selfspec-bench-forward/1"
GB = 1e9  # decimal gigabytes, as bandwidth figures are usually quoted


@dataclass
class ForwardBenchConfig:
    """Settings of ``selfspec bench-forward`` (forward cost per block size)."""

    block_sizes: list[int] = opt([1, 2, 4, 8, 16], "Block sizes n (new tokens per forward) to time; n = 1 is "
                                                   "always timed, it is what the ratios are relative to.")
    contexts: list[int] = opt([256, 1024], "Tokens already in the KV cache before the timed forward.")
    exit_layer: int | None = opt(None, "Exit layer k splitting shallow [0, k) from deep [k, L) (None: the "
                                       "bundled trained head's layer when the model has one, else L // 4).")
    backends: list[str] = opt(["fast", "reference"], "Forward backends to time ('fast', 'reference').")
    reps: int = opt(8, "Timed repetitions per figure (the lower quartile is kept), after 2 warm-up calls.")
    bandwidth_mb: int = opt(256, "Size (MB) of the float32 tensor whose sum() measures memory read bandwidth.")
    prefill_tokens: list[int] = opt([128, 512], "Prompt lengths whose prefill (an empty cache, the LM head on the "
                                                "last row) is timed per backend ([]: none).")
    prefill_reps: int = opt(3, "Timed repetitions per prefill figure (the median is kept), after one warm-up.")
    out: str = opt("runs/bench-forward.json", "Where to write the results (JSON).")
    plot: str | None = opt(None, "Where to write the plot (PNG) of the first context (None: beside --out, its "
                                 "name with .png); '' for none.")

    def to_dict(self) -> dict:
        return asdict(self)

    def plot_path(self) -> Path | None:
        """Where the plot goes: ``plot``, else beside ``out`` (so every output lands where --out says)."""
        if self.plot is None:
            return Path(self.out).with_suffix(".png")
        return Path(self.plot) if self.plot else None


# ---- measurements ------------------------------------------------------------------------------
@torch.inference_mode()
def measure_bandwidth(mb: int = 256, reps: int = 10) -> float:
    """Memory read bandwidth in GB/s: ``mb`` MB of float32 over the lower quartile of timed ``sum()``s."""
    x = torch.ones(max(1, mb * 2**20 // 4), dtype=torch.float32)
    seconds = time_call(lambda: x.sum(), reps)
    return x.numel() * x.element_size() / seconds / GB


PEAK_KINDS = {"fma_f32": 0, "vnni_int8": 1, "bf16_dot": 2, "amx_bf16": 3}  # kernels/peak.cpp's kinds
LIMBS = 3  # a float32-accurate product from bf16 or int8 multiplies: three limbs of the activation


def measure_peaks(threads: int, seconds: float = 0.2) -> dict[str, float]:
    """GFLOP/s (two per multiply-add) of a register-only loop of each multiply instruction on ``threads`` threads
    (kernels/peak.cpp): ``fma_f32``, what the exact kernels sum on; ``vnni_int8``, ``bf16_dot``, ``amx_bf16`` as
    float32-accurate products, i.e. the instruction's rate over ``LIMBS`` (0: the build or CPU lacks it). ``{}``
    without the compiled kernels."""
    ext = cpu_extension()
    if ext is None or not hasattr(ext, "compute_peak"):
        return {}
    out = {}
    for name, kind in PEAK_KINDS.items():
        rate = 2 * ext.compute_peak(kind, seconds, threads) / 1e9
        out[name] = rate if kind == 0 else rate / LIMBS
    return out


@torch.inference_mode()
def time_prefills(splits: dict[str, SplitModel], lengths: list[int], reps: int) -> dict[tuple[str, int], float]:
    """Seconds of a prefill of each length per backend, from an empty cache: every layer over the prompt and the
    LM head on its last row. The fast backend runs it as plain decoding's prefill does (the last layer's attention
    and MLP on the last MIN_ROWS rows only: ``Engine.prefill_tail``), the reference as transformers' forward with
    ``logits_to_keep=1`` (every row through every layer). Backends and lengths alternate within each repetition
    (a slow spell falls on all alike); the median of ``reps`` per figure, after one warm-up."""
    g = torch.Generator().manual_seed(0)
    vocab = next(iter(splits.values())).vocab_size  # every backend splits the same model
    calls = {}
    for n in lengths:
        ids = torch.randint(0, vocab, (1, n), generator=g)
        pos = torch.arange(n)[None]
        for b, split in splits.items():
            cache = split.new_cache(n)
            tail = min(n, MIN_ROWS) if b == "fast" else None

            def call(split: SplitModel = split, cache: Any = cache, ids: torch.Tensor = ids, pos: torch.Tensor = pos,
                     tail: int | None = tail) -> None:
                h = split.run_layers(split.embed(ids.to(split.device)), 0, split.num_layers, pos.to(split.device),
                                     cache, tail=tail)
                split.logits(h[:, -1:])
                cache.truncate(0)

            calls[b, n] = call
    times: dict[tuple[str, int], list[float]] = {key: [] for key in calls}
    for rep in range(reps + 1):
        for key, call in calls.items():
            t0 = time.perf_counter()
            call()
            if rep:  # the first pass warms up
                times[key].append(time.perf_counter() - t0)
    return {key: statistics.median(ts) for key, ts in times.items()}


@torch.inference_mode()
def kernel_figures(ss: SelfSpec, sizes: list[int], reps: int, bandwidth: float) -> list[dict]:
    """Per block-quantized type in the model, its largest matrix through the kernel at each n: ms, GB/s of its
    packed bytes, GFLOP/s."""
    biggest: dict[str, Any] = {}
    for m in ss.model.modules():
        qw = getattr(m, "qweight", None)
        if qw is not None and qw.nbytes > getattr(biggest.get(qw.type_name), "nbytes", 0):
            biggest[qw.type_name] = qw
    out = []
    for type_name, qw in sorted(biggest.items()):
        for n in sizes:
            x = torch.randn(n, qw.shape[1])
            y = torch.empty(n, qw.shape[0])
            t = time_call(lambda qw=qw, x=x, y=y: qw.matmul(x, y), reps)
            out.append({"type": type_name, "shape": list(qw.shape), "n": n, "ms": t * 1e3, "bytes": qw.nbytes,
                        "gbps": qw.nbytes / t / GB, "bandwidth_fraction": qw.nbytes / t / GB / bandwidth,
                        "gflops": 2 * n * qw.shape[0] * qw.shape[1] / t / 1e9})
    return out


def default_exit_layer(ss: SelfSpec) -> int:
    """The bundled trained head's exit layer when the model has one, else L // 4 (at least 1)."""
    bundled = bundled_head_dir(ss.model_id)
    if bundled is not None:
        return int(read_head_config(bundled)["exit_layer"])
    return max(1, ss.split.num_layers // 4)


def _head_on(head, split: SplitModel):
    """``head`` computing through ``split`` (its final norm / LM head run on that backend): a shallow copy
    sharing the weights, or the head itself when it already belongs to ``split``."""
    if head.split is split:
        return head
    twin = copy.copy(head)
    object.__setattr__(twin, "split", split)
    return twin


def _check(cfg: ForwardBenchConfig) -> list[int]:
    if not cfg.block_sizes or any(n < 1 for n in cfg.block_sizes):
        raise InvalidConfigError(f"block sizes must be >= 1, got {cfg.block_sizes}")
    if not cfg.contexts or any(c < 0 for c in cfg.contexts):
        raise InvalidConfigError(f"contexts must be >= 0, got {cfg.contexts}")
    bad = [b for b in cfg.backends if b not in BACKENDS]
    if not cfg.backends or bad:
        raise InvalidConfigError(f"unknown backends {bad or cfg.backends} (known: {', '.join(BACKENDS)})")
    if cfg.reps < 1:
        raise InvalidConfigError(f"reps must be >= 1, got {cfg.reps}")
    return sorted(set(cfg.block_sizes) | {1})


def run(model_cfg: ModelConfig, cfg: ForwardBenchConfig, ss: SelfSpec | None = None) -> dict:
    """Time every backend x context x n x range; write ``cfg.out`` (JSON) and ``cfg.plot_path()`` (PNG) and
    return the results. ``ss``: an already loaded model (else ``model_cfg`` is loaded)."""
    sizes = _check(cfg)
    if model_cfg.threads:
        torch.set_num_threads(model_cfg.threads)
    if ss is None:
        # a fixed gamma: the bench needs the head, not the draft-cost measurement of gamma=None
        ss = SelfSpec.load(replace(model_cfg, backend=cfg.backends[0]), DraftConfig(exit_layer=cfg.exit_layer, gamma=4))
        announce(ss.describe())
    rss_after_load = resident_mb()  # before a reference backend dequantizes anything
    memory = memory_breakdown(ss, rss_after_load)
    L = ss.split.num_layers
    k = cfg.exit_layer if cfg.exit_layer is not None else default_exit_layer(ss)
    head = ss.head if ss.head.exit_layer == k else ss.make_head(DraftConfig(exit_layer=k))
    with torch.inference_mode():
        head.prepare()  # its packed copies, so that the bytes counted are what it drafts with
    splits = {b: ss.split if ss.split.backend == b else SplitModel(ss.model, b) for b in cfg.backends}
    nbytes = range_bytes(ss.split, head, k)
    nweights = range_weights(ss.split, head, k)
    machine = machine_info()
    bandwidth = measure_bandwidth(cfg.bandwidth_mb)
    threads = torch.get_num_threads()
    peaks = measure_peaks(threads)
    fma_peak = peaks.get("fma_f32") or None  # None without the compiled kernels: no fraction, not a NaN in the JSON
    dtype = str(ss.split.dtype).removeprefix("torch.")
    spans = {"full": (0, L, True), "greedy": (0, L, True), "shallow": (0, k, False), "deep": (k, L, True)}

    bar = progress(total=len(cfg.backends) * (len(cfg.contexts) * 4 + 1) * len(sizes), desc="bench-forward",
                   unit="figure", dynamic_ncols=True)
    seconds: dict[tuple[str, int, str, int], float] = {}
    head_s: dict[tuple[str, int], float] = {}
    for n in sizes:  # the exit head does not depend on the context: timed once per backend and n
        for b, split in splits.items():
            bar.set_postfix_str(f"{b} head n={n}")
            head_s[b, n] = time_head(_head_on(head, split), split, cfg.reps, n=n)
            bar.update(1)
    for c in cfg.contexts:
        for b, split in splits.items():
            for name, (start, end, lm) in spans.items():  # block sizes interleaved: machine drift hits all alike
                bar.set_postfix_str(f"ctx {c} {b} {name}")
                for n, t in time_blocks(split, start, end, tuple(sizes), c, cfg.reps, lm_head=lm,
                                        greedy=name == "greedy").items():
                    seconds[b, c, name, n] = t
                bar.update(len(sizes))
    bar.set_postfix_str("prefills")
    prefills = time_prefills(splits, cfg.prefill_tokens, cfg.prefill_reps) if cfg.prefill_tokens else {}
    bar.close()

    figures = []
    for c in cfg.contexts:
        for b, split in splits.items():
            for name in RANGES:
                t1 = head_s[b, 1] if name == "head" else seconds[b, c, name, 1]
                span = spans.get(name)  # None: the head (no layer range)
                for n in sizes:
                    t = head_s[b, n] if name == "head" else seconds[b, c, name, n]
                    gbps = nbytes[name] / t / GB
                    figures.append({
                        "backend": b, "kernel": split.kernel, "context": 0 if name == "head" else c,
                        "table_context": c, "range": name,
                        "layers": None if span is None else [span[0], span[1]],
                        "lm_head": None if span is None else span[2], "n": n,
                        "ms": t * 1e3, "ratio": t / t1, "bytes": nbytes[name], "gbps": gbps,
                        "gflops": 2 * n * nweights[name] / t / 1e9,
                        "fma_peak_fraction": 2 * n * nweights[name] / t / 1e9 / fma_peak if fma_peak else None,
                        "bandwidth_fraction": gbps / bandwidth, "floor_ms": nbytes[name] / (bandwidth * GB) * 1e3,
                        "exit_layer": k, "dtype": dtype, "threads": threads, "cpu": machine["cpu"],
                        "torch": torch.__version__,
                    })
    result = {
        "format": FORMAT, "config": asdict(cfg), "model": asdict(model_cfg), "model_id": ss.model_id,
        "model_info": {"num_layers": L, "exit_layer": k, "head": head.kind, "hidden_size": ss.split.hidden_size,
                       "vocab_size": ss.split.vocab_size, "dtype": dtype,
                       "parameters": sum(p.numel() for p in ss.model.parameters())},
        "kernels": {b: s.kernel for b, s in splits.items()}, "numerics": ss.split.numerics.name, "matrix_unit": matrix_unit(), "block_sizes": sizes,
        "memory": {**memory, "weights_mb": nbytes["full"] / MIB},
        "quantized_kernels": kernel_figures(ss, sizes, cfg.reps, bandwidth) if ss.split.quantized else [],
        "prefill": [{"backend": b, "tokens": n, "ms": t * 1e3, "ms_per_token": t * 1e3 / n,
                     "gflops": 2 * n * (nweights["full"] - ss.split.vocab_size * ss.split.hidden_size) / t / 1e9}
                    for (b, n), t in prefills.items()],
        "machine": {**machine, "threads": threads, "torch": torch.__version__},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "bandwidth_gbps": bandwidth, "bandwidth_mb": cfg.bandwidth_mb, "bytes": nbytes, "peaks_gflops": peaks,
        "notes": "ms: lower quartile of reps (selfspec.costs); ratio: t(n) / t(1) of the same backend, range "
                 "and context; gbps: bytes / time; floor_ms: bytes / bandwidth_gbps; peaks_gflops: register-only loops of each multiply instruction on "
                 "these threads (bf16 / int8 / AMX as float32-accurate products: a third of the instruction's rate), "
                 "fma_peak_fraction: gflops / peaks_gflops.fma_f32. The head is timed "
                 "without context (selfspec.costs.time_head; n > 1: the head on n rows), its figures are "
                 "repeated under every table_context.",
        "figures": figures,
    }
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    plot = cfg.plot_path()
    if plot is not None:
        write_plot(result, plot)
    return result


# ---- command line ------------------------------------------------------------------------------
def cmd(args: argparse.Namespace) -> int:
    cfg = config_from_args(args, ForwardBenchConfig)
    res = run(config_from_args(args, ModelConfig), cfg)
    print(format_tables(res))
    plot = cfg.plot_path()
    print(f"\nresults: {cfg.out}" + (f", plot: {plot}" if plot is not None else ""), file=sys.stderr)
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("bench-forward", help="Time the forward ranges (full, shallow, deep, exit head) per "
                                             "block size n: ms, t(n)/t(1), GB/s against measured bandwidth.")
    add_config_args(p, ModelConfig, skip=("backend",))
    add_config_args(p, ForwardBenchConfig)
    p.set_defaults(func=cmd)
