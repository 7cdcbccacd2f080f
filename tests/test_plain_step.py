"""A plain greedy step in one compiled call (``SplitModel.step``, the plan of models/plans.py) and the rotary rows it
and the other one-call paths read from a table (``SplitModel.rotary_rows``): bit for bit the step in parts."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHS, tiny_model
from torch import nn

from selfspec import SelfSpec
from selfspec.models.rotary import ROTARY_TABLE_MIN, static_rope
from selfspec.quant.convert import quantize_model


def split_of(arch: str, quantize: str | None):
    model = tiny_model(arch) if quantize is None else quantize_model(tiny_model(arch), quantize)
    return SelfSpec(model, None).split


@pytest.mark.parametrize("arch", ARCHS)
def test_rotary_rows_are_the_rotary_call_bit_for_bit(arch):
    """Rows of the table (consecutive positions of one sequence, 1-16 at a time, across the table's growth) equal
    the rotary call on those positions; other positions (a tree's, a batch) take the call itself."""
    split = split_of(arch, None)
    kinds = list(dict.fromkeys(split.layer_types))
    h = torch.zeros(1, 1, split.hidden_size)
    g = torch.Generator().manual_seed(0)
    for kind in kinds:
        for start, n in [(0, 1), (5, 16), (ROTARY_TABLE_MIN - 3, 7), (3 * ROTARY_TABLE_MIN, 2), (40, 3)]:
            pos = torch.arange(start, start + n)[None]
            want = split.rotary(h, pos, kind)
            got = split.rotary_rows(h, pos, kind)
            assert all(torch.equal(a, b) and b.is_contiguous() for a, b in zip(want, got)), (kind, start, n)
        assert split.rotary_tables._tables[(kind, torch.float32)][0].shape[1] >= 3 * ROTARY_TABLE_MIN + 2
        tree = torch.tensor([[9, 10, 10, 11]])  # not consecutive: the call
        batch = torch.randint(0, 50, (2, 3), generator=g)
        for pos in (tree, batch):
            want = split.rotary(h, pos, kind)
            assert all(torch.equal(a, b) for a, b in zip(want, split.rotary_rows(h, pos, kind)))


def test_a_sequences_positions_say_their_first_and_reserving_every_layer_at_once_is_reserving_each():
    """``SequenceState.positions`` carries its first position, which ``consecutive`` takes without reading values
    (the same answer as reading them); ``KVCache.reserve_all`` gives each layer's old length and grows a full
    layer's buffers as ``reserve`` does, layer by layer."""
    from selfspec.models.cache import KVCache
    from selfspec.models.rotary import consecutive
    from selfspec.state import SequenceState

    seq = SequenceState(KVCache(3, 2, 4, 8, torch.float32))
    pos = seq.positions(5, 3)
    assert pos.tolist() == [[5, 6, 7]] and consecutive(pos) == 5 == consecutive(pos.clone())  # the clone reads values
    assert consecutive(torch.tensor([[5, 7]])) is None
    a, b = KVCache(4, 2, 4, 8, torch.float32), KVCache(4, 2, 4, 8, torch.float32)
    for cache in (a, b):
        cache.lengths = [6, 7, 5, 6]
    assert a.reserve_all(2, 1, 3) == [7, 5] == [b.reserve(1, 2), b.reserve(2, 2)]
    assert a.lengths == b.lengths == [6, 9, 7, 6]
    assert [k.shape[2] for k in a.keys] == [k.shape[2] for k in b.keys] == [8, 16, 8, 8]  # layer 1 grew
    assert a.reserve_all(1) == [6, 9, 7, 6] and a.lengths == [7, 10, 8, 7]


def test_a_rotary_that_depends_on_the_longest_position_takes_no_table():
    dynamic = nn.Module()
    dynamic.rope_type = "dynamic"  # transformers updates its frequencies with the longest position seen
    per_kind = nn.Module()
    per_kind.rope_type = {"full_attention": "default", "sliding_attention": "longrope"}
    plain = nn.Module()
    plain.rope_type = "default"
    assert not static_rope(dynamic) and not static_rope(per_kind) and not static_rope(nn.Module())
    assert static_rope(plain)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("quantize", [None, "Q4_0"])
def test_one_call_step_is_the_step_in_parts_bit_for_bit(arch, quantize, one_thread):
    """``step`` gives the token ``greedy_ids(forward_all(...))`` gives and writes the same keys and values,
    step after step; it declines (None, nothing done) for Gemma 3 (a scaled embedding, sandwich norms) and for a
    batched cache, and a token out of range is an error that leaves the cache as it was."""
    split = split_of(arch, quantize)
    prompt = torch.tensor([[3, 17, 5, 42, 8]])
    fused, ref = split.new_cache(64), split.new_cache(64)
    with torch.inference_mode():
        for cache in (fused, ref):
            h = split.forward_all(prompt, torch.arange(5)[None], cache)
        tok = int(split.greedy_ids(h)[0, -1])
        if arch == "gemma3_text":
            assert split.step(tok, 5, fused) is None and fused.lengths == ref.lengths
            return
        for pos in range(5, 15):
            got = split.step(tok, pos, fused).token
            want = int(split.greedy_ids(split.forward_all(torch.tensor([[tok]]), torch.arange(pos, pos + 1)[None],
                                                          ref))[0, -1])
            assert got == want, pos
            assert fused.lengths == ref.lengths
            for a, b in ((fused.keys, ref.keys), (fused.values, ref.values)):
                assert all(torch.equal(x[:, :, : pos + 1], y[:, :, : pos + 1]) for x, y in zip(a, b))
            tok = got
        lengths = list(fused.lengths)
        with pytest.raises(IndexError, match="out of range"):
            split.step(split.vocab_size, 15, fused)
        assert fused.lengths == lengths
        assert split.step(tok, 0, split.new_cache(8, batch=2)) is None


def test_plain_greedy_decoding_takes_the_one_call(one_thread):
    """The engine's plain greedy step runs through ``step`` (one call per token) and its output is
    transformers' greedy."""
    from conftest import hf_greedy

    model = quantize_model(tiny_model("qwen2"), "Q8_0")
    ss = SelfSpec(model, None)
    calls = []
    real = ss.split.step
    ss.split.step = lambda *a, **k: calls.append(a[1]) or real(*a, **k)
    prompt = [3, 17, 5, 42, 8, 11]
    out = ss.generate(prompt, max_new_tokens=12, method="plain").token_ids
    assert out == hf_greedy(model, prompt, 12)
    assert calls == list(range(len(prompt), len(prompt) + 11))
