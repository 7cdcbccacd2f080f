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
from typing import Any

from selfspec.batch.scheduler import BatchConfig, TextScheduler
from selfspec.config import DraftConfig, GenerateConfig, ModelConfig, PipelineConfig
from selfspec.costs import DraftCosts, measure_draft_costs
from selfspec.drafting.early_exit import EarlyExitDrafter
from selfspec.drafting.policies import CostAwarePolicy, DepthBandit, ThompsonPolicy, make_policy
from selfspec.engine import MAX_TREE_NODES, Engine, validate_request
from selfspec.errors import EmptyPromptError, InvalidConfigError, NoChatTemplateError
from selfspec.heads.base import ExitHead
from selfspec.heads.io import load_head, new_head, read_head_config
from selfspec.models.split import SplitModel
from selfspec.outputs import GenerationResult, RequestOutput, StreamEvent
from selfspec.specee.decode import DEFAULT_THRESHOLDS, SpecEERunner, SpecEESettings
from selfspec.specee.predictors import has_predictors, load_predictors
from selfspec.tuning import Tuning, head_depths, tuned

Prompt = str | list[dict[str, str]] | list[int]
MAX_AUTO_GAMMA = 8  # the longest draft the cost-aware choice considers
LOOKUP_PRIOR = 0.5  # prior acceptance of lookup drafts per position (then learned from every lookup round)


def bundled_head_dir(model_id: str) -> Any:
    """The trained head shipped with selfspec for a model, if any (see docs/TRAINING.md)."""
    from importlib.resources import files

    path = files("selfspec") / "assets" / "heads" / model_id
    return path if path.joinpath("head_config.json").is_file() else None


class SelfSpec:
    def __init__(self, model: Any, tokenizer: Any, draft: DraftConfig | None = None, model_id: str = "model",
                 backend: str = "fast") -> None:
        self.model, self.tokenizer, self.model_id = model, tokenizer, model_id
        self.split = SplitModel(model, backend)
        self._costs: dict[tuple, DraftCosts] = {}
        self.eos_token_ids = self._model_eos_ids()
        self.draft_config = DraftConfig()
        self.engine = Engine(self.split)
        self.source_gguf: Path | None = None  # the GGUF file the model came from (llama.cpp peers run it), if any
        self.pipeline: Any = None  # a PipelineService (use_pipeline): schedulers send 'selfspec' requests through it
        self.set_draft(draft or DraftConfig())

    @classmethod
    def load(cls, model: str | ModelConfig = "default", draft: DraftConfig | None = None, **kw: Any) -> SelfSpec:
        """Load a target model (see ModelConfig) and set up its draft (see DraftConfig)."""
        from selfspec.models.loading import load_model, local_gguf, model_id_of

        mcfg = model if isinstance(model, ModelConfig) else ModelConfig(model=model, **kw)
        hf_model, tokenizer = load_model(mcfg)
        ss = cls(hf_model, tokenizer, draft, model_id=model_id_of(mcfg), backend=mcfg.backend)
        ss.source_gguf = local_gguf(mcfg)
        return ss

    # ---- draft setup ----------------------------------------------------------------
    def make_head(self, draft: DraftConfig) -> ExitHead:
        spec = draft.head
        if spec == "auto":
            bundled = bundled_head_dir(self.model_id)
            spec = str(bundled) if bundled is not None and draft.exit_layer in (None, _layer_of(bundled)) else "lm"
        if spec == "nested":
            bundled = bundled_head_dir(self.model_id + "-nested")
            if bundled is None:
                raise InvalidConfigError(f"no bundled nested head for '{self.model_id}': train one with "
                                         "`selfspec train-nested` and pass its directory as the head")
            spec = str(bundled)
        if spec == "lm":
            k = draft.exit_layer if draft.exit_layer is not None else max(1, self.split.num_layers // 4)
            return new_head("lm", self.split, k)
        return load_head(spec, self.split, draft.exit_layer)

    def set_draft(self, draft: DraftConfig) -> None:
        """Switch exit layer / head / policy / gamma without reloading the model. With ``gamma=None`` the
        draft is adaptive: its shape comes from a cached calibration (``tune``, selfspec.tuning) and the
        length of each round from forward costs measured here and the acceptance seen so far (a Thompson
        posterior per request, or ``CostAwarePolicy``)."""
        head = self.make_head(draft)
        if draft.lookup < 0 or draft.lookup_ngram < 2:
            raise InvalidConfigError(f"lookup must be >= 0 and lookup_ngram >= 2, got {draft.lookup}, "
                                     f"{draft.lookup_ngram}")
        if draft.tree_width is not None and draft.tree_width < 0:
            raise InvalidConfigError(f"tree_width must be >= 0, got {draft.tree_width}")
        tuning = None
        if draft.gamma is None and draft.tune != "off":
            tuning = self.tuning(head, refresh=draft.tune == "refresh")
            if draft.exit_layer is None and tuning.exit_layer in head_depths(head):
                head.exit_layer = tuning.exit_layer
            draft = replace(draft, tree_width=tuning.tree_width if draft.tree_width is None else draft.tree_width,
                            depth_policy=draft.depth_policy or tuning.depth_policy)
        if draft.tree_width is None:  # the head's measured best, else chains
            width = head.recommended_draft.get("tree_width", 0)
            draft = replace(draft, tree_width=width if head.supports_tree else 0)
        if draft.tree_width > 1 and (not head.supports_tree or self.split.kernel.endswith("int8")):
            # int8 numerics: tree blocks attend through SDPA, which does not give single steps' rows bitwise
            draft = replace(draft, tree_width=0)
        name = draft.policy if draft.policy != "auto" else ("thompson-confidence" if tuning else "confidence")
        threshold = draft.threshold
        if threshold is None:  # the calibration's confidence stop, else 0.5 (measured best for the bundled head)
            threshold = tuning.threshold if tuning is not None else 0.5
            draft = replace(draft, threshold=threshold)
        base = make_policy(name, threshold)
        policy, gamma, lookup_policy = base, draft.gamma, None
        if name.startswith("thompson") or gamma is None:
            thompson = name.startswith("thompson")  # only a Thompson policy drafts at other depths (the bandit)
            costs = {d: self.draft_costs(head, draft, d) for d in (head_depths(head) if thompson else [head.exit_layer])}
            shaped = {d: replace(c, tree_width=draft.tree_width) if draft.tree_width > 1 else c for d, c in costs.items()}
            k = head.exit_layer
            if thompson:
                arms = {d: ThompsonPolicy(base, shaped[d], tuning.prior(d) if tuning else 0.35) for d in shaped}
                policy = DepthBandit(arms, k) if draft.depth_policy == "bandit" and len(arms) > 1 else arms[k]
            else:
                policy = CostAwarePolicy(base, shaped[k])
            if gamma is None and tuning is None:
                lookup_policy = CostAwarePolicy(make_policy("fixed"), costs[k].for_lookup(), prior=LOOKUP_PRIOR)
            # Self-tuned: lookup blocks at full length (`lookup`) whenever there is a match. In the 20-per-group
            # ablation (docs/BENCHMARKS.md) the cost-aware lookup length cost the adaptive drafts 0.2x hf.
            if gamma is None:
                gamma = MAX_AUTO_GAMMA
                if draft.tree_width > 1:
                    gamma = max(1, min(MAX_AUTO_GAMMA, (MAX_TREE_NODES - 1) // draft.tree_width))
                if tuning is not None:  # the calibrated cap (the replayed optimum; 1 when nothing paid, to explore)
                    gamma = min(gamma, max(tuning.gamma, 1))
        drafter = EarlyExitDrafter(self.split, head, policy, draft.lookup, draft.lookup_ngram, lookup_policy)
        specee = self.specee_runner(head, drafter, draft)
        self.engine = Engine(self.split, drafter, gamma=gamma, tree_width=draft.tree_width, specee=specee)
        self.draft_config = replace(draft, exit_layer=head.exit_layer, policy=name)
        self.head, self.tuning_result = head, tuning

    def tuning(self, head: ExitHead | None = None, refresh: bool = False) -> Tuning:
        """The self-tuning calibration of ``head`` (default: the current one) on this machine (cached)."""
        head = head or self.head
        costs = {d: self.draft_costs(head, None, d) for d in head_depths(head)}
        return tuned(self.split, head, self.tokenizer, refresh=refresh, costs=costs)

    def specee_runner(self, head: ExitHead, drafter: EarlyExitDrafter, draft: DraftConfig) -> SpecEERunner | None:
        """SpecEE over ``head``'s candidates, when predictors are found (``DraftConfig.predictors``)."""
        if draft.specee_threshold is not None and not 0.0 <= draft.specee_threshold <= 1.0:
            raise InvalidConfigError(f"specee_threshold must be in [0, 1], got {draft.specee_threshold}")
        if draft.specee_window < 0 or draft.specee_radius < 0:
            raise InvalidConfigError(f"specee_window and specee_radius must be >= 0, got {draft.specee_window}, "
                                     f"{draft.specee_radius}")
        if draft.predictors == "none":
            return None
        where = head.source if draft.predictors == "auto" else draft.predictors
        if where is None or (draft.predictors == "auto" and not has_predictors(where)):
            return None
        preds = load_predictors(where, head.exit_layer, self.split.num_layers)
        thresholds = {**DEFAULT_THRESHOLDS, **preds.meta.get("thresholds", {})}
        if draft.specee_threshold is not None:
            thresholds = dict.fromkeys(thresholds, draft.specee_threshold)
        max_layer = draft.specee_max_layer if draft.specee_max_layer is not None else preds.meta.get("max_layer")
        settings = SpecEESettings(thresholds, draft.specee_window, draft.specee_radius,
                                  draft.gamma if draft.gamma is not None else SpecEESettings.max_drafts,
                                  max_layer=max_layer)
        return SpecEERunner(self.split, drafter, preds, settings)

    def _cost_key(self, head: ExitHead, depth: int) -> tuple:
        return depth, head.source or "lm", head.kind, len(head.vocab_ids)

    def draft_costs(self, head: ExitHead, draft: DraftConfig | None = None, depth: int | None = None) -> DraftCosts:
        """Forward costs of ``head``'s draft at ``depth`` (default: its exit layer) on this machine (measured
        once per head and depth, ~1-2 s)."""
        depth = depth or head.exit_layer
        key = self._cost_key(head, depth)
        if key not in self._costs:
            self._costs[key] = measure_draft_costs(self.split, head, exit_layer=depth)
        return self._costs[key]

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
            for i, m in enumerate(prompt):
                if "role" not in m or "content" not in m:
                    raise InvalidConfigError(f"chat message {i} needs 'role' and 'content' keys, got {sorted(m)}")
            if not self.has_chat_template:
                raise NoChatTemplateError(
                    f"the model '{self.model_id}' has no chat template (its tokenizer defines none, as base "
                    "models do), so chat messages cannot be encoded: send plain text instead"
                )
            out = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
            return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            if not prompt:
                raise EmptyPromptError("the prompt is empty")
            return list(prompt)
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
        cfg = self.resolve(config, **overrides)
        ids = self.encode(prompt)
        output = RequestOutput(self.tokenizer, cfg)
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
        """A continuous-batching session over this model (``selfspec.batch``): ``add`` requests (token ids and a
        GenerateConfig) at any time, ``step_events`` until none is ``busy``; the server runs one."""
        return TextScheduler(self.engine, self.tokenizer, batch, self.eos_token_ids, self.pipeline)

    def use_pipeline(self, config: PipelineConfig | None = None, model_config: ModelConfig | None = None) -> Any:
        """Decode 'selfspec' requests with the pipeline (PPSD or Mirror-SD, selfspec.pipeline): ``generate``,
        ``stream`` and ``scheduler`` sessions (the server, one pipelined request at a time). Its deep stage loads
        ``model_config`` (default: a copy of this model). ``None`` config: back to the sequential engine."""
        from selfspec.pipeline.service import PipelineService

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
        cfgs = [self.resolve(c, **overrides) for c in configs]
        ids = [self.encode(p) for p in prompts]
        sched = self.scheduler(batch or BatchConfig(max_batch=max(1, len(prompts))))
        for i, c in zip(ids, cfgs):  # every request checked before any is added
            validate_request(len(i), c, self.split.context_length)
            self.engine.check_method(c.method)
        reqs = [sched.add(i, c) for i, c in zip(ids, cfgs)]
        while sched.busy:
            sched.step_events()
        return [r.output.result for r in reqs]

    def generate(self, prompt: Prompt, config: GenerateConfig | None = None, **overrides: Any) -> GenerationResult:
        """Generate a completion; returns text, token ids and stats."""
        result = None
        for ev in self.stream(prompt, config, **overrides):
            result = ev.result
        assert result is not None
        return result


def _layer_of(head_dir: Any) -> int:
    return int(read_head_config(head_dir)["exit_layer"])

