"""Linear layers packed once for decoding, with the kernel chosen per device and dtype.

A decoding step multiplies a few rows (1 token, a verification block, a draft) by every weight of
the model, so its cost is reading the weights: memory bandwidth. torch's default ``F.linear`` and oneDNN
are GEMMs built for compute-bound shapes and fall short of the read bandwidth at a few rows
(docs/BENCHMARKS.md); selfspec's own kernel (``gemv.cpp``) streams a packed copy of each weight in the
order it is read, so a step reads each weight once, front to back. Paths, by device and dtype:

    cpu float32, rows <= 16   selfspec-cpu: gemv.cpp, compiled once on first use (-O3 -march=native)
                              into the cache directory; weights packed [N/8, K, 8]
    cpu float32, 17-64 rows   the same kernel, 16 rows per call (a batch's verification blocks)
    cpu float32, rows > 64    torch F.linear on the original weights (MKL sgemm: prefill is compute-bound)
    block-quantized (GGUF)    selfspec-quant: qlinear.cpp for every row count, 16 rows per call (docs/QUANTIZED.md);
                              no fallback: without the compiled kernels a clear error, not a slow path
    cpu bfloat16              oneDNN with the weight reordered once (``torch.ops.mkldnn``) on CPUs with
                              native bf16 support (AVX-512 BF16 / AMX / AVX-NE-CONVERT), else F.linear
    cuda / other              F.linear (cuBLAS is left alone)

When the kernel cannot be built (no C++ compiler), float32 falls back to oneDNN, then to F.linear,
with one warning; ``SELFSPEC_KERNEL=onednn`` skips selfspec's kernels and ``SELFSPEC_KERNEL=torch`` forces
plain F.linear everywhere (a reference for tests).

Several weights sharing an input (q, k, v; gate, up) are packed as one (fused projections): one
kernel call instead of three, and the output is their concatenation.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F

from selfspec.errors import SelfSpecError
from selfspec.kernels.build import built_extension, cpu_extension
from selfspec.quant.weight import QuantWeight

MAX_GEMV_ROWS = 16  # the custom kernel's row limit (a decoding step, a verification block)
MAX_CHUNKED_ROWS = 64  # up to here, blocks of 16 rows through the kernel beat MKL's sgemm (PackedLinear.__call__)


# The kinds of kernel call a step plan makes (``Part.kind`` in selfspec/kernels/step.cpp)
_PART_FLOAT32 = 2  # a float32 weight's Part kind (quantized parts: their numerics' part_kind)


class KernelUnavailableError(SelfSpecError):
    """A weight format that needs selfspec's compiled kernels, where they could not be built."""


def _onednn_ok(dtype: torch.dtype) -> bool:
    return (
        os.environ.get("SELFSPEC_KERNEL", "") != "torch"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and (dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()))
    )


def kernel_name(device: torch.device | str, dtype: torch.dtype) -> str:
    """The kernel path a (device, dtype) gets, as named in every benchmark figure."""
    if torch.device(device).type != "cpu":
        return "torch-F.linear"
    if dtype == torch.float32 and cpu_extension() is not None:
        return "selfspec-cpu"
    if _onednn_ok(dtype):
        return "onednn"
    return "torch-F.linear"


class PackedLinear:
    """``y = x @ cat(W_i)^T + cat(b_i)`` for weights ``W_i [N_i, K]`` sharing the input ``x [..., K]``.

    A weight may be a block-quantized ``QuantWeight`` (a GGUF loaded natively): then every row count runs through
    the quantized kernel (``selfspec/kernels/qlinear.cpp``, 16 rows per call; it reads the packed blocks, a fraction
    of float32's bytes, and beats MKL's float32 GEMM on them, so prefill uses it too), consecutive weights of one
    type fused into one call. ``out`` given and ``accumulate=True`` adds into it in place (the residual stream)."""

    def __init__(self, parts: list[tuple[torch.Tensor | QuantWeight, torch.Tensor | None]]) -> None:
        ws = [w if isinstance(w, QuantWeight) else w.detach() for w, _ in parts]
        self.parts = parts  # the originals, for many rows (prefill) and the reference
        self.out_features = sum(w.shape[0] for w in ws)
        self.in_features = ws[0].shape[1]
        quant = any(isinstance(w, QuantWeight) for w in ws)
        dense = [w for w in ws if isinstance(w, torch.Tensor)]  # every part unless quant
        self.device, self.dtype = (torch.device("cpu"), torch.float32) if quant else (dense[0].device, dense[0].dtype)
        biases = [b.detach() if b is not None else torch.zeros(w.shape[0], dtype=self.dtype, device=self.device)
                  for w, b in zip(ws, [b for _, b in parts])]
        self.bias = torch.cat(biases) if any(b is not None for _, b in parts) else None
        self.path = kernel_name(self.device, self.dtype)
        self._packed: torch.Tensor | None = None
        self._onednn: torch.Tensor | None = None
        self._quant: list[tuple[Any, int, int]] | None = None  # (QuantWeight or float PackedLinear, first, end)
        if quant:
            self._quant = _quant_segments(ws)
            self.path = "selfspec-quant"
        elif self.path in ("selfspec-cpu", "onednn"):
            w = torch.cat(dense) if len(dense) > 1 else dense[0]  # the fused weight, kept only in packed form
            if self.path == "selfspec-cpu" and self.in_features % 4 == 0:
                n_pad = -w.shape[0] % 8
                if n_pad:
                    w = torch.cat([w, w.new_zeros(n_pad, w.shape[1])])
                n, k = w.shape
                self._packed = w.reshape(n // 8, 8, k).permute(0, 2, 1).contiguous()  # [N/8, K, 8]
                self._bias_arg = self.bias if self.bias is not None else w.new_empty(0)
            else:
                self.path = "onednn"
                self._onednn = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 1)
        else:
            self.path = "torch-F.linear"

    @property
    def nbytes(self) -> int:
        """Bytes of weights one call reads: each block-quantized part's packed streams, each dense part's float
        weight (its packed or reordered copy holds the same values, padding aside), and the bias."""
        total = sum(w.nbytes if isinstance(w, QuantWeight) else w.numel() * w.element_size() for w, _ in self.parts)
        return total + (self.bias.numel() * self.bias.element_size() if self.bias is not None else 0)

    def _torch(self, x: torch.Tensor) -> torch.Tensor:
        parts = [(w.dense() if isinstance(w, QuantWeight) else w, b) for w, b in self.parts]
        if len(parts) == 1:
            w, b = parts[0]
            return F.linear(x, w, b)
        return torch.cat([F.linear(x, w, b) for w, b in parts], dim=-1)

    def _rows(self, x: torch.Tensor, rows: int, out: torch.Tensor | None,
              accumulate: bool) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """The kernels' view of a call: x as ``# [rows, K]`` float32 contiguous, the ``# [rows, N]`` output to
        write (``out``'s view, or a new one, which nothing is accumulated into)."""
        x2 = x.reshape(rows, self.in_features).float().contiguous()
        if out is None:
            return x2, x2.new_empty(rows, self.out_features), False
        return x2, out.view(rows, self.out_features), accumulate

    def _run_quant(self, x2: torch.Tensor, y: torch.Tensor, accumulate: bool) -> None:
        assert self._quant is not None
        if len(self._quant) == 1 and isinstance(self._quant[0][0], QuantWeight):  # one call, no column slices
            self._quant[0][0].matmul(x2, y, self.bias, accumulate)
            return
        for w, a, b in self._quant:
            bias = self.bias[a:b] if self.bias is not None else None
            if isinstance(w, QuantWeight):
                w.matmul(x2, y[:, a:b], bias, accumulate)
            else:  # a float32 weight among quantized ones
                part = w(x2)
                part = part if bias is None else part + bias
                y[:, a:b] = y[:, a:b] + part if accumulate else part

    def kernel_plan(self, ext: Any) -> Any | None:
        """This linear as the kernel calls a decoding step makes (``ext.Linear`` of ``selfspec/kernels/step.cpp``,
        the same calls with the same arguments as ``__call__`` for 1-16 rows), or None where it runs off
        selfspec's kernels (oneDNN, F.linear, a float32 part among quantized ones)."""
        empty = torch.empty(0)
        if self._quant is not None:
            parts = []
            for w, a, b in self._quant:
                if not isinstance(w, QuantWeight):
                    return None
                bias = self.bias[a:b] if self.bias is not None else empty
                parts.append(ext.Part(w.mode.part_kind, *w.kernel_args(), bias, a, b))
        elif self._packed is not None:
            parts = [ext.Part(_PART_FLOAT32, self._packed, empty, empty, 0, 0, 0.0, self._bias_arg, 0, self.out_features)]
        else:
            return None
        return ext.Linear(parts, self.out_features)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.numel() // self.in_features
        no_grad = not (x.requires_grad and torch.is_grad_enabled())  # the kernels have no backward
        if self._quant is not None and rows > 0 and no_grad:
            x2, y, accumulate = self._rows(x, rows, out, accumulate)
            self._run_quant(x2, y, accumulate)
            return y.view(*lead, self.out_features) if out is None else out
        if self._packed is not None and 0 < rows <= MAX_CHUNKED_ROWS and x.dtype == torch.float32 and no_grad:
            x2, y, accumulate = self._rows(x, rows, out, accumulate)
            # Beyond 16 rows (a batch's verification blocks), 16 rows per kernel call: a few passes over the
            # packed weights still cost less than MKL's sgemm until the rows make the multiply compute-bound
            # (MAX_CHUNKED_ROWS; past it MKL's blocking wins)
            for s in range(0, rows, MAX_GEMV_ROWS):
                e = min(rows, s + MAX_GEMV_ROWS)
                built_extension().linear(x2[s:e], self._packed, self._bias_arg, y[s:e], accumulate)
            return y.view(*lead, self.out_features) if out is None else out
        if self._onednn is not None and no_grad:
            y = torch.ops.mkldnn._linear_pointwise(x, self._onednn, self.bias, "none", [], "")
        else:
            y = self._torch(x)
        if out is None:
            return y
        if accumulate:
            return out.add_(y)
        return out.copy_(y)


def _quant_segments(ws: list[torch.Tensor | QuantWeight]) -> list[tuple[Any, int, int]]:
    """Output column ranges of the parts; consecutive quantized parts of one type (row counts a multiple of
    16) fused into one QuantWeight, float parts packed on their own."""
    if cpu_extension() is None:
        raise KernelUnavailableError(
            "quantized weights need selfspec's CPU kernels, which could not be built here (a C++ compiler and "
            "ninja are needed); load the model with dtype='float32' to run it dequantized instead"
        )
    runs: list[list[Any]] = []  # consecutive parts computed by one call
    for w in ws:
        prev = runs[-1][-1] if runs else None
        if (isinstance(w, QuantWeight) and isinstance(prev, QuantWeight) and prev.type_name == w.type_name
                and prev.shape[0] % 16 == 0 and w.shape[0] % 16 == 0):
            runs[-1].append(w)
        else:
            runs.append([w])
    segs: list[tuple[Any, int, int]] = []
    start = 0
    for run in runs:
        end = start + sum(w.shape[0] for w in run)
        if isinstance(run[0], QuantWeight):
            segs.append((QuantWeight.concat(run) if len(run) > 1 else run[0], start, end))
        else:
            segs.append((PackedLinear([(run[0].float(), None)]), start, end))
        start = end
    return segs


def pack_linear(*modules: Any) -> PackedLinear:
    """Pack ``nn.Linear`` modules (or ``QuantLinear``s) that share an input into one PackedLinear (their
    outputs concatenated)."""
    return PackedLinear([(getattr(m, "qweight", None) or m.weight, m.bias) for m in modules])
