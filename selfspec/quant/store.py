"""The packed-weights cache and model assembly shared by every quantized model (a GGUF loaded natively,
a float model quantized at load).

A cache directory holds ``config.json`` and ``packed.safetensors``: each quantized module's codes, scales
and offsets (``q.<module>.*``, with its type and shape in the metadata) and every float tensor
(``f.<parameter>``). Loading maps the file (no decoding, no GGUF parsing); ``assemble`` puts the tensors
into a meta-device transformers model, quantized modules in place of its Linear / Embedding. Loading reads the
file into one buffer of 2 MB pages (``read_pages``; ``mmap=True``: maps it instead).

The projections the fast layers fuse (q, k, v; gate, up: ``FUSED``) are kept as one block of rows per run
(``fused_runs``): in the file, one tensor under the run's first module (the metadata lists the runs), and
in the model, each module's weight a slice of the run's. The fused kernel call then reads the very bytes
the modules hold: a model keeps one copy of its packed weights (the buffer, or the mapped file) instead of
that plus a fused copy made when the engine is built.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from selfspec.errors import ModelNotFoundError
from selfspec.models.configs import plain_config, transformers_config
from selfspec.paths import atomic_dir
from selfspec.progress import quiet_transformers
from selfspec.quant.modules import QuantEmbedding, QuantLinear
from selfspec.quant.packing import LANES, pack_layout
from selfspec.quant.weight import QuantWeight

PACK_VERSION = 6  # bump when the packed layout (selfspec/kernels/qcodes.h) or the file's changes: old caches
# are ignored (2: fused runs stored as one tensor; 3: Q6_K's codes as bytes; 4: 5-bit codes as words; 5: the legacy
# types' scales and offsets as float16; 6: the K-quants' scales and offsets in their GGUF's two levels)
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # what FastLayer fuses (selfspec.models.fast)


def _version() -> str:
    """PACK_VERSION and this build's layout of 5-bit codes and K-quant scales (``pack_layout``): the packed file's
    "version"."""
    return f"{PACK_VERSION}-{pack_layout()}"


def fused_runs(quant: dict[str, QuantWeight]) -> list[list[str]]:
    """Module names whose weights are kept as one block of rows: consecutive members of a ``FUSED`` group
    under one parent that ``QuantWeight.concat`` can join (the rule the fast layers' fusing follows)."""
    runs: list[list[str]] = []
    for group in FUSED:
        for name in quant:
            parent, _, child = name.rpartition(".")
            if child != group[0]:
                continue
            run: list[str] = []
            for member in (f"{parent}.{c}" if parent else c for c in group):
                if member not in quant:
                    break
                if run and not quant[run[-1]].joins(quant[member]):
                    runs.append(run)
                    run = []
                run.append(member)
            runs.append(run)
    return [r for r in runs if len(r) > 1]


def _set_module(model: nn.Module, dotted: str, module: nn.Module) -> None:
    parent, _, child = dotted.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def load_packed(cache: Path, mmap: bool = False) -> tuple[Any, dict[str, QuantWeight], dict[str, torch.Tensor]] | None:
    """(config, packed weights, float tensors) as ``save_packed`` wrote them, or None when there is no complete cache
    of this layout. ``mmap``: the tensors map the file; else the file is read into one buffer of 2 MB pages
    (``read_pages``) and the tensors are views of it."""
    from safetensors import safe_open

    if not (cache / "packed.safetensors").is_file() or not (cache / "config.json").is_file():
        return None
    quant, floats = {}, {}
    with safe_open(str(cache / "packed.safetensors"), framework="pt") as mapped:
        f = mapped if mmap else _Pages(cache / "packed.safetensors", mapped)
        meta = f.metadata() or {}
        if meta.get("version") != _version():
            return None
        keys = set(f.keys())
        modules = json.loads(meta["modules"])
        for run in json.loads(meta.get("runs", "[]")):  # one tensor of rows each: every module a slice of it
            parts = {part: f.get_tensor(f"q.{run[0]}.{part}") for part in ("codes", "scales", "offsets")
                     if f"q.{run[0]}.{part}" in keys}
            start = 0
            for name in run:
                type_name, n, k = modules.pop(name)
                end = start + n // LANES
                quant[name] = QuantWeight(type_name, (n, k), parts["codes"][start:end], parts["scales"][start:end],
                                          parts["offsets"][start:end] if "offsets" in parts else torch.empty(0))
                start = end
        for name, (type_name, n, k) in modules.items():
            offsets = f.get_tensor(f"q.{name}.offsets") if f"q.{name}.offsets" in keys else torch.empty(0)
            quant[name] = QuantWeight(type_name, (n, k), f.get_tensor(f"q.{name}.codes"),
                                      f.get_tensor(f"q.{name}.scales"), offsets)
        for key in keys:
            if key.startswith("f."):
                floats[key[2:]] = f.get_tensor(key)
    return plain_config(cache / "config.json"), quant, floats  # (converted where transformers' classes need it)


HUGE_PAGE = 1 << 21  # the x86-64 transparent huge page
_MADV_HUGEPAGE = 14  # linux/mman.h


_page_storages: set[tuple[int, int]] = set()  # (address, bytes) of every read_pages buffer's storage


def in_page_buffer(t: torch.Tensor) -> bool:
    """Whether ``t`` is a view of a ``read_pages`` buffer (its storage is one: same address and size)."""
    st = t.untyped_storage()
    return (st.data_ptr(), st.nbytes()) in _page_storages


def read_pages(path: Path) -> torch.Tensor:
    """``path``'s bytes in one uint8 tensor whose memory asks the OS for 2 MB pages (madvise MADV_HUGEPAGE, before
    any page is touched): a decoding step streams every packed weight, and with 4 KB pages each step walks ~120k
    page-table entries for Qwen2.5-0.5B; with 2 MB pages, ~250, hence far fewer TLB misses (docs/QUANTIZED.md has the
    A/B). Where madvise is not available (not Linux) the buffer is ordinary memory."""
    import ctypes
    import ctypes.util

    size = path.stat().st_size
    raw = torch.empty(size + HUGE_PAGE, dtype=torch.uint8)  # untouched: glibc maps a block this large lazily
    start = -raw.data_ptr() % HUGE_PAGE
    buf = raw[start : start + size]
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise(buf.data_ptr(), (size + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE, _MADV_HUGEPAGE)
    except (OSError, AttributeError):
        pass
    with open(path, "rb", buffering=0) as fh:
        arr = buf.numpy().data  # a writable memoryview of the buffer
        done = 0
        while done < size:
            got = fh.readinto(arr[done:])
            if not got:
                raise OSError(f"'{path}' ended after {done} of {size} bytes")
            done += got
    _page_storages.add((raw.untyped_storage().data_ptr(), raw.untyped_storage().nbytes()))
    return buf


class _Pages:
    """The tensors of a safetensors file as views of one ``read_pages`` buffer (the ``get_tensor`` of safe_open)."""

    _DTYPES = {"U8": torch.uint8, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
               "I64": torch.int64, "I32": torch.int32, "I8": torch.int8}

    def __init__(self, path: Path, mapped: Any) -> None:
        self._mapped = mapped  # its metadata, keys and any tensor of a dtype not listed above
        self._buf = read_pages(path)
        head = int.from_bytes(self._buf[:8].numpy().tobytes(), "little")
        self._header = json.loads(self._buf[8 : 8 + head].numpy().tobytes())
        self._base = 8 + head

    def metadata(self) -> dict[str, str] | None:
        return self._mapped.metadata()

    def keys(self) -> list[str]:
        return list(self._mapped.keys())

    def get_tensor(self, key: str) -> torch.Tensor:
        info = self._header[key]
        dtype = self._DTYPES.get(info["dtype"])
        a, b = info["data_offsets"]
        if dtype is None or (self._base + a) % dtype.itemsize:
            return self._mapped.get_tensor(key)
        return self._buf[self._base + a : self._base + b].view(dtype).view(info["shape"])


def save_packed(cache: Path, config: Any, quant: dict[str, QuantWeight], floats: dict[str, torch.Tensor]) -> None:
    """Config, packed and float tensors into ``cache``, atomically (a killed load leaves no half cache)."""
    from safetensors.torch import save_file

    tensors = {f"f.{k}": v for k, v in floats.items()}
    runs = fused_runs(quant)
    stored = {run[0]: QuantWeight.concat([_detached(quant[n]) for n in run]) for run in runs}  # a run: one block
    in_runs = {n for run in runs for n in run}
    stored |= {name: qw for name, qw in quant.items() if name not in in_runs}
    for name, qw in stored.items():
        tensors[f"q.{name}.codes"], tensors[f"q.{name}.scales"] = qw.codes, qw.scales
        if qw.offsets.numel():
            tensors[f"q.{name}.offsets"] = qw.offsets
    modules = {name: [qw.type_name, *qw.shape] for name, qw in quant.items()}
    with atomic_dir(cache) as tmp:
        config.save_pretrained(tmp)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "packed.safetensors"),
                  metadata={"modules": json.dumps(modules), "runs": json.dumps(runs), "version": _version()})


def _detached(qw: QuantWeight) -> QuantWeight:
    """A QuantWeight object over the same tensors (``concat`` re-points its parts: the caller's stay as they are)."""
    return QuantWeight(qw.type_name, qw.shape, qw.codes, qw.scales, qw.offsets, qw.numerics)


def assemble(model: nn.Module, quant: dict[str, QuantWeight], floats: dict[str, torch.Tensor], source: str) -> nn.Module:
    """Put the weights into the meta-device model: float parameters, then quantized modules in place of
    their Linear / Embedding; a tied LM head shares the embedding's weight."""
    for hf_name, value in floats.items():
        module_name, _, kind = hf_name.rpartition(".")
        model.get_submodule(module_name)._parameters[kind] = nn.Parameter(value, requires_grad=False)
    for module_name, qw in quant.items():
        module: Any = model.get_submodule(module_name)  # a Linear or an Embedding (or the architecture's kind)
        if isinstance(module, nn.Embedding):
            scale = getattr(module, "embed_scale", None)
            _set_module(model, module_name, QuantEmbedding(qw, module.padding_idx, scale))
        else:
            bias = module.bias if module.bias is not None and module.bias.device.type != "meta" else None
            _set_module(model, module_name, QuantLinear(qw, None if bias is None else bias.detach()))
    for run in fused_runs(quant):  # one block of rows per run (a view when it comes so from the cache)
        QuantWeight.concat([quant[n] for n in run])
    hf: Any = model  # a transformers CausalLM: lm_head, model.embed_tokens and config read by name
    if isinstance(hf.lm_head, nn.Linear) and hf.lm_head.weight.device.type == "meta":  # tied, no output.weight
        embed = hf.model.embed_tokens
        if isinstance(embed, QuantEmbedding):
            hf.lm_head = QuantLinear(embed.qweight)  # the same packed weight, not a copy
        else:
            hf.lm_head.weight = embed.weight
    missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if missing:
        raise ModelNotFoundError(f"'{source}' lacks tensors the {hf.config.model_type} model needs: "
                                 f"{', '.join(missing[:5])}")
    return model.eval().requires_grad_(False)


def empty_model(config: Any) -> nn.Module:
    """transformers' model for ``config`` with its parameters on the meta device (nothing allocated;
    buffers such as rotary tables are real)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False), quiet_transformers():
        return AutoModelForCausalLM.from_config(transformers_config(config), dtype=torch.float32, attn_implementation="sdpa")
