"""GGUF block types, decoded into one form the kernels compute with: ``w = (q - z) * s - o``.

Each GGUF tensor type stores rows of blocks (32 or 256 weights) with half-precision scales and small
integer codes packed in its own bit layout. ``decode`` turns a tensor's raw rows into

    codes    # [N, K] uint8     q, an unsigned integer of ``bits`` bits
    scales   # [N, K / g] float32  s per group of g weights
    offsets  # [N, K / g] float32  o per group, or None where the type has none
    zero     z, the type's integer zero point

chosen so that ``(q - z) * s - o`` evaluated in float32 is bit for bit gguf-py's ``dequantize`` (the
values transformers loads, so the target model does not change): the scale products (``d * sc`` of the
K-quants) are formed here exactly as gguf-py forms them. ``tests/test_quant.py`` checks every type.

| type | g | bits | z | s | o | gguf-py's value |
|---|---|---|---|---|---|---|
| Q4_0 | 32 | 4 | 8 | d | - | d * (q - 8) |
| Q4_1 | 32 | 4 | 0 | d | -m | d * q + m |
| Q5_0 | 32 | 5 | 16 | d | - | d * (q - 16) |
| Q5_1 | 32 | 5 | 0 | d | -m | d * q + m |
| Q8_0 | 32 | 8 | 128 | d | - | d * int8 (q = int8 + 128) |
| Q4_K | 32 | 4 | 0 | d * sc | dmin * m | (d * sc) * q - dmin * m |
| Q5_K | 32 | 5 | 0 | d * sc | dmin * m | (d * sc) * q - dmin * m |
| Q6_K | 16 | 8 | 128 | d * sc | - | (d * sc) * (q6 - 32), q = q6 + 96 |

F32, F16 and BF16 tensors are plain floats (``float_types``); other GGUF types (Q2_K, Q3_K, the IQ
types, ...) are refused with the list above (``UnsupportedQuantError``).

Q6_K's 6-bit codes q6 are kept as bytes q = q6 + 96 = (q6 - 32) + 128, Q8_0's form with groups of 16: a byte
per weight instead of 6 bits (the packed Q6_K matrix 1.25x the size) buys a decode of one sign extension instead
of a nibble, a permute and two bit planes: at a few x-rows the decode, not the bytes read, bounds the kernel
(bitwise the same outputs; docs/QUANTIZED.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import overload

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import Q4_K

from selfspec.errors import SelfSpecError


class UnsupportedQuantError(SelfSpecError):
    """A tensor type the quantized kernels do not compute with."""


@dataclass(frozen=True)
class Format:
    """How one GGUF type maps onto the kernels' form."""

    group: int  # weights per scale (g)
    bits: int  # code width: 4, 5 or 8
    zero: int  # z
    offset: bool  # whether o is stored


FORMATS: dict[str, Format] = {
    "Q4_0": Format(32, 4, 8, False),
    "Q4_1": Format(32, 4, 0, True),
    "Q5_0": Format(32, 5, 16, False),
    "Q5_1": Format(32, 5, 0, True),
    "Q8_0": Format(32, 8, 128, False),
    "Q4_K": Format(32, 4, 0, True),
    "Q5_K": Format(32, 5, 0, True),
    "Q6_K": Format(16, 8, 128, False),  # the 6-bit codes as bytes + 96 (the module docstring)
}
FLOAT_TYPES = ("F32", "F16", "BF16")
SUPPORTED_TYPES = (*FORMATS, *FLOAT_TYPES)


def check_type(name: str, tensor: str = "a tensor") -> None:
    """Raise a clear error for a GGUF tensor type selfspec cannot compute with natively."""
    if name not in SUPPORTED_TYPES:
        raise UnsupportedQuantError(
            f"{tensor} has GGUF type {name}, which selfspec's quantized kernels do not support "
            f"(supported: {', '.join(SUPPORTED_TYPES)}); load it with dtype='float32' to dequantize it instead"
        )


def _f16(b: np.ndarray) -> np.ndarray:  # [..., 2] uint8 -> [...] float32
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:  # [n, 16] bytes -> [n, 32]: low nibbles first, then high ones
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _bits32(qh: np.ndarray) -> np.ndarray:  # [n, 4] bytes (a little-endian uint32) -> [n, 32] bits
    v = np.ascontiguousarray(qh).view(np.uint32)  # [n, 1]
    return ((v >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


@dataclass(frozen=True)
class Factored:
    """A K-quant's per-group scales (or offsets) in the two levels its GGUF stores: a small integer per group times a
    float16 per super-block of 256 weights. ``values()`` is their float32 product, as gguf-py forms it."""

    sub: np.ndarray  # [N, G] uint8 (Q4_K / Q5_K's 6-bit sc and m) or int8 (Q6_K's sc)
    sup: np.ndarray  # [N, G / P] float16: d (or dmin) of each super-block of P = 256 / g groups

    @property
    def per(self) -> int:
        return self.sub.shape[1] // self.sup.shape[1]

    def values(self) -> np.ndarray:  # [N, G] float32
        return np.repeat(self.sup.astype(np.float32), self.per, axis=1) * self.sub.astype(np.float32)

    def rows(self, idx: np.ndarray) -> Factored:
        return Factored(self.sub[idx], self.sup[idx])

    def padded(self, pad: int) -> Factored:  # pad rows of zeros (value 0)
        return Factored(np.concatenate([self.sub, np.zeros((pad, self.sub.shape[1]), self.sub.dtype)]),
                        np.concatenate([self.sup, np.zeros((pad, self.sup.shape[1]), self.sup.dtype)]))


Groups = np.ndarray | Factored  # per-group scales or offsets: float32 values, or a K-quant's two levels


@overload
def values_of(v: Groups) -> np.ndarray: ...
@overload
def values_of(v: None) -> None: ...
@overload
def values_of(v: Groups | None) -> np.ndarray | None: ...
def values_of(v: Groups | None) -> np.ndarray | None:
    """Per-group values as float32 ``# [N, G]`` (None stays None)."""
    return v.values() if isinstance(v, Factored) else v


def decode(raw: np.ndarray, type_name: str, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, Format]:
    """``raw`` ``# [N, row_bytes] uint8`` rows of a GGUF tensor of ``type_name`` with ``k`` columns ->
    (codes ``# [N, K] uint8``, scales ``# [N, K / g]`` float32, offsets or None, format)."""
    codes, scales, offsets, fmt = decode_factored(raw, type_name, k)
    return codes, values_of(scales), values_of(offsets), fmt


def decode_factored(raw: np.ndarray, type_name: str, k: int) -> tuple[np.ndarray, Groups, Groups | None, Format]:
    """``decode``, with a K-quant's scales and offsets kept in their two levels (``Factored``), as it packs them."""
    check_type(type_name)
    fmt = FORMATS[type_name]
    qt = T[type_name]
    block, size = GGML_QUANT_SIZES[qt]
    n = raw.shape[0]
    if k % block or raw.shape[1] != k // block * size:
        raise UnsupportedQuantError(f"{type_name} rows of {k} weights: {raw.shape[1]} bytes each, where blocks of "
                                    f"{block} weights in {size} bytes need a row length that is a multiple of {block}")
    b = np.ascontiguousarray(raw).reshape(-1, size)  # [n * blocks, size]
    scale: np.ndarray | tuple  # per block: float32 values, or a K-quant's (d, sub) levels
    off: np.ndarray | tuple | None = None
    if type_name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        d = _f16(b[:, 0:2])
        pos = 2
        if fmt.offset:
            off = -_f16(b[:, 2:4])
            pos = 4
        q = _nibbles(b[:, -16:])
        if fmt.bits == 5:
            q = q | (_bits32(b[:, pos : pos + 4]) << 4)
        scale = d
    elif type_name == "Q8_0":
        scale = _f16(b[:, 0:2])
        q = (b[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    elif type_name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
        sc, m = Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))  # [nb, 8] each (gguf-py's unpacking)
        scale = (d, sc.astype(np.uint8))  # d * sc, as gguf-py forms it (Factored.values)
        off = (dmin, m.astype(np.uint8))
        qs = b[:, -128:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        q = (qs & 15).reshape(-1, 8, 32)
        if type_name == "Q5_K":
            qh = b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
            q = q | ((qh & 1) << 4)
    else:  # Q6_K
        ql, qh, sc = b[:, 0:128], b[:, 128:192], b[:, 192:208].view(np.int8)
        d = _f16(b[:, 208:210])
        scale = (d, sc.copy())  # d * sc: [nb, 16]
        lo = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 15
        hi = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
        q = (lo.reshape(-1, 8, 32) | (hi.reshape(-1, 8, 32) << 4)) + np.uint8(96)  # (q6 - 32) + 128
    groups = k // fmt.group
    codes = np.ascontiguousarray(q, dtype=np.uint8).reshape(n, k)

    def per_row(v: np.ndarray | tuple | None) -> Groups | None:
        if isinstance(v, tuple):  # (d [nb] float32 from float16, sub [nb, P]): one super-block each
            d, sub = v
            return Factored(np.ascontiguousarray(sub).reshape(n, groups), d.astype(np.float16).reshape(n, -1))
        return None if v is None else np.ascontiguousarray(v, dtype=np.float32).reshape(n, groups)

    scales = per_row(scale)
    assert scales is not None
    return codes, scales, per_row(off), fmt


def reference_values(codes: np.ndarray, scales: np.ndarray, offsets: np.ndarray | None, fmt: Format) -> np.ndarray:
    """``(q - z) * s - o`` in float32, ``# [N, K]``: what the kernels compute per weight (for tests)."""
    n, k = codes.shape
    s = np.repeat(scales, fmt.group, axis=1)
    w = (codes.astype(np.float32) - np.float32(fmt.zero)) * s
    if offsets is not None:
        w = w - np.repeat(offsets, fmt.group, axis=1)
    return w
