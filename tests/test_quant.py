"""Block-quantized weights: every GGUF type decodes to gguf-py's exact values, and the kernels multiply
with them as dequantize + F.linear does (rows 1-64, odd shapes, bias, accumulate, column slices)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize, quantize

from selfspec.kernels.build import built_extension
from selfspec.quant import packing, weight
from selfspec.quant.formats import FORMATS, UnsupportedQuantError, check_type, decode, reference_values
from selfspec.quant.weight import GEMM_ROWS, PANEL_ROWS, PREFILL_PATHS, QuantWeight

QUANTIZABLE = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]  # gguf-py quantizes these
K_QUANTS = ["Q4_K", "Q5_K", "Q6_K"]  # random blocks with finite scales


def random_tensor(type_name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """A GGUF tensor's raw rows ``# [n, row_bytes] uint8`` of ``type_name``."""
    rng = np.random.default_rng(seed)
    qt = GGMLQuantizationType[type_name]
    if type_name in QUANTIZABLE:
        w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
        w[0, :8] = 0.0  # a zero stretch (d = 0 for Q4_0's first block... a corner worth having)
        return quantize(w, qt)
    block, size = GGML_QUANT_SIZES[qt]
    raw = rng.integers(0, 256, size=(n * (k // block), size), dtype=np.uint8)
    halves = (rng.standard_normal((n * (k // block), 2)) * 0.01).astype(np.float16).view(np.uint8)
    if type_name == "Q6_K":
        raw[:, 208:210] = halves[:, 0:2]  # d at the end
    else:
        raw[:, 0:4] = halves  # d, dmin first
    return raw.reshape(n, -1)


@pytest.mark.parametrize("type_name", QUANTIZABLE + K_QUANTS)
def test_decode_is_gguf_dequantize_bit_for_bit(type_name):
    raw = random_tensor(type_name, 20, 512)
    codes, scales, offsets, fmt = decode(raw, type_name, 512)
    want = dequantize(raw, GGMLQuantizationType[type_name]).astype(np.float32)
    got = reference_values(codes, scales, offsets, fmt)
    assert codes.max() < 2**fmt.bits
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    qw = QuantWeight.from_gguf(raw, type_name, 512)
    np.testing.assert_array_equal(qw.dense().numpy().view(np.uint32), want.view(np.uint32))  # the kernel's dequant
    c2, s2, o2 = qw.unpacked()
    np.testing.assert_array_equal(c2, codes)
    np.testing.assert_array_equal(s2, scales)


ROW_COUNTS = [1, 2, 3, 5, 8, 13, 16, 17, 40, 64, GEMM_ROWS, GEMM_ROWS + 37, 301]  # 301: two chunks of the panels


@pytest.mark.parametrize("type_name", QUANTIZABLE + K_QUANTS)
@pytest.mark.parametrize(("rows", "way"), [(r, w) for r in ROW_COUNTS for w in PREFILL_PATHS
                                           if w == "kernel" or r >= PANEL_ROWS])
def test_kernel_matches_dequantize_linear(type_name, rows, way, monkeypatch):
    """Every way of multiplying (the kernel; for a prefill's rows panels or torch's GEMM on tiles, whatever this
    machine measured) gives the dequantized weight's product, bias, an output slice and accumulation included."""
    n, k = 53, 256 * 3  # an odd N (padding rows), K of three super-blocks
    monkeypatch.setattr(weight, "GEMM_TILE", k * 16 * 2)  # a prefill's GEMM in tiles of two blocks (32 rows)
    monkeypatch.setattr(weight, "prefill_path", lambda type_name: way)
    raw = random_tensor(type_name, n, k, seed=rows)
    qw = QuantWeight.from_gguf(raw, type_name, k)
    w = torch.from_numpy(dequantize(raw, GGMLQuantizationType[type_name]).astype(np.float32))
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g)
    bias = torch.randn(n, generator=g)
    want = F.linear(x.double(), w.double(), bias.double())
    # float32 summation in another order: bounded by a few ulps of the sum of |x * w|
    bound = 1e-6 * (F.linear(x.abs(), w.abs()).double() + bias.abs().double()) + 1e-6
    out = torch.full((rows, n + 7), 3.0)  # a wider output: the weight writes columns [2, 2 + n)
    qw.matmul(x, out[:, 2 : 2 + n], bias)
    assert ((out[:, 2 : 2 + n].double() - want).abs() <= bound).all()
    assert (out[:, :2] == 3.0).all() and (out[:, 2 + n :] == 3.0).all()
    qw.matmul(x, out[:, 2 : 2 + n], None, accumulate=True)
    want2 = want + F.linear(x.double(), w.double())
    assert ((out[:, 2 : 2 + n].double() - want2).abs() <= 2 * bound + 1e-6 * want.abs()).all()


@pytest.mark.parametrize("type_name", ["Q5_0", "Q6_K", "Q4_1"])
def test_panels_give_a_row_the_same_bits_in_any_call(type_name):
    """The prefill's panels (qgemm): each output is one float32 sum over k in order, whatever the call's row count, its
    chunks of x-rows or its register tiles (x packed per tile, remainders in smaller tiles); the prefix cache relies
    on it. 301 rows: two chunks (240 + 61, five tiles of 12 and one row); 37 and 1 alone; a middle slice."""
    n, k = 53, 256 * 3
    qw = QuantWeight.from_gguf(random_tensor(type_name, n, k, seed=7), type_name, k)
    x = torch.randn(301, k, generator=torch.Generator().manual_seed(7))
    ext, no_bias = built_extension(), torch.empty(0)
    whole = ext.qgemm(x, *qw.kernel_args(), no_bias, torch.empty(301, n), False)
    for a, b in ((0, 37), (264, 301), (300, 301), (13, 290)):
        part = ext.qgemm(x[a:b].contiguous(), *qw.kernel_args(), no_bias, torch.empty(b - a, n), False)
        assert torch.equal(part, whole[a:b]), (a, b)


@pytest.mark.parametrize("type_name", QUANTIZABLE + K_QUANTS)
def test_prefill_tiles_are_the_dequantized_weights_bit_for_bit(type_name):
    """The GEMM path's tiles (W^T of blocks [b0, b1)) hold exactly the values rows() gives (gguf-py's)."""
    qw = QuantWeight.from_gguf(random_tensor(type_name, 53, 512, seed=3), type_name, 512)
    tile = built_extension().qdense_t(*qw.kernel_args(), 1, 4, torch.empty(512, 48))
    assert torch.equal(tile[:, :37].t(), qw.rows(torch.arange(16, 53)))
    with pytest.raises(RuntimeError, match="out of range"):
        built_extension().qdense_t(*qw.kernel_args(), 2, 5, torch.empty(512, 48))


def test_prefill_path_is_measured_once_per_type_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(weight, "_prefill_paths", {})
    assert weight.prefill_path("Q4_K") in PREFILL_PATHS
    entry = next((tmp_path / "prefill").glob("*.json"))
    assert set(json.loads(entry.read_text())["ms"]) == set(PREFILL_PATHS)  # all three timed
    monkeypatch.setattr(weight, "_prefill_paths", {})
    entry.write_text('{"path": "panels", "ms": {"kernel": 10.0, "panels": 10.0, "torch": 5.0}}')  # read back, not
    assert weight.prefill_path("Q4_K") == "torch"  # measured again; decided from its times
    monkeypatch.setattr(weight, "_prefill_paths", {})
    entry.write_text('{"path": "kernel", "ms": {"kernel": 9.7, "panels": 10.0, "torch": 15.0}}')
    assert weight.prefill_path("Q4_K") == "panels"  # a near-tie goes to the panels (the prefix cache needs them)
    assert weight.choose_prefill_path({"kernel": 8.9, "panels": 10.0, "torch": 15.0}) == "kernel"
    monkeypatch.setattr(weight, "_prefill_paths", {})
    entry.write_text('{"path": "nonsense"}')  # a damaged entry is measured again
    monkeypatch.setattr(weight, "_prefill_paths", {})
    assert weight.prefill_path("Q4_K") in PREFILL_PATHS
    assert len(list((tmp_path / "prefill").glob("*.json"))) == 1


def test_select_and_concat_keep_rows():
    raw = random_tensor("Q4_K", 48, 256)
    qw = QuantWeight.from_gguf(raw, "Q4_K", 256)
    ids = torch.tensor([40, 3, 17, 16])
    torch.testing.assert_close(qw.select(ids).dense(), qw.rows(ids), rtol=0, atol=0)
    both = QuantWeight.concat([qw, QuantWeight.from_gguf(raw[:16], "Q4_K", 256)])
    assert both.shape == (64, 256)
    torch.testing.assert_close(both.rows(torch.tensor([47, 48, 63])), qw.rows(torch.tensor([47, 0, 15])), rtol=0, atol=0)
    with pytest.raises(IndexError):
        qw.rows(torch.tensor([48]))


@pytest.mark.parametrize("type_name", QUANTIZABLE + K_QUANTS)
def test_select_unpacks_only_the_blocks_it_needs_and_keeps_the_rows(type_name, monkeypatch):
    """A trimmed LM head: rows in any order, repeated, from a last block with padding rows (N = 61: four blocks); the
    result is the rows bit for bit, and only the packed blocks holding them (not block 1) were unpacked."""
    raw = random_tensor(type_name, 61, 256)
    qw = QuantWeight.from_gguf(raw, type_name, 256)
    seen = []
    decode_blocks = QuantWeight._block_codes
    monkeypatch.setattr(QuantWeight, "_block_codes", lambda self, c: seen.append(len(c)) or decode_blocks(self, c))
    ids = torch.tensor([60, 3, 35, 3, 32, 0])
    got = qw.select(ids)
    assert got.shape == (6, 256) and got.type_name == type_name
    assert seen == [3]  # blocks 0, 2 and 3
    want = qw.rows(ids)
    np.testing.assert_array_equal(got.dense().numpy().view(np.uint32), want.numpy().view(np.uint32))
    with pytest.raises(IndexError):
        qw.select(torch.tensor([61]))


def test_unsupported_type_names_the_supported_ones():
    with pytest.raises(UnsupportedQuantError, match="Q2_K.*supported: Q4_0, Q4_1"):
        check_type("Q2_K", "blk.0.ffn_down.weight")
    assert set(FORMATS) == {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"}


@pytest.mark.slow
def test_avx2_variant_matches_too(tmp_path):
    """The AVX2 build of the kernels (what a CPU without AVX-512 runs) passes the same checks. On an AVX2-only
    machine the suite's own build already is that variant (every check here ran on it), so rebuilding it under
    another name (~40 s) would test nothing new."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from selfspec.machine import cpu_info

    if "avx512f" not in cpu_info().flags:
        pytest.skip("no AVX-512 on this CPU: the suite's own kernel build is the AVX2 variant")
    env = {**os.environ, "SELFSPEC_ISA": "avx2"}
    here = Path(__file__).parent
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(here / "test_quant.py"),
                        "-k", "not avx2"], env=env, capture_output=True, text=True, timeout=900, cwd=here.parent)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert " passed" in r.stdout


def int8_reference(x: torch.Tensor, qw: QuantWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8-bit activation mode in float64: x rounded to int8 per group (d = max|x| / 127, x / d rounded to
    nearest, ties to even, in float32 as the kernel does), each group's exact integer dot product scaled back; and the size of the terms summed (the
    float32 epilogue's rounding is relative to it)."""
    codes, scales, offsets = qw.unpacked()
    fmt = qw.format
    g = fmt.group
    xs = x.numpy().reshape(x.shape[0], -1, g)  # [M, G, g] float32
    d = np.abs(xs).max(-1, keepdims=True) / np.float32(127)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), np.float32(0)).astype(np.float32)
    q = np.rint(xs * inv).astype(np.float64)  # float32 products, rounded half to even
    d = d.astype(np.float64)
    c = codes.astype(np.float64).reshape(codes.shape[0], -1, g)  # [N, G, g]
    dots = np.einsum("mjk,njk->mnj", q, c)  # exact integer sums
    cz = fmt.zero * scales.astype(np.float64) + (offsets if offsets is not None else 0)  # [N, G]
    t = scales[None] * dots - cz[None] * q.sum(-1)[:, None, :]
    size = np.abs(scales[None]) * np.einsum("mjk,njk->mnj", np.abs(q), c) + np.abs(cz[None]) * np.abs(q).sum(-1)[:, None]
    return torch.from_numpy((t * d[:, None, :, 0]).sum(-1)), torch.from_numpy((size * d[:, None, :, 0]).sum(-1))


@pytest.mark.parametrize("type_name", QUANTIZABLE + K_QUANTS)
def test_int8_mode_matches_its_reference_and_is_row_independent(type_name):
    n, k = 37, 512
    qw = QuantWeight.from_gguf(random_tensor(type_name, n, k, seed=5), type_name, k)
    qw.numerics = "int8"
    x = torch.randn(11, k, generator=torch.Generator().manual_seed(3))
    out = torch.empty(11, n)
    qw.matmul(x, out)
    want, size = int8_reference(x, qw)
    assert ((out.double() - want).abs() <= 1e-6 * size + 1e-6).all()
    for i in range(11):  # a block of rows gives bitwise what each row gives alone
        one = torch.empty(1, n)
        qw.matmul(x[i : i + 1], one)
        assert torch.equal(one[0], out[i])


@pytest.mark.parametrize("type_name", QUANTIZABLE + K_QUANTS)
def test_int8_mode_integer_sums_at_their_bounds(type_name):
    """The largest and smallest codes against activations at +-127 in every column: the AVX2 path adds code
    pairs as int16 before widening (docs/QUANTIZED.md), exact only while those sums stay under 32767; here they
    reach their bound and must still equal the reference's integers."""
    fmt = FORMATS[type_name]
    n, k = 37, 512
    codes = np.full((n, k), (1 << fmt.bits) - 1, dtype=np.uint8)
    codes[8:16] = 0  # a half-block of the smallest codes (Q8_0: -128)
    codes[20:] = np.random.default_rng(1).integers(0, 1 << fmt.bits, (n - 20, k), dtype=np.uint8)
    scales = np.full((n, k // fmt.group), 0.01, dtype=np.float32)
    offsets = np.full((n, k // fmt.group), 0.02, dtype=np.float32) if fmt.offset else None
    qw = QuantWeight.from_codes(type_name, codes, scales, offsets)
    qw.numerics = "int8"
    x = torch.ones(4, k)
    x[1] = -1.0
    x[2, 1::2] = -1.0  # +-127 alternating: pairs cancel, quads do not overflow either way
    x[3] = torch.randn(k, generator=torch.Generator().manual_seed(2))
    out = torch.empty(4, n)
    qw.matmul(x, out)
    want, size = int8_reference(x, qw)
    assert ((out.double() - want).abs() <= 1e-6 * size + 1e-6).all()


def test_concat_of_consecutive_slices_is_a_view_and_the_store_keeps_runs(tmp_path):
    """Weights that are consecutive row blocks of one tensor fuse without a copy; the packed cache stores the
    projections the fast layers fuse as one tensor and maps each module's weight as a slice of it."""
    from transformers import LlamaConfig

    from selfspec.quant.store import fused_runs, load_packed, save_packed

    whole = QuantWeight.from_gguf(random_tensor("Q4_1", 48, 64), "Q4_1", 64)
    parts = [QuantWeight("Q4_1", (16, 64), whole.codes[i : i + 1], whole.scales[i : i + 1], whole.offsets[i : i + 1])
             for i in range(3)]
    fused = QuantWeight.concat(parts)
    assert fused.codes.data_ptr() == whole.codes.data_ptr() and fused.offsets.data_ptr() == whole.offsets.data_ptr()
    torch.testing.assert_close(fused.dense(), whole.dense(), rtol=0, atol=0)
    apart = QuantWeight.concat([parts[2], parts[0]])  # not consecutive: a copy, rows in the order given
    assert apart.codes.data_ptr() != whole.codes.data_ptr()
    torch.testing.assert_close(apart.dense(), whole.dense()[[*range(32, 48), *range(16)]], rtol=0, atol=0)

    names = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj",
             "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj"]
    types = ["Q4_1", "Q4_1", "Q8_0", "Q4_0", "Q4_0", "Q4_0"]  # v is another type: q and k alone form a run
    quant = {n: QuantWeight.from_gguf(random_tensor(t, 32, 64, seed=i), t, 64) for i, (n, t) in enumerate(zip(names, types))}
    assert fused_runs(quant) == [names[:2], names[3:5]]
    save_packed(tmp_path / "c", LlamaConfig(), quant, {})
    _, mapped, _ = load_packed(tmp_path / "c")
    for n in names:
        torch.testing.assert_close(mapped[n].dense(), quant[n].dense(), rtol=0, atol=0)
    q, k = mapped[names[0]], mapped[names[1]]
    assert k.codes.data_ptr() == q.codes.data_ptr() + q.codes.nbytes  # one tensor: k's rows right after q's
    assert QuantWeight.concat([q, k]).codes.data_ptr() == q.codes.data_ptr()


def test_five_bit_words_layout():
    """The AVX-512 layout of 5-bit codes (qcodes.h's header): the header's worked example, the spare bits of
    columns 30 and 31, and the round trip; the layout is the build's (AVX2 builds keep nibbles and planes)."""
    q = np.zeros((1, 1, 32, packing.LANES), dtype=np.uint8)
    q[0, 0, :6, 0] = [1, 2, 3, 4, 5, 6]
    q[0, 0, 30, 0], q[0, 0, 31, 0] = 0b10111, 0b01101  # S = 0b01101_10111
    words = packing.pack_words5(q).view("<u4").reshape(5, packing.LANES)
    s = 0b0110110111
    assert words[0, 0] == (1 | 2 << 5 | 3 << 10 | 4 << 15 | 5 << 20 | 6 << 25 | (s & 3) << 30)
    assert [int(words[w, 0]) >> 30 for w in range(5)] == [(s >> (2 * w)) & 3 for w in range(5)]
    assert not words[:, 1:].any()
    rng = np.random.default_rng(5)
    q = rng.integers(0, 32, (3, 4, 32, packing.LANES), dtype=np.uint8)
    np.testing.assert_array_equal(packing.unpack_words5(packing.pack_words5(q)), q)
    assert packing.words5() == bool(built_extension().qcodes5_words())
    assert packing.pack_layout() == ("w5-k2" if packing.words5() else "p5-k32")
    with pytest.raises(ValueError, match="groups of 32"):
        packing.pack_words5(q[:, :, :16])


@pytest.mark.parametrize("type_name", QUANTIZABLE + K_QUANTS)
def test_compact_scales_compute_as_float32_ones(type_name):
    """The legacy types keep their GGUF float16 scales (and offsets) as float16, the K-quants theirs in the GGUF's two
    levels (a sub-scale byte per group, a float16 per super-block): every kernel (rows, panels, int8 mode, dequantized
    rows and tiles, the screen's bound table) gives bit for bit what float32 copies of the same values give."""
    raw = random_tensor(type_name, 53, 512, seed=7)
    compact = QuantWeight.from_gguf(raw, type_name, 512, factored=True)  # two levels whatever this build packs
    k_quant = type_name in K_QUANTS
    if k_quant:
        assert compact.scales.dtype == (torch.int8 if type_name == "Q6_K" else torch.uint8)
        per = 256 // FORMATS[type_name].group
        assert compact.scales.shape == (4, 512 // 256, 16 * per + 32)
        codes, scales, offsets = compact.unpacked()
        full = QuantWeight.from_codes(type_name, codes, scales, offsets, factored=False)  # float32 values
        assert full.scales.dtype == torch.float32
    else:
        assert compact.scales.dtype == torch.float16
        if FORMATS[type_name].offset:
            assert compact.offsets.dtype == torch.float16
        full = QuantWeight(type_name, compact.shape, compact.codes, compact.scales.float(),
                           compact.offsets.float() if compact.offsets.numel() else compact.offsets)
        assert full.nbytes - compact.nbytes == (compact.scales.numel() + compact.offsets.numel()) * 2
    assert compact.offsets.dtype == compact.scales.dtype or not compact.offsets.numel()
    g = torch.Generator().manual_seed(1)
    for rows in (1, 4, 16, 40, 130):
        x = torch.randn(rows, 512, generator=g)
        for int8 in (False, True):
            compact.numerics = full.numerics = "int8" if int8 else "exact"
            a, b = torch.empty(rows, 53), torch.empty(rows, 53)
            compact.matmul(x, a)
            full.matmul(x, b)
            assert torch.equal(a, b), (rows, int8)
        a, b = torch.empty(rows, 53), torch.empty(rows, 53)
        compact._panels(x, a, None, False)
        full._panels(x, b, None, False)
        assert torch.equal(a, b), rows
    ids = torch.tensor([0, 17, 52])
    assert torch.equal(compact.rows(ids), full.rows(ids))
    assert torch.equal(compact.select(ids).dense(), full.rows(ids))
    ext = built_extension()
    assert torch.equal(ext.qdense_t(*compact.kernel_args(), 0, 4, torch.empty(512, 64)),
                       ext.qdense_t(*full.kernel_args(), 0, 4, torch.empty(512, 64)))
    from selfspec.quant.screen import error_table
    assert torch.equal(error_table(compact), error_table(full))


@pytest.mark.parametrize("type_name", K_QUANTS)
def test_k_quants_pack_at_their_gguf_size(type_name):
    """A K-quant's packed scales and offsets take at most an eighth of a bit a weight more than the GGUF's (Q6_K's
    codes are bytes: docs/QUANTIZED.md); the factored values are gguf-py's products exactly."""
    from selfspec.quant.formats import Factored, decode_factored
    from selfspec.quant.packing import factored_k_scales

    raw = random_tensor(type_name, 64, 1024, seed=3)
    qw = QuantWeight.from_gguf(raw, type_name, 1024, factored=True)
    build = QuantWeight.from_gguf(raw, type_name, 1024)  # this build's form: two levels on AVX-512, float32 on AVX2
    assert (build.scales.dtype != torch.float32) == factored_k_scales()
    assert torch.equal(build.dense(), qw.dense())
    assert torch.equal(qw.select(torch.tensor([3, 40])).scales, QuantWeight.from_gguf(raw[[3, 40]], type_name, 1024,
                                                                                      factored=True).scales)
    fmt = FORMATS[type_name]
    code_bytes = qw.codes.numel()
    gguf_scale_bits = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][1] * 8 / 256 - int(type_name[1])
    scale_bits = (qw.scales.numel() + qw.offsets.numel()) * 8 / (64 * 1024)
    assert scale_bits <= gguf_scale_bits + 0.125, (scale_bits, gguf_scale_bits)
    assert code_bytes == 64 * 1024 * (1 if fmt.bits == 8 else fmt.bits / 8)
    _, scales, offsets, _ = decode_factored(raw, type_name, 1024)
    assert isinstance(scales, Factored) and (offsets is None) == (not fmt.offset)
    _, s32, o32, _ = decode(raw, type_name, 1024)
    np.testing.assert_array_equal(scales.values(), s32)
    with pytest.raises(RuntimeError, match="K-quant scales"):
        built_extension().qdequant(qw.codes, qw.scales[:, :, :-16].contiguous(), qw.offsets, fmt.bits, fmt.group,
                                   float(fmt.zero), torch.tensor([0]), torch.empty(1, 1024))


@pytest.mark.parametrize("type_name", QUANTIZABLE + K_QUANTS)
def test_screened_argmax_is_the_exact_logits_argmax(type_name):
    """qargmax (the LM head's screen for greedy verification) gives, for 1-16 rows, torch.argmax of qlinear's exact
    logits: duplicated rows tie exactly (the first index wins), and every candidate block counts."""
    from selfspec.quant.screen import ScreenedArgmax

    n, k = 333, 512
    raw = random_tensor(type_name, n, k, seed=11)
    top = int(QuantWeight.from_gguf(raw, type_name, k).dense()[: n - 1].norm(dim=1).argmax())  # the longest row
    raw[n - 1] = raw[top]  # ... twice: x = that row makes them the two largest logits (Cauchy-Schwarz), tied exactly
    qw = QuantWeight.from_gguf(raw, type_name, k)
    screen = ScreenedArgmax(qw)
    gen = torch.Generator().manual_seed(2)
    for m in range(1, 17):
        x = torch.randn(m, k, generator=gen) * torch.randn(1, k, generator=gen).exp()  # uneven column scales
        x[0] = qw.dense()[top]
        logits = torch.empty(m, n)
        qw.matmul(x, logits)
        got = screen.argmax(x)
        assert got is not None and torch.equal(got, logits.argmax(-1)), m
        assert got[0] == top and logits[0, top] == logits[0, n - 1]  # the first of the tied pair
    assert 0 < screen.candidate_blocks < screen.calls * qw.codes.shape[0]  # it screened: not every block computed


@pytest.mark.parametrize("type_name", QUANTIZABLE + K_QUANTS)
def test_screen_table_sums_each_rows_weights_per_group(type_name):
    """qgroup_l1, the screen's bound table in one pass over the packed codes: each row's sum of |w| over each group,
    the dequantized weights' (float64) to float32 rounding; padding rows past N sum to 0."""
    n, k = 45, 512  # 3 blocks, the last with 3 padding rows
    qw = QuantWeight.from_gguf(random_tensor(type_name, n, k, seed=5), type_name, k)
    nb, groups = qw.codes.shape[0], qw.codes.shape[1]
    got = built_extension().qgroup_l1(*qw.kernel_args(), torch.empty(nb, groups, 16))  # [NB, G, 16]
    got = got.transpose(1, 2).reshape(nb * 16, groups)  # [rows, G]
    want = qw.dense().double().abs().view(n, groups, -1).sum(-1)
    assert (got[:n] > 0).any()
    torch.testing.assert_close(got[:n].double(), want, rtol=2.0**-20, atol=0)
    assert (got[n:] == 0).all()


def test_screened_argmax_skips_padding_rows_and_refuses_non_finite_input():
    """With every logit negative, the padding rows past N (weight 0, logit 0) must not win; a non-finite activation
    gives None (the caller computes the logits)."""
    from selfspec.quant.screen import ScreenedArgmax

    n, k = 37, 64  # 3 blocks of 16, the last with 11 padding rows
    rng = np.random.default_rng(0)
    codes = rng.integers(1, 16, (n, k), dtype=np.uint8)  # Q4_1: w = d q + m > 0
    scales = np.full((n, k // 32), 0.01, dtype=np.float32)
    qw = QuantWeight.from_codes("Q4_1", codes, scales, np.full((n, k // 32), -0.001, dtype=np.float32))
    x = -torch.rand(4, k) - 0.1  # every logit < 0
    logits = torch.empty(4, n)
    qw.matmul(x, logits)
    assert (logits < 0).all()
    got = ScreenedArgmax(qw).argmax(x)
    assert got is not None and torch.equal(got, logits.argmax(-1)) and (got < n).all()
    x[2, 5] = float("nan")
    assert ScreenedArgmax(qw).argmax(x) is None


def test_every_numerics_decision_reads_its_table_entry():
    """The numerics table (selfspec/quant/numerics.py) names each mode's kernel and what it promises; a weight's
    mode is its entry, and an unknown name is a clear error that leaves the weights as they were."""
    from conftest import tiny_model

    from selfspec.errors import InvalidConfigError
    from selfspec.kernels.build import built_extension
    from selfspec.quant.convert import quantize_model
    from selfspec.quant.modules import set_numerics
    from selfspec.quant.numerics import NUMERICS

    ext = built_extension()
    for mode in NUMERICS.values():
        assert callable(getattr(ext, mode.kernel)), mode.name  # its kernel exists in the build
    assert NUMERICS["exact"].exact and NUMERICS["exact"].suffix == "" and NUMERICS["int8"].suffix == "-int8"
    model = quantize_model(tiny_model("qwen2"), "Q4_0")
    with pytest.raises(InvalidConfigError, match="numerics must be one of 'exact', 'int8'"):
        set_numerics(model, "int4")
    weights = [m.qweight for m in model.modules() if hasattr(m, "qweight")]
    assert {w.numerics for w in weights} == {"exact"}
    set_numerics(model, "int8")
    assert {w.mode.name for w in weights} == {"int8"} and not any(w.mode.panels for w in weights)
