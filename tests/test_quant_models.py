"""Quantized models are lossless: the engine over block-quantized weights gives transformers' greedy
output on the same (dequantized) weights, for every block type, every architecture, chains and trees;
a GGUF loaded natively is the float32 conversion's model token for token; bad files get clear errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import ARCHS, LAYERS, VOCAB, hf_greedy, tiny_config, tiny_model
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from test_quant import random_tensor

from selfspec import DraftConfig, SelfSpec
from selfspec.config import ModelConfig
from selfspec.errors import InvalidConfigError, ModelNotFoundError
from selfspec.quant import weight
from selfspec.quant.convert import QUANTIZE_TYPES, quantize_model
from selfspec.quant.modules import QuantEmbedding, QuantLinear
from selfspec.quant.store import assemble, empty_model
from selfspec.quant.weight import GEMM_ROWS, QuantWeight

NEW = 20


def prompt_of(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (n,), generator=g).tolist()


def k_quant_model(type_name: str):
    """A tiny Llama whose matrices (K a multiple of 256) are random blocks of a K-quant type."""
    from transformers import LlamaConfig

    cfg = tiny_config("llama").to_dict()
    cfg.update(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    config = LlamaConfig(**cfg)
    quant, floats = {}, {}
    for i, (name, p) in enumerate(empty_model(config).named_parameters()):
        module, _, kind = name.rpartition(".")
        if kind == "weight" and p.dim() == 2 and p.shape[1] % 256 == 0:
            raw = random_tensor(type_name, p.shape[0], p.shape[1], seed=i)
            blocks = raw.reshape(-1, GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][1])
            d = (np.random.default_rng(i).standard_normal((len(blocks), 2)) * 5e-5).astype(np.float16)
            if type_name == "Q6_K":
                blocks[:, 208:210] = d[:, :1].view(np.uint8)  # d
            else:
                blocks[:, 0:4] = d.view(np.uint8)  # d, dmin
            quant[module] = QuantWeight.from_gguf(raw, type_name, p.shape[1])
        else:
            floats[name] = torch.ones(p.shape) if "norm" in name else torch.randn(p.shape) * 0.2
    model = assemble(empty_model(config), quant, floats, "random blocks")
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    return model


def check_lossless(model, trees: bool = True) -> None:
    """A short prompt (the kernels' prefill) and one past GEMM_ROWS (the GEMM or panel prefill, forced whatever this
    machine measured): plain and speculative decoding equal transformers' greedy generate."""
    ss = SelfSpec(model, None)
    assert ss.split.kernel == "selfspec-quant"
    if ss.split.screen is not None:  # its bound table built by the draft setup, not in the first screened request
        assert ss.split.screen._table is not None
    for prompt in (prompt_of(9, 1), prompt_of(GEMM_ROWS + 21, 4)):
        ref = hf_greedy(model, prompt, NEW)  # transformers' forward over the dequantized weights
        assert ss.generate(prompt, method="plain", max_new_tokens=NEW).token_ids == ref, len(prompt)
        for k in (1, LAYERS - 1):
            for gamma, tree in ((3, 0), (5, 3 if trees else 0)):
                ss.set_draft(DraftConfig(exit_layer=k, head="lm", gamma=gamma, policy="fixed", tree_width=tree))
                assert ss.generate(prompt, max_new_tokens=NEW).token_ids == ref, (len(prompt), k, gamma, tree)
    if ss.split.screen is not None:  # AVX-512 VNNI builds: greedy blocks of 3-8 rows went through the LM head's screen
        assert ss.split.screen.calls > 0


@pytest.fixture(params=["panels", "torch"])
def gemm_prefill(monkeypatch, request):
    """Prefills of PANEL_ROWS rows or more take the panels, or from GEMM_ROWS torch's GEMM on tiles, whatever this
    machine measured."""
    monkeypatch.setattr(weight, "prefill_path", lambda type_name: request.param)


@pytest.mark.parametrize("type_name", QUANTIZE_TYPES)
def test_every_legacy_type_is_lossless(type_name, one_thread, gemm_prefill):
    model = quantize_model(tiny_model("llama"), type_name)
    assert isinstance(model.model.layers[0].mlp.down_proj, QuantLinear)
    assert isinstance(model.model.embed_tokens, QuantEmbedding)
    check_lossless(model)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K"])
def test_every_k_quant_is_lossless(type_name, one_thread, gemm_prefill):
    model = k_quant_model(type_name)
    assert model.model.layers[1].mlp.down_proj.qweight.type_name == type_name
    check_lossless(model, trees=False)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_architecture_quantized_is_lossless(arch, one_thread, gemm_prefill):
    check_lossless(quantize_model(tiny_model(arch), "Q4_0" if arch != "phi3" else "Q8_0"))


@pytest.mark.parametrize("heads,kv_heads", [(14, 2), (4, 1)])
def test_grouped_query_shapes_quantized_are_lossless(heads, kv_heads):
    """Qwen2.5-0.5B's 7 query heads a key/value head, and a single key/value head, on 2 threads: a decoding block's
    attention takes a KV head's query heads together, split by rows and heads to fit the threads
    (attention.cpp attend_decode); greedy output stays transformers'."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = tiny_config("qwen2").to_dict()
    cfg.update(hidden_size=32 * heads, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=32)
    torch.manual_seed(1234)
    m = AutoModelForCausalLM.from_config(Qwen2Config(**cfg), attn_implementation="sdpa", dtype=torch.float32)
    m.generation_config.eos_token_id, m.generation_config.pad_token_id = None, 0
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        check_lossless(quantize_model(m.eval().requires_grad_(False), "Q8_0"), trees=False)
    finally:
        torch.set_num_threads(threads)


def test_quantize_at_load_is_cached_and_refuses_a_gguf(tmp_path, monkeypatch, one_thread):
    from conftest import tiny_tokenizer

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    tiny_model("qwen2").save_pretrained(tmp_path / "m")
    tiny_tokenizer().save_pretrained(tmp_path / "m")
    ss = SelfSpec.load(ModelConfig(model=str(tmp_path / "m"), quantize="Q5_1"), DraftConfig(head="lm", tune="off"))
    assert ss.model.model.layers[0].self_attn.q_proj.qweight.type_name == "Q5_1"
    assert list((tmp_path / "cache" / "packed").glob("*/packed.safetensors"))
    import transformers

    def no_float_model(*args, **kwargs):
        raise AssertionError("a cached quantized load read the float model")

    with monkeypatch.context() as m:  # a cache hit builds the lean tree over the packed weights, nothing else
        m.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_float_model)
        again = SelfSpec.load(ModelConfig(model=str(tmp_path / "m"), quantize="Q5_1"),
                              DraftConfig(head="lm", tune="off"))
    assert type(again.model).__name__ == "LeanCausalLM"
    assert again.model.generation_config.to_dict() == ss.model.generation_config.to_dict()
    w = ss.model.model.layers[2].mlp.up_proj.weight
    assert torch.equal(again.model.model.layers[2].mlp.up_proj.weight, w)  # from the cache, the same values
    prompt = prompt_of(7, 2)
    ref = hf_greedy(ss.model, prompt, NEW, ss.eos_token_ids)
    assert again.generate(prompt, max_new_tokens=NEW).token_ids == ref
    assert hf_greedy(again.model, prompt, NEW, again.eos_token_ids) == ref
    with pytest.raises(InvalidConfigError, match="already quantized"):
        SelfSpec.load(ModelConfig(quantize="Q4_0"))


@pytest.mark.slow
def test_truncated_gguf_is_a_clear_error(tmp_path):
    from selfspec.models.loading import default_gguf_path

    bad = tmp_path / "cut.gguf"
    bad.write_bytes(default_gguf_path().read_bytes()[:1_000_000])
    with pytest.raises(ModelNotFoundError, match="cut.gguf"):
        SelfSpec.load(str(bad))


@pytest.mark.slow
def test_default_gguf_native_equals_float32_conversion(default_ss):
    """The real model, loaded natively (the default), against transformers' generate on the float32
    conversion of the same file (a separate float32 model): the same tokens, with the bundled head."""
    from selfspec.models.loading import load_model

    assert default_ss.split.kernel == "selfspec-quant"
    ref_model, _ = load_model(ModelConfig(dtype="float32"))
    assert torch.equal(ref_model.model.layers[5].self_attn.k_proj.weight,
                       default_ss.model.model.layers[5].self_attn.k_proj.qweight.dense())  # Llama's q/k row order
    for text in ("Tell me about volcanoes.", "Write a haiku about the sea."):
        ids = default_ss.encode([{"role": "user", "content": text}])
        ref = hf_greedy(ref_model, ids, 32, default_ss.eos_token_ids)
        assert default_ss.generate(ids, max_new_tokens=32).token_ids == ref
        assert default_ss.generate(ids, max_new_tokens=32, method="plain").token_ids == ref


@pytest.mark.slow
def test_bench_forward_reports_the_quantized_path(tmp_path, one_thread):
    import json
    from pathlib import Path

    from selfspec.bench.forward import ForwardBenchConfig, run
    from selfspec.bench.forward_report import format_tables

    float_ss = SelfSpec(tiny_model("llama"), None, DraftConfig(gamma=2))
    ss = SelfSpec(quantize_model(tiny_model("llama"), "Q4_0"), None, DraftConfig(gamma=2))
    cfg = ForwardBenchConfig(block_sizes=[1, 4], contexts=[8], reps=1, bandwidth_mb=8, backends=["fast"],
                             out=str(tmp_path / "fwd.json"), plot="")
    res = run(ModelConfig(), cfg, ss=ss)
    saved = json.loads(Path(cfg.out).read_text())
    assert saved["kernels"] == {"fast": "selfspec-quant"}
    # Q4_0 packs 4-bit codes plus a float32 scale per 32 weights: fewer bytes than float32's 4 per weight
    float_bytes = run(ModelConfig(), cfg, ss=float_ss)["bytes"]["full"]
    assert 0 < saved["bytes"]["full"] < float_bytes / 4
    assert saved["memory"]["rss_after_load_mb"] > 0
    assert all(f["gflops"] > 0 for f in saved["figures"])
    kf = saved["quantized_kernels"]
    assert {f["type"] for f in kf} == {"Q4_0"} and {f["n"] for f in kf} == {1, 4}
    assert all(f["ms"] > 0 and f["gbps"] > 0 and f["gflops"] > 0 for f in kf)
    assert "quantized kernels" in format_tables(res) and "resident memory after load" in format_tables(res)


def test_no_kernels_is_a_clear_error_not_a_slow_path(monkeypatch):
    from selfspec.kernels import linear

    model = quantize_model(tiny_model("llama"), "Q8_0")
    monkeypatch.setattr(linear, "cpu_extension", lambda: None)
    with pytest.raises(linear.KernelUnavailableError, match="dtype='float32'"):
        SelfSpec(model, None)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3_text"])
def test_int8_numerics_speculation_equals_its_own_plain_decoding(arch, one_thread):
    """In the opt-in 8-bit activation mode the target is selfspec's own plain decoding in that mode: every
    draft configuration must give exactly its tokens (and the mode must really change the numerics)."""
    from selfspec.quant.modules import set_numerics

    exact = SelfSpec(quantize_model(tiny_model(arch), "Q4_1"), None)
    model = set_numerics(quantize_model(tiny_model(arch), "Q4_1"), "int8")
    ss = SelfSpec(model, None)
    assert ss.split.kernel == "selfspec-quant-int8"
    x = torch.randn(1, 3, 64)
    assert not torch.equal(ss.split.fast_layers[0].qkv(x), exact.split.fast_layers[0].qkv(x))
    for plen, seed in ((9, 1), (17, 2)):
        prompt = prompt_of(plen, seed)
        ref = ss.generate(prompt, method="plain", max_new_tokens=NEW).token_ids
        for k in (1, LAYERS - 1):
            for gamma, tree in ((2, 0), (4, 0), (4, 3)):
                ss.set_draft(DraftConfig(exit_layer=k, head="lm", gamma=gamma, policy="fixed", tree_width=tree))
                assert ss.generate(prompt, max_new_tokens=NEW).token_ids == ref, (k, gamma, tree)


def test_int8_numerics_needs_quantized_weights():
    from selfspec.quant.modules import set_numerics

    with pytest.raises(InvalidConfigError, match="needs quantized weights"):
        set_numerics(tiny_model("llama"), "int8")


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_packed_weights_are_held_once(tmp_path, monkeypatch, one_thread):
    """Resident memory: after a load, from the packed cache or when it is first written, every packed
    weight lies in the one buffer the cache file was read into (``mmap=True``: the file's mapped pages), and the
    fused projections the fast layers run are views of them (no second copy of any packed weight); no quantized
    module holds a dense float32 copy, even after decoding, and no KV cache is made before a request."""
    from conftest import tiny_tokenizer

    from selfspec.bench.forward_memory import memory_breakdown

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    tiny_model("llama").save_pretrained(tmp_path / "m")
    tiny_tokenizer().save_pretrained(tmp_path / "m")
    for mmap in (False, False, True):  # writes the cache, reads it, maps it
        ss = SelfSpec.load(ModelConfig(model=str(tmp_path / "m"), quantize="Q4_1", mmap=mmap),
                           DraftConfig(head="lm", gamma=3, exit_layer=1))
        attn, mlp = ss.model.model.layers[1].self_attn, ss.model.model.layers[1].mlp
        qkv, gate_up = ss.split.fast_layers[1].qkv._quant[0][0], ss.split.fast_layers[1].gate_up._quant[0][0]
        assert qkv.shape[0] == attn.q_proj.out_features + attn.k_proj.out_features + attn.v_proj.out_features
        for fused, parts in ((qkv, (attn.q_proj, attn.k_proj, attn.v_proj)), (gate_up, (mlp.gate_proj, mlp.up_proj))):
            for t in ("codes", "scales", "offsets"):
                assert getattr(fused, t).data_ptr() == getattr(parts[0].qweight, t).data_ptr()
                assert {_storage(getattr(p.qweight, t)) for p in parts} == {_storage(getattr(fused, t))}
        assert memory_breakdown(ss, 0.0)["kv_cache_mb"] == 0  # no KV cache made at load: requests make theirs
        ss.generate(prompt_of(7, 3), max_new_tokens=8)
        mem = memory_breakdown(ss, 0.0)
        where = "packed_mapped_mb" if mmap else "packed_pages_mb"
        assert mem[where] == mem["packed_mb"] > 0  # all of it in the file's pages, or in the one buffer: no copy
        assert mem["dense_copies_mb"] == 0
        assert all(m._dense is None for m in ss.model.modules() if isinstance(m, QuantLinear))


def test_lean_tokenizer_keeps_outputs(tmp_path):
    """Dropping a BPE tokenizer class's Python copies of its vocabulary and merges (to save memory) changes
    nothing it encodes, decodes, templates or saves."""
    from transformers import AutoTokenizer, Qwen2Tokenizer

    from selfspec.models.loading import lean_tokenizer

    chars = list("abcdefghijklmnopqrstuvwxyz .,\u0120")
    vocab = {c: i for i, c in enumerate(chars)} | {"ab": len(chars), "abc": len(chars) + 1, "<|endoftext|>": len(chars) + 2}
    tok = Qwen2Tokenizer(vocab=vocab, merges=[("a", "b"), ("ab", "c")])
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    text, msgs = "abc cab, bca.", [{"role": "user", "content": "abc ab"}]

    def outputs(t):
        ids = t.encode(text)
        return ids, t.decode(ids), t.apply_chat_template(msgs), len(t), t.get_vocab()

    before = outputs(tok)
    assert isinstance(tok._vocab, dict) and tok._merges
    lean_tokenizer(tok)
    assert tok._vocab is None and tok._merges is None
    assert outputs(tok) == before
    tok.save_pretrained(tmp_path / "t")
    assert outputs(AutoTokenizer.from_pretrained(tmp_path / "t")) == before


def test_greedy_ids_are_the_logits_argmax(one_thread):
    """split.greedy_ids (a greedy verification's argmax: the int8 screen for 3-8 rows on VNNI builds) equals the
    logits' argmax for every row count, and a non-finite state falls back to the logits."""
    ss = SelfSpec(quantize_model(tiny_model("llama"), "Q8_0"), None)
    split = ss.split
    assert split.lm_head.qweight is not None
    h = torch.randn(1, 12, split.hidden_size, generator=torch.Generator().manual_seed(0)) * 3
    for rows in range(1, 13):
        assert torch.equal(split.greedy_ids(h[:, :rows]), split.logits(h[:, :rows]).argmax(-1)), rows
    h[0, 1, 3] = float("inf")
    assert torch.equal(split.greedy_ids(h[:, :4]), split.logits(h[:, :4]).argmax(-1))


@pytest.mark.parametrize("quantize", [None, "Q5_0"])
def test_a_greedy_step_takes_the_final_norm_lm_head_and_argmax_in_one_call(one_thread, quantize):
    """For the rows the screen does not take, ``greedy_ids`` is one compiled call (the plan's argmax: the final norm,
    the LM head, the argmax), and its ids are the logits' argmax bit for bit, 1-16 rows; the final norm is the
    compiled RMSNorm every fast layer uses. Past 16 rows, or without the compiled call, the unfused path."""
    model = tiny_model("qwen2") if quantize is None else quantize_model(tiny_model("qwen2"), quantize)
    split = SelfSpec(model, None).split
    ops = split.fast_layers[0].ops
    assert split.plans is not None and split.plans.has_head
    calls: list[int] = []
    real = split.plans.argmax
    split.lm.plan_argmax = lambda h: calls.append(h.shape[0]) or real(h)
    h = torch.randn(1, 20, split.hidden_size, generator=torch.Generator().manual_seed(1)) * 3
    with torch.inference_mode():
        norm = split.lm.fast_norm
        assert torch.equal(split.final_norm(h), ops.rms_norm(h, norm.weight, norm.eps))
        for rows in (1, 2, 5, 16, 20):
            assert torch.equal(split.greedy_ids(h[:, :rows]), split.logits(h[:, :rows]).argmax(-1)), rows
    screened = [r for r in (1, 2, 5, 16) if split.screen is not None and split.screen.covers(r)]
    assert calls == [r for r in (1, 2, 5, 16) if r not in screened]


def test_the_numerics_in_use_are_described_at_load(capsys):
    from selfspec.quant.modules import set_numerics

    exact = SelfSpec(quantize_model(tiny_model("llama"), "Q4_0"), None, DraftConfig(exit_layer=2, head="lm", gamma=2))
    line = exact.describe()
    assert "kernel selfspec-quant," in line and "numerics exact (float32 activations" in line
    assert "weights Q4_0" in line and ("AVX-512 build" in line or "AVX2 build" in line)
    int8 = SelfSpec(set_numerics(quantize_model(tiny_model("llama"), "Q4_0"), "int8"), None,
                    DraftConfig(exit_layer=2, head="lm", gamma=2))
    assert "numerics int8 (activations rounded to 8 bits" in int8.describe() and "Q4_0+int8" in int8.describe()
    plain = SelfSpec(tiny_model("llama"), None, DraftConfig(exit_layer=2, head="lm", gamma=2)).describe()
    assert "numerics" not in plain and "dtype float32" in plain
