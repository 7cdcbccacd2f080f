"""A block-quantized weight matrix, packed once for selfspec's kernels (layout: ``selfspec/kernels/qcodes.h``).

``QuantWeight.from_gguf(raw, type_name, k)`` decodes a GGUF tensor's rows (``selfspec.quant.formats``)
and interleaves 16 output rows per block (``selfspec.quant.packing``), so a column of the block is one vector
of codes:

    codes    # [N / 16, G, CB] uint8   (CB bytes per group: nibble pairs, 5-bit words or planes, or bytes)
    scales   # [N / 16, G, 16] float16 for the legacy types (exact: their d and m are float16 in the GGUF);
             # the K-quants' two levels as their GGUF stores them, [N / 16, G / P, 16 P + 32] bytes (a sub-scale
             # byte per group, a float16 d per super-block of P groups; qcodes.h's Scales); float32 otherwise
    offsets  # in the form of scales, or an empty tensor

Nothing else is kept: no float32 copy of the matrix. ``matmul`` runs the kernel (any number of rows, 16
at a time), ``rows(ids)`` dequantizes some rows (an embedding lookup, a trimmed LM head), ``dense()``
the whole matrix (the reference path only), ``select(ids)`` keeps some rows as a new QuantWeight.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import overload

import numpy as np
import torch

from selfspec.kernels.build import built_extension, cpu_flags, kernel_source_hash, matrix_unit
from selfspec.paths import atomic_write_text, cache_root
from selfspec.quant.formats import FORMATS, Factored, Format, Groups, decode_factored, values_of
from selfspec.quant.numerics import NUMERICS, Numerics
from selfspec.quant.packing import (
    LANES,
    factored_k_scales,
    pack_codes,
    pack_groups,
    pack_scales,
    scale_dtype,
    unpack_scales,
    unpack_words5,
    words5,
)
from selfspec.timing import time_call

_NO_BIAS = torch.empty(0)
KERNEL_ROWS = 16  # x-rows per kernel call: the kernel keeps one accumulator per x-row and lane vector
# A prefill multiplies hundreds of x-rows by every weight, so its cost is multiply-adds, not reading weights; the
# decoding kernel then spends much of its time decoding every weight again for each tile of 8 rows. Two other ways
# decode each weight once per many rows: panels (``qgemm`` in qgemm.cpp: a panel of 32 output rows x 256 columns
# dequantized into a cache-resident buffer, register tiles of 12 x-rows x 32 outputs against it) from PANEL_ROWS rows,
# and tiles of W^T dequantized for torch's GEMM from GEMM_ROWS rows. Which one is fastest depends on the CPU and the
# weight type (on one CPU torch's GEMM wins at a long prompt, on another the panels win and torch's GEMM is slowest;
# docs/QUANTIZED.md), so it is timed once per machine and type (``prefill_path``). Same weights every way, so the same
# target; the int8 mode keeps its kernel.
PANEL_ROWS = 32
GEMM_ROWS = 128
GEMM_TILE = 1 << 20  # float32 weights per dequantized tile (4 MB: stays in cache while the GEMM reads it)
PREFILL_PATHS = ("kernel", "panels", "torch")
# Another path is chosen over the panels only when it takes under this share of their time: the panels alone give a
# row the same bits in any call, which the prompt prefix cache needs (selfspec/prefix_cache.py), and a whole prompt's
# prefill saved is worth more than a few percent of one. Without the margin a near-tie between the kernel and the
# panels would be decided by the host's noise, and a noisy probe could turn the prefix cache off.
PANELS_MARGIN = 0.9
PROBE = (4096, 1024, 256)  # the probe weight of each type: N, K, x-rows
_prefill_paths: dict[tuple[str, str], str] = {}  # this process's answers by weight type and matrix unit


def prefill_path(type_name: str) -> str:
    """How ``matmul`` multiplies PANEL_ROWS or more x-rows by a weight of ``type_name`` on this machine: "kernel",
    "panels" or "torch" (PREFILL_PATHS), whichever was fastest on a PROBE weight of that type. Timed once per
    machine (its CPU, torch, thread count and kernels) and cached in ``cache_root()/prefill``."""
    key = (type_name, matrix_unit())
    if key not in _prefill_paths:
        _prefill_paths[key] = _measured_prefill_path(type_name)
    return _prefill_paths[key]


def kernel_rows_independent(type_name: str) -> bool:
    """Whether the decoding kernel gives a row of ``type_name`` the same bits in any call, as the panels do: on AMX
    tiles (4- and 5-bit codes in groups of 32, bytes in groups of 16 or 32; ``matrix_unit``) each row's sums are its
    own, for bytes in calls of more than 16 rows (a prefill's PANEL_ROWS or more). The FMA kernels' partial sums
    follow the tile a row falls in."""
    fmt = FORMATS[type_name]
    tiles = (fmt.bits in (4, 5) and fmt.group == 32) or (fmt.bits == 8 and fmt.group in (16, 32))
    return tiles and matrix_unit() == "amx"


def _measured_prefill_path(type_name: str) -> str:
    key = json.dumps([cpu_flags(), torch.__version__, torch.get_num_threads(), kernel_source_hash(), matrix_unit(),
                      type_name, PROBE])
    path = cache_root() / "prefill" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    try:
        ms = json.loads(path.read_text())["ms"]
        if set(ms) == set(PREFILL_PATHS):  # decided again from the stored timings (they outlive a change of the rule)
            return choose_prefill_path({name: float(t) for name, t in ms.items()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    n, k, rows = PROBE
    rng = np.random.default_rng(0)
    w = random_weight(type_name, n, k, rng)
    x, out = torch.randn(rows, k), torch.empty(rows, n)
    ways = {"kernel": w._kernel_rows, "panels": w._panels, "torch": w._gemm}
    with torch.inference_mode():
        ms = {name: time_call(lambda f=f: f(x, out, None, False), reps=5, warmup=1, quantile=0.0) * 1e3
              for name, f in ways.items()}
    answer = choose_prefill_path(ms)
    atomic_write_text(path, json.dumps({"path": answer, "ms": ms, "type": type_name, "probe": PROBE}))
    return answer


def random_weight(type_name: str, n: int, k: int, rng: np.random.Generator) -> QuantWeight:
    """A packed weight of ``type_name`` with random codes, scales and offsets in the type's packed form."""
    fmt = FORMATS[type_name]
    codes = rng.integers(0, 1 << fmt.bits, (n, k), dtype=np.uint8)
    groups = k // fmt.group

    def scales() -> Groups:
        if type_name.endswith("_K"):  # two levels, as the GGUF's
            sub = rng.integers(-32 if type_name == "Q6_K" else 0, 64, (n, groups)).astype(
                np.int8 if type_name == "Q6_K" else np.uint8)
            return Factored(sub, rng.random((n, groups * fmt.group // 256), dtype=np.float32).astype(np.float16))
        return rng.random((n, groups), dtype=np.float32)

    return QuantWeight.from_codes(type_name, codes, scales(), scales() if fmt.offset else None)


@overload
def _padded(v: Groups, pad: int) -> Groups: ...
@overload
def _padded(v: None, pad: int) -> None: ...
def _padded(v: Groups | None, pad: int) -> Groups | None:
    if v is None:
        return None
    if isinstance(v, Factored):
        return v.padded(pad)
    return np.concatenate([v, np.zeros((pad, v.shape[1]), dtype=np.float32)])


def choose_prefill_path(ms: dict[str, float]) -> str:
    """The prefill path of a type from its probe's times (ms per path): the fastest, unless the panels are within
    PANELS_MARGIN of it (then the panels)."""
    best = min(ms, key=lambda name: ms[name])
    return "panels" if "panels" in ms and ms[best] > PANELS_MARGIN * ms["panels"] else best


def _joined(ts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(ts)``, or without a copy a view spanning them when they are consecutive contiguous slices
    (along dim 0) of one storage."""
    first = ts[0]
    ptr, end = first.untyped_storage().data_ptr(), first.storage_offset()
    for t in ts:
        if (not t.is_contiguous() or t.untyped_storage().data_ptr() != ptr or t.storage_offset() != end
                or t.dtype != first.dtype or t.shape[1:] != first.shape[1:]):
            return torch.cat(ts)
        end += t.numel()
    return first.as_strided((sum(t.shape[0] for t in ts), *first.shape[1:]), first.stride())


@dataclass
class QuantWeight:
    """A [N, K] weight in the kernels' packed block form (see the module docstring)."""

    type_name: str  # the GGUF type it came from, e.g. "Q4_K"
    shape: tuple[int, int]  # (N, K)
    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    numerics: str = "exact"  # how it multiplies (ModelConfig.numerics; selfspec/quant/numerics.py)

    @property
    def mode(self) -> Numerics:
        return NUMERICS[self.numerics]

    @property
    def format(self) -> Format:
        return FORMATS[self.type_name]

    @property
    def nbytes(self) -> int:
        """Bytes a full read of the packed weight streams (what one decoding step reads)."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.offsets))

    @classmethod
    def from_gguf(cls, raw: np.ndarray, type_name: str, k: int, factored: bool | None = None) -> QuantWeight:
        """``raw`` ``# [N, row_bytes] uint8``: a GGUF tensor's rows of ``type_name`` with ``k`` columns
        (``factored``: as in ``from_codes``)."""
        codes, scales, offsets, fmt = decode_factored(raw, type_name, k)
        return cls.from_codes(type_name, codes, scales, offsets, factored)

    @classmethod
    def from_codes(cls, type_name: str, codes: np.ndarray, scales: Groups, offsets: Groups | None,
                   factored: bool | None = None) -> QuantWeight:
        """Pack codes ``# [N, K]`` with their per-group scales and offsets ``# [N, G]`` (float32 values, or a
        K-quant's ``Factored`` two levels). ``factored``: whether two levels stay two levels (near the GGUF's size)
        or become float32 values; None: this build's choice (``factored_k_scales``)."""
        if factored is None:
            factored = factored_k_scales()
        if not factored:
            scales, offsets = values_of(scales), values_of(offsets)
        fmt = FORMATS[type_name]
        n, k = codes.shape
        pad = -n % LANES
        if pad:  # padding rows: code z, scale 0 -> weight 0 (never written out)
            codes = np.concatenate([codes, np.full((pad, k), fmt.zero, dtype=np.uint8)])
            scales, offsets = _padded(scales, pad), _padded(offsets, pad)
        dtype = scale_dtype(type_name, values_of(scales), values_of(offsets))
        return cls(
            type_name, (n, k), torch.from_numpy(pack_codes(codes, fmt)), torch.from_numpy(pack_scales(scales, dtype)),
            torch.from_numpy(pack_scales(offsets, dtype)) if offsets is not None else torch.empty(0),
        )

    def kernel_args(self) -> tuple:
        """(codes, scales, offsets, bits, group, zero point): the packed weight as every kernel takes it."""
        f = self.format
        return self.codes, self.scales, self.offsets, f.bits, f.group, float(f.zero)

    def matmul(self, x: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None = None,
               accumulate: bool = False) -> torch.Tensor:
        """``out`` ``# [M, >= N]`` (a column slice of a wider output is fine) = or += ``x`` ``# [M, K]`` @ W^T
        (+ bias): 16 rows of x per kernel call, or for a prefill the way measured fastest on this machine
        (``prefill_path``): panels from PANEL_ROWS rows, dequantized tiles through torch's GEMM from GEMM_ROWS."""
        rows = x.shape[0]
        if rows >= PANEL_ROWS and self.mode.panels:
            way = prefill_path(self.type_name)
            if way == "panels":
                return self._panels(x, out, bias, accumulate)
            if way == "torch" and rows >= GEMM_ROWS:
                return self._gemm(x, out, bias, accumulate)
        return self._kernel_rows(x, out, bias, accumulate)

    def _kernel_rows(self, x: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None,
                     accumulate: bool) -> torch.Tensor:
        """``matmul`` through the kernel, 16 rows of x per call."""
        ext = built_extension()
        b = bias if bias is not None else _NO_BIAS
        kernel = getattr(ext, self.mode.kernel)
        # a decoding step, or any rows for qlinear (its AMX path decodes each block once for many rows; the FMA
        # kernels take them in runs of KERNEL_ROWS, as below): no slicing (each slice is an op on the hot path)
        if x.shape[0] <= KERNEL_ROWS or self.mode.kernel == "qlinear":
            return kernel(x, *self.kernel_args(), b, out, accumulate)
        for s in range(0, x.shape[0], KERNEL_ROWS):
            e = min(x.shape[0], s + KERNEL_ROWS)
            kernel(x[s:e], *self.kernel_args(), b, out[s:e], accumulate)
        return out

    def _panels(self, x: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None,
                accumulate: bool) -> torch.Tensor:
        """``matmul`` for many rows: panels of the weight dequantized once per 120 rows of x (``qgemm``)."""
        return built_extension().qgemm(x, *self.kernel_args(), bias if bias is not None else _NO_BIAS, out, accumulate)

    def _gemm(self, x: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None, accumulate: bool) -> torch.Tensor:
        """``matmul`` for many rows: tiles of W^T ``# [K, rows]`` dequantized by the kernels, then ``x @ tile``."""
        n, k = self.shape
        blocks = self.codes.shape[0]
        step = max(1, GEMM_TILE // (k * LANES))  # blocks per tile
        ext = built_extension()
        for b0 in range(0, blocks, step):
            b1 = min(blocks, b0 + step)
            n0, n1 = b0 * LANES, min(n, b1 * LANES)
            tile = ext.qdense_t(*self.kernel_args(), b0, b1, torch.empty(k, (b1 - b0) * LANES))
            y = torch.mm(x, tile[:, : n1 - n0])  # [M, n1 - n0]
            if bias is not None:
                y += bias[n0:n1]
            if accumulate:
                out[:, n0:n1] += y
            else:
                out[:, n0:n1] = y
        return out

    def group_values(self, t: torch.Tensor) -> torch.Tensor:
        """Packed scales or offsets ``t`` as float32 values ``# [N / 16, G, 16]``, whatever their form."""
        return torch.from_numpy(pack_groups(values_of(unpack_scales(t.numpy()))))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` ``# [R]`` dequantized: ``# [R, K]`` float32, bit for bit gguf-py's values."""
        if ids.dim() != 1 or ids.dtype != torch.long or not ids.is_contiguous():  # a step's ids: no op to make
            ids = ids.reshape(-1).to(torch.long).contiguous()
        out = torch.empty(len(ids), self.shape[1], dtype=torch.float32)
        n = self.shape[0]
        # a decoding step's few ids checked as Python ints (four tensor ops cost more than the row itself)
        bad = any(not 0 <= i < n for i in ids.tolist()) if len(ids) <= 64 else bool((ids >= n).any() or (ids < 0).any())
        if bad:
            raise IndexError(f"row ids must be in [0, {n})")
        return built_extension().qdequant(*self.kernel_args(), ids, out)

    def dense(self) -> torch.Tensor:
        """The whole matrix in float32 (the reference path; the engine never calls this)."""
        return self.rows(torch.arange(self.shape[0]))

    def _block_codes(self, c: np.ndarray) -> np.ndarray:  # [B, G, group bytes] packed -> [B, G, g, 16] codes
        fmt = self.format
        nb, groups, g = c.shape[0], c.shape[1], fmt.group
        if fmt.bits == 8:
            return c.reshape(nb, groups, g, LANES)
        if fmt.bits == 5 and words5():
            return unpack_words5(c)
        pairs = c[:, :, : g * 8].reshape(nb, groups, g // 2, LANES)
        q = np.empty((nb, groups, g, LANES), dtype=np.uint8)
        q[:, :, 0::2], q[:, :, 1::2] = pairs & 15, pairs >> 4
        if fmt.bits == 5:
            plane = c[:, :, g * 8 :].copy().view(np.uint16)  # [B, G, g]
            q |= (((plane[..., None] >> np.arange(LANES, dtype=np.uint16)) & 1) << 4).astype(np.uint8)
        return q

    def unpacked(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(codes ``# [N, K]``, scales, offsets) as ``formats.decode`` gave them."""
        n, k = self.shape
        nb = self.codes.shape[0]
        codes = self._block_codes(self.codes.numpy()).transpose(0, 3, 1, 2).reshape(nb * LANES, k)[:n]

        def groups_of(t: torch.Tensor) -> np.ndarray:  # float32, as decode gives them (float16 widens exactly)
            return values_of(unpack_scales(t.numpy()))[:n]

        return codes, groups_of(self.scales), groups_of(self.offsets) if self.offsets.numel() else None

    def select(self, ids: torch.Tensor | np.ndarray) -> QuantWeight:
        """Rows ``ids`` as a new packed QuantWeight (a trimmed LM head: the rows stay quantized). Only the packed
        blocks that hold them are decoded, and only their rows gathered (Qwen2.5's 4,096-token draft vocabulary:
        1,492 of 9,496 blocks, where decoding the whole matrix is a large part of a load)."""
        idx = np.asarray(ids, dtype=np.int64).reshape(-1)
        if len(idx) and (idx.min() < 0 or idx.max() >= self.shape[0]):
            raise IndexError(f"row ids must be in [0, {self.shape[0]})")
        blocks, where = np.unique(idx // LANES, return_inverse=True)
        where, lane = where.reshape(-1), idx % LANES
        q = self._block_codes(self.codes.numpy()[blocks])  # [B, G, g, 16]
        codes = q[where, :, :, lane].reshape(len(idx), self.shape[1])  # [R, G, g] -> [R, K]

        def rows_of(t: torch.Tensor) -> Groups:  # the blocks' scales -> [R, G] (float16 widens exactly)
            v = unpack_scales(t.numpy()[blocks])  # [B * 16, G]
            r = where * LANES + lane
            return v.rows(r) if isinstance(v, Factored) else v[r]

        sub_scales = rows_of(self.scales)
        out = QuantWeight.from_codes(self.type_name, codes, sub_scales,
                                     rows_of(self.offsets) if self.offsets.numel() else None,
                                     factored=isinstance(sub_scales, Factored))  # the form this weight has
        out.numerics = self.numerics
        return out

    def joins(self, other: QuantWeight) -> bool:
        """Whether ``concat`` can fuse ``other`` after this weight: one type, one K, one numerics mode, one scale
        dtype and row counts that are multiples of 16 (whole packed blocks)."""
        return (other.type_name == self.type_name and other.shape[1] == self.shape[1] and other.numerics == self.numerics
                and other.scales.dtype == self.scales.dtype and self.shape[0] % LANES == 0
                and other.shape[0] % LANES == 0)

    @staticmethod
    def concat(parts: list[QuantWeight]) -> QuantWeight:
        """Several weights of one type and K, each N a multiple of 16, as one (fused q/k/v, gate/up). The parts
        are re-pointed at slices of the fused tensors, so the model holds one copy, not two. Parts that already
        are consecutive slices of one tensor (``selfspec.quant.store`` keeps such runs together) are fused as a
        view of it: no copy at all."""
        first = parts[0]
        if not all(first.joins(p) for p in parts):
            raise ValueError("concat needs one type, one K, one numerics mode, one scale dtype and row counts that are "
                             "multiples of 16")
        fused = QuantWeight(first.type_name, (sum(p.shape[0] for p in parts), first.shape[1]),
                            _joined([p.codes for p in parts]), _joined([p.scales for p in parts]),
                            _joined([p.offsets for p in parts]) if first.offsets.numel() else torch.empty(0),
                            first.numerics)
        start = 0
        for p in parts:
            end = start + p.shape[0] // LANES
            p.codes, p.scales = fused.codes[start:end], fused.scales[start:end]
            if p.offsets.numel():
                p.offsets = fused.offsets[start:end]
            start = end
        return fused
