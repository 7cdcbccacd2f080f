"""The CPU this process runs on, read once from /proc/cpuinfo: its name, vendor, family/model, flags and kind.

The kind (``amd-zen4``, ``intel-family6-model207``, ...) names a results folder (``results/<kind>/``) and a line of
a report; the flags say which kernels and matrix units the machine has (``has_amx``).
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass, field
from pathlib import Path

# AMD family 25 (0x19) model ranges by core generation; family 26 (0x1A) is Zen 5.
_ZEN_19 = ((0x00, 0x0F, "zen3"), (0x10, 0x1F, "zen4"), (0x20, 0x5F, "zen3"), (0x60, 0x7F, "zen4"),
           (0xA0, 0xAF, "zen4"))
SHOWN_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile")


@dataclass(frozen=True)
class CpuInfo:
    """One processor's identity as the kernel reports it."""

    name: str = ""
    """The model name line ('AMD EPYC', 'Intel(R) Xeon(R) ...')."""
    vendor: str = ""
    """'AuthenticAMD', 'GenuineIntel', or '' where unknown."""
    family: int | None = None
    """The CPU family number."""
    model: int | None = None
    """The model number within the family."""
    flags: frozenset[str] = field(default_factory=frozenset)
    """The instruction-set flags (avx2, avx512f, amx_tile, ...)."""
    flags_line: str = ""
    """The flags line exactly as read ('' where there is none): the kernel build's tag and the measured caches'
    keys hash it, so it stays byte for byte what the kernel printed."""

    @property
    def kind(self) -> str:
        """A short, stable name of the core generation: amd-zen3/4/5, intel-family6-model207, or the arch."""
        if self.vendor == "AuthenticAMD" and self.family is not None and self.model is not None:
            if self.family == 0x1A:
                return "amd-zen5"
            if self.family == 0x17:  # Zen and Zen+ below model 0x30, Zen 2 from it (Rome is 0x31)
                return "amd-zen2" if self.model >= 0x30 else "amd-zen"
            if self.family == 0x19:
                gen = next((g for lo, hi, g in _ZEN_19 if lo <= self.model <= hi), None)
                if gen:
                    return f"amd-{gen}"
            return f"amd-family{self.family}-model{self.model}"
        if self.vendor == "GenuineIntel" and self.family is not None and self.model is not None:
            return f"intel-family{self.family}-model{self.model}"
        return platform.machine() or "unknown"

    @property
    def has_amx(self) -> bool:
        """The CPU shows AMX tiles (a program must still ask the kernel for the tile state to use them)."""
        return "amx_tile" in self.flags

    def describe(self) -> str:
        """One line for a report: name, kind and the vector / matrix extensions that matter here."""
        shown = [f for f in SHOWN_FLAGS if f in self.flags]
        return f"{self.name or 'unknown CPU'} ({self.kind}; {', '.join(shown) or 'no AVX2'})"


def parse_cpuinfo(text: str) -> CpuInfo:
    """The first processor's fields of a /proc/cpuinfo text."""
    fields: dict[str, str] = {}
    lines: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor's block is enough: all cores of a machine here are alike
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
        lines.setdefault(key.strip(), line)

    def number(key: str) -> int | None:
        v = fields.get(key, "")
        return int(v) if v.isdigit() else None

    return CpuInfo(fields.get("model name", ""), fields.get("vendor_id", ""), number("cpu family"), number("model"),
                   frozenset(fields.get("flags", "").split()), lines.get("flags", ""))


@functools.lru_cache(maxsize=1)
def cpu_info() -> CpuInfo:
    """This machine's CPU (cached); an empty CpuInfo where /proc/cpuinfo cannot be read."""
    try:
        return parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        return CpuInfo(name=platform.processor())


def cpu_name() -> str:
    """This CPU's model name for cache keys and records: the processor's or the architecture's name where
    /proc/cpuinfo gives none."""
    return cpu_info().name or platform.processor() or platform.machine()


__all__ = ["CpuInfo", "cpu_info", "cpu_name", "parse_cpuinfo"]
