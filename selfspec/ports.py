"""Loopback ports for the servers selfspec starts in other processes (``selfspec serve`` in the load test,
llama.cpp's server, Mirror-SD's process link).

A port found by binding port 0 comes from the kernel's ephemeral range, the same range from which every
other process's outgoing connections and port-0 listeners (Ray's raylet, GCS and workers among them) take
theirs: between reading it and the child binding it, one of them may take it. ``free_port`` picks a free port
below that range and above Ray's worker ports (10002-19999), where the kernel never hands out a port by itself,
so only a process that asks for that very number could collide.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOW = 20000  # above Ray's default worker ports (min_worker_port 10002 .. max_worker_port 19999)
EPHEMERAL = (32768, 60999)  # Linux's default, where /proc does not say


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (/proc/sys/net/ipv4/ip_local_port_range)."""
    try:
        lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return EPHEMERAL


def candidates() -> range:
    """Where ``free_port`` looks: [LOW, ephemeral start), or above the ephemeral range if that is too small."""
    lo, hi = ephemeral_range()
    return range(LOW, lo) if lo - LOW >= 1000 else range(hi + 1, 65536)


def is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1", tries: int = 200) -> int:
    """A port free on ``host`` now, outside the ephemeral range (see the module's docstring)."""
    pool = candidates()
    rng = random.SystemRandom()
    for _ in range(tries):
        port = rng.choice(pool)
        if is_free(port, host):
            return port
    raise OSError(f"no free port in {pool.start}-{pool.stop - 1} on {host} after {tries} tries")


__all__ = ["ephemeral_range", "free_port", "is_free"]
