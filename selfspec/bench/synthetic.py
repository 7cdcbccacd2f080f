"""A GGUF of a model shape nobody ships here, written from random blocks: bench-forward times it like a real file.

The two models this project runs offline are small (135M and 0.5B parameters) and their GGUFs mostly hold the
legacy types (their row lengths are not multiples of 256), while most GGUFs users have are K-quant files of larger
models. ``write_synthetic`` writes a Qwen2-architecture GGUF of any shape with llama.cpp's Q4_K_M type choice
(``q4_k_m_type``: Q4_K, with Q6_K for the tied embedding / LM head and for attn_v and ffn_down in the layers
llama.cpp gives more bits), each block's codes random and its scales set so that a weight is of the size a
trained one is. The tokenizer is copied from a real GGUF of the same vocabulary (``--tokenizer-from``), so the file
loads as any other; its outputs are meaningless, its bytes and shapes real.

    python -m selfspec.bench.synthetic OUT.gguf --tokenizer-from Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf

writes the 1.5B-class shape ``SHAPE_1_5B`` (Qwen2.5-1.5B's: hidden 1536, intermediate 8960, 28 layers, 12 query and
2 KV heads, vocabulary 151,936).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFValueType, GGUFWriter
from gguf import GGMLQuantizationType as T


@dataclass(frozen=True)
class Shape:
    """A Qwen2-architecture model's dimensions."""

    hidden: int  # embedding width
    intermediate: int  # the MLP's inner width
    layers: int  # decoder layers
    heads: int  # query heads
    kv_heads: int  # key/value heads
    vocab: int  # rows of the (tied) embedding and LM head


SHAPE_1_5B = Shape(hidden=1536, intermediate=8960, layers=28, heads=12, kv_heads=2, vocab=151936)


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's ``use_more_bits``: the layers whose attn_v and ffn_down a Q4_K_M file keeps in Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def q4_k_m_type(name: str, layer: int, layers: int) -> T:
    """The type llama.cpp's Q4_K_M gives a weight (F32 for norms and biases is the caller's)."""
    if name == "token_embd":  # tied: it is the LM head too, which Q4_K_M keeps in Q6_K
        return T.Q6_K
    if name in ("attn_v", "ffn_down") and more_bits(layer, layers):
        return T.Q6_K
    return T.Q4_K


def random_blocks(qtype: T, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """``# [rows, cols / 256 * block bytes] uint8``: random codes and sub-scales, and half-precision super-scales
    that make a weight about 1 / sqrt(cols) in size (so activations stay finite through the layers)."""
    block, size = GGML_QUANT_SIZES[qtype]
    nb = rows * cols // block
    raw = rng.integers(0, 256, (nb, size), dtype=np.uint8)
    target = 1.0 / np.sqrt(cols)
    if qtype == T.Q4_K:  # d, dmin, 12 bytes of 6-bit sub-scales and mins, 128 bytes of nibbles
        d = rng.uniform(0.5, 1.5, nb) * target / (32 * 8)
        raw[:, 0:2] = d.astype(np.float16).view(np.uint8).reshape(nb, 2)
        raw[:, 2:4] = (d * 8).astype(np.float16).view(np.uint8).reshape(nb, 2)
    elif qtype == T.Q6_K:  # 128 bytes low nibbles, 64 of high bit pairs, 16 int8 sub-scales, d
        d = rng.uniform(0.5, 1.5, nb) * target / (64 * 16)
        raw[:, 208:210] = d.astype(np.float16).view(np.uint8).reshape(nb, 2)
    else:
        raise ValueError(f"random blocks of {qtype.name} are not written")
    return raw.reshape(rows, -1)


def _copy_tokenizer(source: Path, w: GGUFWriter) -> None:
    r = GGUFReader(str(source))
    for name, field in r.fields.items():
        if not name.startswith("tokenizer."):
            continue
        vtype = GGUFValueType(field.types[0])
        sub = GGUFValueType(field.types[1]) if vtype == GGUFValueType.ARRAY else None
        w.add_key_value(name, field.contents(), vtype, sub_type=sub)


def write_synthetic(path: Path, shape: Shape, tokenizer_from: Path, seed: int = 0) -> Path:
    """Write ``shape`` as a Q4_K_M-typed Qwen2 GGUF at ``path`` (see the module docstring); returns ``path``."""
    rng = np.random.default_rng(seed)
    s = shape
    head_dim = s.hidden // s.heads
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(str(path), "qwen2")
    w.add_name(f"synthetic-{s.hidden}x{s.layers}")
    w.add_block_count(s.layers)
    w.add_context_length(32768)
    w.add_embedding_length(s.hidden)
    w.add_feed_forward_length(s.intermediate)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_rope_freq_base(1_000_000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(15)  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    _copy_tokenizer(tokenizer_from, w)

    def quant(name: str, qtype: T, rows: int, cols: int) -> None:
        w.add_tensor(name, random_blocks(qtype, rows, cols, rng), raw_dtype=qtype)  # shape: from the bytes

    def ones(name: str, n: int) -> None:
        w.add_tensor(name, np.ones(n, dtype=np.float32))

    quant("token_embd.weight", q4_k_m_type("token_embd", 0, s.layers), s.vocab, s.hidden)
    ones("output_norm.weight", s.hidden)
    kv = s.kv_heads * head_dim
    for i in range(s.layers):
        p = f"blk.{i}."
        ones(p + "attn_norm.weight", s.hidden)
        ones(p + "ffn_norm.weight", s.hidden)
        for name, rows, cols in (("attn_q", s.hidden, s.hidden), ("attn_k", kv, s.hidden), ("attn_v", kv, s.hidden),
                                 ("attn_output", s.hidden, s.hidden), ("ffn_gate", s.intermediate, s.hidden),
                                 ("ffn_up", s.intermediate, s.hidden), ("ffn_down", s.hidden, s.intermediate)):
            quant(p + name + ".weight", q4_k_m_type(name, i, s.layers), rows, cols)
        for name, n in (("attn_q", s.hidden), ("attn_k", kv), ("attn_v", kv)):
            w.add_tensor(p + name + ".bias", np.zeros(n, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m selfspec.bench.synthetic", description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="the GGUF to write")
    p.add_argument("--tokenizer-from", type=Path, required=True,
                   help="a GGUF whose tokenizer (and so vocabulary) the file takes")
    for field in ("hidden", "intermediate", "layers", "heads", "kv_heads", "vocab"):
        p.add_argument(f"--{field.replace('_', '-')}", type=int, default=getattr(SHAPE_1_5B, field))
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    shape = Shape(a.hidden, a.intermediate, a.layers, a.heads, a.kv_heads, a.vocab)
    print(write_synthetic(a.out, shape, a.tokenizer_from, a.seed))


if __name__ == "__main__":
    main()
