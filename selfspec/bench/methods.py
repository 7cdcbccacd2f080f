"""The decoding methods ``selfspec bench`` times, parsed from spec strings (selfspec.bench.turn runs a turn of one).

Spec strings (``--methods``, repeatable or comma-separated):

    hf                                  transformers ``generate(do_sample=False)``: the baseline
    hf-prompt-lookup[:num_tokens=N]     transformers prompt lookup decoding (N: the bench's setting, 10)
    hf-early-exit[:exit_layer=K]        transformers ``assistant_early_exit=K`` (LayerSkip-style
                                        self-speculation, no KV sharing); K: the bench's exit layer
    plain                               selfspec's own autoregressive path (``method="plain"``)
    selfspec-lm[-POLICY]                untrained exit (final norm + LM head) at the bench's exit layer
    selfspec-trained[-POLICY]           the trained head (``--head``, or the bundled one) at its own layer
    selfspec-default                    DraftConfig() as a user gets it: the bundled head if any, self-tuned
                                        (selfspec.tuning), Thompson-sampled draft lengths
    selfspec[:KEY=VALUE,...]            any DraftConfig: exit_layer, head (lm | trained | a head
                                        directory, nested: the bundled nested head), gamma, policy,
                                        threshold, tune, depth_policy, ...; unset keys take the bench's
                                        defaults (--gamma, --threshold, policy fixed), except that an
                                        adaptive spec (gamma=none) leaves policy and threshold to
                                        DraftConfig's defaults (auto, calibrated), as a user gets them
    specee-verified[:KEY=VALUE,...]     SpecEE's predictors pick each draft token's exit layer (lossless);
                                        keys: any DraftConfig (specee_threshold, specee_window, ...) over
                                        DraftConfig()'s defaults (the bundled head and its predictors)
    specee[:KEY=VALUE,...]              LOSSY SpecEE (a token stops where its predictor fires); same keys
    llama-cpp[:spec=ngram]              llama.cpp's llama-server on the same GGUF file and threads (selfspec.bench.
                                        llamacpp; `make llama-cpp` builds it); spec=ngram: its n-gram speculation
    NAME=SPEC                           any of the above, recorded under NAME

POLICY is any drafting policy of DraftConfig (fixed, confidence, ...); without one, ``fixed``.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from selfspec.bench import llamacpp
from selfspec.config import DraftConfig
from selfspec.errors import InvalidConfigError
from selfspec.heads.io import bundled_head_dir, read_head_config

if TYPE_CHECKING:
    from selfspec.api import SelfSpec
    from selfspec.bench.config import BenchConfig

HF_KINDS = ("hf", "hf-prompt-lookup", "hf-early-exit")
SPECEE_KINDS = ("specee-verified", "specee")
KINDS = (*HF_KINDS, "plain", "selfspec", *SPECEE_KINDS, "llama-cpp")


def policies() -> list[str]:
    """Every drafting policy DraftConfig accepts (the engine's registry of policies)."""
    f = next(f for f in fields(DraftConfig) if f.name == "policy")
    return list(f.metadata.get("choices", ["fixed"]))


@dataclass
class Method:
    """One timed method: a kind plus its settings (a DraftConfig for selfspec kinds)."""

    name: str
    kind: str
    spec: str
    draft: DraftConfig | None = None
    options: dict[str, Any] = field(default_factory=dict)  # generate kwargs of the hf peers
    info: dict[str, Any] = field(default_factory=dict)  # resolved facts: exit layer, layers, head config

    def settings(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "spec": self.spec,
                "draft": asdict(self.draft) if self.draft is not None else None,
                "options": dict(self.options), "info": dict(self.info)}


def split_specs(values: list[str]) -> list[str]:
    """Split comma-separated method lists, keeping ``selfspec:a=1,b=2`` specs whole."""
    out: list[str] = []
    for value in values:
        for piece in (p.strip() for p in value.split(",")):
            if not piece:
                continue
            continues = out and ":" in out[-1] and "=" in piece and ":" not in piece
            if continues:
                out[-1] += "," + piece
            else:
                out.append(piece)
    return out


def trained_head(cfg: BenchConfig, ss: SelfSpec) -> str | None:
    """The trained head directory of the ``selfspec-trained`` presets, or None when there is none."""

    if cfg.head in ("", "lm", "none"):
        return None
    if cfg.head == "auto":
        bundled = bundled_head_dir(ss.model_id)
        return str(bundled) if bundled is not None else None
    read_head_config(cfg.head)  # a clear error if the directory holds no head
    return cfg.head


def bench_exit_layer(cfg: BenchConfig, ss: SelfSpec) -> int:
    """The exit layer shared by the untrained presets and hf-early-exit: --exit-layer, else the trained
    head's layer, else L // 4."""

    if cfg.exit_layer is not None:
        return cfg.exit_layer
    head = trained_head(cfg, ss)
    if head is not None:
        return int(read_head_config(head)["exit_layer"])
    return max(1, ss.split.num_layers // 4)


def default_specs(cfg: BenchConfig, ss: SelfSpec) -> list[str]:
    """Every method: the hf peers, plain, and every policy with the untrained and the trained head."""
    pol = [p for p in policies() if p not in ("fixed", "auto")]
    specs = ["hf", "hf-prompt-lookup", "hf-early-exit", "plain", "selfspec-lm", *(f"selfspec-lm-{p}" for p in pol)]
    if trained_head(cfg, ss) is not None:
        specs += ["selfspec-trained", *(f"selfspec-trained-{p}" for p in pol)]
    return specs


def _convert(name: str, value: str) -> Any:
    if name not in {f.name for f in fields(DraftConfig)}:
        known = ", ".join(f.name for f in fields(DraftConfig))
        raise InvalidConfigError(f"unknown selfspec setting '{name}' (known: {known})")
    return DraftConfig.parse_field(name, value)  # the CLI's conversion: none, numbers, bools, choices


def _pairs(text: str, spec: str) -> dict[str, str]:
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "=" not in part:
            raise InvalidConfigError(f"method '{spec}': expected KEY=VALUE, got '{part}'")
        k, v = part.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=+-]+", "_", text).strip("_") or "method"


def parse_method(spec: str, cfg: BenchConfig, ss: SelfSpec) -> Method:
    """A spec string -> a Method with every setting resolved (see the module docstring)."""
    alias: str | None = None
    name: str | None  # the method's name (None: made from the resolved draft below)
    head_part = spec.split(":", 1)[0]
    if "=" in head_part:  # NAME=SPEC
        alias, spec = spec.split("=", 1)
        alias = alias.strip()
    base, _, rest = spec.partition(":")
    kv = _pairs(rest, spec)
    k = bench_exit_layer(cfg, ss)
    if base in ("hf", "plain"):
        if kv:
            raise InvalidConfigError(f"method '{base}' takes no settings, got {kv}")
        return Method(alias or base, base, spec)
    if base == "hf-prompt-lookup":
        n = int(kv.pop("num_tokens", cfg.prompt_lookup_num_tokens))
        _no_more(kv, spec)
        name = alias or (base if n == 10 else f"{base}-n{n}")
        return Method(name, base, spec, options={"prompt_lookup_num_tokens": n})
    if base == "hf-early-exit":
        layer = int(kv.pop("exit_layer", k))
        _no_more(kv, spec)
        name = alias or (base if "exit_layer" not in rest else f"{base}-k{layer}")
        return Method(name, base, spec, options={"assistant_early_exit": layer},
                      info={"exit_layer": layer, "num_layers": ss.split.num_layers})
    if base == "llama-cpp":
        spec_type = kv.pop("spec", "none")
        _no_more(kv, spec)
        if ss.source_gguf is None:
            raise InvalidConfigError(f"method '{spec}' runs llama.cpp on the model's GGUF file; this model has none")
        return Method(alias or ("llama-cpp" if spec_type == "none" else f"llama-cpp-{spec_type}"), base, spec,
                      options={"spec": spec_type},
                      info={"gguf": str(ss.source_gguf), "threads": torch.get_num_threads(),
                            "binary": str(llamacpp.server_binary()), "flags": llamacpp.SPEC_ARGS[spec_type]})
    draft = DraftConfig(exit_layer=k, head="lm", gamma=cfg.gamma, policy="fixed", threshold=cfg.threshold)
    if base in SPECEE_KINDS:
        values = {key: _convert(key, v) for key, v in kv.items()}
        if values.get("head") == "trained":
            values["head"] = _need_trained(cfg, ss, spec)
        draft = replace(DraftConfig(), **values)
        ss.set_draft(draft)
        ss.engine.check_method(base)
        th = ss.engine.need_specee().settings.threshold[base]
        name = alias or (base if not kv else f"{base}-" + "-".join(f"{a}{b}" for a, b in kv.items()))
        info = {"exit_layer": ss.head.exit_layer, "num_layers": ss.split.num_layers, "head_kind": ss.head.kind,
                "threshold": th, "predictor_layers": ss.engine.need_specee().layers, "lossy": base == "specee"}
        return Method(_slug(name), base, spec, draft=ss.draft_config, info=info)
    if base in ("selfspec", "selfspec-default"):
        if base == "selfspec-default":  # exactly what a user gets: DraftConfig()'s defaults
            _no_more(kv, spec)
            draft, kv, alias = DraftConfig(), {"head": "auto"}, alias or base
        values = {key: _convert(key, v) for key, v in kv.items()}
        if values.get("head") == "trained":
            values["head"] = _need_trained(cfg, ss, spec)
        if values.get("head") == "auto":  # DraftConfig's 'auto': the bundled head if any, else lm

            values["head"] = str(bundled_head_dir(ss.model_id) or "lm")
        if values.get("head") == "nested":  # the bundled nested (multi-depth) head

            nested = bundled_head_dir(ss.model_id + "-nested")
            if nested is None:
                raise InvalidConfigError(f"method '{spec}': no bundled nested head for {ss.model_id}")
            values["head"] = str(nested)
        if values.get("head", "lm") != "lm" and "exit_layer" not in values:
            values["exit_layer"] = None  # a trained head drafts at its own layer
        if "gamma" in values and values["gamma"] is None and base == "selfspec":  # adaptive: a user's defaults
            values.setdefault("policy", DraftConfig.policy)
            values.setdefault("threshold", DraftConfig.threshold)
        draft = replace(draft, **values)
        name = alias
    else:
        m = re.fullmatch(r"selfspec-(lm|trained)(?:-([\w-]+))?", base)
        if m is None:
            raise InvalidConfigError(f"unknown method '{spec}' (known: {', '.join(KINDS)}, selfspec-lm[-POLICY], "
                                     f"selfspec-trained[-POLICY], selfspec:KEY=VALUE,..., NAME=SPEC)")
        _no_more(kv, spec)
        if m.group(1) == "trained":
            draft = replace(draft, head=_need_trained(cfg, ss, spec), exit_layer=None)
        draft = replace(draft, policy=m.group(2) or "fixed")
        name = alias or base
    ss.set_draft(draft)  # validates exit layer, head and policy now, not mid-run
    draft = ss.draft_config
    if name is None:
        head = "lm" if draft.head == "lm" else Path(draft.head).name
        name = f"selfspec-k{draft.exit_layer}-{head}-g{draft.gamma}-{draft.policy}"
        name += f"{draft.threshold:g}" if draft.policy != "fixed" else ""
    info = {"exit_layer": draft.exit_layer, "num_layers": ss.split.num_layers, "head_kind": ss.head.kind,
            "kernel": ss.split.kernel, "costs": ss.draft_costs(ss.head, draft).to_dict()}
    if ss.tuning_result is not None:  # the self-tuning calibration the method ran with
        info["tuning"] = ss.tuning_result.to_dict()
    if draft.head != "lm":

        info["head_config"] = read_head_config(draft.head)
    return Method(_slug(name), "selfspec", spec, draft=draft, info=info)


def _no_more(kv: dict[str, str], spec: str) -> None:
    if kv:
        raise InvalidConfigError(f"method '{spec}': unknown settings {sorted(kv)}")


def _need_trained(cfg: BenchConfig, ss: SelfSpec, spec: str) -> str:
    head = trained_head(cfg, ss)
    if head is None:
        raise InvalidConfigError(
            f"method '{spec}' needs a trained exit head: give --head DIR (no bundled head for {ss.model_id})"
        )
    return head


def resolve_methods(specs: list[str], cfg: BenchConfig, ss: SelfSpec) -> list[Method]:
    """Parse every spec (the defaults when none is given); names must be unique."""
    methods = [parse_method(s, cfg, ss) for s in split_specs(specs) or default_specs(cfg, ss)]
    names = [m.name for m in methods]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise InvalidConfigError(f"method names must be unique, repeated: {dup} (use NAME=SPEC)")
    return methods
