"""The fast forward (packed fused weights, selfspec's kernels) against the reference path
(transformers' own decoder modules): logits per architecture for every block size a decoding step
uses (n <= 16, and 17-64 rows as a batch verifies), split at every layer, and the default model."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHS, LAYERS, VOCAB, tiny_model

from selfspec.models.split import SplitModel


def _forward(split: SplitModel, ids: torch.Tensor, blocks: list[int], cut: int) -> torch.Tensor:
    """Prefill ids[:, :p] then decode the rest in blocks of the given sizes, shallow [0, cut) then deep
    [cut, L) as self-speculation does; -> the logits of every decoded position [1, sum(blocks), vocab]."""
    cache = split.new_cache(ids.shape[1])
    p = ids.shape[1] - sum(blocks)
    pos = torch.arange(p)[None]
    split.run_layers(split.embed(ids[:, :p]), 0, split.num_layers, pos, cache)
    out = []
    for n in blocks:
        pos = torch.arange(p, p + n)[None]
        h = split.run_layers(split.embed(ids[:, p : p + n]), 0, cut, pos, cache)
        h = split.run_layers(h, cut, split.num_layers, pos, cache)
        out.append(split.logits(h))
        p += n
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("arch", ARCHS)
def test_fast_logits_match_reference(arch):
    model = tiny_model(arch)
    fast, ref = SplitModel(model, "fast"), SplitModel(model, "reference")
    assert fast.kernel != ref.kernel
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(2, VOCAB, (1, 110), generator=g)
    blocks = [1, 2, 4, 8, 16, 1, 3, 24, 17]  # 17-64 rows: the kernel 16 rows at a time
    with torch.inference_mode():
        for cut in range(LAYERS + 1):
            a, b = _forward(fast, ids, blocks, cut), _forward(ref, ids, blocks, cut)
            diff = (a - b).abs().max().item()
            rel = diff / b.abs().max().item()
            assert diff < 1e-4 and rel < 1e-5, f"{arch} cut {cut}: max abs {diff:.2e}, rel {rel:.2e}"
            assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("weights", ["float32", "Q4_1", "Q4_1-int8"])
@pytest.mark.parametrize("arch", ARCHS)
def test_step_plan_is_the_fused_python_path_bit_for_bit(arch, weights, monkeypatch):
    """A causal step of one sequence runs a range of layers as one C++ call (``FastLayer.plan``,
    ``selfspec/kernels/step.cpp``): its logits equal the per-op Python path's exactly, for every block size up
    to 16 and every split, over float32, quantized and int8-mode weights. A layout it does not cover (Gemma's
    sandwich norms) has no plan and keeps the Python path."""
    from selfspec.quant.convert import quantize_model
    from selfspec.quant.modules import set_numerics

    model = tiny_model(arch)
    if weights != "float32":
        model = quantize_model(model, "Q4_1")
        if weights.endswith("int8"):
            set_numerics(model, "int8")
    split = SplitModel(model, "fast")
    plans = [layer.plan for layer in split.fast_layers]
    assert all(p is None for p in plans) if arch == "gemma3_text" else all(p is not None for p in plans)
    calls = []
    from selfspec.models.plans import StepPlans

    planned, was = StepPlans.run, split.plans.planned
    monkeypatch.setattr(StepPlans, "run", lambda self, *a: calls.append(1) or planned(self, *a))
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(2, VOCAB, (1, 60), generator=g)
    with torch.inference_mode():
        for cut in (0, 2, LAYERS):
            a = _forward(split, ids, [1, 2, 4, 16, 3], cut)
            for layer in split.fast_layers:
                layer.plan = None
            split.plans.planned = False  # the per-op path
            b = _forward(split, ids, [1, 2, 4, 16, 3], cut)
            for layer, plan in zip(split.fast_layers, plans):
                layer.plan = plan
            split.plans.planned = was
            assert torch.equal(a, b), f"{arch} {weights} cut {cut}: max abs {(a - b).abs().max().item():.2e}"
    assert bool(calls) == (arch != "gemma3_text")


def test_a_layer_plan_whose_linears_do_not_chain_is_a_clear_error():
    """The compiled layer runs its kernels on raw pointers (``selfspec/kernels/step.cpp``), so its plan checks once,
    when made, that its linears and norms fit one another (a mismatch would otherwise read past a buffer): the
    layer's own plan is made, and the same plan with two linears swapped is an error naming the problem."""
    split = SplitModel(tiny_model("llama"), "fast")
    layer = split.fast_layers[0]
    assert layer.plan is not None
    ops, empty = layer.ops, torch.empty(0)
    qkv, o, gate_up, down = (lin.kernel_plan(ops) for lin in layer.linears)
    rest = (layer.input_norm.weight, layer.input_norm.eps, layer.post_attn_norm.weight, layer.post_attn_norm.eps,
            empty, 0.0, empty, 0.0, layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.window, layer.scaling)
    assert ops.LayerPlan(qkv, o, gate_up, down, *rest) is not None
    with pytest.raises(RuntimeError, match="must chain"):
        ops.LayerPlan(qkv, down, gate_up, o, *rest)


def test_unknown_backend_is_a_clear_error():
    from selfspec.errors import InvalidConfigError

    with pytest.raises(InvalidConfigError, match="unknown backend 'fastest'"):
        SplitModel(tiny_model("llama"), "fastest")


@pytest.mark.slow
def test_fast_logits_match_reference_on_default_model(default_ss):
    fast = default_ss.split
    ref = SplitModel(default_ss.model, "reference")
    ids = torch.tensor([default_ss.encode("The quick brown fox jumps over the lazy dog. " * 6)])
    with torch.inference_mode():
        a = _forward(fast, ids, [1, 4, 8, 16], 4)
        b = _forward(ref, ids, [1, 4, 8, 16], 4)
    diff = (a - b).abs().max().item()
    assert diff < 5e-3, f"max abs logit difference {diff:.2e}"
    assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "qwen3"])
def test_layer_head_fast_block_matches_its_module(arch):
    """The trained 'layer' head runs its block as a FastLayer at inference (packed weights, rebuilt when
    training changes them); its logits match the transformers module's, step by step with its cache."""
    from selfspec.heads.io import new_head

    split = SplitModel(tiny_model(arch), "fast")
    head = new_head("layer", split, 2)
    g = torch.Generator().manual_seed(3)
    h = torch.randn(1, 12, split.hidden_size, generator=g)

    def run(grad: bool) -> torch.Tensor:
        state = head.new_state(16)
        with torch.set_grad_enabled(grad):
            outs = [head(h[:, :5], torch.arange(5)[None], state)]
            outs += [head(h[:, i : i + 1], torch.tensor([[i]]), state) for i in range(5, 12)]
        return torch.cat(outs, dim=1).detach()

    ref, fast = run(True), run(False)  # grad on: the module; off: the fast block
    assert head._fast is not None
    assert (ref - fast).abs().max().item() < 1e-4
    with torch.no_grad():
        w = head.block.mlp.down_proj.weight  # changed in place as an optimizer step would: the copy is rebuilt
        w.add_(torch.randn(w.shape, generator=g) * w.abs().mean())
    ref2, fast2 = run(True), run(False)
    assert (ref2 - fast2).abs().max().item() < 1e-4
    assert (ref2 - ref).abs().max().item() > 1e-3


@pytest.mark.parametrize("arch", ARCHS)
def test_ragged_batch_forward_equals_each_sequence_alone(arch):
    """run_layers_batch: three sequences of different lengths step together with different numbers of new
    tokens (1, 3, 2; 16 rows in all in the second step), each through its own cache; every sequence's states,
    logits and cache equal its own run_layers, on both backends."""
    model = tiny_model(arch)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, VOCAB, (1, p), generator=g) for p in (5, 11, 2)]
    steps = [[1, 3, 2], [4, 7, 5], [9, 6, 4]]  # 6, 16 (the fused path) and 19 rows
    news = [[torch.randint(2, VOCAB, (1, n), generator=g) for n in sizes] for sizes in steps]
    for backend in ("fast", "reference"):
        split = SplitModel(model, backend)
        with torch.inference_mode():
            alone = [split.new_cache(40) for _ in prompts]
            batch = [split.new_cache(8) for _ in prompts]  # too small: the batched steps grow them
            for ids, c1, c2 in zip(prompts, alone, batch):
                pos = torch.arange(ids.shape[1])[None]
                split.run_layers(split.embed(ids), 0, split.num_layers, pos, c1)
                split.run_layers(split.embed(ids), 0, split.num_layers, pos, c2)
            for new in news:
                pos = [torch.arange(c.lengths[0], c.lengths[0] + x.shape[1])[None] for c, x in zip(alone, new)]
                ref = [split.logits(split.run_layers(split.embed(x), 0, split.num_layers, p, c))
                       for x, p, c in zip(new, pos, alone)]
                cut = 1  # a shallow and a deep pass, as self-speculation runs them
                hs = split.run_layers_batch([split.embed(x) for x in new], 0, cut, pos, batch)
                hs = split.run_layers_batch(hs, cut, split.num_layers, pos, batch)
                for j, (h, r) in enumerate(zip(hs, ref)):
                    torch.testing.assert_close(split.logits(h), r, atol=1e-4, rtol=1e-4, msg=f"{arch} {backend} seq {j}")
            for c1, c2 in zip(alone, batch):
                assert c1.lengths == c2.lengths
                for i in range(split.num_layers):
                    n = c1.lengths[i]
                    torch.testing.assert_close(c2.keys[i][:, :, :n], c1.keys[i][:, :, :n], atol=1e-5, rtol=1e-5)
                    torch.testing.assert_close(c2.values[i][:, :, :n], c1.values[i][:, :, :n], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("weights", ["float32", "Q4_1"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_a_batched_stage_on_the_plan_is_the_per_op_path_bit_for_bit(arch, weights, monkeypatch):
    """Several sequences' causal blocks through a range of layers in one call of the plan (``StepPlans.run_batch``,
    16 rows or fewer in all): their states and every cache entry equal the per-op path's (``forward_segments``)
    exactly; more than 16 rows, or a tree, take the per-op path."""
    from selfspec.models.plans import StepPlans
    from selfspec.quant.convert import quantize_model

    model = tiny_model(arch) if weights == "float32" else quantize_model(tiny_model(arch), weights)
    split = SplitModel(model, "fast")
    assert split.plans is not None and split.plans.planned
    calls: list[int] = []
    real = StepPlans.run_batch
    monkeypatch.setattr(StepPlans, "run_batch", lambda self, hs, *a: calls.append(sum(h.shape[1] for h in hs))
                        or real(self, hs, *a))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, VOCAB, (1, p), generator=g) for p in (5, 11, 2)]
    runs = []
    for planned in (True, False):
        split.plans.planned = planned
        caches = [split.new_cache(8) for _ in prompts]  # too small: the batched steps grow them
        states = []
        with torch.inference_mode():
            for ids, c in zip(prompts, caches):
                split.run_layers(split.embed(ids), 0, split.num_layers, torch.arange(ids.shape[1])[None], c)
            for sizes in ([1, 3, 2], [4, 7, 5], [9, 6, 4], [1, 1, 1]):  # 6, 16, 19 (per op) and 3 rows
                new = [torch.randint(2, VOCAB, (1, n), generator=torch.Generator().manual_seed(n)) for n in sizes]
                pos = [torch.arange(c.lengths[0], c.lengths[0] + n)[None] for c, n in zip(caches, sizes)]
                hs = split.run_layers_batch([split.embed(x) for x in new], 0, 1, pos, caches)
                hs = split.run_layers_batch(hs, 1, split.num_layers, pos, caches)
                states.append([h.clone() for h in hs])
        runs.append((states, caches))
    split.plans.planned = True
    (a, ca), (b, cb) = runs
    assert all(torch.equal(x, y) for sa, sb in zip(a, b) for x, y in zip(sa, sb))
    for c1, c2 in zip(ca, cb):
        assert c1.lengths == c2.lengths
        for i in range(split.num_layers):
            n = c1.lengths[i]
            assert torch.equal(c1.keys[i][:, :, :n], c2.keys[i][:, :, :n])
            assert torch.equal(c1.values[i][:, :, :n], c2.values[i][:, :, :n])
    assert 6 in calls and 16 in calls and 3 in calls


@pytest.mark.parametrize("b,n,hq,hkv,d,start,window", [
    (1, 1, 14, 2, 64, 200, 0), (1, 4, 14, 2, 64, 255, 0), (2, 3, 9, 3, 64, 30, 0), (1, 8, 14, 2, 64, 100, 16),
    (1, 16, 4, 1, 32, 5, 0), (1, 5, 8, 8, 128, 40, 7), (1, 1, 9, 3, 64, 0, 0), (1, 13, 6, 2, 80, 3, 0),
    (1, 3, 9, 3, 64, 700, 0), (1, 2, 4, 2, 128, 333, 100), (1, 1, 4, 1, 64, 17, 0),
    (1, 70, 14, 2, 64, 0, 0), (1, 41, 9, 3, 64, 0, 16)])  # the last two: prefills (from position 0; a window)
def test_fused_attention_matches_softmax_and_rows_do_not_interact(b, n, hq, hkv, d, start, window):
    """ops.attention (a decoding block of up to 16 rows: each row and query head with its keys in vector lanes, a
    KV head's query heads and rows sharing its reads; a prefill: the query rows of a KV head in the lanes; its own
    exp): equal to softmax attention in float64 up to float rounding, and each row of a decoding block bitwise the
    row of a single-query call at that position (what lets a verification block stand for single steps in the int8
    mode), whatever the thread count (the work is split by rows and heads to fit the threads). A prefill's rows may
    take the other kernel than single steps: equal to them up to rounding."""
    from selfspec.kernels.build import cpu_extension

    ops = cpu_extension()
    g = torch.Generator().manual_seed(n * 100 + start)
    cap = start + n + 3
    q, keys, values = (torch.randn(*s, generator=g) for s in ((b, n, hq, d), (b, hkv, cap, d), (b, hkv, cap, d)))
    scale = d ** -0.5
    out = ops.attention(q, keys, values, start, window, scale)
    if n <= 16:  # a decoding block's work is split by rows and heads to fit the threads: no bit depends on it
        threads = torch.get_num_threads()
        try:
            for t in (1, 2, 3):
                torch.set_num_threads(t)
                assert torch.equal(ops.attention(q, keys, values, start, window, scale), out), t
        finally:
            torch.set_num_threads(threads)
    group = hq // hkv
    for i in range(n):
        pos = start + i
        lo = max(0, pos - window + 1) if window else 0
        k, v = keys[:, :, lo : pos + 1].double(), values[:, :, lo : pos + 1].double()
        for h in range(hq):
            p = torch.softmax(torch.einsum("bd,bjd->bj", q[:, i, h].double(), k[:, h // group]) * scale, -1)
            ref = torch.einsum("bj,bjd->bd", p, v[:, h // group]).float()
            torch.testing.assert_close(out[:, i, h * d : (h + 1) * d], ref, atol=2e-6, rtol=1e-5)
        one = ops.attention(q[:, i : i + 1].contiguous(), keys, values, pos, window, scale)
        if n <= 16:
            assert torch.equal(one[:, 0], out[:, i])
        else:
            torch.testing.assert_close(one[:, 0], out[:, i], atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("shape", [(1, 151936), (8, 4099), (3, 49152), (1, 1), (2, 17), (1, 33)])
def test_argmax_rows_is_torch_argmax(shape):
    """ops.argmax_rows (greedy picks): torch.argmax's index on random rows, ties (the first wins), a NaN (the first
    NaN wins), all -inf / +inf, -0.0 beside 0.0; and sampling.greedy takes it."""
    from selfspec.kernels.build import cpu_extension
    from selfspec.sampling import greedy

    ops = cpu_extension()
    g = torch.Generator().manual_seed(shape[1])
    for _ in range(4):
        x = torch.randn(*shape, generator=g)
        assert torch.equal(ops.argmax_rows(x), x.argmax(-1))
        x[:, -1] = x.max(-1).values
        assert torch.equal(ops.argmax_rows(x), x.argmax(-1))
        x[0, int(torch.randint(0, shape[1], (1,), generator=g))] = float("nan")
        assert torch.equal(ops.argmax_rows(x), x.argmax(-1))
        assert torch.equal(greedy(x), x.argmax(-1)) and greedy(x[0]).shape == ()
    for fill in (float("-inf"), float("inf"), 0.0):
        x = torch.full(shape, fill)
        x[:, shape[1] // 2] = -0.0 if fill == 0.0 else fill
        assert torch.equal(ops.argmax_rows(x), x.argmax(-1))
