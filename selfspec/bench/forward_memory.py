"""The resident memory after load and what it is made of (``memory_breakdown``: runtime, packed weights, float
parameters, exit head, KV caches), with issue 25's bound on it; ``selfspec bench-forward`` reports it."""

from __future__ import annotations

import sys
from functools import lru_cache
from typing import Any

from selfspec.api import SelfSpec
from selfspec.bench.forward_ranges import param_bytes
from selfspec.memory import file_mappings, proc_mb
from selfspec.models.cache import KVCache
from selfspec.models.lean import ARCHITECTURES
from selfspec.quant.store import in_page_buffer

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
        "head_mb": (param_bytes(ss.head) + sum(pl.nbytes for pl in ss.head.packed_linears())) / MIB, "kv_cache_mb": kv, "kv_kb_per_token": kv_token / 1024,
        "runtime_mb": runtime, "runtime_with_model_code_mb": modeling,
        # a GGUF's lean tree (selfspec.models.lean) runs without transformers' model code
        "model_code_imported": "transformers.modeling_utils" in sys.modules,
        "bound_mb": BOUND_FACTOR * gguf + kv + runtime if gguf else None,
    }
