"""selfspec.bench.synthetic: a GGUF of a shape nobody ships, with Q4_K_M's type choice, loads and decodes as a real
file does, and its packed K-quant weights are exactly the file's (gguf-py's dequantize)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGUFReader, dequantize

from selfspec import DraftConfig, SelfSpec
from selfspec.bench.synthetic import Shape, more_bits, q4_k_m_type, write_synthetic
from selfspec.models.loading import default_gguf_path
from selfspec.quant.packing import factored_k_scales

TINY = Shape(hidden=256, intermediate=512, layers=3, heads=4, kv_heads=2, vocab=49152)  # SmolLM2's vocabulary


def test_q4_k_m_gives_more_bits_where_llama_cpp_does():
    # llama.cpp's use_more_bits for 28 layers: the first and last 3 (n / 8 = 3) and every third between
    assert [i for i in range(28) if more_bits(i, 28)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27]
    assert q4_k_m_type("ffn_down", 0, 28).name == "Q6_K" and q4_k_m_type("ffn_down", 3, 28).name == "Q4_K"
    assert q4_k_m_type("ffn_up", 0, 28).name == "Q4_K" and q4_k_m_type("token_embd", 9, 28).name == "Q6_K"


@pytest.mark.slow
def test_a_synthetic_k_quant_gguf_loads_as_its_bytes_say(tmp_path):
    path = write_synthetic(tmp_path / "new" / "synthetic.gguf", TINY, default_gguf_path(), seed=1)
    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    assert [more_bits(i, TINY.layers) for i in range(TINY.layers)] == [False, False, True]
    assert tensors["blk.2.ffn_down.weight"].tensor_type.name == "Q6_K"
    assert tensors["blk.1.ffn_down.weight"].tensor_type.name == "Q4_K"
    ss = SelfSpec.load(str(path), DraftConfig(exit_layer=1, head="lm", gamma=2, tune="off"))  # no calibration
    layers = ss.model.model.layers
    for name, module in (("blk.1.ffn_down.weight", layers[1].mlp.down_proj),
                         ("blk.2.ffn_down.weight", layers[2].mlp.down_proj),
                         ("blk.2.attn_q.weight", layers[2].self_attn.q_proj)):
        t = tensors[name]
        want = torch.from_numpy(np.ascontiguousarray(dequantize(t.data, t.tensor_type))).reshape(module.qweight.shape)
        assert module.qweight.type_name == t.tensor_type.name
        # packed near the file's size where the build takes two levels (AVX-512), as float32 on AVX2 builds
        assert (module.qweight.scales.dtype in (torch.uint8, torch.int8)) == factored_k_scales()
        assert torch.equal(module.qweight.dense(), want)
    out = ss.generate([1, 2, 3, 4], max_new_tokens=8, method="plain").token_ids
    assert len(out) == 8 and all(0 <= t < TINY.vocab for t in out)
