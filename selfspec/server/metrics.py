"""Server metrics in the Prometheus text exposition format (version 0.0.4), no extra dependency.

Counters grow for the life of the process; ratios (tokens/s, mean accepted length, acceptance
rate) are given both as gauges and through their counters, so a scraper can compute rates over
any window (e.g. ``rate(selfspec_completion_tokens_total[1m]) / rate(selfspec_generation_seconds_total[1m])``).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, float("inf"))


class Histogram:
    def __init__(self) -> None:
        self.counts = [0] * len(BUCKETS)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.sum += value
        self.count += 1
        for i, b in enumerate(BUCKETS):
            if value <= b:
                self.counts[i] += 1

    def lines(self, name: str, labels: str = "") -> list[str]:
        sep = "," if labels else ""
        out = [f'{name}_bucket{{{labels}{sep}le="{"+Inf" if b == float("inf") else b}"}} {c}'
               for b, c in zip(BUCKETS, self.counts)]
        suffix = f"{{{labels}}}" if labels else ""
        return out + [f"{name}_sum{suffix} {self.sum:.6f}", f"{name}_count{suffix} {self.count}"]


class Metrics:
    """Thread-safe accumulators, fed by the HTTP middleware and by the worker thread."""

    def __init__(self, info: dict[str, Any] | None = None) -> None:
        self.info = info or {}
        self._lock = threading.Lock()
        self.http: dict[tuple[str, str, int], int] = defaultdict(int)
        self.http_duration: dict[str, Histogram] = defaultdict(Histogram)
        self.outcomes: dict[str, int] = defaultdict(int)
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0  # of those, taken from the prefix cache
        self.completion_tokens = 0
        self.generation_seconds = 0.0
        self.steps = 0
        self.step_tokens = 0
        self.proposed: list[int] = []
        self.accepted: list[int] = []
        self.ttft = Histogram()
        self.queue_wait = Histogram()

    # ---- feeding --------------------------------------------------------------------------
    def http_request(self, method: str, path: str, status: int, seconds: float) -> None:
        with self._lock:
            self.http[(method, path, status)] += 1
            self.http_duration[path].observe(seconds)

    def job_done(self, job: Any) -> None:
        """Record a finished job (see worker.Job): completed, cancelled or failed."""
        result = job.result
        outcome = "completed" if result is not None else ("cancelled" if job.cancelled else "failed")
        with self._lock:
            self.outcomes[outcome] += 1
            if job.started is not None:
                self.queue_wait.observe(job.started - job.submitted)
            if job.first_event is not None:
                self.ttft.observe(job.first_event - job.submitted)
                self.prompt_tokens += len(job.prompt_ids)
                self.completion_tokens += job.tokens
                self.generation_seconds += (job.finished or job.first_event) - job.started
            if result is not None:
                st = result.stats
                self.cached_prompt_tokens += st.cached_tokens
                self.steps += st.steps
                self.step_tokens += sum(st.accept_lengths)
                for i, (p, a) in enumerate(zip(st.proposed_per_position, st.accepted_per_position)):
                    while len(self.proposed) <= i:
                        self.proposed.append(0)
                        self.accepted.append(0)
                    self.proposed[i] += p
                    self.accepted[i] += a

    # ---- reading --------------------------------------------------------------------------
    @property
    def tokens_per_second(self) -> float:
        return self.completion_tokens / self.generation_seconds if self.generation_seconds > 0 else 0.0

    def render(self, waiting: int = 0, running: int = 0) -> str:
        """The whole exposition text."""
        with self._lock:
            return "\n".join(self._lines(waiting, running)) + "\n"

    def _lines(self, waiting: int, running: int) -> list[str]:
        out: list[str] = []

        def metric(name: str, kind: str, help: str, samples: list[str]) -> None:  # noqa: A002
            out.extend([f"# HELP {name} {help}", f"# TYPE {name} {kind}", *samples])

        info = ",".join(f'{k}="{_esc(v)}"' for k, v in self.info.items())
        metric("selfspec_info", "gauge", "Served model and draft settings.", [f"selfspec_info{{{info}}} 1"])
        metric("selfspec_http_requests_total", "counter", "HTTP requests by method, path and status code.",
               [f'selfspec_http_requests_total{{method="{m}",path="{_esc(p)}",status="{s}"}} {n}'
                for (m, p, s), n in sorted(self.http.items())])
        dur: list[str] = []
        for path, h in sorted(self.http_duration.items()):
            dur += h.lines("selfspec_http_request_duration_seconds", f'path="{_esc(path)}"')
        metric("selfspec_http_request_duration_seconds", "histogram",
               "HTTP request latency, first byte in to last byte out.", dur)
        metric("selfspec_generations_total", "counter",
               "Generation jobs by outcome (completed, cancelled: client gone or shutdown, failed).",
               [f'selfspec_generations_total{{outcome="{k}"}} {self.outcomes.get(k, 0)}'
                for k in ("completed", "cancelled", "failed")])
        metric("selfspec_queue_waiting", "gauge", "Requests waiting for the engine.", [f"selfspec_queue_waiting {waiting}"])
        metric("selfspec_queue_running", "gauge", "Requests in the decoding batch (at most --max-batch).", [f"selfspec_queue_running {running}"])
        metric("selfspec_queue_wait_seconds", "histogram", "Time from admission to the engine picking the job up.",
               self.queue_wait.lines("selfspec_queue_wait_seconds"))
        metric("selfspec_time_to_first_token_seconds", "histogram", "Time from admission to the first output block.",
               self.ttft.lines("selfspec_time_to_first_token_seconds"))
        metric("selfspec_prompt_tokens_total", "counter", "Prompt tokens processed.",
               [f"selfspec_prompt_tokens_total {self.prompt_tokens}"])
        metric("selfspec_prompt_tokens_cached_total", "counter",
               "Prompt tokens of completed requests taken from the prefix cache instead of prefilled.",
               [f"selfspec_prompt_tokens_cached_total {self.cached_prompt_tokens}"])
        metric("selfspec_completion_tokens_total", "counter", "Completion tokens generated (cancelled jobs included).",
               [f"selfspec_completion_tokens_total {self.completion_tokens}"])
        metric("selfspec_generation_seconds_total", "counter", "Seconds the engine spent generating.",
               [f"selfspec_generation_seconds_total {self.generation_seconds:.6f}"])
        metric("selfspec_tokens_per_second", "gauge", "Completion tokens per second of a request generating, pooled since start (batched requests overlap: for throughput use rate(selfspec_completion_tokens_total)).",
               [f"selfspec_tokens_per_second {self.tokens_per_second:.4f}"])
        metric("selfspec_verify_steps_total", "counter", "Target verification steps (completed jobs).",
               [f"selfspec_verify_steps_total {self.steps}"])
        mal = self.step_tokens / self.steps if self.steps else 0.0
        metric("selfspec_mean_accepted_length", "gauge", "Tokens emitted per verification step, bonus included.",
               [f"selfspec_mean_accepted_length {mal:.4f}"])
        metric("selfspec_draft_tokens_proposed_total", "counter", "Draft tokens proposed, by draft position (1-based).",
               [f'selfspec_draft_tokens_proposed_total{{position="{i + 1}"}} {n}' for i, n in enumerate(self.proposed)])
        metric("selfspec_draft_tokens_accepted_total", "counter", "Draft tokens accepted, by draft position (1-based).",
               [f'selfspec_draft_tokens_accepted_total{{position="{i + 1}"}} {n}' for i, n in enumerate(self.accepted)])
        total_p, total_a = sum(self.proposed), sum(self.accepted)
        metric("selfspec_draft_acceptance_rate", "gauge", "Accepted / proposed draft tokens, all positions.",
               [f"selfspec_draft_acceptance_rate {total_a / total_p if total_p else 0.0:.4f}"])
        return out


def _esc(v: Any) -> str:
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
