"""OpenAI-style error answers: ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status
for anything the client got wrong, installed as FastAPI exception handlers."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from selfspec.errors import (
    ContextOverflowError,
    EmptyPromptError,
    NoChatTemplateError,
    PipelineError,
    SelfSpecError,
)

log = logging.getLogger("selfspec.server")


class APIError(Exception):
    """An error answer: HTTP status plus the OpenAI error object fields."""

    def __init__(
        self, status: int, message: str, type: str = "invalid_request_error",  # noqa: A002 - OpenAI's name
        param: str | None = None, code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


class QueueFullError(APIError):
    def __init__(self, limit: int) -> None:
        super().__init__(429, f"the server is busy: {limit} requests are already waiting or running, retry later",
                         "rate_limit_error", code="queue_full")


class ShuttingDownError(APIError):
    def __init__(self) -> None:
        super().__init__(503, "the server is shutting down; the request was not completed",
                         "server_error", code="server_shutting_down")


def from_selfspec_error(e: SelfSpecError, prompt_param: str) -> APIError:
    """Engine / API input errors (bad prompt, bad settings, too long) -> 400; a pipeline stage that failed
    -> 503 (the server restarts the pipeline for the next request)."""
    if isinstance(e, PipelineError):
        return APIError(503, str(e), "server_error", code="pipeline_stage_failed")
    if isinstance(e, ContextOverflowError):
        return APIError(400, str(e), param=prompt_param, code="context_length_exceeded")
    if isinstance(e, EmptyPromptError):
        return APIError(400, str(e), param=prompt_param, code="empty_prompt")
    if isinstance(e, NoChatTemplateError):  # a base model: chat needs a template, completions do not
        return APIError(400, f"{e} to /v1/completions", param=prompt_param, code="no_chat_template")
    return APIError(400, str(e), code="invalid_value")


def internal_error(e: BaseException) -> APIError:
    return APIError(500, f"internal error: {type(e).__name__}: {e}", "server_error", code="internal_error")


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return APIError(400, "the request body is not valid JSON: " + str(first.get("ctx", {}).get("error", "")),
                        code="invalid_json")
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    code = "invalid_value"
    if first.get("type") == "missing":
        msg, code = (f"missing required parameter '{param}'" if param else "the request body is missing"), \
            "missing_required_parameter"
    elif param:
        msg = f"invalid value for '{param}': {msg}"
    else:
        msg, code = "the request body must be a JSON object", "invalid_request"
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    return APIError(400, msg + more, param=param, code=code)


def install_handlers(app: FastAPI) -> None:
    """Every error leaves the server as an OpenAI-style JSON error object."""

    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), code=code).response()

    @app.exception_handler(Exception)
    async def _crash(_: Request, exc: Exception) -> JSONResponse:  # a bug: still a clean JSON answer
        log.exception("unhandled error")
        return internal_error(exc).response()
