"""Scale-out on Ray Serve: N engine replicas behind the same OpenAI-compatible API.

    selfspec serve --replicas 2                       # a local Ray instance, two replicas
    selfspec serve --replicas 4 --ray-address auto    # an existing Ray cluster (see docs/SERVER.md)

Each replica is a Ray actor that loads the model and runs the very app of ``create_app``: its own
worker thread, continuous batching, queue limit (429), metrics and streaming. Ray Serve's HTTP
proxy listens on --host/--port and spreads requests over the replicas. Needs the optional extra:
``pip install 'selfspec[ray]'``.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from selfspec.batch.scheduler import BatchConfig
from selfspec.config import DraftConfig, ModelConfig
from selfspec.errors import InvalidConfigError
from selfspec.server.config import ServeConfig

log = logging.getLogger("selfspec.server")


def replica_threads(model: ModelConfig, cfg: ServeConfig) -> int:
    """torch threads per replica: ModelConfig.threads, else this machine's cores shared out."""
    return model.threads or max(1, (os.cpu_count() or 1) // max(1, cfg.replicas))


def app_builder(model: ModelConfig, draft: DraftConfig, cfg: ServeConfig, batch: BatchConfig) -> Callable[[], Any]:
    """A function that builds one replica's app; Ray Serve calls it in each replica process."""
    threads = replica_threads(model, cfg)

    def build() -> Any:
        from selfspec.api import SelfSpec
        from selfspec.server.app import create_app

        ss = SelfSpec.load(replace(model, threads=threads), draft)
        api_key = cfg.api_key if cfg.api_key is not None else os.environ.get("SELFSPEC_API_KEY") or None
        return create_app(ss, api_key=api_key, model_name=cfg.model_name, max_queue=cfg.max_queue,
                          method=cfg.method, batch=batch)

    return build


def deployment(model: ModelConfig, draft: DraftConfig, cfg: ServeConfig, batch: BatchConfig) -> Any:
    """The Ray Serve deployment: ``cfg.replicas`` copies of the app, each asking for its torch threads in CPUs."""
    from ray import serve

    cls = serve.ingress(app_builder(model, draft, cfg, batch))(type("SelfSpecReplica", (), {}))
    return serve.deployment(
        cls, name="selfspec", num_replicas=cfg.replicas,
        # CPUs Ray reserves per replica: its threads, on a local instance at most its share of the cores
        ray_actor_options={"num_cpus": replica_threads(model, cfg) if cfg.ray_address else
                           min(replica_threads(model, cfg), (os.cpu_count() or 1) / cfg.replicas)},
        max_ongoing_requests=cfg.max_queue + 8,  # the replica's own queue answers 429 past max_queue
        graceful_shutdown_timeout_s=cfg.graceful_timeout,
    )


def serve_ray(model: ModelConfig, draft: DraftConfig, cfg: ServeConfig, batch: BatchConfig,
              stop: threading.Event | None = None) -> None:
    """Start (or join) Ray, deploy the replicas behind one HTTP endpoint, serve until Ctrl-C / SIGTERM
    (or ``stop``), then take the deployment down."""
    try:
        import ray
        from ray import serve
    except ImportError as e:
        raise InvalidConfigError("--replicas > 1 / --ray-address need Ray Serve: pip install 'selfspec[ray]'") from e
    if cfg.replicas < 1:
        raise InvalidConfigError(f"replicas must be >= 1, got {cfg.replicas}")
    if cfg.ray_address:
        ray.init(address=cfg.ray_address, log_to_driver=False)
    else:
        ray.init(include_dashboard=False, log_to_driver=False)
    stop = stop or threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": cfg.host, "port": cfg.port})
        serve.run(deployment(model, draft, cfg, batch).bind(), name="selfspec", route_prefix="/")
        log.warning("serving %d replicas on http://%s:%d (Ray Serve)", cfg.replicas, cfg.host, cfg.port)
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
