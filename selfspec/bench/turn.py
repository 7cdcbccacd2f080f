"""One timed turn of one method (``run_turn``): selfspec's engine, transformers' generate (the hf peers, ``_run_hf``)
or llama.cpp's server; greedy, batch 1, prefill included."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from selfspec.bench import llamacpp
from selfspec.bench.methods import HF_KINDS, SPECEE_KINDS, Method
from selfspec.config import GenerateConfig
from selfspec.models.lean import transformers_model

if TYPE_CHECKING:
    from selfspec.api import SelfSpec


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
    # rounds}, "head_proposed" / "head_accepted": the head's drafts per chain position, ...}
    rounds: dict[str, Any] | None = None
    peer: dict[str, Any] | None = None  # llama-cpp: the server's own timings (prompt / predicted ms, drafts)
    prefill_time: float | None = None  # seconds of wall_time spent on the prompt and the first token (None: unknown)
    cached_tokens: int = 0  # prompt tokens reused from an earlier turn (selfspec's prefix cache, llama.cpp's cache_n)

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)


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
                  "depths": {str(d): n for d, n in sorted(st.draft_depths.items())},
                  "head_proposed": list(st.proposed_per_position), "head_accepted": list(st.accepted_per_position)}
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
