"""The Python API: load once, then generate or stream.

    from selfspec import SelfSpec
    ss = SelfSpec.load()                                  # default model, default draft
    out = ss.generate("Tell me a joke.", max_new_tokens=64)
    print(out.text, out.stats.summary())
    for ev in ss.stream([{"role": "user", "content": "Hi!"}], max_new_tokens=32):
        print(ev.text, end="", flush=True)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import torch

from selfspec.batch.scheduler import BatchConfig, TextScheduler
from selfspec.config import DraftConfig, GenerateConfig, ModelConfig, PipelineConfig
from selfspec.cost_cache import CostCache
from selfspec.costs import DraftCosts
from selfspec.drafting.registry import build_draft
from selfspec.engine import Engine
from selfspec.errors import EmptyPromptError, InvalidConfigError, NoChatTemplateError
from selfspec.heads.base import ExitHead
from selfspec.heads.io import resolve_head
from selfspec.kernels.build import matrix_unit
from selfspec.memory import freeze_gc, trim_heap
from selfspec.models.loading import load_model, local_gguf, model_id_of
from selfspec.models.split import SplitModel
from selfspec.outputs import GenerationResult, RequestOutput, StreamEvent
from selfspec.pipeline.service import PipelineService
from selfspec.prefix_cache import PrefixCache
from selfspec.quant.packing import words5
from selfspec.tuning import Tuning, head_depths, tuned

Prompt = str | list[dict[str, str]] | list[int]


class SelfSpec:
    def __init__(self, model: Any, tokenizer: Any, draft: DraftConfig | None = None, model_id: str = "model",
                 backend: str = "fast", prefix_cache: float = ModelConfig.prefix_cache) -> None:
        self.model, self.tokenizer, self.model_id = model, tokenizer, model_id
        self.split = SplitModel(model, backend)
        if prefix_cache < 0:
            raise InvalidConfigError(f"prefix_cache is MiB of prompts kept, >= 0; got {prefix_cache}")
        self.prefix_cache = PrefixCache(self.split, prefix_cache)  # earlier prompts' keys and values (exact)
        self.cost_cache = CostCache(self.split)  # measured draft costs, cached on disk (selfspec.cost_cache)
        self.eos_token_ids = self._model_eos_ids()
        self.draft_config = DraftConfig()
        self.engine = Engine(self.split)
        self.source_gguf: Path | None = None  # the GGUF file the model came from (llama.cpp peers run it), if any
        self.pipeline: Any = None  # a PipelineService (use_pipeline): schedulers send 'selfspec' requests through it
        self.set_draft(draft or DraftConfig())

    @classmethod
    def load(cls, model: str | ModelConfig = "default", draft: DraftConfig | None = None, **kw: Any) -> SelfSpec:
        """Load a target model (see ModelConfig) and set up its draft (see DraftConfig)."""

        mcfg = model if isinstance(model, ModelConfig) else ModelConfig(model=model, **kw)
        hf_model, tokenizer = load_model(mcfg)
        ss = cls(hf_model, tokenizer, draft, model_id=model_id_of(mcfg), backend=mcfg.backend,
                 prefix_cache=mcfg.prefix_cache)
        ss.source_gguf = local_gguf(mcfg)
        freeze_gc()  # what the load left (torch, transformers, the model): out of the cyclic collector's walks
        return ss

    def describe(self) -> str:
        """One line on how this model runs: kernel, numerics and its arithmetic, the instruction set the kernels
        were built for, block types, threads and draft (the CLI prints it at load)."""
        s = self.split
        parts = [f"kernel {s.kernel}"]
        if s.quantized and s.backend == "fast":
            isa = "AVX-512" if words5() else "AVX2"
            unit = "; 4- and 5-bit codes' group sums on AMX tiles" if s.numerics.exact and matrix_unit() == "amx" else ""
            parts.append(f"numerics {s.numerics.name} ({s.numerics.arithmetic}; {isa} build{unit})")
            parts.append("weights " + " ".join(s.block_types))
        else:
            parts.append(f"dtype {str(s.dtype).removeprefix('torch.')}")
        parts.append(f"{torch.get_num_threads()} threads")
        d = self.draft_config
        parts.append(f"draft {d.drafter}: head '{self.head.kind}' at exit layer {self.head.exit_layer}" if self.head
                     else f"draft {d.drafter}")
        return f"{self.model_id}: " + ", ".join(parts)

    # ---- draft setup ----------------------------------------------------------------
    def make_head(self, draft: DraftConfig) -> ExitHead:
        """The exit head ``draft.head`` names, at ``draft.exit_layer`` (``selfspec.heads.io.resolve_head``)."""
        return resolve_head(draft.head, self.split, self.model_id, draft.exit_layer)

    def set_draft(self, draft: DraftConfig) -> None:
        """Switch the way to draft (``drafter``), exit layer, head, policy or gamma without reloading the model
        (see DraftConfig; the early-exit drafter's setup: ``selfspec.drafting.setup``)."""
        built = build_draft(self, draft)
        assert built.draft is not None  # build_draft gives the config as resolved
        self.engine = Engine(self.split, built.drafter, gamma=built.gamma, tree_width=built.tree_width,
                             specee=built.specee, prefix=self.prefix_cache)
        self.draft_config, self.head, self.tuning_result = built.draft, built.head, built.tuning
        if self.split.screen is not None:  # the greedy verification's int8 screen: its table now, not mid-request
            self.split.screen.prepare()
        trim_heap()  # what the setup freed (a released head's float weights, the cost check's forwards): back to the system

    def tuning(self, head: ExitHead | None = None, refresh: bool = False) -> Tuning:
        """The self-tuning calibration of ``head`` (default: the current one) on this machine (cached);
        ``refresh``: calibrated again, its costs measured again too."""
        head = head or self.head
        costs = {d: self.draft_costs(head, None, d, refresh=refresh) for d in head_depths(head)}
        return tuned(self.split, head, self.tokenizer, refresh=refresh, costs=costs)

    def draft_costs(self, head: ExitHead, draft: DraftConfig | None = None, depth: int | None = None,
                    refresh: bool = False) -> DraftCosts:
        """Forward costs of ``head``'s draft at ``depth`` (default: its exit layer) on this machine: measured
        once per machine, model, head, depth and kernel build and cached on disk, checked at each load
        by timing one plain step (``selfspec.cost_cache``); ``refresh``: measured now."""
        return self.cost_cache.get(head, depth or head.exit_layer, refresh)

    # ---- prompts ----------------------------------------------------------------------
    def _model_eos_ids(self) -> list[int]:
        ids: set[int] = set()
        for src in (getattr(self.model, "generation_config", None), self.model.config):
            e = getattr(src, "eos_token_id", None) if src is not None else None
            ids.update([e] if isinstance(e, int) else (e or []))
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return sorted(ids)

    @property
    def has_chat_template(self) -> bool:
        """Whether the tokenizer has a chat template, i.e. chat messages can be encoded."""
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, prompt: Prompt) -> list[int]:
        """Text -> ids; chat messages -> ids through the chat template; ids pass through.
        Chat messages to a model without a chat template raise NoChatTemplateError."""
        if isinstance(prompt, str):
            if not prompt:
                raise EmptyPromptError("the prompt is empty")
            return list(self.tokenizer(prompt)["input_ids"])
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            messages = cast(list[dict[str, str]], prompt)  # every item checked above
            for i, m in enumerate(messages):
                if "role" not in m or "content" not in m:
                    raise InvalidConfigError(f"chat message {i} needs 'role' and 'content' keys, got {sorted(m)}")
            if not self.has_chat_template:
                raise NoChatTemplateError(
                    f"the model '{self.model_id}' has no chat template (its tokenizer defines none, as base "
                    "models do), so chat messages cannot be encoded: send plain text instead"
                )
            out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            if not prompt:
                raise EmptyPromptError("the prompt is empty")
            return list(cast(list[int], prompt))  # every item checked above
        raise InvalidConfigError("prompt must be a string, a list of chat messages or a list of token ids")

    def resolve(self, config: GenerateConfig | None = None, **overrides: Any) -> GenerateConfig:
        """The settings a request runs with: ``config`` (default GenerateConfig()) with ``overrides``, and the
        model's EOS tokens when it names none."""
        cfg = replace(config or GenerateConfig(), **overrides)
        if cfg.eos_token_ids is None:
            cfg = replace(cfg, eos_token_ids=self.eos_token_ids)
        return cfg

    # ---- generation -------------------------------------------------------------------
    def stream(self, prompt: Prompt, config: GenerateConfig | None = None, **overrides: Any) -> Iterator[StreamEvent]:
        """Yield text as tokens are accepted; the last event carries the full result."""
        return self._events(prompt, config, True, **overrides)

    def _events(self, prompt: Prompt, config: GenerateConfig | None, incremental: bool,
                **overrides: Any) -> Iterator[StreamEvent]:
        """``stream``'s events; ``incremental`` False: only the last one's result is read (its text is decoded once
        at the end unless stop strings are looked for: ``RequestOutput``)."""
        cfg = self.resolve(config, **overrides)
        ids = self.encode(prompt)
        output = RequestOutput(self.tokenizer, cfg, incremental=incremental)
        if self.pipeline is not None and cfg.method == "selfspec":  # use_pipeline: PPSD / Mirror-SD
            blocks = self.pipeline.tokens(ids, cfg, output.stats)
        else:
            blocks = self.engine.generate_tokens(ids, cfg, output.stats)
        try:
            for block in blocks:
                ev = output.push(block)
                yield ev
                if ev.result is not None:
                    return
        finally:
            blocks.close()
        yield output.end()

    def scheduler(self, batch: BatchConfig | None = None) -> TextScheduler:
        """A continuous-batching scheduler over this model (``selfspec.batch``): ``add`` requests (token ids and a
        GenerateConfig) at any time, ``step_events`` until none is ``busy``; the server runs one."""
        return TextScheduler(self.engine, self.tokenizer, batch, self.eos_token_ids, self.pipeline)

    def use_pipeline(self, config: PipelineConfig | None = None, model_config: ModelConfig | None = None) -> Any:
        """Decode 'selfspec' requests with the pipeline (PPSD or Mirror-SD, selfspec.pipeline): ``generate``,
        ``stream`` and ``scheduler`` calls (the server, one pipelined request at a time). Its deep stage loads
        ``model_config`` (default: a copy of this model). ``None`` config: back to the sequential engine."""

        if self.pipeline is not None:
            self.pipeline.close()
            self.pipeline = None
        if config is not None:
            self.pipeline = PipelineService(self, config, model_config)
        return self.pipeline

    def generate_batch(self, prompts: list[Prompt], config: GenerateConfig | list[GenerateConfig] | None = None,
                       batch: BatchConfig | None = None, **overrides: Any) -> list[GenerationResult]:
        """Generate several completions together (continuous batching, see docs/BATCHING.md): ``config`` is one
        GenerateConfig for all or one per prompt (``overrides`` apply to each). Every result equals that
        prompt's own ``generate`` (same text, same tokens; seeded sampling included)."""
        configs = config if isinstance(config, list) else [config] * len(prompts)
        if len(configs) != len(prompts):
            raise InvalidConfigError(f"generate_batch: {len(prompts)} prompts but {len(configs)} generation configs")
        sched = self.scheduler(batch or BatchConfig(max_batch=max(1, len(prompts))))
        reqs = sched.add_all([self.encode(p) for p in prompts], [self.resolve(c, **overrides) for c in configs])
        while sched.busy:
            sched.step_events()
        results = []
        for r in reqs:
            assert r.output is not None and r.output.result is not None  # a TextScheduler's request, ended
            results.append(r.output.result)
        return results

    def generate(self, prompt: Prompt, config: GenerateConfig | None = None, **overrides: Any) -> GenerationResult:
        """Generate a completion; returns text, token ids and stats."""
        result = None
        for ev in self._events(prompt, config, False, **overrides):
            result = ev.result
        assert result is not None
        return result

