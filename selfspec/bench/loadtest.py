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
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx

from selfspec.config import add_config_args, config_from_args, opt
from selfspec.ports import free_port

PROMPTS = [
    "Name three colors of the rainbow.",
    "What is the capital of France?",
    "Give me one tip for writing clear code.",
    "Write one sentence about the sea.",
]
KINDS = ["chat", "completion_stream", "malformed", "chat_stream", "completion", "disconnect", "unauthorized",
         "chat_stream"]
MALFORMED: list[tuple[str, int]] = [  # (body, expected status)
    ('{"model": "MODEL", "messages": [{"role": "user", "content": "hi"}', 400),  # invalid JSON
    ('{"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}', 404),
    ('{"model": "MODEL", "messages": [{"role": "user", "content": "hi"}], "temperature": -1}', 400),
    ('{"model": "MODEL", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000000}', 400),
    ('{"model": "MODEL", "messages": []}', 400),
    ('{"model": "MODEL", "prompt": ["a", "b"]}', 400),
]
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


@dataclass
class LoadTestConfig:
    """Settings of the bounded load test."""

    clients: int = opt(8, "Concurrent clients (threads), each sending its requests one after another.")
    requests_per_client: int = opt(20, "Requests each client sends (a fixed mix of kinds, see KINDS).")
    max_tokens: int = opt(16, "max_tokens of every generation request (greedy, temperature 0).")
    num_prompts: int = opt(4, "How many of the built-in prompts to cycle through.")
    url: str | None = opt(None, "Base URL of a running server on this machine (None: start `selfspec serve`).")
    api_key: str = opt("loadtest-key", "API key (given to the spawned server; sent by the good clients).")
    threads: int | None = opt(1, "torch threads of the spawned server (leaves a core for the clients).")
    serve_args: str = opt("", "Extra arguments for the spawned server, e.g. '--exit-layer 20 --head lm'.")
    request_timeout: float = opt(300.0, "Seconds before one request counts as failed.")
    ready_timeout: float = opt(600.0, "Seconds the spawned server may take to load and answer /health (Ray Serve's "
                                      "replicas start slowly on a loaded machine); a server that exits fails at "
                                      "once.")
    out: str = opt("runs/loadtest.json", "Where to write the results (JSON).")


def rss_mb(pid: int) -> float | None:
    """Resident set size of a process in MB (Linux /proc), None elsewhere."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


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


class Clients:
    """The request kinds; each returns a record {kind, ok, latency, tokens, detail}."""

    def __init__(self, url: str, cfg: LoadTestConfig, model: str) -> None:
        import openai  # lazy: an optional dependency (the dev extra), needed only by the clients

        self.url, self.cfg, self.model = url, cfg, model
        self.openai = openai
        self.good = openai.OpenAI(base_url=url + "/v1", api_key=cfg.api_key, max_retries=0,
                                  timeout=cfg.request_timeout)
        self.reference: dict[tuple[str, int], str] = {}

    def _chat(self, p: int, stream: bool) -> tuple[str, int]:
        kw: dict[str, Any] = dict(model=self.model, messages=[{"role": "user", "content": PROMPTS[p]}],
                                  max_tokens=self.cfg.max_tokens, temperature=0)
        if not stream:
            r = self.good.chat.completions.create(**kw)
            return r.choices[0].message.content, r.usage.completion_tokens
        text, tokens = "", 0
        for ch in self.good.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
            text += "".join(c.delta.content or "" for c in ch.choices)
            tokens = ch.usage.completion_tokens if ch.usage else tokens
        return text, tokens

    def _completion(self, p: int, stream: bool) -> tuple[str, int]:
        kw: dict[str, Any] = dict(model=self.model, prompt=PROMPTS[p], max_tokens=self.cfg.max_tokens, temperature=0)
        if not stream:
            r = self.good.completions.create(**kw)
            return r.choices[0].text, r.usage.completion_tokens
        text, tokens = "", 0
        for ch in self.good.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
            text += "".join(c.text for c in ch.choices)
            tokens = ch.usage.completion_tokens if ch.usage else tokens
        return text, tokens

    def make_references(self) -> None:
        for p in range(self.cfg.num_prompts):
            self.reference[("chat", p)] = self._chat(p, False)[0]
            self.reference[("completion", p)] = self._completion(p, False)[0]

    def run(self, kind: str, i: int) -> dict[str, Any]:
        p = i % self.cfg.num_prompts
        t0 = time.perf_counter()
        rec: dict[str, Any] = {"kind": kind, "ok": False, "tokens": 0, "detail": ""}
        try:
            if kind in ("chat", "chat_stream", "completion", "completion_stream"):
                endpoint = kind.split("_")[0]
                fn = self._chat if endpoint == "chat" else self._completion
                text, rec["tokens"] = fn(p, kind.endswith("_stream"))
                rec["ok"] = text == self.reference[(endpoint, p)]
                rec["detail"] = "" if rec["ok"] else f"got {text!r}, expected {self.reference[(endpoint, p)]!r}"
            elif kind == "malformed":
                body, want = MALFORMED[i % len(MALFORMED)]
                r = httpx.post(self.url + "/v1/chat/completions", content=body.replace("MODEL", self.model),
                               headers={"Authorization": f"Bearer {self.cfg.api_key}",
                                        "Content-Type": "application/json"}, timeout=self.cfg.request_timeout)
                err = r.json().get("error", {})
                rec["ok"] = r.status_code == want and bool(err.get("message")) and "type" in err
                rec["detail"] = f"{r.status_code} {r.text[:200]}"
            elif kind == "unauthorized":
                bad = self.openai.OpenAI(base_url=self.url + "/v1", api_key="wrong-key", max_retries=0)
                try:
                    bad.models.list()
                except self.openai.AuthenticationError:
                    rec["ok"] = True
            elif kind == "disconnect":  # read one chunk of a long answer, then hang up
                stream = self.good.chat.completions.create(
                    model=self.model, messages=[{"role": "user", "content": "Tell me a long story."}],
                    max_tokens=512, temperature=0, stream=True, extra_body={"ignore_eos": True})
                next(iter(stream))
                stream.close()
                rec["ok"] = True
        except Exception as e:  # noqa: BLE001 - every failure is recorded, none stops the test
            rec["detail"] = f"{type(e).__name__}: {e}"
        rec["latency"] = time.perf_counter() - t0
        return rec


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def _server_metrics(url: str, key: str) -> dict[str, float]:
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
        server_side = _server_metrics(url, cfg.api_key)
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
