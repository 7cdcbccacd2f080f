"""One worker thread owns the engine and batches continuously: requests join and leave the running
batch between steps.

    handler (event loop)                         worker thread
    job = Job(ids, config); worker.submit(job) -> queue -> sched.add(job)   (joins at the next step)
                                                  loop: for req, ev in sched.step_events():
    async for ev in job.events(): ...         <-          req.tag.emit(ev)
    client gone: job.cancel()                 ->      cancelled jobs: sched.cancel(req)  (leaves now)

Each request's state lives in its ``Job`` (prompt, settings, cancel flag, event queue), never in
globals; its decoding state lives in the scheduler's ``BatchRequest`` (``selfspec.batch``). Up to
``max_batch`` requests decode together, each with its own settings, seed and stop strings, and
each gets exactly the output it would get alone; the rest wait in FIFO order. A client that goes
away calls ``job.cancel()``: a waiting job is dropped and stops counting against ``max_queue`` at
once, a running one leaves the batch before the next step. Shutdown stops admitting new jobs,
gives the admitted ones a grace period, then cancels what is left with a 503 error event.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from typing import Any, Protocol

from selfspec.api import StreamEvent
from selfspec.batch.scheduler import BatchConfig
from selfspec.config import GenerateConfig
from selfspec.errors import SelfSpecError
from selfspec.server.errors import APIError, QueueFullError, ShuttingDownError

log = logging.getLogger("selfspec.server")
_END = object()


class BatchSession(Protocol):
    """What the worker drives (``selfspec.batch.TextScheduler``; tests use a fake)."""

    busy: bool

    def add(self, prompt_ids: list[int], gen: GenerateConfig, tag: Any = None) -> Any: ...

    def cancel(self, req: Any) -> None: ...

    def step_events(self) -> list[tuple[Any, StreamEvent]]: ...


class Engine(Protocol):
    """What the worker needs from the engine (a SelfSpec): a continuous-batching scheduler."""

    def scheduler(self, batch: BatchConfig | None = None) -> BatchSession: ...


class Job:
    """One request: its inputs, its cancel flag and the events the worker hands back to the handler.
    Create it inside the event loop that will read it."""

    def __init__(self, prompt_ids: list[int], config: GenerateConfig) -> None:
        self.id = uuid.uuid4().hex
        self.prompt_ids, self.config = prompt_ids, config
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue = asyncio.Queue()
        self._cancel = threading.Event()
        self.cancel_error: APIError | None = None  # sent to the client when cancelled by the server
        self.ended = False
        self.submitted = time.perf_counter()
        self.started: float | None = None  # the worker picked it up
        self.first_event: float | None = None
        self.finished: float | None = None
        self.result: Any = None  # GenerationResult once complete
        self.tokens = 0  # completion tokens produced so far (also for cancelled jobs)

    # ---- handler side ---------------------------------------------------------------------
    def cancel(self, error: APIError | None = None) -> None:
        """Stop this job: None when the client left, an APIError to tell the client why."""
        if not self._cancel.is_set():
            self.cancel_error = error
            self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    async def next(self) -> StreamEvent | None:
        """The next event, None after the last; raises the job's error (an APIError / SelfSpecError)."""
        if self.ended:
            return None
        item = await self._events.get()
        if item is _END:
            self.ended = True
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    # ---- worker side ----------------------------------------------------------------------
    def emit(self, item: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, item)
        except RuntimeError:  # the event loop is gone (server stopped): nobody is listening
            pass


class Worker:
    """The FIFO queue and the thread that owns the engine."""

    def __init__(self, engine: Engine, max_queue: int = 64, metrics: Any = None, batch: BatchConfig | None = None) -> None:
        self.engine, self.max_queue, self.metrics = engine, max_queue, metrics
        self.batch = batch or BatchConfig()
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._jobs: set[Job] = set()  # admitted, not finished
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._timer: threading.Timer | None = None
        self.accepting = True
        self._sched: BatchSession | None = None

    # ---- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._serve, name="selfspec-worker", daemon=True)
                self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def begin_shutdown(self, grace: float) -> None:
        """Admit nothing new; cancel whatever is still queued or running after ``grace`` seconds."""
        self.accepting = False
        if grace <= 0:
            self.cancel_all()
        elif self._timer is None:
            self._timer = threading.Timer(grace, self.cancel_all)
            self._timer.daemon = True
            self._timer.start()

    def cancel_all(self) -> None:
        with self._lock:
            jobs = list(self._jobs)
        for job in jobs:
            job.cancel(ShuttingDownError())

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel everything left, end the thread and wait for it."""
        self.accepting = False
        if self._timer is not None:
            self._timer.cancel()
        self.cancel_all()
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("the worker thread did not stop within %.0f s", timeout)

    # ---- admission ------------------------------------------------------------------------
    def submit(self, job: Job) -> Job:
        """Queue a job (FIFO). Raises ShuttingDownError or QueueFullError (429)."""
        if not self.accepting:
            raise ShuttingDownError()
        with self._lock:
            if sum(not j.cancelled for j in self._jobs) >= self.max_queue:
                raise QueueFullError(self.max_queue)
            self._jobs.add(job)
        self.start()
        self._queue.put(job)
        return job

    def depth(self) -> tuple[int, int]:
        """(waiting, running) jobs that are not cancelled."""
        with self._lock:
            live = [j for j in self._jobs if not j.cancelled]
        batch = list(getattr(self._sched, "running", ()))  # the scheduler's own list: admitted into the batch
        running = sum(getattr(r, "tag", None) in live for r in batch)
        return len(live) - running, running

    # ---- the thread -------------------------------------------------------------------------
    def _serve(self) -> None:
        sched = self._sched = self.engine.scheduler(self.batch)
        reqs: dict[Job, Any] = {}
        stopping = False
        while True:
            try:  # block for work only when there is nothing to step
                job = self._queue.get(timeout=None) if not sched.busy and not stopping else self._queue.get_nowait()
                while True:
                    if job is None:
                        stopping = True
                    else:
                        self._admit(sched, reqs, job)
                    job = self._queue.get_nowait()
            except queue.Empty:
                pass
            for job, req in list(reqs.items()):  # clients gone, shutdown: leave the batch now
                if job.cancelled:
                    sched.cancel(req)
                    self._finish(reqs, job)
            if not sched.busy:
                if stopping:
                    return
                continue
            try:
                events = sched.step_events()
            except Exception as e:  # a bug or an engine failure: fail this batch's requests, keep serving
                log.exception("a batched step failed; failing its %d requests", len(reqs))
                for job, req in list(reqs.items()):
                    sched.cancel(req)
                    job.emit(e)
                    self._finish(reqs, job)
                continue
            now = time.perf_counter()
            for req, ev in events:
                job = req.tag
                if job not in reqs:
                    continue
                if job.started is None:
                    job.started = getattr(req, "started", None) or now
                if job.first_event is None:
                    job.first_event = now
                job.tokens += len(ev.token_ids)
                if ev.result is not None:
                    job.result = ev.result
                job.emit(ev)
                if ev.result is not None:
                    self._finish(reqs, job)

    def _admit(self, sched: BatchSession, reqs: dict[Job, Any], job: Job) -> None:
        """A job from the queue joins the scheduler (it waits there for a free slot in the batch)."""
        if job.cancelled:
            self._finish(reqs, job)
            return
        try:
            reqs[job] = sched.add(job.prompt_ids, job.config, tag=job)
        except SelfSpecError as e:  # bad input the handler did not catch up front: it becomes a 400
            job.emit(e)
            self._finish(reqs, job)
        except Exception as e:
            log.exception("could not admit job %s", job.id)
            job.emit(e)
            self._finish(reqs, job)

    def _finish(self, reqs: dict[Job, Any], job: Job) -> None:
        reqs.pop(job, None)
        if job.cancelled and job.cancel_error is not None and job.result is None:
            job.emit(job.cancel_error)
        job.emit(_END)
        job.finished = time.perf_counter()
        with self._lock:
            self._jobs.discard(job)
        if self.metrics is not None:
            self.metrics.job_done(job)
