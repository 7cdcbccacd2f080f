"""The settings of the bounded load test (selfspec.bench.loadtest), read by its clients and the server it spawns."""

from __future__ import annotations

from dataclasses import dataclass

from selfspec.config import opt


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
