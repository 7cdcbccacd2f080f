"""The packed layout of a block-quantized weight (selfspec.quant.weight's ``QuantWeight``): 16 output rows
interleaved per block, so a column of the block is one vector of codes, the codes of a group packed as bytes, nibble
pairs, or (5-bit types) 5-bit words on AVX-512 builds and nibbles plus a bit plane on AVX2 ones (qcodes.h's
header); scales and offsets per group and row: float16 where they are exact in it, the K-quants' in their GGUF's
two levels (``pack_factored``, qcodes.h's ``Scales``), else float32.
"""

from __future__ import annotations

import numpy as np

from selfspec.kernels.build import built_extension
from selfspec.quant.formats import Factored, Format, Groups

LANES = 16  # output rows per packed block (one vector register of float32 on AVX-512)
WORDS5_GROUP = 32  # 5-bit codes are packed per group of 32 columns (every 5-bit GGUF type's group)


def pack_codes(codes: np.ndarray, fmt: Format) -> np.ndarray:  # [N_pad, K] -> [N_pad / 16, G, CB]
    n, k = codes.shape
    g, groups = fmt.group, k // fmt.group
    q = codes.reshape(n // LANES, LANES, groups, g).transpose(0, 2, 3, 1)  # [NB, G, g, 16]: column k's 16 rows
    if fmt.bits == 8:
        return np.ascontiguousarray(q).reshape(n // LANES, groups, g * LANES)
    if fmt.bits == 5 and words5():
        return pack_words5(q)
    parts = [(q[:, :, 0::2] & 15) | ((q[:, :, 1::2] & 15) << 4)]  # [NB, G, g/2, 16] nibble pairs
    if fmt.bits == 5:  # one 16-bit plane per column: bit r = bit 4 of row r's code
        weights = (1 << np.arange(LANES, dtype=np.uint32)).astype(np.uint32)
        plane = (((q >> 4) & 1).astype(np.uint32) * weights).sum(axis=-1).astype(np.uint16)  # [NB, G, g]
        parts.append(plane.view(np.uint8).reshape(n // LANES, groups, g * 2))
    return np.concatenate([p.reshape(n // LANES, groups, -1) for p in parts], axis=-1)


def words5() -> bool:
    """Whether this machine's kernel build packs 5-bit codes as words (AVX-512) or as nibbles and planes (AVX2):
    the layout each build's paths decode fastest (qcodes.h's header)."""
    return bool(built_extension().qcodes5_words())


def factored_k_scales() -> bool:
    """Whether this machine's kernel build packs the K-quants' scales in their GGUF's two levels (AVX-512 builds) or
    as float32 values (AVX2 builds): AVX2's one-row kernels are bound by vector instructions, not memory, and the
    widening and multiply of a group's sub-scales cost them more than the bytes save (docs/QUANTIZED.md). The
    kernels of every build read both forms."""
    return words5()


def pack_layout() -> str:
    """The packed layout's name beside PACK_VERSION (a cache packed by another build is packed again): the 5-bit
    codes' form and the K-quant scales' (both follow the build: words and two levels, or planes and float32)."""
    return ("w5" if words5() else "p5") + ("-k2" if factored_k_scales() else "-k32")


def pack_words5(q: np.ndarray) -> np.ndarray:  # [NB, G, 32, 16] 5-bit codes -> [NB, G, 320] (qcodes.h: "words")
    nb, groups, g, _ = q.shape
    if g != WORDS5_GROUP:
        raise ValueError(f"5-bit codes are packed in groups of {WORDS5_GROUP}, got {g}")
    q = q.astype(np.uint32)
    words = np.zeros((nb, groups, 5, LANES), dtype=np.uint32)
    for w in range(5):
        for c in range(6):
            words[:, :, w] |= q[:, :, 6 * w + c] << (5 * c)
    spare = q[:, :, 30] | q[:, :, 31] << 5  # [NB, G, 16] ten bits, two in the top of each word
    for w in range(5):
        words[:, :, w] |= ((spare >> (2 * w)) & 3) << 30
    return words.astype("<u4").view(np.uint8).reshape(nb, groups, 5 * LANES * 4)


def unpack_words5(c: np.ndarray) -> np.ndarray:  # [NB, G, 320] -> [NB, G, 32, 16] (inverse of pack_words5)
    nb, groups = c.shape[:2]
    words = np.ascontiguousarray(c).view("<u4").reshape(nb, groups, 5, LANES)
    q = np.empty((nb, groups, WORDS5_GROUP, LANES), dtype=np.uint8)
    for w in range(5):
        for i in range(6):
            q[:, :, 6 * w + i] = (words[:, :, w] >> (5 * i)) & 31
    spare = sum(((words[:, :, w] >> 30) & 3) << (2 * w) for w in range(5))
    q[:, :, 30], q[:, :, 31] = spare & 31, spare >> 5
    return q


def pack_groups(v: np.ndarray) -> np.ndarray:  # [N_pad, G] -> [N_pad / 16, G, 16]
    n, groups = v.shape
    return np.ascontiguousarray(v.reshape(n // LANES, LANES, groups).transpose(0, 2, 1))


def pack_factored(v: Factored) -> np.ndarray:
    """A K-quant's two-level scales ``# [N_pad, G]`` -> ``# [N_pad / 16, G / P, 16 P + 32]`` bytes (uint8, or int8
    for signed sub-scales): per super-block of P groups, each group's 16 sub-scales, then the 16 rows' float16."""
    per = v.per
    sub = pack_groups(v.sub)  # [NB, G, 16]
    nb, groups = sub.shape[:2]
    sup = pack_groups(v.sup.astype(np.float16)).view(np.uint8)  # [NB, G / P, 32]
    out = np.concatenate([sub.view(np.uint8).reshape(nb, groups // per, per * LANES), sup], axis=-1)
    return out.view(v.sub.dtype)


def unpack_factored(t: np.ndarray) -> Factored:
    """The inverse of ``pack_factored``: ``# [NB, G / P, 16 P + 32]`` -> sub ``# [NB * 16, G]``, sup."""
    nb, supers, width = t.shape
    per = (width - 2 * LANES) // LANES
    b = np.ascontiguousarray(t).view(np.uint8)
    sub = b[:, :, : per * LANES].reshape(nb, supers * per, LANES).view(t.dtype)
    sup = np.ascontiguousarray(b[:, :, per * LANES :]).view(np.float16)  # [NB, G / P, 16]
    return Factored(unpack_groups(sub), unpack_groups(sup))


def unpack_groups(v: np.ndarray) -> np.ndarray:  # [NB, G, 16] -> [NB * 16, G] (inverse of pack_groups)
    nb, groups, _ = v.shape
    return np.ascontiguousarray(v.transpose(0, 2, 1)).reshape(nb * LANES, groups)


def pack_scales(v: Groups, dtype: type) -> np.ndarray:
    """Per-group scales or offsets ``# [N_pad, G]`` in their packed form: ``pack_factored`` for a K-quant's,
    else ``pack_groups`` as ``dtype``."""
    return pack_factored(v) if isinstance(v, Factored) else pack_groups(v).astype(dtype, copy=False)


def unpack_scales(t: np.ndarray) -> Groups:
    """The inverse of ``pack_scales``: ``# [NB * 16, G]`` float32 values, or a K-quant's ``Factored``."""
    if t.dtype in (np.uint8, np.int8):
        return unpack_factored(t)
    return unpack_groups(t).astype(np.float32)


HALF_SCALE_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # d (and m) are float16 in the GGUF block


def scale_dtype(type_name: str, scales: np.ndarray, offsets: np.ndarray | None) -> type:
    """float16 for a legacy type whose scales (and offsets) are all exact in it, as a GGUF's are (half the bytes a
    decoding step reads for them; the kernels widen them exactly), else float32."""
    if type_name not in HALF_SCALE_TYPES:
        return np.float32
    for v in (scales, offsets):
        if v is not None and not np.array_equal(v.astype(np.float16).astype(np.float32), v):
            return np.float32
    return np.float16
