"""The prompt prefix cache (selfspec/prefix_cache.py) is exact: a request that reuses a cached prefix computes
bit for bit the keys, values and logits of a full prefill, drafts exactly as it would without the cache, and
gives the same output (transformers' greedy generate); where the kernels could not promise that, it stays off."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHS, hf_greedy, tiny_model
from test_deep_head import deep_ss
from test_engine_equality import prompt_of
from test_quant_models import k_quant_model

from selfspec import SelfSpec
from selfspec.batch.scheduler import BatchConfig, Scheduler, decode_batch
from selfspec.config import GenerateConfig
from selfspec.drafting.policies import make_policy
from selfspec.errors import InvalidConfigError
from selfspec.kernels.build import built_extension
from selfspec.prefix_cache import MIN_ROWS, common_prefix
from selfspec.quant import weight
from selfspec.quant.convert import QUANTIZE_TYPES, quantize_model
from selfspec.stats import GenerationStats

pytestmark = pytest.mark.usefixtures("one_thread")
NEW = 16


@pytest.fixture
def panels(monkeypatch):
    """Prefills of PANEL_ROWS rows or more take the panels (what the cache needs), whatever this machine measured."""
    monkeypatch.setattr(weight, "prefill_path", lambda type_name: "panels")


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix([1, 2, 3, 4], [1, 2, 3]) == 3
    assert common_prefix([1, 2, 9, 4], [1, 2, 3, 4]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([5] * 100 + [1], [5] * 100 + [2]) == 100
    for n in range(40):
        a = list(range(50))
        b = a[:n] + [-1] + a[n + 1 :]
        assert common_prefix(a, b) == n


@torch.inference_mode()
def started(ss: SelfSpec, prompt: list[int], method: str = "plain"):
    """A request's sequence right after its prefill (the engine's own ``start_sequence``) and its stats."""
    stats = GenerationStats()
    gen = GenerateConfig(max_new_tokens=NEW, method=method)
    return ss.engine.start_sequence(prompt, gen, ss.engine.speculative(method), stats), stats


CASES = [("llama", t) for t in QUANTIZE_TYPES] + [("llama", t) for t in ("Q4_K", "Q5_K", "Q6_K")] + \
    [(a, "Q4_0" if a != "phi3" else "Q8_0") for a in ARCHS if a != "llama"]


@pytest.mark.parametrize(("arch", "type_name"), CASES)
def test_a_reused_prefix_gives_a_full_prefills_bits(panels, arch, type_name):
    """Every block type and architecture: keys, values and the next step's logits after a reuse are a full
    prefill's, bit for bit."""
    model = k_quant_model(type_name) if type_name.endswith("_K") else quantize_model(tiny_model(arch), type_name)
    reuse_is_exact(SelfSpec(model, None))


def reuse_is_exact(ss: SelfSpec) -> None:
    """A prompt's reused prefix: keys, values and the next step's logits are a full prefill's, bit for bit."""
    assert ss.prefix_cache.off is None
    a = prompt_of(40, 1)
    b = a + prompt_of(50, 2)
    started(ss, a)  # cached: 40 rows computed in one call
    warm, stats = started(ss, b)
    assert stats.cached_tokens == 40 and ss.prefix_cache.hits == 1
    ss.prefix_cache.clear()
    cold, cold_stats = started(ss, b)
    assert cold_stats.cached_tokens == 0
    for i in range(len(cold.cache.keys)):
        assert torch.equal(warm.cache.keys[i][:, :, : len(b)], cold.cache.keys[i][:, :, : len(b)]), i
        assert torch.equal(warm.cache.values[i][:, :, : len(b)], cold.cache.values[i][:, :, : len(b)]), i
    assert warm.pending == cold.pending
    # the next step's logits too (the first token after the prompt, through every layer)
    with torch.inference_mode():
        ids = torch.tensor([[warm.pending]])
        hw = ss.split.forward_all(ids, warm.positions(len(b), 1), warm.cache)
        hc = ss.split.forward_all(ids, cold.positions(len(b), 1), cold.cache)
    assert torch.equal(ss.split.logits(hw), ss.split.logits(hc))


@pytest.mark.parametrize("type_name", ["Q4_0", "Q5_1", "Q4_K"])
def test_on_amx_tiles_the_kernels_prefill_reuses_exactly(monkeypatch, type_name):
    """On AMX a row's sums are its own in any call, so a prefill through the decoding kernel keeps the cache on and
    exact; with the FMA kernels (AMX turned off) the same path turns it off."""
    ext = built_extension()
    if not ext.amx_on():
        pytest.skip("needs AMX (amx_tile, amx_bf16), Linux's tile state and SELFSPEC_AMX not 0")
    monkeypatch.setattr(weight, "prefill_path", lambda type_name: "kernel")
    model = k_quant_model(type_name) if type_name.endswith("_K") else quantize_model(tiny_model("llama"), type_name)
    reuse_is_exact(SelfSpec(model, None))
    try:
        ext.set_amx(False)
        assert f"kernel path for {type_name}" in (SelfSpec(model, None).prefix_cache.off or "")
    finally:
        ext.set_amx(True)  # it was on (above)


def test_the_int8_mode_reuses_exactly_too():
    """The int8 mode's kernel takes every prefill (whatever path this machine measured for the exact mode)."""
    from selfspec.quant.modules import set_numerics

    ss = SelfSpec(set_numerics(quantize_model(tiny_model("llama"), "Q4_1"), "int8"), None)
    assert ss.split.kernel == "selfspec-quant-int8" and ss.prefix_cache.off is None
    a = prompt_of(40, 1)
    b = a + prompt_of(45, 2)
    started(ss, a)
    warm, stats = started(ss, b)
    assert stats.cached_tokens == 40
    ss.prefix_cache.clear()
    cold, _ = started(ss, b)
    assert all(torch.equal(w[:, :, : len(b)], c[:, :, : len(b)]) for w, c in zip(warm.cache.keys, cold.cache.keys))
    assert warm.pending == cold.pending


def test_reuse_leaves_the_rows_a_prefill_must_compute(panels):
    ss = SelfSpec(quantize_model(tiny_model("llama"), "Q4_0"), None)
    a = prompt_of(60, 3)
    started(ss, a)
    _, stats = started(ss, a + prompt_of(10, 4))  # 70 tokens: at most 70 - 32 may come from the cache
    assert stats.cached_tokens == 70 - MIN_ROWS
    _, stats = started(ss, a[:MIN_ROWS + 5])  # a prefix of a cached prompt: all but MIN_ROWS rows reused
    assert stats.cached_tokens == 5
    _, stats = started(ss, prompt_of(20, 5))  # too short to be kept, or to reuse anything
    assert stats.cached_tokens == 0
    n = len(ss.prefix_cache.entries)
    started(ss, prompt_of(20, 5))
    assert len(ss.prefix_cache.entries) == n  # 20 rows are computed by the decoding kernel: never kept


@pytest.mark.parametrize("method", ["plain", "selfspec"])
def test_output_with_and_without_the_cache_is_the_models_own(panels, method):
    ss = SelfSpec(quantize_model(tiny_model("qwen2"), "Q8_0"), None)
    a = prompt_of(45, 6)
    b = a + prompt_of(41, 7)
    ref = hf_greedy(ss.model, b, NEW)
    ss.generate(a, max_new_tokens=NEW, method=method)
    warm = ss.generate(b, max_new_tokens=NEW, method=method)
    assert warm.stats.cached_tokens == 45
    assert "45 of 86 prompt tokens from the prefix cache" in warm.stats.summary()
    ss.prefix_cache.clear()
    cold = ss.generate(b, max_new_tokens=NEW, method=method)
    assert warm.token_ids == cold.token_ids == ref
    assert warm.stats.accept_lengths == cold.stats.accept_lengths


@pytest.mark.parametrize("k", [0, 2])
def test_a_deep_head_drafts_exactly_as_after_a_full_prefill(panels, k):
    """A deep-context head reads its last head_context exit and final states of the prompt: a reuse leaves them to
    the prefill, so every round drafts, and is accepted, as without the cache."""
    ss, _ = deep_ss("llama", k, gamma=3, lookup=2, quantize="Q4_0")
    drafter = ss.engine.drafter
    drafter.policy = make_policy("fixed", 0.1)
    drafter.head_context = 8
    assert drafter.prompt_rows_needed() == 9
    a = prompt_of(70, 8)
    b = a + prompt_of(40, 9)
    ss.generate(a, max_new_tokens=NEW)
    warm = ss.generate(b, max_new_tokens=NEW)
    assert warm.stats.cached_tokens == 70
    ss.prefix_cache.clear()
    cold = ss.generate(b, max_new_tokens=NEW)
    assert warm.token_ids == cold.token_ids == hf_greedy(ss.model, b, NEW)
    assert warm.stats.proposed_per_position == cold.stats.proposed_per_position
    assert warm.stats.accepted_per_position == cold.stats.accepted_per_position
    assert warm.stats.accept_lengths == cold.stats.accept_lengths
    assert sum(warm.stats.proposed_per_position) > 0
    drafter.head_context = None  # a head that reads the whole prompt: nothing is reused
    assert drafter.prompt_rows_needed() is None
    assert ss.generate(b, max_new_tokens=NEW).stats.cached_tokens == 0


def test_a_batch_reuses_the_cache_and_keeps_each_requests_output(panels):
    ss = SelfSpec(quantize_model(tiny_model("llama"), "Q4_0"), None)
    a = prompt_of(50, 10)
    prompts = [a + prompt_of(35, 11), prompt_of(12, 12), a + prompt_of(33, 13)]
    alone = [hf_greedy(ss.model, p, NEW) for p in prompts]
    ss.generate(a, max_new_tokens=2)
    gens = [GenerateConfig(max_new_tokens=NEW, ignore_eos=True) for _ in prompts]
    stats: list[GenerationStats] = []
    out = decode_batch(ss.engine, prompts, gens, method="plain", stats=stats, batch=BatchConfig(max_batch=3))
    assert out == alone
    assert [s.cached_tokens for s in stats] == [50, 0, 50]


def test_off_where_a_prefill_could_change_the_bits(monkeypatch):
    monkeypatch.setattr(weight, "prefill_path", lambda type_name: "torch")
    ss = SelfSpec(quantize_model(tiny_model("llama"), "Q4_0"), None)
    assert "torch path for Q4_0" in (ss.prefix_cache.off or "")
    a = prompt_of(40, 1)
    ss.generate(a, max_new_tokens=2)
    assert ss.generate(a + prompt_of(40, 2), max_new_tokens=2).stats.cached_tokens == 0
    assert not ss.prefix_cache.entries
    assert "quantized" in (SelfSpec(tiny_model("llama"), None).prefix_cache.off or "")  # float weights
    assert SelfSpec(tiny_model("llama"), None, prefix_cache=0).prefix_cache.off == "capacity 0"
    with pytest.raises(InvalidConfigError, match="prefix_cache"):
        SelfSpec(tiny_model("llama"), None, prefix_cache=-1)


def test_least_recently_used_prompts_go_first(panels):
    ss = SelfSpec(quantize_model(tiny_model("llama"), "Q4_0"), None)
    pc = ss.prefix_cache
    prompts = [prompt_of(40, 20 + i) for i in range(3)]
    started(ss, prompts[0])
    one = pc.nbytes
    pc.capacity = 3 * one  # room for three prompts of 40
    started(ss, prompts[1])
    started(ss, prompts[0] + prompt_of(40, 30))  # reuses prompts[0], then replaces it: it holds it whole
    assert [len(e.tokens) for e in pc.entries.values()] == [40, 80]
    assert next(iter(pc.entries.values())).tokens == prompts[1]
    started(ss, prompts[2])  # past capacity: the least recently used (prompts[1]) goes
    assert [e.tokens[:40] for e in pc.entries.values()] == [prompts[0], prompts[2]]
    assert pc.nbytes <= pc.capacity


def test_a_prompt_held_already_is_not_copied_again(panels):
    """The same prompt again (another method on the same question), or a prefix of a held one: no new copy, the
    held entry becomes the most recently used; the request still reuses and computes its rows as before."""
    ss = SelfSpec(quantize_model(tiny_model("llama"), "Q4_0"), None)
    pc = ss.prefix_cache
    a, b = prompt_of(80, 20), prompt_of(70, 21)
    started(ss, a)
    held = next(iter(pc.entries.values()))
    started(ss, b)
    assert [e.tokens for e in pc.entries.values()] == [a, b]
    seq, stats = started(ss, a, "selfspec")  # the same prompt: reuses 80 - 32 rows, stores nothing new
    assert stats.cached_tokens == 80 - MIN_ROWS
    assert [e.tokens for e in pc.entries.values()] == [b, a]
    assert pc.entries[next(reversed(pc.entries))] is held  # the copy made by the first request
    started(ss, a[:60])  # a prefix of a held prompt: nothing new either
    assert [e.tokens for e in pc.entries.values()] == [b, a]


@pytest.mark.slow
def test_the_default_model_reuses_a_chats_first_turn_exactly(default_ss):
    ss = default_ss
    assert ss.prefix_cache.off is None, ss.prefix_cache.off
    ss.prefix_cache.clear()
    turn1 = [{"role": "system", "content": "You are a careful assistant. " * 12},
             {"role": "user", "content": "Name three rivers of Europe and one fact about each."}]
    first = ss.generate(turn1, max_new_tokens=24)
    turn2 = [*turn1, {"role": "assistant", "content": first.text}, {"role": "user", "content": "Which is longest?"}]
    ids = ss.encode(turn2)
    warm, stats = started(ss, ids, "selfspec")
    assert stats.cached_tokens == len(ss.encode(turn1))
    ss.prefix_cache.clear()
    cold, _ = started(ss, ids, "selfspec")
    assert all(torch.equal(w[:, :, : len(ids)], c[:, :, : len(ids)]) for w, c in zip(warm.cache.keys, cold.cache.keys))
    assert warm.pending == cold.pending
    ss.prefix_cache.clear()


def full_prefill(ss: SelfSpec, prompt: list[int], method: str = "plain"):
    """``started`` with every row of the last layer computed (the engine told its tails are not exact)."""
    ss.engine._tails_exact = False
    try:
        return started(ss, prompt, method)
    finally:
        ss.engine._tails_exact = None


@pytest.mark.parametrize("method", ["plain", "selfspec"])
def test_a_prefills_last_layer_runs_only_the_rows_it_needs_with_a_full_prefills_bits(panels, method, monkeypatch):
    """The last layer of a 90-token prefill runs attention and MLP on its last MIN_ROWS rows (a deep head's
    head_context + 1 = 41 for selfspec), every layer's keys and values on all; the cache, the first token, the next
    step's logits and the drafter's final states are a full prefill's, bit for bit."""
    from selfspec.models import fast

    ss, _ = deep_ss("llama", 0, gamma=3, lookup=2, quantize="Q4_0")
    ss.engine.drafter.head_context = 40
    want_rows = MIN_ROWS if method == "plain" else 41
    assert ss.engine.prefill_tail(GenerateConfig(method=method), method == "selfspec", 0) == want_rows
    prompt = prompt_of(90, 8)
    ss.prefix_cache.clear()
    full, _ = full_prefill(ss, prompt, method)
    ss.prefix_cache.clear()
    last = ss.split.fast_layers[-1]
    rows = []
    mlp = fast.FastLayer._mlp
    monkeypatch.setattr(fast.FastLayer, "_mlp", lambda self, h, a, ops: (self is last and rows.append(h.shape[1]))
                        or mlp(self, h, a, ops))
    cut, _ = started(ss, prompt, method)
    assert rows == [want_rows]
    monkeypatch.setattr(fast.FastLayer, "_mlp", mlp)
    for i in range(len(full.cache.keys)):
        assert torch.equal(cut.cache.keys[i][:, :, :90], full.cache.keys[i][:, :, :90]), i
        assert torch.equal(cut.cache.values[i][:, :, :90], full.cache.values[i][:, :, :90]), i
    assert cut.pending == full.pending
    with torch.inference_mode():
        ids = torch.tensor([[cut.pending]])
        hc = ss.split.forward_all(ids, cut.positions(90, 1), cut.cache)
        hf = ss.split.forward_all(ids, full.positions(90, 1), full.cache)
    assert torch.equal(ss.split.logits(hc), ss.split.logits(hf))
    if method == "selfspec":  # the rows a deep head reads of the prompt's final states (its last head_context + 1)
        assert torch.equal(cut.head.finals[91 - want_rows : 91], full.head.finals[91 - want_rows : 91])


def test_a_batched_prefill_runs_the_tail_too_and_answers_as_alone(panels, monkeypatch):
    """Continuous batching: a prompt's prefill beside another request's decoding rows (two segments in one layer
    call) computes its last layer's tail only, and both answers are each request's own."""
    from selfspec.models import fast

    ss = SelfSpec(quantize_model(tiny_model("qwen2"), "Q8_0"), None)
    a, b = prompt_of(20, 9), prompt_of(70, 10)
    alone = [ss.generate(p, max_new_tokens=NEW, method="plain").token_ids for p in (a, b)]
    tails = []
    forward = fast.FastLayer._forward_tails
    monkeypatch.setattr(fast.FastLayer, "_forward_tails", lambda self, h, segs, t, ops: tails.append(list(t))
                        or forward(self, h, segs, t, ops))
    ss.prefix_cache.clear()  # b's prefill whole again, not its last MIN_ROWS rows after a reuse
    gen = GenerateConfig(max_new_tokens=NEW, method="plain")
    sched = Scheduler(ss.engine, BatchConfig(max_batch=2))
    ra = sched.add(a, gen)
    sched.step()  # a's prefill (20 rows: no tail, under MIN_ROWS)
    sched.step()  # a decodes
    assert tails == []
    rb = sched.add(b, gen)
    sched.run()  # b's 70-row prefill beside a's decoding row
    assert [ra.out, rb.out] == alone
    assert tails == [[1, MIN_ROWS]]
