"""Server metrics for Prometheus (prometheus_client), one registry per app.

Counters grow for the life of the app; ratios (tokens/s, mean accepted length, acceptance rate) are given both
as gauges and through their counters, so a scraper can compute rates over any window (e.g.
``rate(selfspec_completion_tokens_total[1m]) / rate(selfspec_generation_seconds_total[1m])``). Each app has its
own CollectorRegistry, not prometheus_client's global one: several apps in one process (tests, a replica
rebuilt) count apart and register the same names without a clash.
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    generate_latest,
)

BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, float("inf"))
OUTCOMES = ("completed", "cancelled", "failed")
CONTENT_TYPE = CONTENT_TYPE_LATEST  # of ``Metrics.render``'s text


class Metrics:
    """The app's metrics, fed by the HTTP middleware and by the worker thread (thread-safe)."""

    def __init__(self, info: dict[str, Any] | None = None) -> None:
        self.registry = r = CollectorRegistry()
        Info("selfspec", "Served model and draft settings.", registry=r).info(
            {k: str(v) for k, v in (info or {}).items()})
        self.http = Counter("selfspec_http_requests_total", "HTTP requests by method, path and status code.",
                            ["method", "path", "status"], registry=r)
        self.http_duration = Histogram("selfspec_http_request_duration_seconds",
                                       "HTTP request latency, first byte in to last byte out.", ["path"],
                                       buckets=BUCKETS, registry=r)
        self.outcomes = Counter("selfspec_generations_total",
                                "Generation jobs by outcome (completed, cancelled: client gone or shutdown, failed).",
                                ["outcome"], registry=r)
        for outcome in OUTCOMES:
            self.outcomes.labels(outcome=outcome)  # every outcome is reported, 0 until it happens
        self.waiting = Gauge("selfspec_queue_waiting", "Requests waiting for the engine.", registry=r)
        self.running = Gauge("selfspec_queue_running", "Requests in the decoding batch (at most --max-batch).",
                             registry=r)
        self.queue_wait = Histogram("selfspec_queue_wait_seconds", "Time from admission to the engine picking the job up.",
                                    buckets=BUCKETS, registry=r)
        self.ttft = Histogram("selfspec_time_to_first_token_seconds", "Time from admission to the first output block.",
                              buckets=BUCKETS, registry=r)
        self.prompt_tokens = Counter("selfspec_prompt_tokens_total", "Prompt tokens processed.", registry=r)
        self.cached_prompt_tokens = Counter(
            "selfspec_prompt_tokens_cached_total",
            "Prompt tokens of completed requests taken from the prefix cache instead of prefilled.", registry=r)
        self.completion_tokens = Counter("selfspec_completion_tokens_total",
                                         "Completion tokens generated (cancelled jobs included).", registry=r)
        self.generation_seconds = Counter("selfspec_generation_seconds_total", "Seconds the engine spent generating.",
                                          registry=r)
        self.tokens_per_second_gauge = Gauge(
            "selfspec_tokens_per_second", "Completion tokens per second of a request generating, pooled since start "
            "(batched requests overlap: for throughput use rate(selfspec_completion_tokens_total)).", registry=r)
        self.steps = Counter("selfspec_verify_steps_total", "Target verification steps (completed jobs).", registry=r)
        self.mean_accepted_length = Gauge("selfspec_mean_accepted_length",
                                          "Tokens emitted per verification step, bonus included.", registry=r)
        self.proposed = Counter("selfspec_draft_tokens_proposed_total",
                                "Draft tokens proposed, by draft position (1-based).", ["position"], registry=r)
        self.accepted = Counter("selfspec_draft_tokens_accepted_total",
                                "Draft tokens accepted, by draft position (1-based).", ["position"], registry=r)
        self.acceptance_rate = Gauge("selfspec_draft_acceptance_rate", "Accepted / proposed draft tokens, all positions.",
                                     registry=r)
        self._lock = threading.Lock()  # a job's counts land together: a scrape sees all of them or none
        self._step_tokens = 0  # tokens the verification steps emitted: mean_accepted_length's numerator

    # ---- feeding --------------------------------------------------------------------------
    def http_request(self, method: str, path: str, status: int, seconds: float) -> None:
        self.http.labels(method=method, path=path, status=str(status)).inc()
        self.http_duration.labels(path=path).observe(seconds)

    def job_done(self, job: Any) -> None:
        """Record a finished job (see worker.Job): completed, cancelled or failed."""
        result = job.result
        outcome = "completed" if result is not None else ("cancelled" if job.cancelled else "failed")
        with self._lock:
            self.outcomes.labels(outcome=outcome).inc()
            if job.started is not None:
                self.queue_wait.observe(job.started - job.submitted)
            if job.first_event is not None:
                self.ttft.observe(job.first_event - job.submitted)
                self.prompt_tokens.inc(len(job.prompt_ids))
                self.completion_tokens.inc(job.tokens)
                self.generation_seconds.inc((job.finished or job.first_event) - job.started)
            if result is not None:
                st = result.stats
                self.cached_prompt_tokens.inc(st.cached_tokens)
                self.steps.inc(st.steps)
                self._step_tokens += sum(st.accept_lengths)
                for i, (p, a) in enumerate(zip(st.proposed_per_position, st.accepted_per_position)):
                    self.proposed.labels(position=str(i + 1)).inc(p)
                    self.accepted.labels(position=str(i + 1)).inc(a)

    # ---- reading --------------------------------------------------------------------------
    @property
    def tokens_per_second(self) -> float:
        seconds = _total(self.generation_seconds)
        return _total(self.completion_tokens) / seconds if seconds > 0 else 0.0

    def render(self, waiting: int = 0, running: int = 0) -> str:
        """The whole exposition text (``CONTENT_TYPE``); ``waiting`` and ``running``: the queue's depth now."""
        with self._lock:
            self.waiting.set(waiting)
            self.running.set(running)
            self.tokens_per_second_gauge.set(self.tokens_per_second)
            steps, proposed = _total(self.steps), _total(self.proposed)
            self.mean_accepted_length.set(self._step_tokens / steps if steps else 0.0)
            self.acceptance_rate.set(_total(self.accepted) / proposed if proposed else 0.0)
            return generate_latest(self.registry).decode()


def _total(counter: Counter) -> float:
    """A counter's value, summed over its labels."""
    return sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total"))
