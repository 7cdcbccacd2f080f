"""The pipeline behind the scheduler and the server: one request at a time, restarted after a failure.

    ss.use_pipeline(PipelineConfig(mode="mirror"))      # 'selfspec' requests now go through it
    selfspec generate --pipeline mirror "Hello"          # the same from the command line
    selfspec serve --pipeline mirror                     # behind the OpenAI-compatible API

A stage that dies fails the request it was serving with a ``PipelineError`` (the server answers 503);
the next request starts a fresh pipeline, so the server stays up.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from selfspec.config import GenerateConfig, PipelineConfig
from selfspec.engine import validate_request
from selfspec.pipeline.ppsd import Pipeline
from selfspec.stats import GenerationStats


class PipelineService:
    def __init__(self, ss: Any, config: PipelineConfig | None = None, model_config: Any = None) -> None:
        self.ss, self.config, self.model_config = ss, config or PipelineConfig(), model_config
        self.pipe: Pipeline | None = None
        self.started = 0  # pipelines started (more than one: restarts after failures)
        self.busy = False  # a request is streaming (the pipeline serves one at a time)
        self.start()

    def start(self) -> Pipeline:
        """The running pipeline; a new one if there is none or the last one failed."""
        if self.pipe is None or self.pipe.closed:
            self.pipe = Pipeline.of(self.ss, self.config, self.model_config)
            self.started += 1
        return self.pipe

    def tokens(self, prompt_ids: list[int], gen: GenerateConfig, stats: GenerationStats) -> Generator[list[int], None, None]:
        """New token chunks of one request, as the verdicts come in; ``stats`` follows them."""
        validate_request(len(prompt_ids), gen, self.ss.split.context_length)
        pipe = self.start()
        self.busy = True
        try:
            stats.prompt_tokens = len(prompt_ids)
            for chunk in pipe.stream(prompt_ids, gen):
                stats.accept_lengths = list(pipe.stats.accept_lengths)
                stats.steps = pipe.stats.rounds
                yield chunk
        finally:
            self.busy = False

    def close(self) -> None:
        if self.pipe is not None:
            self.pipe.close()
