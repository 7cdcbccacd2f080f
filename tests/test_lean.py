"""The lean model tree (selfspec.models.lean): a GGUF run natively without transformers' model code. On every
architecture it holds the same weights under the same names as transformers' model, the engine gives the same
tokens over it, its norms and rotary tables are transformers' bit for bit, and where transformers' math is needed
(generate, an exit head's trainable layer) transformers' own modules run over the very same weights."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import ARCHS, LAYERS, VOCAB, hf_greedy, tiny_config, tiny_model
from test_quant_models import prompt_of

from selfspec import DraftConfig, SelfSpec
from selfspec.models.configs import plain_config, transformers_config
from selfspec.models.lean import LeanCausalLM, lean_model, lean_supported, transformers_model
from selfspec.quant.convert import quantize_parts
from selfspec.quant.store import assemble, empty_model


def _plain(arch: str, tmp_path) -> object:
    """The tiny config as a load from the packed cache reads it: saved, then read as the base config class."""
    tiny_config(arch).save_pretrained(tmp_path)
    return plain_config(tmp_path / "config.json")


def _pair(arch: str, tmp_path, type_name: str = "Q8_0"):
    """(lean tree, transformers' tree) holding the same quantized weights of the tiny model."""
    config = _plain(arch, tmp_path)
    assert lean_supported(config)
    lean = assemble(lean_model(config), *quantize_parts(tiny_model(arch), type_name), "tiny")
    full = assemble(empty_model(tiny_config(arch)), *quantize_parts(tiny_model(arch), type_name), "tiny")
    for m in (lean, full):
        m.generation_config.eos_token_id, m.generation_config.pad_token_id = None, 0
    return lean, full


@pytest.mark.parametrize("arch", ARCHS)
def test_plain_config_round_trips_to_the_architectures_class(arch, tmp_path):
    config = _plain(arch, tmp_path)
    assert type(config).__name__ == "PreTrainedConfig" and config.model_type == arch
    real = transformers_config(config)
    assert type(real) is type(tiny_config(arch)) and real.model_type == arch
    assert real.__dict__ == type(real).from_pretrained(tmp_path).__dict__


@pytest.mark.parametrize("arch", ARCHS)
def test_same_names_norms_and_rotary_as_transformers(arch, tmp_path):
    lean, full = _pair(arch, tmp_path)
    assert [n for n, _ in lean.named_parameters()] == [n for n, _ in full.named_parameters()]
    assert all(torch.equal(a, b) for a, b in zip(lean.parameters(), full.parameters()))
    h = torch.randn(1, 5, 64)
    pos = torch.tensor([[0, 3, 7, 100, 255]])
    kinds = sorted(set(tiny_config(arch).layer_types)) if arch == "gemma3_text" else [None]
    for kind in kinds:
        args = (h, pos, kind) if kind else (h, pos)
        for a, b in zip(lean.model.rotary_emb(*args), full.model.rotary_emb(*args)):
            assert torch.equal(a, b)
    assert torch.equal(lean.model.norm(h), full.model.norm(h))
    assert torch.equal(lean.model.layers[1].post_attention_layernorm(h), full.model.layers[1].post_attention_layernorm(h))
    ids = torch.tensor([[3, 9, 0, VOCAB - 1]])
    assert torch.equal(lean.model.embed_tokens(ids), full.model.embed_tokens(ids))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_engine_over_the_lean_tree_is_lossless(arch, tmp_path, one_thread):
    """Plain and speculative decoding over the lean tree give transformers' greedy tokens, and the fast layers
    give the same logits as over transformers' tree; the lean model's own generate is transformers'."""
    lean, full = _pair(arch, tmp_path)
    prompt = prompt_of(11, 2)
    ref = hf_greedy(full, prompt, 16)
    assert hf_greedy(lean, prompt, 16) == ref  # transformers' CausalLM over the same weights
    assert isinstance(lean, LeanCausalLM) and transformers_model(full) is full
    ss = SelfSpec(lean, None)
    assert ss.split.kernel == "selfspec-quant"
    assert ss.generate(prompt, method="plain", max_new_tokens=16).token_ids == ref
    ss.set_draft(DraftConfig(exit_layer=1, head="lm", gamma=3, policy="fixed"))
    assert ss.generate(prompt, max_new_tokens=16).token_ids == ref
    split_full = SelfSpec(full, None).split
    x = torch.tensor([prompt])
    pos = torch.arange(len(prompt))[None]
    a = ss.split.logits(ss.split.forward_all(x, pos, ss.split.new_cache(32)))
    b = split_full.logits(split_full.forward_all(x, pos, split_full.new_cache(32)))
    assert torch.equal(a, b)
    ref_split = SelfSpec(lean, None, backend="reference").split  # transformers' layers over the lean weights
    c = ref_split.logits(ref_split.forward_all(x, pos, ref_split.new_cache(32)))
    d = SelfSpec(full, None, backend="reference").split
    assert torch.equal(c, d.logits(d.forward_all(x, pos, d.new_cache(32))))


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text"])
def test_a_layer_heads_block_trains_through_transformers_layer(arch, tmp_path, one_thread):
    """An exit head copies a lean layer; its forward with gradients is transformers' decoder layer over the copy's
    own float weights (the target's stay quantized and untouched), and a training step changes the copy only."""
    from selfspec.heads.layer import DecoderLayerHead

    lean, full = _pair(arch, tmp_path)
    head = DecoderLayerHead(SelfSpec(lean, None).split, 2)
    ref = DecoderLayerHead(SelfSpec(full, None).split, 2)
    assert type(head.block).__name__ == "LeanDecoderLayer"
    h = torch.randn(1, 6, 64)
    pos = torch.arange(6)[None]
    with torch.no_grad():
        assert torch.equal(head(h, pos), ref(h, pos))
    before = lean.model.layers[2].self_attn.q_proj.qweight.dense().clone()
    q = head.block.self_attn.q_proj.weight
    old = q.detach().clone()
    head.train()
    opt = torch.optim.SGD(head.parameters(), lr=0.1)
    head(h, pos).logsumexp(-1).mean().backward()
    assert q.grad is not None and q.grad.abs().sum() > 0
    opt.step()
    assert not torch.equal(q.detach(), old)
    assert torch.equal(lean.model.layers[2].self_attn.q_proj.qweight.dense(), before)
    head.eval()
    with torch.no_grad():  # the changed weights are what the layer now runs (its transformers twin follows)
        assert not torch.equal(head(h, pos), ref(h, pos))


@pytest.mark.slow
def test_loading_a_gguf_imports_no_model_code():
    """The default model from its packed cache: no transformers model code, torch._dynamo or accelerate imported
    by a load and a generate (they cost ~130 MB resident and seconds)."""
    code = """
import sys
from selfspec import SelfSpec
ss = SelfSpec.load()
ss.generate(ss.tokenizer("Hello there").input_ids, max_new_tokens=4)
print(type(ss.model).__name__, [m for m in ("transformers.modeling_utils", "torch._dynamo", "accelerate",
      "transformers.activations") if m in sys.modules])
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True)
    assert out.stdout.split("\n")[-2] == "LeanCausalLM []", out.stdout + out.stderr


def test_unlisted_rope_types_keep_transformers_tree(tmp_path):
    config = _plain("llama", tmp_path)
    config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    assert not lean_supported(config)
    with pytest.raises(ValueError, match="no lean tree"):
        lean_model(config)
    assert LAYERS == len(empty_model(config).model.layers)  # the base config class converted for transformers
