"""Two plain ASGI middlewares (no BaseHTTPMiddleware, so streaming and disconnects pass untouched):
the API key check and the HTTP request metrics."""

from __future__ import annotations

import secrets
import time
from typing import Any

from selfspec.server.errors import APIError
from selfspec.server.metrics import Metrics

OPEN_PATHS = frozenset({"/health"})


class APIKeyMiddleware:
    """Refuse (401) any request but /health without ``Authorization: Bearer <api_key>``."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            auth = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not secrets.compare_digest(token.strip(), self.key):
                msg = "missing API key: send 'Authorization: Bearer <key>'" if not auth else "incorrect API key"
                await APIError(401, msg, code="invalid_api_key").response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class MetricsMiddleware:
    """Count every HTTP request by method, route and status, and time it."""

    def __init__(self, app: Any, metrics: Metrics, paths: frozenset[str]) -> None:
        self.app, self.metrics, self.paths = app, metrics, paths

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = {"code": 0}
        t0 = time.perf_counter()

        async def _send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, _send)
        finally:
            path = scope["path"] if scope["path"] in self.paths else "other"
            # 499 (nginx's "client closed request"): the client left before any answer
            self.metrics.http_request(scope["method"], path, status["code"] or 499, time.perf_counter() - t0)
