"""The report of ``selfspec bench-forward``: its Markdown tables (``format_tables``, the memory breakdown's lines
among them) and its plot (``write_plot``)."""

from __future__ import annotations

from pathlib import Path

from selfspec.bench.forward_memory import BOUND_FACTOR
from selfspec.bench.forward_ranges import RANGES


def format_tables(result: dict) -> str:
    """One Markdown table per context: rows backend x range, columns n as "ms (ratio)", GB/s at n = 1."""
    sizes = result["block_sizes"]
    bw = result["bandwidth_gbps"]
    info = result["model_info"]
    parts = [f"{result['model_id']}: {info['num_layers']} layers, exit layer {info['exit_layer']} "
             f"(head '{info['head']}'), {info['dtype']}, {result['machine']['threads']} threads; "
             f"measured read bandwidth {bw:.1f} GB/s; numerics {result.get('numerics', 'exact')}; kernels: "
             + ", ".join(f"{b} = {k}" for b, k in result["kernels"].items())]
    peaks = result.get("peaks_gflops") or {}
    if peaks:
        parts.append(format_peaks(peaks, result["machine"]["threads"]))
    by_ctx: dict[int, list[dict]] = {}
    for f in result["figures"]:
        by_ctx.setdefault(f["table_context"], []).append(f)
    for c, figs in by_ctx.items():
        cells = {(f["backend"], f["range"], f["n"]): f for f in figs}
        rows = list(dict.fromkeys((f["backend"], f["range"]) for f in figs))
        head = "| backend | range | " + " | ".join(f"n={n} ms (ratio)" for n in sizes) + \
               f" | GB/s n=1 | % of bw | floor ms | GFLOP/s n={sizes[-1]} | % of FMA peak n={sizes[-1]} |"
        lines = [f"\ncontext {c}:", "", head, "|" + "---|" * (len(sizes) + 7)]
        for b, r in rows:
            one = cells[b, r, 1]
            vals = " | ".join(f"{cells[b, r, n]['ms']:.2f} ({cells[b, r, n]['ratio']:.2f})" for n in sizes)
            lines.append(f"| {b} | {r} | {vals} | {one['gbps']:.1f} | {100 * one['bandwidth_fraction']:.0f}% "
                         f"| {one['floor_ms']:.2f} | {cells[b, r, sizes[-1]].get('gflops', float('nan')):.0f} "
                         f"| {_percent(cells[b, r, sizes[-1]].get('fma_peak_fraction'))} |")
        parts.append("\n".join(lines))
    if result.get("prefill"):
        parts.append(format_prefill(result["prefill"]))
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


def _percent(x: float | None) -> str:
    return "-" if x is None or x != x else f"{100 * x:.0f}%"


def format_peaks(peaks: dict, threads: int) -> str:
    """The multiply peaks (register-only loops, bench.forward.measure_peaks) and what they bound."""
    fma = peaks.get("fma_f32", 0.0)
    limbs = [f"{name} {peaks[key]:.0f} ({peaks[key] / fma:.2f}x FMA)" if peaks.get(key) else f"{name} -"
             for key, name in (("vnni_int8", "int8 VNNI"), ("bf16_dot", "bf16 dot"), ("amx_bf16", "AMX bf16 tiles"))]
    return (f"multiply peaks on {threads} threads (register-only loops): float32 FMA {fma:.0f} GFLOP/s, what the "
            f"exact kernels sum on; as float32-accurate products of three limbs: " + ", ".join(limbs))


def format_prefill(prefill: list[dict]) -> str:
    """Prefill per length and backend (an empty cache, the LM head on the last row) and reference / fast."""
    by = {(p["backend"], p["tokens"]): p for p in prefill}
    backends = list(dict.fromkeys(p["backend"] for p in prefill))
    lines = ["\nprefill from an empty cache (the LM head on the last row; median of the alternating reps):", "",
             "| tokens | " + " | ".join(f"{b} ms (GFLOP/s)" for b in backends)
             + (" | reference / fast |" if {"fast", "reference"} <= set(backends) else " |"),
             "|" + "---|" * (len(backends) + 1 + ({"fast", "reference"} <= set(backends)))]
    for n in dict.fromkeys(p["tokens"] for p in prefill):
        cells = " | ".join(f"{by[b, n]['ms']:.1f} ({by[b, n]['gflops']:.0f})" for b in backends)
        ratio = (f" | {by['reference', n]['ms'] / by['fast', n]['ms']:.2f}x"
                 if ("fast", n) in by and ("reference", n) in by else "")
        lines.append(f"| {n} | {cells}{ratio} |")
    return "\n".join(lines)


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
