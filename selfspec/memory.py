"""Resident memory: a process's figure (``resident_mb``), and giving freed heap pages back to the system.

Loading a model frees much more than it keeps: a GGUF's decoded blocks, the tokenizer's parsed JSON, the
calibration forwards' caches and activations. glibc's malloc keeps such freed pages in its arenas (they stay
resident) unless asked to return them; ``trim_heap`` asks, at the end of those steps. What it returns grows
with what the load allocated and freed: most after a first load of a GGUF (which decodes it).

Python's cyclic garbage collector is the other cost a load leaves behind: importing torch and transformers and
building a model leave hundreds of thousands of objects it tracks, and each of its full collections walks them all,
at a moment no one chooses: the request being served then waits for it. ``freeze_gc`` moves what a load leaves out
of its reach (``gc.freeze``).
"""

from __future__ import annotations

import ctypes
import gc
from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=1)
def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc; absent on musl, macOS, Windows
    except (OSError, AttributeError, TypeError):
        return None


def trim_heap() -> None:
    """Return the C heap's free pages to the system (glibc ``malloc_trim(0)``); nothing elsewhere. Takes a few
    milliseconds: call it after a step that freed a lot, never per decoding step."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def freeze_gc() -> None:
    """Move every object alive now to the garbage collector's permanent generation (``gc.freeze``): later full
    collections skip them (see above). Objects freed by reference counting go as
    before; only reference cycles among them, if they become garbage later, are never collected (a load leaves
    ~130 unreachable objects, so none is collected first). Call it once after loading, not per request."""
    gc.freeze()


def proc_mb(path: str, field: str, default: float = float("nan")) -> float:
    """A "Field:  N kB" line of a /proc file (``/proc/self/status``, ``/proc/self/smaps_rollup``) in MiB, or
    ``default`` where the file or field is not there."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return default


def resident_mb(pid: int | str = "self") -> float:
    """The resident memory (VmRSS) of process ``pid`` (default: this one) in MiB, NaN where /proc or the process
    is not there."""
    return proc_mb(f"/proc/{pid}/status", "VmRSS")


def file_mappings() -> list[tuple[int, int, str, int]]:
    """(start, end, path, resident bytes) of this process's file-backed memory mappings, from
    /proc/self/smaps; empty where that is not available."""
    out: list[tuple[int, int, str, int]] = []
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        head = line.split(maxsplit=5)
        if len(head) >= 5 and "-" in head[0] and ":" in head[3]:  # "start-end perms offset dev inode [path]"
            start, _, end = head[0].partition("-")
            path = head[5] if len(head) > 5 and head[5].startswith("/") else ""
            out.append((int(start, 16), int(end, 16), path, 0))
        elif line.startswith("Rss:") and out:
            lo, hi, mapped, _ = out[-1]
            out[-1] = (lo, hi, mapped, int(line.split()[1]) * 1024)
    return [m for m in out if m[2]]
