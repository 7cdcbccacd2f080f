"""The load test's server: ``selfspec serve`` spawned in a child process on a free 127.0.0.1 port, and what is read
from a server: its resident memory, its /metrics, the replicas its arguments ask for."""

from __future__ import annotations

import math
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from selfspec.bench.loadtest_config import LoadTestConfig
from selfspec.memory import resident_mb
from selfspec.ports import free_port


def rss_mb(pid: int) -> float | None:
    """Resident set size of a process in MiB (``memory.resident_mb``), None where it cannot be read."""
    mb = resident_mb(pid)
    return None if math.isnan(mb) else mb


class SpawnedServer:
    """``selfspec serve`` in a child process, logging beside the results (``--out`` with .server.log)."""

    def __init__(self, cfg: LoadTestConfig) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(cfg.out).with_suffix(".server.log")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(self.log_path, "w+")  # the child writes to it; read back by log_text()
        cmd = [sys.executable, "-m", "selfspec.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--api-key", cfg.api_key, "--log-level", "warning", "--max-queue", str(4 * cfg.clients)]
        if cfg.threads:
            cmd += ["--threads", str(cfg.threads)]
        cmd += shlex.split(cfg.serve_args)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log_text()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"the server was not ready within {timeout:.0f} s:\n{self.log_text()}")

    def stop(self, timeout: float = 60.0) -> int:
        """SIGINT (graceful shutdown), SIGKILL if it hangs; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def log_text(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")


def server_metrics(url: str, key: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=30).text
    out: dict[str, float] = {"http_5xx": 0.0}
    for line in text.splitlines():
        if line.startswith("selfspec_http_requests_total{") and 'status="5' in line:
            out["http_5xx"] += float(line.rsplit(" ", 1)[1])
        for name in ("selfspec_tokens_per_second", "selfspec_mean_accepted_length", "selfspec_draft_acceptance_rate"):
            if line.startswith(name + " "):
                out[name.removeprefix("selfspec_")] = float(line.rsplit(" ", 1)[1])
        if line.startswith("selfspec_generations_total{"):
            out["generations_" + line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
    return out


def replicas_asked(serve_args: str) -> int:
    """The replica count ``serve_args`` asks for (``--replicas N``; 1 without it)."""
    args = shlex.split(serve_args)
    for i, a in enumerate(args):
        if a == "--replicas" and i + 1 < len(args):
            return int(args[i + 1])
        if a.startswith("--replicas="):
            return int(a.split("=", 1)[1])
    return 1
