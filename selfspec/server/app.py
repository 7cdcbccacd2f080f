"""The OpenAI-compatible server: ``create_app`` (FastAPI app factory), ``make_server`` (uvicorn with a
graceful shutdown that also drains the worker) and ``serve`` (both until Ctrl-C); the command ``selfspec serve``
is selfspec/server/cli.py. See docs/SERVER.md.

    from selfspec import SelfSpec
    from selfspec.server.app import create_app, make_server
    app = create_app(SelfSpec.load(), api_key="secret")
    make_server(app, port=8000).run()
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI

from selfspec.batch.scheduler import BatchConfig
from selfspec.models import catalog
from selfspec.server.config import ServeConfig
from selfspec.server.errors import install_handlers
from selfspec.server.metrics import Metrics
from selfspec.server.middleware import APIKeyMiddleware, MetricsMiddleware
from selfspec.server.routes import ServerState, router
from selfspec.server.worker import Worker
from selfspec.specee.decode import SPECEE_METHODS

log = logging.getLogger("selfspec.server")
ROUTE_PATHS = frozenset({"/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions"})


def _info(ss: Any, name: str) -> dict[str, Any]:
    d = getattr(ss, "draft_config", None)
    head = getattr(getattr(ss, "head", None), "kind", None)
    return {"model": name, "exit_layer": getattr(d, "exit_layer", None), "head": head,
            "gamma": getattr(d, "gamma", None), "policy": getattr(d, "policy", None)}


def create_app(ss: Any, api_key: str | None = None, model_name: str | None = None, max_queue: int = 64,
               method: str = "selfspec", batch: BatchConfig | None = None) -> FastAPI:
    """A FastAPI app serving ``ss`` (a SelfSpec). Its worker thread starts and stops with the app's
    lifespan; only that thread ever calls the engine, batching up to ``batch.max_batch`` requests at once.
    ``method``: the decoding method of requests that name none ('specee' is lossy)."""
    name = model_name or ss.model_id
    if method in SPECEE_METHODS:
        ss.engine.check_method(method)
    batch = batch or BatchConfig()
    metrics = Metrics({**_info(ss, name), "method": method, "lossy": method == "specee", "max_batch": batch.max_batch})
    worker = Worker(ss, max_queue=max_queue, metrics=metrics, batch=batch)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        worker.start()
        yield
        await asyncio.to_thread(worker.stop)

    app = FastAPI(title="selfspec", description="OpenAI-compatible API over selfspec", lifespan=lifespan)
    # the short name it may have been started with (`selfspec serve --model qwen2.5-coder-0.5b`) is accepted too
    aliases = catalog.short_names(name) if model_name is None else frozenset()
    app.state.selfspec = ServerState(ss, worker, metrics, name, int(time.time()), method, aliases)
    install_handlers(app)
    app.include_router(router)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(MetricsMiddleware, metrics=metrics, paths=ROUTE_PATHS)  # outermost: sees the 401s too
    return app


class GracefulServer(uvicorn.Server):
    """uvicorn.Server whose shutdown also drains the worker: nothing new is admitted, in-flight and
    queued requests get ``grace`` seconds, then the rest are cancelled with an error event / 503."""

    def __init__(self, config: uvicorn.Config, worker: Worker, grace: float) -> None:
        super().__init__(config)
        self.worker, self.grace = worker, grace

    async def shutdown(self, sockets: Any = None) -> None:
        self.worker.begin_shutdown(self.grace)
        await super().shutdown(sockets=sockets)


def make_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, graceful_timeout: float = 10.0,
                log_level: str = "info") -> GracefulServer:
    """The uvicorn server for an app from ``create_app``; ``.run()`` it (or ``.run(sockets=[sock])``)."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            # uvicorn annotates an int but passes it to asyncio.wait_for as a timeout (a float is fine)
                            timeout_graceful_shutdown=graceful_timeout + 5.0)  # type: ignore[arg-type]
    return GracefulServer(config, app.state.selfspec.worker, graceful_timeout)


def serve(ss: Any, cfg: ServeConfig, batch: BatchConfig | None = None) -> None:
    """Serve until Ctrl-C / SIGTERM."""
    api_key = cfg.api_key if cfg.api_key is not None else os.environ.get("SELFSPEC_API_KEY") or None
    if not api_key and cfg.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("serving on %s without an API key: anyone who can reach it can use it", cfg.host)
    if cfg.method == "specee":
        log.warning("serving with method 'specee' by default: LOSSY, outputs may differ from the model's own")
    app = create_app(ss, api_key=api_key, model_name=cfg.model_name, max_queue=cfg.max_queue, method=cfg.method,
                     batch=batch)
    make_server(app, cfg.host, cfg.port, cfg.graceful_timeout, cfg.log_level).run()
