"""``selfspec bench-forward``: the forward costs the engine's economics depend on (selfspec/costs.py).

For each backend, context length and block size n it times (``selfspec.costs``, lower quartile):

    full     layers [0, L) + final norm + LM head     (one plain decoding step at n = 1)
    shallow  layers [0, k)                            (one draft token's layers at n = 1)
    deep     layers [k, L) + final norm + LM head     (the verification of n - 1 drafts)
    head     the exit head on n rows                  (the draft head, one token at n = 1)

and reports each as ms, as the ratio t(n) / t(1), and as achieved GB/s: bytes of weights the range
reads (its decoder layers' parameters, plus the final norm and the LM head weight for full / deep,
counted even when tied to the embedding) over the time. The machine's memory read bandwidth is
measured here too (``measure_bandwidth``), so each figure is also a fraction of it and has a
"floor": the ms the range would take if it only streamed its weights at that bandwidth. On a CPU
at batch 1 a forward is bandwidth bound, so t(n) / t(1) well below n is what makes verifying a
block of drafts cheap; these figures show how far from that each backend is.

    selfspec bench-forward --threads 2 --out runs/bench-forward.json    # the plot: runs/bench-forward.png
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from selfspec.api import SelfSpec, bundled_head_dir
from selfspec.bench.specbench import machine_info
from selfspec.config import DraftConfig, ModelConfig, add_config_args, config_from_args, opt
from selfspec.costs import time_call, time_head, time_layers
from selfspec.errors import InvalidConfigError
from selfspec.heads.io import read_head_config
from selfspec.models.split import BACKENDS, SplitModel
from selfspec.progress import progress

FORMAT = "selfspec-bench-forward/1"
RANGES = ("full", "shallow", "deep", "head")
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


@torch.inference_mode()
def _param_bytes(module: torch.nn.Module) -> int:
    """Bytes of the weights a forward through ``module`` reads: its parameters and, for block-quantized
    modules, their packed codes, scales and offsets (each shared weight once)."""
    seen: set[int] = set()
    total = 0
    for m in module.modules():
        qw = getattr(m, "qweight", None)
        if qw is not None and id(qw) not in seen:
            seen.add(id(qw))
            total += qw.nbytes
    return total + sum(p.numel() * p.element_size() for p in module.parameters())


def _matrix_weights(module: torch.nn.Module) -> int:
    """Weights (elements) of the matrices a forward multiplies with: 2 * n * this = its FLOPs at n rows."""
    total = 0
    for m in module.modules():
        qw = getattr(m, "qweight", None)
        if qw is not None:
            total += qw.shape[0] * qw.shape[1]
        elif isinstance(m, torch.nn.Linear):
            total += m.weight.numel()
    return total


def resident_mb() -> float:
    """This process's resident memory (VmRSS) in MB."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


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


def range_bytes(split: SplitModel, head, exit_layer: int) -> dict[str, int]:
    """Bytes of weights each range reads: its decoder layers, plus the final norm and the whole LM head
    weight for full / deep (tied or not); for the head, its own parameters plus the LM head rows it
    computes (the trimmed vocabulary if any) and, for the 'lm' head, the target's final norm."""
    layers = [_param_bytes(layer) for layer in split.layers]
    lm = _param_bytes(split.lm_head)
    top = _param_bytes(split.norm) + lm
    k, L = exit_layer, split.num_layers
    rows = len(head.vocab_ids) or split.vocab_size
    head_bytes = _param_bytes(head) + lm * rows // split.vocab_size
    if head.kind == "lm":
        head_bytes += _param_bytes(split.norm)
    return {"full": sum(layers) + top, "shallow": sum(layers[:k]), "deep": sum(layers[k:L]) + top,
            "head": head_bytes}


def range_weights(split: SplitModel, head, exit_layer: int) -> dict[str, int]:
    """Matrix weights each range multiplies with (for GFLOP/s), counted like ``range_bytes``."""
    layers = [_matrix_weights(layer) for layer in split.layers]
    lm = split.vocab_size * split.hidden_size
    rows = len(head.vocab_ids) or split.vocab_size
    k, L = exit_layer, split.num_layers
    return {"full": sum(layers) + lm, "shallow": sum(layers[:k]), "deep": sum(layers[k:L]) + lm,
            "head": _matrix_weights(head) + rows * split.hidden_size}


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
    rss_after_load = resident_mb()  # before a reference backend dequantizes anything
    L = ss.split.num_layers
    k = cfg.exit_layer if cfg.exit_layer is not None else default_exit_layer(ss)
    head = ss.head if ss.head.exit_layer == k else ss.make_head(DraftConfig(exit_layer=k))
    splits = {b: ss.split if ss.split.backend == b else SplitModel(ss.model, b) for b in cfg.backends}
    nbytes = range_bytes(ss.split, head, k)
    nweights = range_weights(ss.split, head, k)
    machine = machine_info()
    bandwidth = measure_bandwidth(cfg.bandwidth_mb)
    dtype = str(ss.split.dtype).removeprefix("torch.")
    threads = torch.get_num_threads()
    spans = {"full": (0, L, True), "shallow": (0, k, False), "deep": (k, L, True)}

    bar = progress(total=len(cfg.backends) * (len(cfg.contexts) * 3 + 1) * len(sizes), desc="bench-forward",
                   unit="figure", dynamic_ncols=True)
    seconds: dict[tuple[str, int, str, int], float] = {}
    head_s: dict[tuple[str, int], float] = {}
    for n in sizes:  # the exit head does not depend on the context: timed once per backend and n
        for b, split in splits.items():
            bar.set_postfix_str(f"{b} head n={n}")
            head_s[b, n] = time_head(_head_on(head, split), split, cfg.reps, n=n)
            bar.update(1)
    for c in cfg.contexts:
        for n in sizes:
            for b, split in splits.items():  # backends interleaved so machine drift hits both alike
                for name, (start, end, lm) in spans.items():
                    bar.set_postfix_str(f"ctx {c} n={n} {b} {name}")
                    seconds[b, c, name, n] = time_layers(split, start, end, n, c, cfg.reps, lm_head=lm)
                    bar.update(1)
    bar.close()

    figures = []
    for c in cfg.contexts:
        for b, split in splits.items():
            for name in RANGES:
                t1 = head_s[b, 1] if name == "head" else seconds[b, c, name, 1]
                start, end, lm = spans.get(name, (None, None, None))
                for n in sizes:
                    t = head_s[b, n] if name == "head" else seconds[b, c, name, n]
                    gbps = nbytes[name] / t / GB
                    figures.append({
                        "backend": b, "kernel": split.kernel, "context": 0 if name == "head" else c,
                        "table_context": c, "range": name,
                        "layers": None if start is None else [start, end], "lm_head": lm, "n": n,
                        "ms": t * 1e3, "ratio": t / t1, "bytes": nbytes[name], "gbps": gbps,
                        "gflops": 2 * n * nweights[name] / t / 1e9,
                        "bandwidth_fraction": gbps / bandwidth, "floor_ms": nbytes[name] / (bandwidth * GB) * 1e3,
                        "exit_layer": k, "dtype": dtype, "threads": threads, "cpu": machine["cpu"],
                        "torch": torch.__version__,
                    })
    result = {
        "format": FORMAT, "config": asdict(cfg), "model": asdict(model_cfg), "model_id": ss.model_id,
        "model_info": {"num_layers": L, "exit_layer": k, "head": head.kind, "hidden_size": ss.split.hidden_size,
                       "vocab_size": ss.split.vocab_size, "dtype": dtype,
                       "parameters": sum(p.numel() for p in ss.model.parameters())},
        "kernels": {b: s.kernel for b, s in splits.items()}, "block_sizes": sizes,
        "memory": {"rss_after_load_mb": rss_after_load, "weights_mb": nbytes["full"] / 2**20,
                   "gguf_mb": ss.source_gguf.stat().st_size / 2**20 if ss.source_gguf else None},
        "quantized_kernels": kernel_figures(ss, sizes, cfg.reps, bandwidth) if ss.split.quantized else [],
        "machine": {**machine, "threads": threads, "torch": torch.__version__},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "bandwidth_gbps": bandwidth, "bandwidth_mb": cfg.bandwidth_mb, "bytes": nbytes,
        "notes": "ms: lower quartile of reps (selfspec.costs); ratio: t(n) / t(1) of the same backend, range "
                 "and context; gbps: bytes / time; floor_ms: bytes / bandwidth_gbps. The head is timed "
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


# ---- report ------------------------------------------------------------------------------------
def format_tables(result: dict) -> str:
    """One Markdown table per context: rows backend x range, columns n as "ms (ratio)", GB/s at n = 1."""
    sizes = result["block_sizes"]
    bw = result["bandwidth_gbps"]
    info = result["model_info"]
    parts = [f"{result['model_id']}: {info['num_layers']} layers, exit layer {info['exit_layer']} "
             f"(head '{info['head']}'), {info['dtype']}, {result['machine']['threads']} threads; "
             f"measured read bandwidth {bw:.1f} GB/s; kernels: "
             + ", ".join(f"{b} = {k}" for b, k in result["kernels"].items())]
    by_ctx: dict[int, list[dict]] = {}
    for f in result["figures"]:
        by_ctx.setdefault(f["table_context"], []).append(f)
    for c, figs in by_ctx.items():
        cells = {(f["backend"], f["range"], f["n"]): f for f in figs}
        rows = list(dict.fromkeys((f["backend"], f["range"]) for f in figs))
        head = "| backend | range | " + " | ".join(f"n={n} ms (ratio)" for n in sizes) + \
               f" | GB/s n=1 | % of bw | floor ms | GFLOP/s n={sizes[-1]} |"
        lines = [f"\ncontext {c}:", "", head, "|" + "---|" * (len(sizes) + 6)]
        for b, r in rows:
            one = cells[b, r, 1]
            vals = " | ".join(f"{cells[b, r, n]['ms']:.2f} ({cells[b, r, n]['ratio']:.2f})" for n in sizes)
            lines.append(f"| {b} | {r} | {vals} | {one['gbps']:.1f} | {100 * one['bandwidth_fraction']:.0f}% "
                         f"| {one['floor_ms']:.2f} | {cells[b, r, sizes[-1]].get('gflops', float('nan')):.0f} |")
        parts.append("\n".join(lines))
    mem = result.get("memory")
    if mem:
        gguf = f", GGUF file {mem['gguf_mb']:.0f} MB" if mem.get("gguf_mb") else ""
        parts.append(f"\nresident memory after load: {mem['rss_after_load_mb']:.0f} MB; weights read per step "
                     f"{mem['weights_mb']:.0f} MB{gguf}")
    kf = result.get("quantized_kernels") or []
    if kf:
        lines = ["\nquantized kernels (each type's largest matrix):", "",
                 "| type | shape | " + " | ".join(f"n={n} ms / GB/s / GFLOP/s" for n in sizes) + " |",
                 "|" + "---|" * (len(sizes) + 2)]
        for t in dict.fromkeys(f["type"] for f in kf):
            cell = {f["n"]: f for f in kf if f["type"] == t}
            shape = "x".join(map(str, cell[sizes[0]]["shape"]))
            lines.append(f"| {t} | {shape} | " + " | ".join(
                f"{cell[n]['ms']:.3f} / {cell[n]['gbps']:.1f} / {cell[n]['gflops']:.0f}" for n in sizes) + " |")
        parts.append("\n".join(lines))
    return "\n".join(parts)


def write_plot(result: dict, path: str | Path) -> Path:
    """ms vs n per range (fast solid, reference dashed, log-x) with the bandwidth floor of "full", and
    t(n) / t(1) vs n, at the first context."""
    # lazy: matplotlib is a heavy import, needed only when a plot is drawn
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    c = result["config"]["contexts"][0]
    figs = [f for f in result["figures"] if f["table_context"] == c]
    styles = {"fast": "-", "reference": "--"}
    colors = dict(zip(RANGES, ("C0", "C1", "C2", "C3")))
    fig = Figure(figsize=(11, 4.2))
    FigureCanvasAgg(fig)
    ax_ms, ax_ratio = fig.subplots(1, 2)
    for b in dict.fromkeys(f["backend"] for f in figs):
        for r in RANGES:
            pts = sorted((f["n"], f["ms"], f["ratio"]) for f in figs if f["backend"] == b and f["range"] == r)
            if not pts:
                continue
            ns = [p[0] for p in pts]
            kw = {"color": colors[r], "linestyle": styles.get(b, ":"), "marker": "o", "markersize": 3,
                  "label": f"{r} ({b})"}
            ax_ms.plot(ns, [p[1] for p in pts], **kw)
            ax_ratio.plot(ns, [p[2] for p in pts], **kw)
    floor = next((f["floor_ms"] for f in figs if f["range"] == "full"), None)
    if floor is not None:
        ax_ms.axhline(floor, color="k", linewidth=0.8, linestyle=":",
                      label=f"full: bandwidth floor ({result['bandwidth_gbps']:.1f} GB/s)")
    ns = result["block_sizes"]
    ax_ratio.plot(ns, ns, color="0.6", linewidth=0.8, linestyle=":", label="t(n) = n t(1)")
    info = result["model_info"]
    for ax, ylabel in ((ax_ms, "ms per forward"), (ax_ratio, "t(n) / t(1)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel("block size n (new tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    ax_ms.set_ylim(bottom=0)
    ax_ms.legend(fontsize=7)
    ax_ratio.legend(fontsize=7)
    fig.suptitle(f"{result['model_id']}: forward cost, context {c}, exit layer {info['exit_layer']} of "
                 f"{info['num_layers']}, {info['dtype']}, {result['machine']['threads']} threads", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


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
