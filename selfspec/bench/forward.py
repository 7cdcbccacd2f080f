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
block of drafts cheap; these figures show how far from that each backend is.

The report ends with the resident memory after load and what it is made of (``memory_breakdown``: runtime,
packed weights, float parameters, exit head, KV caches), checked against issue 25's bound.

    selfspec bench-forward --threads 2 --out runs/bench-forward.json    # the plot: runs/bench-forward.png
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from selfspec.api import SelfSpec
from selfspec.bench.specbench import machine_info
from selfspec.config import DraftConfig, ModelConfig, add_config_args, config_from_args, opt
from selfspec.costs import time_blocks, time_head
from selfspec.errors import InvalidConfigError
from selfspec.heads.io import bundled_head_dir, read_head_config
from selfspec.memory import file_mappings, proc_mb, resident_mb
from selfspec.models.cache import KVCache
from selfspec.models.lean import ARCHITECTURES
from selfspec.models.split import BACKENDS, SplitModel
from selfspec.progress import progress
from selfspec.quant.store import in_page_buffer
from selfspec.timing import time_call

FORMAT = "selfspec-bench-forward/1"
RANGES = ("full", "greedy", "shallow", "deep", "head")
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


MIB = 2**20
BOUND_FACTOR = 1.3  # issue 25: resident after load <= 1.3 x the GGUF + KV cache + the Python runtime
_RUNTIME_PROBE = """
import importlib, sys
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
import torch, transformers
base = rss()
importlib.import_module("transformers.modeling_utils")
importlib.import_module(sys.argv[1])
print(base, rss())
"""


@lru_cache(maxsize=4)
def runtime_baseline_mb(modeling_module: str = "transformers.models.llama.modeling_llama") -> tuple[float, float]:
    """Resident MB of a fresh Python with torch and transformers imported (the bound's runtime), and with
    transformers' model code imported too (``modeling_module``: what every loaded model imports; it pulls in
    accelerate, torch.distributed and torch._dynamo), measured in a subprocess; NaNs when that fails."""
    import subprocess
    import sys

    try:
        out = subprocess.run([sys.executable, "-c", _RUNTIME_PROBE, modeling_module], capture_output=True,
                             text=True, timeout=300, check=True).stdout.split()
        return float(out[-2]), float(out[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return float("nan"), float("nan")


def _live_kv_bytes() -> int:
    """Bytes of the KV caches alive in this process (requests make their own, sized to them)."""
    import gc


    gc.collect()
    return sum(t.numel() * t.element_size() for c in gc.get_objects() if issubclass(type(c), KVCache)
               for t in (*c.keys, *c.values))


def memory_breakdown(ss: SelfSpec, rss_after_load: float) -> dict[str, Any]:
    """What the resident memory after load is made of, in MiB, and issue 25's bound on it: BOUND_FACTOR x the
    GGUF + the KV caches alive + the runtime (python + torch + transformers imported)."""
    split = ss.split
    qws = {id(qw): qw for m in ss.model.modules() if (qw := getattr(m, "qweight", None)) is not None}
    files = [m for m in file_mappings() if m[2].endswith("packed.safetensors")]  # selfspec.quant.store's cache
    mapped = sum(qw.nbytes for qw in qws.values() if any(s <= qw.codes.data_ptr() < e for s, e, _, _ in files))
    pages = sum(qw.nbytes for qw in qws.values() if in_page_buffer(qw.codes))
    dense = sum(m._dense.numel() * m._dense.element_size() for m in ss.model.modules()
                if getattr(m, "_dense", None) is not None)
    kv_token = 2 * split.num_layers * split.num_kv_heads * split.head_dim * split.dtype.itemsize
    gguf = ss.source_gguf.stat().st_size / MIB if ss.source_gguf else None
    package = ARCHITECTURES.get(split.config.model_type, ("llama",))[0]
    runtime, modeling = runtime_baseline_mb(f"transformers.models.{package}.modeling_{package}")
    kv = _live_kv_bytes() / MIB
    file_resident = sum(m[3] for m in files)
    return {
        "rss_after_load_mb": rss_after_load, "gguf_mb": gguf,
        # mapped pages count once read: the figure once every packed page has been (a decoding step reads all but
        # the embedding's rows, which are read as tokens are looked up)
        "rss_all_weights_read_mb": rss_after_load + max(0, mapped - file_resident) / MIB,
        "packed_mb": sum(qw.nbytes for qw in qws.values()) / MIB, "packed_mapped_mb": mapped / MIB,
        "packed_pages_mb": pages / MIB, "huge_pages_mb": proc_mb("/proc/self/smaps_rollup", "AnonHugePages", 0.0),
        "packed_file_resident_mb": file_resident / MIB,
        "dense_copies_mb": dense / MIB,
        "float_params_mb": sum(p.numel() * p.element_size() for p in ss.model.parameters()) / MIB,
        # the head's float parameters and its packed copies (a released head's matrices are those alone)
        "head_mb": (_param_bytes(ss.head) + sum(pl.nbytes for pl in ss.head.packed_linears())) / MIB, "kv_cache_mb": kv, "kv_kb_per_token": kv_token / 1024,
        "runtime_mb": runtime, "runtime_with_model_code_mb": modeling,
        # a GGUF's lean tree (selfspec.models.lean) runs without transformers' model code
        "model_code_imported": "transformers.modeling_utils" in sys.modules,
        "bound_mb": BOUND_FACTOR * gguf + kv + runtime if gguf else None,
    }


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
    computes (the trimmed vocabulary if any) and, for the 'lm' head, the target's final norm. The head's own
    weights are what it drafts with (``ExitHead.draft_reads``: its packed copies once ``prepare`` built them)."""
    layers = [_param_bytes(layer) for layer in split.layers]
    lm = _param_bytes(split.lm_head)
    top = _param_bytes(split.norm) + lm
    k, L = exit_layer, split.num_layers
    rows = len(head.vocab_ids) or split.vocab_size
    head_bytes = head.draft_reads()[0] + lm * rows // split.vocab_size
    if head.kind == "lm":
        head_bytes += _param_bytes(split.norm)
    return {"full": sum(layers) + top, "greedy": sum(layers) + top, "shallow": sum(layers[:k]), "deep": sum(layers[k:L]) + top,
            "head": head_bytes}


def range_weights(split: SplitModel, head, exit_layer: int) -> dict[str, int]:
    """Matrix weights each range multiplies with (for GFLOP/s), counted like ``range_bytes``."""
    layers = [_matrix_weights(layer) for layer in split.layers]
    lm = split.vocab_size * split.hidden_size
    rows = len(head.vocab_ids) or split.vocab_size
    k, L = exit_layer, split.num_layers
    return {"full": sum(layers) + lm, "greedy": sum(layers) + lm, "shallow": sum(layers[:k]), "deep": sum(layers[k:L]) + lm,
            "head": head.draft_reads()[1] + rows * split.hidden_size}


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
    dtype = str(ss.split.dtype).removeprefix("torch.")
    threads = torch.get_num_threads()
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
        "memory": {**memory, "weights_mb": nbytes["full"] / MIB},
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
        parts.append(format_memory(mem))
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


def format_memory(mem: dict) -> str:
    """The resident memory after load, what it is made of and the bound it is checked against (MiB)."""
    gguf = f", GGUF file {mem['gguf_mb']:.0f} MB" if mem.get("gguf_mb") else ""
    lines = [f"\nresident memory after load: {mem['rss_after_load_mb']:.0f} MB (loaded with its head drafting, gamma=4: "
             f"a default load whose calibration turns the head off holds less, ExitHead.unload); weights read per "
             f"step {mem['weights_mb']:.0f} MB{gguf}"]
    if "packed_mb" in mem:  # results written before the breakdown have only the lines above
        ratio = f" = {mem['packed_mb'] / mem['gguf_mb']:.2f} x the GGUF" if mem.get("gguf_mb") else ""
        lines += [
            f"- runtime: {mem['runtime_mb']:.0f} MB (python + torch + transformers imported), "
            f"{mem['runtime_with_model_code_mb']:.0f} MB with transformers' model code imported"
            + ("" if mem.get("model_code_imported", True) else " (not imported here: the lean model tree)"),
            f"- packed weights: {mem['packed_mb']:.1f} MB{ratio}, {mem.get('packed_pages_mb', 0.0):.1f} MB of them "
            f"read into one buffer of 2 MB pages ({mem.get('huge_pages_mb', 0.0):.0f} MB of the process in huge pages), "
            f"{mem['packed_mapped_mb']:.1f} MB mapped from the cache file ({mem['packed_file_resident_mb']:.1f} MB of "
            f"its pages resident), the rest in other memory; dense float32 copies: {mem['dense_copies_mb']:.1f} MB",
            f"- float parameters: {mem['float_params_mb']:.1f} MB; exit head: {mem['head_mb']:.1f} MB",
            f"- KV caches alive: {mem['kv_cache_mb']:.1f} MB (each request makes its own, sized to it: "
            f"{mem['kv_kb_per_token']:.1f} KB per token)",
        ]
        if mem.get("bound_mb"):
            rss = max(mem["rss_after_load_mb"], mem["rss_all_weights_read_mb"])
            line = (f"- {rss:.0f} MB once every packed page has been read, against the bound {BOUND_FACTOR} x "
                    f"GGUF + KV caches + runtime: {mem['bound_mb']:.0f} MB ({rss - mem['bound_mb']:+.0f} MB)")
            if mem.get("model_code_imported", True):
                extra = mem["runtime_with_model_code_mb"] - mem["runtime_mb"]
                line += (f"; counting the runtime with transformers' model code: {mem['bound_mb'] + extra:.0f} MB "
                         f"({rss - mem['bound_mb'] - extra:+.0f} MB)")
            lines.append(line)
    return "\n".join(lines)


def write_plot(result: dict, path: str | Path) -> Path:
    """ms vs n per range (fast solid, reference dashed, log-x) with the bandwidth floor of "full", and
    t(n) / t(1) vs n, at the first context."""
    # lazy: matplotlib is a heavy import, needed only when a plot is drawn
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    c = result["config"]["contexts"][0]
    figs = [f for f in result["figures"] if f["table_context"] == c]
    styles = {"fast": "-", "reference": "--"}
    colors = dict(zip(RANGES, ("C0", "C4", "C1", "C2", "C3")))
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
