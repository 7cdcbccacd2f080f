"""The OpenAI-compatible server: the worker queue on a fake engine (fast), then the real server on the
real default model, driven by the real ``openai`` client over loopback (slow), and the bounded load
test against a real ``selfspec serve`` process."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import threading
import time
import types

import httpx
import openai
import pytest
import torch

from selfspec import DraftConfig
from selfspec.api import GenerationResult, StreamEvent
from selfspec.batch.scheduler import BatchConfig
from selfspec.config import GenerateConfig
from selfspec.prefix_cache import MIN_ROWS
from selfspec.server.app import create_app, make_server
from selfspec.server.errors import APIError, QueueFullError, ShuttingDownError
from selfspec.server.metrics import Metrics
from selfspec.server.worker import Job, Worker
from selfspec.stats import GenerationStats

KEY = "test-key"
MSGS = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a fruit."}]
PROMPT = "The three primary colors are"


def wait_for(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


# ---- the worker and the metrics, on a fake engine ------------------------------------------------
class FakeEngine:
    """A fake batching engine: each request streams ``blocks`` one-token events, one per step, up to
    ``max_batch`` requests per step; ``gate`` holds every step while cleared."""

    def __init__(self, blocks: int = 3, delay: float = 0.0) -> None:
        self.blocks, self.delay = blocks, delay
        self.calls: list[int] = []  # requests in the order they were admitted into the batch
        self.closed: list[int] = []  # ... and left it (finished or cancelled)
        self.step_sizes: list[int] = []
        self.gate = threading.Event()
        self.gate.set()

    def scheduler(self, batch):
        return FakeScheduler(self, batch.max_batch)


class FakeScheduler:
    def __init__(self, eng: FakeEngine, max_batch: int) -> None:
        self.eng, self.max_batch = eng, max_batch
        self.waiting: list = []
        self.running: list = []

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, prompt_ids, gen, tag=None):
        req = types.SimpleNamespace(name=prompt_ids[0], tag=tag, ids=[], started=None)
        self.waiting.append(req)
        return req

    def cancel(self, req) -> None:
        for pool in (self.waiting, self.running):
            if req in pool:
                pool.remove(req)
                self.eng.closed.append(req.name) if pool is self.running else None

    def step_events(self):
        while self.waiting and len(self.running) < self.max_batch:
            req = self.waiting.pop(0)
            self.eng.calls.append(req.name)
            self.running.append(req)
        assert self.eng.gate.wait(10)
        time.sleep(self.eng.delay)
        self.eng.step_sizes.append(len(self.running))
        events = []
        for req in list(self.running):
            i = len(req.ids)
            req.ids.append(i)
            events.append((req, StreamEvent(f"{req.name}.{i} ", [i])))
            if len(req.ids) == self.eng.blocks:
                n = len(req.ids)
                stats = GenerationStats(prompt_tokens=1, new_tokens=n, steps=n, accept_lengths=[1] * n,
                                        proposed_per_position=[n], accepted_per_position=[0])
                events.append((req, StreamEvent("", [], GenerationResult("", req.ids, "length", stats))))
                self.running.remove(req)
                self.eng.closed.append(req.name)
        return events


async def drain(job: Job) -> list[StreamEvent]:
    out = []
    while (ev := await job.next()) is not None:
        out.append(ev)
    return out


def test_worker_is_fifo_and_skips_cancelled_jobs():
    async def scenario():
        eng = FakeEngine(blocks=3)
        eng.gate.clear()
        metrics = Metrics()
        w = Worker(eng, max_queue=8, metrics=metrics, batch=BatchConfig(max_batch=1))
        jobs = [w.submit(Job([i], GenerateConfig())) for i in range(5)]
        assert wait_for(lambda: w.depth() == (4, 1), 5)  # job 0 runs (held by the gate), four wait
        jobs[2].cancel()  # a client that left while queued
        assert w.depth() == (3, 1)
        eng.gate.set()
        outs = [await drain(j) for j in jobs]
        w.stop()
        assert not w.alive
        assert eng.calls == [0, 1, 3, 4]  # arrival order, the cancelled job never reached the engine
        assert outs[2] == [] and jobs[2].result is None
        for i in (0, 1, 3, 4):
            assert "".join(e.text for e in outs[i]) == f"{i}.0 {i}.1 {i}.2 "
            assert jobs[i].result is not None and jobs[i].tokens == 3
        text = metrics.render(*w.depth())
        assert 'selfspec_generations_total{outcome="completed"} 4' in text
        assert 'selfspec_generations_total{outcome="cancelled"} 1' in text
        assert "selfspec_completion_tokens_total 12" in text and "selfspec_verify_steps_total 12" in text
        for line in text.splitlines():  # Prometheus text format: comments or `name{labels} value`
            assert line.startswith("# ") or re.fullmatch(r"[a-z_]+(\{[^}]*\})? [-+0-9.eInf]+", line), line

    asyncio.run(scenario())


def test_worker_cancels_a_running_job_between_blocks():
    async def scenario():
        eng = FakeEngine(blocks=10_000, delay=0.01)
        w = Worker(eng)
        long = w.submit(Job([7], GenerateConfig()))
        first = await long.next()
        assert first is not None and first.text == "7.0 "
        long.cancel()
        rest = await asyncio.wait_for(drain(long), 5)
        assert len(rest) < 50 and long.result is None and eng.closed == [7]  # stopped promptly, stream closed
        eng.blocks = 2
        nxt = w.submit(Job([8], GenerateConfig()))  # the engine moved on
        assert "".join(e.text for e in await asyncio.wait_for(drain(nxt), 5)) == "8.0 8.1 "
        w.stop()

    asyncio.run(scenario())


def test_worker_batches_continuously():
    """Up to max_batch jobs step together; a job submitted while others run joins at the next free slot;
    a cancelled job leaves the batch and the others go on."""
    async def scenario():
        eng = FakeEngine(blocks=4, delay=0.02)
        w = Worker(eng, batch=BatchConfig(max_batch=2))
        a, b = w.submit(Job([1], GenerateConfig())), w.submit(Job([2], GenerateConfig()))
        assert (await a.next()).text == "1.0 " and (await b.next()).text == "2.0 "
        c = w.submit(Job([3], GenerateConfig()))  # waits: both slots are taken
        assert w.depth() == (1, 2)
        b.cancel()  # b leaves; c takes its slot
        outs = [await asyncio.wait_for(drain(j), 5) for j in (a, c)]
        w.stop()
        assert "".join(e.text for e in outs[0]) == "1.1 1.2 1.3 " and a.result is not None
        assert "".join(e.text for e in outs[1]) == "3.0 3.1 3.2 3.3 " and c.result is not None
        assert b.result is None and eng.calls == [1, 2, 3] and 2 in eng.closed
        assert max(eng.step_sizes) == 2 and eng.step_sizes.count(2) >= 3  # a with b, then a with c

    asyncio.run(scenario())


def test_worker_queue_limit_and_shutdown():
    async def scenario():
        eng = FakeEngine(blocks=3)
        eng.gate.clear()
        w = Worker(eng, max_queue=2, batch=BatchConfig(max_batch=1))
        a = w.submit(Job([1], GenerateConfig()))
        b = w.submit(Job([2], GenerateConfig()))
        assert wait_for(lambda: w.depth() == (1, 1), 5)  # a runs (held by the gate), b waits
        with pytest.raises(QueueFullError) as e:
            w.submit(Job([3], GenerateConfig()))
        assert e.value.status == 429
        b.cancel()  # frees its slot at once, before the worker reaches it
        c = w.submit(Job([3], GenerateConfig()))
        w.begin_shutdown(0.0)  # no grace: everything admitted is cancelled with a 503 error
        with pytest.raises(ShuttingDownError):
            w.submit(Job([4], GenerateConfig()))
        eng.gate.set()
        for job in (a, c):
            with pytest.raises(ShuttingDownError):
                await asyncio.wait_for(drain(job), 5)
        w.stop()
        assert not w.alive and eng.calls == [1]

    asyncio.run(scenario())


# ---- the real server, in a thread ---------------------------------------------------------------
class ErrorLog(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class ThreadedServer:
    """A real uvicorn server on a free loopback port, in a thread of this process."""

    def __init__(self, app, graceful_timeout: float = 10.0) -> None:
        self.app = app
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = make_server(app, graceful_timeout=graceful_timeout, log_level="warning")
        self.errors = ErrorLog()
        for name in ("uvicorn", "selfspec.server"):
            logging.getLogger(name).addHandler(self.errors)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)

    def client(self, key: str | None = KEY, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120, **kw)

    def stop(self, timeout: float = 60) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        for name in ("uvicorn", "selfspec.server"):
            logging.getLogger(name).removeHandler(self.errors)


@pytest.fixture(scope="module")
def ss(default_ss):
    default_ss.set_draft(DraftConfig())  # the shared model as served: earlier modules may have set other drafts
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield default_ss
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def server(ss):
    srv = ThreadedServer(create_app(ss, api_key=KEY))
    yield srv
    srv.stop()
    assert not srv.thread.is_alive()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def model_of(ss) -> str:
    return ss.model_id


def stream_text(chunks, chat: bool) -> tuple[str, list]:
    parts, all_chunks = [], []
    for ch in chunks:
        all_chunks.append(ch)
        for c in ch.choices:
            parts.append((c.delta.content or "") if chat else c.text)
    return "".join(parts), all_chunks


@pytest.mark.slow
def test_health_models_and_api_key(server, ss):
    h = httpx.get(server.url + "/health")  # no key needed
    assert h.status_code == 200 and h.json()["status"] == "ok"
    models = server.client().models.list()
    assert [m.id for m in models.data] == [model_of(ss)]
    assert server.client().models.retrieve(model_of(ss)).id == model_of(ss)
    with pytest.raises(openai.AuthenticationError):
        server.client(key="wrong").models.list()
    for path in ("/v1/models", "/metrics"):
        r = httpx.get(server.url + path)  # no key at all
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(server.url + "/v1/completions", content="{not json", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401  # the key is checked before anything else
    with pytest.raises(openai.AuthenticationError):
        server.client(key="wrong").completions.create(model=model_of(ss), prompt=PROMPT, max_tokens=4)


@pytest.mark.slow
def test_completion_stream_equals_nonstream_equals_engine(client, ss):
    ref = ss.generate(PROMPT, max_new_tokens=12, temperature=0.0)
    r = client.completions.create(model=model_of(ss), prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(ss.encode(PROMPT))
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    text, chunks = stream_text(client.completions.create(
        model=model_of(ss), prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}), chat=False)
    assert text == ref.text and len(chunks) >= 3  # streamed in pieces
    assert chunks[-2].choices[0].finish_reason == ref.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == r.usage.model_dump()
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("cmpl-")
    # a prompt given as token ids is the same prompt; a vanishing temperature is greedy
    r2 = client.completions.create(model=model_of(ss), prompt=ss.encode(PROMPT), max_tokens=12, temperature=1e-9)
    assert r2.choices[0].text == ref.text


@pytest.mark.slow
def test_chat_stream_equals_nonstream_equals_engine(client, ss):
    ref = ss.generate(MSGS, max_new_tokens=12, temperature=0.0)
    r = client.chat.completions.create(model=model_of(ss), messages=MSGS, max_tokens=12, temperature=0)
    msg = r.choices[0].message
    assert r.object == "chat.completion" and msg.role == "assistant" and msg.content == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(ss.encode(MSGS)) and r.usage.completion_tokens == len(ref.token_ids)
    text, chunks = stream_text(client.chat.completions.create(
        model=model_of(ss), messages=MSGS, max_completion_tokens=12, temperature=0, stream=True), chat=True)
    assert text == ref.text
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


@pytest.mark.slow
def test_a_chats_next_turn_reuses_its_first_turns_prompt(client, ss, server):
    """The second turn of a chat prefills only what follows the first turn's prompt (the prefix cache), reports
    it as OpenAI's usage.prompt_tokens_details.cached_tokens, and says what the engine says without the cache."""
    system = {"role": "system", "content": "You are a concise assistant for questions about geography. " * 6}
    turn1 = [system, {"role": "user", "content": "Name the longest river in Africa."}]
    r1 = client.chat.completions.create(model=model_of(ss), messages=turn1, max_tokens=16, temperature=0)
    turn2 = [*turn1, {"role": "assistant", "content": r1.choices[0].message.content},
             {"role": "user", "content": "And in South America? Name the countries it flows through, its length in "
                                         "kilometres and where it reaches the sea, in two short sentences."}]
    before = metric(server, "selfspec_prompt_tokens_cached_total")
    r2 = client.chat.completions.create(model=model_of(ss), messages=turn2, max_tokens=16, temperature=0)
    cached = len(ss.encode(turn1))  # all of it: turn 2 adds more than the rows a prefill must compute
    # the rows a prefill must compute: MIN_ROWS, and a deep head's last head_context + 1 states if one drafts
    assert len(ss.encode(turn2)) - cached >= max(MIN_ROWS, DraftConfig().head_context + 1)
    assert r2.usage.prompt_tokens_details.cached_tokens == cached
    assert wait_for(lambda: metric(server, "selfspec_prompt_tokens_cached_total") == before + cached, 10)
    ss.prefix_cache.clear()
    alone = ss.generate(turn2, max_new_tokens=16, temperature=0.0)
    assert alone.stats.cached_tokens == 0 and r2.choices[0].message.content == alone.text


@pytest.mark.slow
def test_stop_strings_and_seeded_sampling(client, ss):
    full = ss.generate(MSGS, max_new_tokens=16, temperature=0.0)
    words = full.text.split()
    assert len(words) >= 3, full.text
    stop = words[2]
    cut = ss.generate(MSGS, max_new_tokens=16, temperature=0.0, stop=[stop])
    r = client.chat.completions.create(model=model_of(ss), messages=MSGS, max_tokens=16, temperature=0, stop=stop)
    assert r.choices[0].message.content == cut.text == full.text[: full.text.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    text, chunks = stream_text(client.chat.completions.create(
        model=model_of(ss), messages=MSGS, max_tokens=16, temperature=0, stop=[stop, "zzz"], stream=True), chat=True)
    assert text == cut.text and chunks[-1].choices[0].finish_reason == "stop"
    # sampling: the seed makes it reproducible, and it is the engine's own sampling
    kw = dict(temperature=0.9, top_p=0.95, seed=1234)
    ref = ss.generate(PROMPT, max_new_tokens=10, **kw)
    a = client.completions.create(model=model_of(ss), prompt=PROMPT, max_tokens=10, **kw)
    b, _ = stream_text(client.completions.create(model=model_of(ss), prompt=PROMPT, max_tokens=10, stream=True,
                                                 **kw), chat=False)
    assert a.choices[0].text == b == ref.text


MALFORMED = [  # (path, body, status, error code)
    ("/v1/completions", "{not json", 400, "invalid_json"),
    ("/v1/completions", "[1, 2]", 400, "invalid_request"),
    ("/v1/completions", {"prompt": "hi"}, 400, "missing_required_parameter"),
    ("/v1/completions", {"model": "M"}, 400, "missing_required_parameter"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model_not_found"),
    ("/v1/completions", {"model": "M", "prompt": ""}, 400, "invalid_value"),
    ("/v1/completions", {"model": "M", "prompt": ["a", "b"]}, 400, "invalid_value"),
    ("/v1/completions", {"model": "M", "prompt": "hi", "temperature": -0.5}, 400, "invalid_value"),
    ("/v1/completions", {"model": "M", "prompt": "hi", "temperature": "hot"}, 400, "invalid_value"),
    ("/v1/completions", {"model": "M", "prompt": "hi", "top_p": 0}, 400, "invalid_value"),
    ("/v1/completions", {"model": "M", "prompt": "hi", "max_tokens": 0}, 400, "invalid_value"),
    ("/v1/completions", {"model": "M", "prompt": "hi", "max_tokens": 10**6}, 400, "context_length_exceeded"),
    ("/v1/completions", {"model": "M", "prompt": "hi", "n": 2}, 400, "invalid_value"),
    ("/v1/completions", {"model": "M", "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "invalid_value"),
    ("/v1/completions", {"model": "M", "prompt": "hi", "echo": True}, 400, "invalid_value"),
    ("/v1/completions", {"model": "M", "prompt": "hi", "seed": "x"}, 400, "invalid_value"),
    ("/v1/completions", {"model": "M", "prompt": "hi", "seed": 2**64}, 400, "invalid_value"),
    ("/v1/completions", {"model": "M", "prompt": [5, 10**9]}, 400, "invalid_value"),
    ("/v1/completions", {"model": "M", "prompt": [[5, -1]]}, 400, "invalid_value"),
    ("/v1/completions", '{"model": "M", "prompt": "hi", "top_p": NaN}', 400, "invalid_value"),
    ("/v1/completions", {"model": "M", "prompt": "hello " * 9000}, 400, "context_length_exceeded"),
    ("/v1/chat/completions", {"model": "M", "messages": []}, 400, "invalid_value"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "wizard", "content": "x"}]}, 400, "invalid_value"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "invalid_value"),
    ("/v1/chat/completions", {"model": "M", "messages": "hi"}, 400, "invalid_value"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function"}]}, 400, "invalid_value"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}],
                              "stream": True, "max_completion_tokens": -1}, 400, "invalid_value"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "hello " * 9000}],
                              "stream": True}, 400, "context_length_exceeded"),
    ("/v1/nothing-here", {}, 404, "not_found"),
]


@pytest.mark.slow
@pytest.mark.parametrize("path,body,status,code", MALFORMED, ids=[f"{i}-{m[3]}" for i, m in enumerate(MALFORMED)])
def test_malformed_requests_get_openai_errors(server, ss, path, body, status, code):
    if isinstance(body, dict) and body.get("model") == "M":
        body = {**body, "model": model_of(ss)}
    content = body.replace('"M"', json.dumps(model_of(ss))) if isinstance(body, str) else json.dumps(body)
    r = httpx.post(server.url + path, content=content, timeout=60,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["code"] == code, err
    assert err["type"] == "invalid_request_error"


@pytest.mark.slow
def test_a_catalog_model_is_served_under_its_short_name_too():
    """`selfspec serve --model qwen2.5-coder-0.5b`: clients may send the short name it was started with or its id."""
    from selfspec.models import catalog
    from selfspec.server.routes import ServerState

    aliases = catalog.short_names("Qwen2.5-Coder-0.5B-Instruct")
    assert aliases == {"qwen2.5-coder-0.5b"} and not catalog.short_names("SmolLM2-135M-Instruct")
    st = ServerState(None, None, None, "Qwen2.5-Coder-0.5B-Instruct", 0, aliases=aliases)
    st.check_model("Qwen2.5-Coder-0.5B-Instruct")
    st.check_model("qwen2.5-coder-0.5b")
    with pytest.raises(APIError, match="does not exist"):
        st.check_model("qwen2.5-coder-7b")


@pytest.mark.slow
def test_openai_client_sees_typed_errors(server, client, ss):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=MSGS)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_of(ss), prompt="word " * 9000, max_tokens=8)
    assert e.value.code == "context_length_exceeded" and str(ss.split.context_length) in e.value.message
    r = httpx.get(server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


def metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(name))


@pytest.mark.slow
def test_disconnecting_clients_free_the_engine(server, ss):
    worker = server.app.state.selfspec.worker
    cancelled = metric(server, 'selfspec_generations_total{outcome="cancelled"}')
    long = {"model": model_of(ss), "prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True,
            "temperature": 0}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as h:
        with h.stream("POST", "/v1/completions", json={**long, "stream": True}) as r:
            assert r.status_code == 200
            lines = []
            for line in r.iter_lines():
                lines += [line] if line else []
                if len(lines) == 2:
                    break  # hang up mid-stream (4000 tokens would take many minutes)
        # a non-streaming request that gives up while queued behind another long one
        def give_up_while_running() -> None:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(server.url + "/v1/completions", headers=headers, json=long,
                           timeout=httpx.Timeout(60, read=3.0))

        blocker = threading.Thread(target=give_up_while_running)
        blocker.start()
        assert wait_for(lambda: worker.depth()[1] == 1, 20)
        with pytest.raises(httpx.ReadTimeout):
            h.post("/v1/completions", json=long, timeout=httpx.Timeout(60, read=1.0))
        blocker.join(30)
        assert wait_for(lambda: worker.depth() == (0, 0), 20)
        assert wait_for(lambda: metric(server, 'selfspec_generations_total{outcome="cancelled"}') == cancelled + 3, 10)
        # the engine is free: a short request is answered (within the client's timeout, not after 4000 tokens)
        r = h.post("/v1/completions", json={**long, "max_tokens": 4, "ignore_eos": False})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 4
    assert metric(server, 'selfspec_http_requests_total{method="POST",path="/v1/completions",status="499"}') >= 2


@pytest.mark.slow
def test_concurrent_clients_each_get_their_own_answer(server, ss):
    """They decode in one batch (continuous batching), each with its own settings: greedy, seeded sampling,
    stop strings; every answer equals what the same request gets alone."""
    prompts = ["The capital of Italy is", "Two plus two equals", "My favourite animal is", "Rain falls because"]
    settings = [dict(temperature=0), dict(temperature=0, stop=[" is", "."]), dict(temperature=0.9, seed=11),
                dict(temperature=0.7, top_p=0.9, seed=5, stop=["\n"])]
    refs = [ss.generate(p, max_new_tokens=12, **kw).text for p, kw in zip(prompts, settings)]
    got: dict[int, str] = {}

    def ask(i: int) -> None:
        c = server.client()
        kw = {k: v for k, v in settings[i].items() if k != "seed"}
        extra = {"seed": settings[i]["seed"]} if "seed" in settings[i] else {}
        if i % 2:
            got[i] = stream_text(c.completions.create(model=model_of(ss), prompt=prompts[i], max_tokens=12,
                                                      stream=True, extra_body=extra, **kw), chat=False)[0]
        else:
            got[i] = c.completions.create(model=model_of(ss), prompt=prompts[i], max_tokens=12, extra_body=extra,
                                          **kw).choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [got.get(i) for i in range(len(prompts))] == refs


@pytest.mark.slow
def test_no_server_errors_so_far(server):
    assert server.errors.records == []
    assert metric(server, "selfspec_http_requests_total{") > 30
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    assert not re.search(r'status="5\d\d"', text)
    assert metric(server, "selfspec_mean_accepted_length") >= 1.0 and metric(server, "selfspec_tokens_per_second") > 0


@pytest.mark.slow
def test_graceful_shutdown_finishes_short_and_cancels_long_requests(ss, server):
    srv = ThreadedServer(create_app(ss), graceful_timeout=6.0)
    c = srv.client()
    out: dict[str, object] = {}

    def short() -> None:
        # long enough to be seen running (4 tokens took ~30 ms on the quantized engine: the 50 ms poll missed it)
        out["short"] = stream_text(c.completions.create(model=model_of(ss), prompt=PROMPT, max_tokens=32,
                                                        temperature=0, stream=True, extra_body={"ignore_eos": True}),
                                   chat=False)[0]

    def long() -> None:
        try:
            for _ in c.completions.create(model=model_of(ss), prompt=PROMPT, max_tokens=4000, temperature=0,
                                          stream=True, extra_body={"ignore_eos": True}):
                pass
            out["long"] = "completed?!"
        except openai.APIError as e:
            out["long"] = e

    threads = [threading.Thread(target=short), threading.Thread(target=long)]
    threads[0].start()
    assert wait_for(lambda: srv.app.state.selfspec.worker.depth()[1] == 1, 20)
    threads[1].start()
    assert wait_for(lambda: sum(srv.app.state.selfspec.worker.depth()) == 2, 20)
    srv.server.should_exit = True  # what Ctrl-C / SIGTERM do
    for t in threads:
        t.join(60)
    srv.stop()
    assert not srv.thread.is_alive()  # liveness: the long request was cancelled (below), not run out
    assert out["short"] == ss.generate(PROMPT, max_new_tokens=32, temperature=0.0, ignore_eos=True).text
    assert isinstance(out["long"], openai.APIError) and "shutting down" in str(out["long"])
    assert not srv.app.state.selfspec.worker.alive
    with pytest.raises(httpx.ConnectError):
        httpx.get(srv.url + "/health", timeout=5)
    assert [r.getMessage() for r in srv.errors.records] == []


@pytest.mark.slow
def test_bounded_load_test_against_a_real_server_process(tmp_path):
    from selfspec.bench.loadtest import run
    from selfspec.bench.loadtest_config import LoadTestConfig

    r = run(LoadTestConfig(clients=4, requests_per_client=5, max_tokens=8, num_prompts=2,
                           out=str(tmp_path / "load.json")))
    assert r["requests"] == 20 and r["good"] >= 10
    assert r["good_correct"] == r["good"] and r["failures"] == [], r["failures"]
    assert all(v["ok"] == v["n"] for v in r["by_kind"].values()), r["by_kind"]
    assert r["by_kind"]["malformed"]["n"] > 0 and r["by_kind"]["disconnect"]["n"] > 0
    assert r["server"]["http_5xx"] == 0 and r["server_log_errors"] == []
    assert r["server"]["generations_cancelled"] >= r["by_kind"]["disconnect"]["n"]
    assert r["server_exit_code"] == 0  # SIGINT: graceful shutdown, clean exit
    if r["rss_before_mb"] is not None:
        assert r["rss_after_mb"] - r["rss_before_mb"] < 150, (r["rss_before_mb"], r["rss_after_mb"])
    assert json.loads((tmp_path / "load.json").read_text())["requests"] == 20
    assert r["server_log"] == str(tmp_path / "load.server.log")  # beside --out, like every output


@pytest.mark.slow
def test_ray_serve_two_replicas(tmp_path):
    """`selfspec serve --replicas 2`: a local Ray Serve deployment of two engine replicas behind the same API;
    the bounded load test (streaming, malformed bodies, wrong keys, disconnects) against it: every answer equal
    to its reference, no 5xx, both replicas answering, a clean exit on SIGINT."""
    pytest.importorskip("ray")
    from selfspec.bench.loadtest import run
    from selfspec.bench.loadtest_config import LoadTestConfig

    r = run(LoadTestConfig(clients=4, requests_per_client=5, max_tokens=8, num_prompts=2, threads=1,
                           serve_args="--replicas 2", out=str(tmp_path / "ray.json")))
    assert r["requests"] == 20 and r["good_correct"] == r["good"] >= 10 and r["failures"] == [], r["failures"]
    assert all(v["ok"] == v["n"] for v in r["by_kind"].values()), r["by_kind"]
    assert r["server"]["http_5xx"] == 0
    assert r["replica_pids"] == 2  # both replicas answered
    assert r["server_exit_code"] == 0


@pytest.mark.slow
def test_specee_methods_per_request(client, ss):
    """A request may pick SpecEE (extra_body 'method'): specee-verified is the model's own greedy text, the
    lossy specee streams text too; an unknown method is a 400 naming the field."""
    from selfspec.config import DraftConfig

    ss.set_draft(DraftConfig())  # the bundled head and its predictors (other tests switch drafts on this model)
    ref = ss.generate(PROMPT, max_new_tokens=16, temperature=0.0)
    r = client.completions.create(model=model_of(ss), prompt=PROMPT, max_tokens=16, temperature=0,
                                  extra_body={"method": "specee-verified"})
    assert r.choices[0].text == ref.text
    text, _ = stream_text(client.completions.create(model=model_of(ss), prompt=PROMPT, max_tokens=16, temperature=0,
                                                    stream=True, extra_body={"method": "specee"}), chat=False)
    assert text
    with pytest.raises(openai.BadRequestError, match="method"):
        client.completions.create(model=model_of(ss), prompt=PROMPT, max_tokens=4, extra_body={"method": "fast"})
