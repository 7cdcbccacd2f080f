"""The decoding methods ``selfspec bench`` times, parsed from spec strings, and how one turn is run.

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
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from selfspec.bench import llamacpp
from selfspec.config import DraftConfig, GenerateConfig
from selfspec.errors import InvalidConfigError
from selfspec.heads.io import bundled_head_dir, read_head_config
from selfspec.models.lean import transformers_model

if TYPE_CHECKING:
    from selfspec.api import SelfSpec
    from selfspec.bench.specbench import BenchConfig

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


@dataclass
class TurnResult:
    """One timed generation (one turn of one question)."""

    token_ids: list[int]
    wall_time: float
    decoding_steps: int  # target verification steps after the prefill
    accept_lengths: list[int]  # tokens emitted per step, bonus included ([] when unknown)
    draft_tokens: int | None = None  # draft tokens proposed (selfspec kinds)
    prompt_tokens: int = 0
    specee: dict[str, Any] | None = None  # SpecEE kinds: exit layers, predictor checks and time, exit agreement
    # selfspec kinds: {"lookup": steps drafted by lookup, "blank": steps whose head draft was refused, "depths": {depth:
    # rounds}, ...}
    rounds: dict[str, Any] | None = None
    peer: dict[str, Any] | None = None  # llama-cpp: the server's own timings (prompt / predicted ms, drafts)
    prefill_time: float | None = None  # seconds of wall_time spent on the prompt and the first token (None: unknown)
    cached_tokens: int = 0  # prompt tokens reused from an earlier turn (selfspec's prefix cache, llama.cpp's cache_n)

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)


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


# ---- running one turn ------------------------------------------------------------------------
def use_draft(ss: SelfSpec, method: Method, kept: dict[str, Any] | None = None) -> None:
    """``method``'s draft on ``ss`` (untimed): built afresh, so an adaptive policy starts anew; or with ``kept``, the
    drafter this method's earlier turns left (built at its first turn), as its own server would keep it."""
    assert method.draft is not None  # parse_method gives the selfspec kinds their draft
    if kept is None:
        ss.set_draft(method.draft)
    elif method.name in kept:
        ss.engine, ss.draft_config, ss.head, ss.tuning_result = kept[method.name]
    else:
        ss.set_draft(method.draft)
        kept[method.name] = (ss.engine, ss.draft_config, ss.head, ss.tuning_result)


def run_turn(ss: SelfSpec, method: Method, ids: list[int], max_new_tokens: int, reuse: bool = False,
             kept: dict[str, Any] | None = None) -> TurnResult:
    """Generate greedily for one turn and time it (prefill included, tokenization excluded). ``reuse``: llama.cpp
    keeps its last request's keys and values for a prompt that starts with it (cache_prompt; selfspec's prefix
    cache is the caller's to empty). ``kept``: each selfspec method's drafter across its turns (``use_draft``)."""
    if method.kind in HF_KINDS:
        return _run_hf(ss, ids, max_new_tokens, method.options)
    if method.kind == "llama-cpp":
        assert ss.source_gguf is not None  # parse_method checked the model came from a GGUF
        tokens, wall, timings = llamacpp.generate(ss.source_gguf, torch.get_num_threads(), method.options["spec"],
                                                  ids, max_new_tokens, ss.eos_token_ids, cache_prompt=reuse)
        drafted = timings.get("draft_n")
        prefill = timings["prompt_ms"] / 1e3 if "prompt_ms" in timings else None  # the server's own figure
        return TurnResult(tokens, wall, max(0, len(tokens) - 1), [], drafted, len(ids), peer=timings,
                          prefill_time=prefill, cached_tokens=int(timings.get("cache_n", 0)))
    gen = GenerateConfig(max_new_tokens=max_new_tokens, ignore_eos=False)
    if method.kind in ("selfspec", *SPECEE_KINDS):
        use_draft(ss, method, kept)
    r = ss.generate(ids, gen, method="selfspec" if method.kind == "selfspec" else method.kind)
    st = r.stats
    drafted = sum(st.proposed_per_position) + st.lookup_proposed if method.kind != "plain" else 0
    specee = None
    if method.kind in SPECEE_KINDS:
        specee = {"exit_layers": list(st.exit_layers), "predictor_checks": st.predictor_checks,
                  "predictor_time": st.predictor_time, "exit_agreed": st.exit_agreed, "exit_compared": st.exit_compared}
    rounds = None
    if method.kind != "plain":
        rounds = {"lookup": st.lookup_steps, "store": st.store_steps, "store_proposed": st.store_proposed,
                  "store_accepted": st.store_accepted, "blank": st.blank_steps,
                  "depths": {str(d): n for d, n in sorted(st.draft_depths.items())}}
    return TurnResult(r.token_ids, st.wall_time, st.steps, list(st.accept_lengths), drafted, len(ids), specee, rounds,
                      prefill_time=st.prefill_time, cached_tokens=st.cached_tokens)


def _run_hf(ss: SelfSpec, ids: list[int], max_new_tokens: int, options: dict[str, Any]) -> TurnResult:
    """transformers' generate. Its target forwards are seen by a hook on the last decoder layer (drafts
    of assistant_early_exit stop earlier): their positions give the tokens emitted per step."""
    starts: list[int | None] = []  # first position of each target forward

    def hook(_module: Any, _args: tuple, kwargs: dict) -> None:
        pos = kwargs.get("position_ids")
        starts.append(int(pos.reshape(-1)[0]) if isinstance(pos, torch.Tensor) else None)

    model = transformers_model(ss.model)  # transformers' CausalLM (over the same weights, for a lean tree)
    pad = getattr(model.generation_config, "pad_token_id", None)
    pad = pad if pad is not None else (ss.eos_token_ids[0] if ss.eos_token_ids else 0)
    x = torch.tensor([ids], dtype=torch.long, device=ss.split.device)
    handle = model.get_submodule("model.layers")[-1].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new_tokens,
                                 min_new_tokens=0, eos_token_id=ss.eos_token_ids or None, pad_token_id=pad,
                                 top_k=None, top_p=None, temperature=None, **options)
        wall = time.perf_counter() - t0
    finally:
        handle.remove()
    new = out[0, len(ids):].tolist()
    eos = set(ss.eos_token_ids)
    for i, t in enumerate(new):  # batch 1 has no padding, but be safe: cut after the first EOS
        if t in eos:
            new = new[: i + 1]
            break
    steps, accepts = hf_steps(starts, len(ids), len(new))
    return TurnResult(new, wall, steps, accepts, None, len(ids))


def hf_steps(starts: list[int | None], prompt_len: int, new_tokens: int) -> tuple[int, list[int]]:
    """(steps after the prefill, tokens emitted per step) from the first position of each target forward.
    A forward starting at s_i emits s_{i+1} - s_i tokens; the prefill (which may already verify prompt
    lookup candidates) is not a step; the last step emits what is left."""
    steps = max(0, len(starts) - 1)
    known = [s for s in starts if s is not None]
    if steps == 0 or len(known) < len(starts):
        return steps, []
    accepts = [b - a for a, b in zip(known[1:], known[2:])]
    emitted_by_prefill = known[1] - prompt_len + 1
    accepts.append(new_tokens - emitted_by_prefill - sum(accepts))
    return (steps, accepts) if min(accepts) > 0 else (steps, [])
