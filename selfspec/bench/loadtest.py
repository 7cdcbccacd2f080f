"""A bounded load test of the OpenAI-compatible server (loopback only, fixed number of requests):

    python -m selfspec.bench.loadtest --clients 8 --requests-per-client 20

Starts ``selfspec serve`` on a free 127.0.0.1 port (or uses ``--url`` on this machine), computes
one reference answer per prompt and endpoint, then runs ``clients`` threads, each sending
``requests_per_client`` requests in a fixed mix: completions and chat, streamed and not (each
must equal its reference: greedy output is deterministic), malformed bodies (each must get its
4xx), a wrong API key (401) and clients that hang up mid-stream. Reports requests/s, p50/p95
latency of the good requests, tokens/s, the server's RSS before/after and any 5xx or logged
error; the spawned server is stopped with SIGINT and must exit cleanly.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx

from selfspec.bench.loadtest_clients import KINDS, Clients
from selfspec.bench.loadtest_config import LoadTestConfig
from selfspec.bench.loadtest_server import SpawnedServer, replicas_asked, rss_mb, server_metrics
from selfspec.cli_options import add_config_args, config_from_args

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def run(cfg: LoadTestConfig, server_pid: int | None = None) -> dict[str, Any]:
    """Run the load test; returns (and writes to ``cfg.out``) its figures."""
    if cfg.url is not None and urlparse(cfg.url).hostname not in LOOPBACK:
        raise ValueError(f"the load test only targets this machine (127.0.0.1), not {cfg.url}")
    server = SpawnedServer(cfg) if cfg.url is None else None
    try:
        if server is not None:
            server.wait_ready(cfg.ready_timeout)
            server_pid = server.proc.pid
        if cfg.url is not None:
            url = cfg.url.rstrip("/")
        else:
            assert server is not None  # spawned above
            url = server.url
        model = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {cfg.api_key}"},
                          timeout=30).json()["data"][0]["id"]
        clients = Clients(url, cfg, model)
        clients.make_references()  # also the warm-up
        rss_before = rss_mb(server_pid) if server_pid else None
        records: list[dict[str, Any]] = []
        lock = threading.Lock()

        def client(c: int) -> None:
            for i in range(cfg.requests_per_client):
                rec = clients.run(KINDS[(c + i) % len(KINDS)], c * cfg.requests_per_client + i)
                with lock:
                    records.append(rec)

        pids: set[int] = set()  # processes that answered /health during the run (replicas behind Ray Serve)
        running = threading.Event()
        running.set()

        def poll() -> None:  # the pid of whichever process answers /health
            try:
                pids.add(httpx.get(url + "/health", timeout=5).json().get("pid"))
            except (httpx.HTTPError, ValueError):
                pass

        def watch() -> None:
            while running.is_set():
                poll()
                time.sleep(0.2)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=client, args=(c,)) for c in range(cfg.clients)]
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        running.clear()
        watcher.join(10)
        # and polls with the server idle, in bursts of concurrent requests: Ray's router sends a request to the
        # less busy of two replicas, and on a loaded machine a replica whose queue probe answers late is passed over,
        # so single polls can all land on one replica; a burst keeps one busy while the next goes to another. Every
        # live replica is counted: bursts for up to 60 s, until as many processes as replicas asked for answer
        replicas = replicas_asked(cfg.serve_args)
        deadline = time.monotonic() + 60.0
        while len(pids - {None}) < replicas and time.monotonic() < deadline:
            burst = [threading.Thread(target=poll) for _ in range(2 * replicas)]
            for b in burst:
                b.start()
            for b in burst:
                b.join()
            time.sleep(0.05)
        time.sleep(0.5)  # let the last cancelled jobs finish
        rss_after = rss_mb(server_pid) if server_pid else None
        server_side = server_metrics(url, cfg.api_key)
    finally:
        exit_code = server.stop() if server is not None else None
    good = [r for r in records if r["kind"] in ("chat", "chat_stream", "completion", "completion_stream")]
    lat = [r["latency"] for r in good if r["ok"]]
    log = server.log_text() if server is not None else ""
    result = {
        "config": asdict(cfg), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "requests": len(records), "wall_s": wall, "requests_per_s": len(records) / wall,
        "good": len(good), "good_correct": sum(r["ok"] for r in good),
        "by_kind": {k: {"n": sum(r["kind"] == k for r in records), "ok": sum(r["ok"] for r in records if r["kind"] == k)}
                    for k in dict.fromkeys(KINDS)},
        "failures": [r for r in records if not r["ok"]][:20],
        "latency_p50_s": _pct(lat, 0.5), "latency_p95_s": _pct(lat, 0.95),
        "completion_tokens": sum(r["tokens"] for r in good),
        "tokens_per_s": sum(r["tokens"] for r in good) / wall,
        "server": server_side, "rss_before_mb": rss_before, "rss_after_mb": rss_after,
        "server_exit_code": exit_code, "replica_pids": len(pids - {None}),
        "server_log_errors": [ln for ln in log.splitlines() if "Traceback" in ln or "ERROR" in ln][:20],
        "server_log": str(server.log_path) if server is not None else None,
    }
    Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
    Path(cfg.out).write_text(json.dumps(result, indent=2))
    return result


def format_summary(r: dict[str, Any]) -> str:
    rss = (f"{r['rss_before_mb']:.0f} -> {r['rss_after_mb']:.0f} MB" if r["rss_before_mb"] is not None else "n/a")
    kinds = ", ".join(f"{k} {v['ok']}/{v['n']}" for k, v in r["by_kind"].items())
    return "\n".join([
        f"requests: {r['requests']} in {r['wall_s']:.1f} s = {r['requests_per_s']:.2f} req/s ({kinds})",
        f"good answers correct: {r['good_correct']}/{r['good']}; failures: {len(r['failures'])}",
        f"latency of good requests: p50 {r['latency_p50_s']:.2f} s, p95 {r['latency_p95_s']:.2f} s",
        f"tokens/s (good completions / wall): {r['tokens_per_s']:.2f}; server side: {r['server']}",
        f"server RSS: {rss}; exit code {r['server_exit_code']}; logged errors: {len(r['server_log_errors'])}; "
        f"processes answering /health: {r['replica_pids']}",
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m selfspec.bench.loadtest", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p, LoadTestConfig)
    r = run(config_from_args(p.parse_args(argv), LoadTestConfig))
    print(format_summary(r))
    clean = (r["good_correct"] == r["good"] and not r["failures"] and r["server"]["http_5xx"] == 0
             and not r["server_log_errors"] and r["server_exit_code"] in (0, None))
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
