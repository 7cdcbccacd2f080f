"""The endpoints: /health, /metrics, /v1/models, /v1/completions, /v1/chat/completions.

A generation request is encoded and checked in the handler (bad input -> 400 before it queues),
becomes a ``Job`` in the worker's FIFO, and is answered from the job's events: collected into one
JSON body, or streamed as server-sent events (OpenAI chunks, then ``data: [DONE]``). If the client
disconnects, the job is cancelled so the engine moves on.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from selfspec.api import StreamEvent
from selfspec.config import GenerateConfig
from selfspec.engine import validate_request
from selfspec.errors import InvalidConfigError, SelfSpecError
from selfspec.outputs import FinishReason
from selfspec.server.errors import APIError, from_selfspec_error, internal_error
from selfspec.server.metrics import CONTENT_TYPE, Metrics
from selfspec.server.schemas import (
    CHAT_DEFAULT_MAX_TOKENS,
    COMPLETION_DEFAULT_MAX_TOKENS,
    GREEDY_BELOW,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    GenerationRequest,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    Usage,
)
from selfspec.server.worker import Job, Worker
from selfspec.specee.decode import SPECEE_METHODS

T = TypeVar("T")
router = APIRouter()
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class ServerState:
    """Everything the handlers share, kept on ``app.state.selfspec``."""

    ss: Any  # the SelfSpec the worker owns; handlers only use its tokenizer (encode) and limits
    worker: Worker
    metrics: Metrics
    model_name: str
    created: int
    method: str = "selfspec"  # decoding method of requests that name none
    aliases: frozenset[str] = frozenset()  # other names the model is served under (its catalog short name)

    def check_model(self, model: str) -> None:
        if model != self.model_name and model not in self.aliases:
            raise APIError(404, f"the model '{model}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")

    async def submit(self, prompt: Any, body: GenerationRequest, max_tokens: int | None, default_max: int,
                     param: str) -> Job:
        """Encode, map the OpenAI settings onto a GenerateConfig, check, and queue."""
        try:
            ids = await run_in_threadpool(self.ss.encode, prompt)
            vocab, context = self.ss.split.vocab_size, self.ss.split.context_length
            if not all(0 <= t < vocab for t in ids):
                raise APIError(400, f"token ids must be in [0, {vocab})", param=param, code="invalid_value")
            if max_tokens is None:
                max_tokens = max(1, min(default_max, context - len(ids)))
            temperature = 1.0 if body.temperature is None else body.temperature
            config = GenerateConfig(
                max_new_tokens=max_tokens,
                temperature=0.0 if temperature < GREEDY_BELOW else temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=body.top_k or 0, seed=body.seed, stop=body.stop_list(), ignore_eos=body.ignore_eos,
                method=body.method or self.method,
            )
            if config.method in SPECEE_METHODS:  # needs the engine's predictors: refuse now, not in the worker
                try:
                    self.ss.engine.check_method(config.method)
                except InvalidConfigError as e:
                    raise APIError(400, str(e), param="method", code="invalid_value") from e
            validate_request(len(ids), config, context)
        except SelfSpecError as e:
            raise from_selfspec_error(e, param) from e
        return self.worker.submit(Job(ids, config))


def state_of(request: Request) -> ServerState:
    return request.app.state.selfspec


def usage_of(job: Job) -> Usage:
    n = len(job.result.token_ids) if job.result is not None else job.tokens
    cached = job.result.stats.cached_tokens if job.result is not None else 0
    return Usage(prompt_tokens=len(job.prompt_ids), completion_tokens=n, total_tokens=len(job.prompt_ids) + n,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


# ---- waiting on a job ------------------------------------------------------------------------
async def next_event(job: Job, param: str) -> StreamEvent | None:
    """The job's next event, with its errors turned into APIErrors."""
    try:
        return await job.next()
    except APIError:
        raise
    except SelfSpecError as e:
        raise from_selfspec_error(e, param) from e
    except Exception as e:
        raise internal_error(e) from e


class ClientGone(Exception):
    """The client disconnected while its request waited or ran."""


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def guarded(job: Job, request: Request, work: Callable[[], Awaitable[T]]) -> T:
    """Run ``work`` while watching the connection: if the client leaves first, cancel the job."""
    task = asyncio.ensure_future(work())
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone()
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            job.cancel()


async def collect(job: Job, param: str) -> list[StreamEvent]:
    events = []
    while (ev := await next_event(job, param)) is not None:
        events.append(ev)
    return events


def sse(obj: Any) -> str:
    return "data: " + (obj if isinstance(obj, str) else obj.model_dump_json()) + "\n\n"


async def respond(job: Job, request: Request, stream: bool, param: str,
                  whole: Callable[[list[StreamEvent]], Any],
                  chunks: Callable[[StreamEvent | None], list[Any]]) -> Response:
    """Answer a job: one JSON body from ``whole(events)``, or SSE from ``chunks(event)`` per event
    (``chunks(None)`` opens the stream). Errors before the first event get a real status code."""
    try:
        if not stream:
            events = await guarded(job, request, lambda: collect(job, param))
            if not events or events[-1].result is None:  # cancelled without a result: nobody to answer
                return Response(status_code=499)
            return JSONResponse(whole(events).model_dump())
        first = await guarded(job, request, lambda: next_event(job, param))
    except ClientGone:
        return Response(status_code=499)

    async def body() -> AsyncIterator[str]:
        try:
            for c in chunks(None):
                yield sse(c)
            ev = first
            while ev is not None:
                for c in chunks(ev):
                    yield sse(c)
                ev = await next_event(job, param)
            yield sse("[DONE]")
        except APIError as e:  # e.g. cancelled by shutdown: tell the client, end the stream cleanly
            yield sse(json.dumps(e.body()))
            yield sse("[DONE]")
        finally:  # client gone (the response task is cancelled) or done: free the engine
            if not job.ended:
                job.cancel()

    return StreamingResponse(body(), media_type="text/event-stream", headers=SSE_HEADERS)


# ---- endpoints --------------------------------------------------------------------------------
@router.get("/health")
async def health(request: Request) -> JSONResponse:
    st = state_of(request)
    waiting, running = st.worker.depth()
    ok = st.worker.accepting and st.worker.alive
    status = "ok" if ok else ("shutting_down" if not st.worker.accepting else "worker_down")
    return JSONResponse({"status": status, "model": st.model_name, "waiting": waiting, "running": running,
                         "pid": os.getpid()},  # which replica answered (several behind Ray Serve)
                        status_code=200 if ok else 503)


@router.get("/metrics")
async def metrics(request: Request) -> PlainTextResponse:
    st = state_of(request)
    return PlainTextResponse(st.metrics.render(*st.worker.depth()), media_type=CONTENT_TYPE)


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    st = state_of(request)
    return ModelList(data=[ModelCard(id=st.model_name, created=st.created)]).model_dump()


@router.get("/v1/models/{model:path}")
async def get_model(model: str, request: Request) -> dict:
    st = state_of(request)
    st.check_model(model)
    return ModelCard(id=st.model_name, created=st.created).model_dump()


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    st = state_of(request)
    st.check_model(body.model)
    job = await st.submit(body.prompt, body, body.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, "prompt")
    head: dict[str, Any] = dict(id="cmpl-" + job.id, created=int(time.time()), model=st.model_name)

    def whole(events: list[StreamEvent]) -> CompletionResponse:
        text, result = "".join(e.text for e in events), events[-1].result
        assert result is not None  # the last event carries the result
        choice = CompletionChoice(text=text, finish_reason=result.finish_reason)
        return CompletionResponse(**head, choices=[choice], usage=usage_of(job))

    def chunks(ev: StreamEvent | None) -> list[CompletionResponse]:
        out = []
        if ev is not None and ev.text:
            out.append(CompletionResponse(**head, choices=[CompletionChoice(text=ev.text, finish_reason=None)]))
        if ev is not None and ev.result is not None:
            out.append(CompletionResponse(
                **head, choices=[CompletionChoice(text="", finish_reason=ev.result.finish_reason)]))
            if body.include_usage():
                out.append(CompletionResponse(**head, choices=[], usage=usage_of(job)))
        return out

    return await respond(job, request, bool(body.stream), "prompt", whole, chunks)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    st = state_of(request)
    st.check_model(body.model)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    job = await st.submit(body.template_messages(), body, max_tokens, CHAT_DEFAULT_MAX_TOKENS, "messages")
    head: dict[str, Any] = dict(id="chatcmpl-" + job.id, created=int(time.time()), model=st.model_name)

    def whole(events: list[StreamEvent]) -> ChatCompletionResponse:
        text, result = "".join(e.text for e in events), events[-1].result
        assert result is not None  # the last event carries the result
        choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=result.finish_reason)
        return ChatCompletionResponse(**head, choices=[choice], usage=usage_of(job))

    def chunk(delta: ChatDelta, finish: FinishReason | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(**head, choices=[ChatChunkChoice(delta=delta, finish_reason=finish)])

    def chunks(ev: StreamEvent | None) -> list[ChatCompletionChunk]:
        if ev is None:
            return [chunk(ChatDelta(role="assistant", content=""))]
        out = [chunk(ChatDelta(content=ev.text))] if ev.text else []
        if ev.result is not None:
            out.append(chunk(ChatDelta(), ev.result.finish_reason))
            if body.include_usage():
                out.append(ChatCompletionChunk(**head, choices=[], usage=usage_of(job)))
        return out

    return await respond(job, request, bool(body.stream), "messages", whole, chunks)
