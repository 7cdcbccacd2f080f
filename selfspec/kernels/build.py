"""Building selfspec's CPU kernels (``_SOURCES``: gemv.cpp; the block-quantized kernels qlinear.cpp, qlinear_amx.cpp,
qlinear_i8.cpp, qargmax.cpp, qdense.cpp, qgemm.cpp; ops.cpp, attention.cpp; step.cpp; peak.cpp: the multiply peaks) once per source, torch and CPU.

The extension is compiled with ``-march=native``, so the instruction set is chosen on the machine that
runs it: AVX-512 (with its 16-row tiles) where the CPU has it, AVX2 otherwise. ``SELFSPEC_ISA=avx2``
builds the AVX2 variant on an AVX-512 machine (to test it there).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import time
import warnings
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from selfspec.machine import cpu_info
from selfspec.paths import cache_root
from selfspec.progress import announce

_SOURCES = [Path(__file__).with_name(n) for n in (
    "gemv.cpp", "qlinear.cpp", "qlinear_amx.cpp", "qlinear_i8.cpp", "qargmax.cpp", "qdense.cpp", "qgemm.cpp", "ops.cpp", "attention.cpp",
    "step.cpp", "peak.cpp",
)]
_HEADERS = [Path(__file__).with_name(n) for n in ("kernels.h", "simd.h", "qcodes.h")]  # part of what the build is made of (its tag), not compiled alone


def _isa_flags() -> list[str]:
    if os.environ.get("SELFSPEC_ISA", "") == "avx2":
        return ["-mno-avx512f"]
    return []


@lru_cache(maxsize=1)
def cpu_flags() -> str:
    """The CPU's flags line (/proc/cpuinfo), else the processor's name."""
    return cpu_info().flags_line or platform.processor()


def _clear_stale_lock(lock: Path, max_age: float = 600.0) -> None:
    """torch's build lock (a file) outlives a killed build and makes every later load wait forever; a build
    takes under a minute, so a lock older than ``max_age`` seconds is stale."""
    try:
        if time.time() - lock.stat().st_mtime > max_age:
            lock.unlink()
            warnings.warn(f"selfspec: removed a stale kernel build lock ({lock})", stacklevel=3)
    except FileNotFoundError:
        pass


@lru_cache(maxsize=1)
def kernel_source_hash() -> str:
    """What the compiled code is made of: the C++ sources and the instruction-set flags (not the folder they
    lie in, nor torch or the CPU: a key that needs those adds them). Measured draft costs are keyed on it
    (``selfspec.cost_cache``)."""
    src = b"".join(p.read_bytes() for p in _SOURCES + _HEADERS)
    return hashlib.sha256(src + " ".join(_isa_flags()).encode()).hexdigest()[:12]


@lru_cache(maxsize=1)
def kernel_tag() -> str:
    """The build's tag (its folder ``cache_root()/kernels/cpu-<tag>`` and module name): the sources, their
    folder (ninja records source paths, so two checkouts sharing one build folder would rebuild it in turn),
    torch's version, the CPU's flags and the instruction-set flags."""
    src = b"".join(p.read_bytes() for p in _SOURCES + _HEADERS)
    where = str(_SOURCES[0].parent).encode()
    return hashlib.sha256(src + where + torch.__version__.encode() + cpu_flags().encode()
                          + " ".join(_isa_flags()).encode()).hexdigest()[:12]


@lru_cache(maxsize=1)
def cpu_extension() -> Any | None:
    """selfspec's compiled CPU kernels (gemv.cpp: linear; qlinear.cpp and its siblings: the block-quantized
    kernels; ops.cpp, attention.cpp: the fused decoding ops; step.cpp: whole layers), built once per source /
    torch / CPU into the cache (once: the files compile side by side, and only ops.cpp and step.cpp, which bind
    to Python, include pybind; see kernels.h), or None where they cannot be built."""
    if os.environ.get("SELFSPEC_KERNEL", "") in ("torch", "onednn"):
        return None
    tag = kernel_tag()
    build = cache_root() / "kernels" / f"cpu-{tag}"
    built = _import_built(build / f"selfspec_cpu_{tag}.so", f"selfspec_cpu_{tag}")
    if built is not None:
        return built
    from torch.utils import cpp_extension  # it imports setuptools: only to build

    build.mkdir(parents=True, exist_ok=True)
    _clear_stale_lock(build / "lock")
    announce("building selfspec's CPU kernels for this CPU (once, about a minute)")
    try:
        return cpp_extension.load(
            name=f"selfspec_cpu_{tag}", sources=[str(p) for p in _SOURCES], build_directory=str(build),
            extra_cflags=["-O3", "-march=native", *_isa_flags(), "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False,
        )
    except Exception as e:  # no compiler, no ninja, an unusual platform: fall back, loudly once
        warnings.warn(f"selfspec: could not build the CPU decoding kernel ({e}); using oneDNN / F.linear",
                      stacklevel=2)
        return None


def _import_built(so: Path, name: str) -> Any | None:
    """The module of a finished build (its tag names the sources, torch and the CPU it was built for), imported
    without torch's build machinery; None when there is none or it does not import (torch's ``load`` then builds
    it again)."""
    if not so.is_file():
        return None
    try:
        spec = importlib.util.spec_from_file_location(name, so)
        if spec is None or spec.loader is None:
            return None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except ImportError:
        return None


def built_extension() -> Any:
    """``cpu_extension()`` on a path chosen only because the kernels were built (a packed or quantized weight)."""
    ext = cpu_extension()
    assert ext is not None, "selfspec's CPU kernels are not built"
    return ext


def matrix_unit() -> str:
    """Where the exact kernels' group sums run: 'amx' (4- and 5-bit codes on AMX tiles, bfloat16 limbs of the
    activations: qlinear_amx.cpp) or 'fma' (the float32 FMA kernels). ``SELFSPEC_AMX=0`` turns AMX off."""
    ext = cpu_extension()
    return "amx" if ext is not None and ext.amx_on() else "fma"
