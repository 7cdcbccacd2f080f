"""The exact kernel on AMX tiles (qlinear_amx.cpp): float32 activations as three bfloat16 limbs times the codes,
group sums in float32. The limb arithmetic is checked everywhere as a torch reference; the kernel itself where the
CPU has AMX and Linux grants the tile state (skipped elsewhere, with the reason). AMX is on by default where it
exists, so test_quant's kernel and screen tests (qargmax is torch.argmax of qlinear's logits) run on it there."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, dequantize
from test_quant import random_tensor

from selfspec.kernels.build import built_extension, matrix_unit
from selfspec.quant.weight import QuantWeight

CODE_TYPES = ["Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K"]  # 4- and 5-bit codes in groups of 32: every call
BYTE_TYPES = ["Q8_0", "Q6_K"]  # bytes in groups of 32 and 16: calls of AMX_BYTES_ROWS / more than 16 rows
AMX_TYPES = CODE_TYPES + BYTE_TYPES  # every block type the engine runs
FROM_ROWS = {"Q8_0": 8, "Q6_K": 17}  # qcodes.h's amx_takes: the fewest rows of a call that take the tiles


def limbs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x = x0 + x1 + x2: each limb bfloat16, rounded to nearest, of what the earlier ones leave (float32, exact)."""
    x0 = x.to(torch.bfloat16)
    r1 = x - x0.float()
    x1 = r1.to(torch.bfloat16)
    x2 = (r1 - x1.float()).to(torch.bfloat16)
    return x0, x1, x2


def limb_reference(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, group: int = 32) -> torch.Tensor:
    """y[m, n] = sum_g s[n, g] * ((S_g(x0) + S_g(x1)) + S_g(x2)), each S_g a float32 sum of exact limb x code
    products: the kernel's arithmetic, in torch's order of the sums. q # [N, K] code values, s # [N, K / group]."""
    m, k = x.shape
    g = k // group
    y = torch.zeros(m, q.shape[0])
    for j in range(g):
        cols = slice(j * group, (j + 1) * group)
        sums = [limb.float()[:, cols] @ q[:, cols].T for limb in limbs(x)]
        y += ((sums[0] + sums[1]) + sums[2]) * s[:, j]
    return y


def test_three_bfloat16_limbs_hold_a_float32_exactly():
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(4096, generator=g) * 10.0 ** torch.randint(-20, 20, (4096,), generator=g),
                   torch.tensor([1.0, -1.0, 3.0e38, 1e-30, 0.0, 1.0 + 2**-23])])
    x0, x1, x2 = limbs(x)
    total = x0.double() + x1.double() + x2.double()
    assert torch.equal(total, x.double())
    assert torch.equal(x0, x.to(torch.bfloat16))  # the first limb is x rounded, so x1, x2 are small


@pytest.mark.parametrize(("group", "codes"), [(32, 8), (16, 128)])  # 4-bit codes in 32s, bytes in 16s (Q6_K's)
def test_limb_arithmetic_is_float32_class_against_float64(group, codes):
    """The reference's group sums (exact products, float32 sums) are within the FMA kernels' bound of float64."""
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-codes, codes, (48, 256), generator=g).float()
    s = (torch.rand(48, 256 // group, generator=g) * 0.01).half().float()
    x = torch.randn(5, 256, generator=g)
    w = (q.view(48, -1, group) * s[:, :, None]).view(48, 256)
    want = x.double() @ w.double().T
    bound = 1e-6 * (x.abs().double() @ w.abs().double().T)
    assert ((limb_reference(x, q, s, group).double() - want).abs() <= bound).all()


AMX = built_extension().amx_available()
needs_amx = pytest.mark.skipif(not AMX, reason="this CPU has no AMX tiles, or Linux did not grant the tile state")


@pytest.fixture
def ext():
    e = built_extension()
    yield e
    e.set_amx(True)


def product(ext, qw: QuantWeight, x: torch.Tensor, amx: bool) -> torch.Tensor:
    """One qlinear call over all of x's rows (QuantWeight.matmul would take a prefill's panels from 32 rows)."""
    ext.set_amx(amx)
    out = torch.empty(x.shape[0], qw.shape[0])
    return ext.qlinear(x, *qw.kernel_args(), torch.empty(0), out, False)


@needs_amx
@pytest.mark.parametrize("type_name", AMX_TYPES)
def test_amx_product_is_as_accurate_as_the_fma_kernels(ext, type_name):
    """Against float64 on the same dequantized weights: within the FMA kernels' bound, and its largest error
    relative to sum |w x| no more than theirs by more than a quarter (it was smaller on every type here)."""
    n, k = 53, 256 * 3
    raw = random_tensor(type_name, n, k, seed=5)
    qw = QuantWeight.from_gguf(raw, type_name, k)
    w = torch.from_numpy(dequantize(raw, GGMLQuantizationType[type_name]).astype(np.float32)).double()
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(5))
    want = x.double() @ w.T
    scale = x.abs().double() @ w.abs().T + 1e-30
    errs = {}
    for amx in (True, False):
        got = product(ext, qw, x, amx).double()
        assert ((got - want).abs() <= 1e-6 * scale + 1e-6).all()
        errs[amx] = ((got - want).abs() / scale).max().item()
    assert errs[True] <= 1.25 * errs[False], errs


@needs_amx
@pytest.mark.parametrize("type_name", CODE_TYPES)
def test_amx_rows_are_independent_of_the_block(ext, type_name):
    """A block of n rows gives bit for bit what each row gives alone, across calls of 16 rows and any remainder:
    a verification block is n single steps."""
    n, k = 37, 256 * 2
    qw = QuantWeight.from_gguf(random_tensor(type_name, n, k, seed=9), type_name, k)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(9))
    whole = product(ext, qw, x, True)
    for a, b in ((0, 1), (3, 5), (0, 16), (7, 40), (39, 40)):
        assert torch.equal(product(ext, qw, x[a:b].contiguous(), True), whole[a:b]), (a, b)


@needs_amx
@pytest.mark.parametrize("type_name", ["Q4_0", "Q5_1", "Q4_K", "Q8_0", "Q6_K"])
def test_a_prefills_rows_are_each_rows_own(ext, type_name):
    """Past a tile of rows the kernel decodes each block once for many rows, in pairs of blocks and chunks of rows
    (three chunks here, an odd block count): every row is still bit for bit the row in a call of its own."""
    n, k = 37, 4096
    qw = QuantWeight.from_gguf(random_tensor(type_name, n, k, seed=5), type_name, k)
    x = torch.randn(200, k, generator=torch.Generator().manual_seed(5))
    whole = product(ext, qw, x, True)
    for a, b in ((0, 17), (16, 33), (80, 100), (60, 140), (183, 200)):
        assert torch.equal(product(ext, qw, x[a:b].contiguous(), True), whole[a:b]), (a, b)


@needs_amx
@pytest.mark.parametrize("type_name", BYTE_TYPES)
def test_bytes_take_the_tiles_from_enough_rows(ext, type_name):
    """Bytes run on the tiles in calls of AMX_BYTES_ROWS rows or more (Q6_K: more than a tile's 16), each row there
    its own; fewer rows (a step's LM head) keep the FMA kernels."""
    n, k = 37, 256 * 2
    qw = QuantWeight.from_gguf(random_tensor(type_name, n, k, seed=9), type_name, k)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(9))
    whole = product(ext, qw, x, True)
    first = FROM_ROWS[type_name]
    for a, b in ((0, first), (3, 3 + first), (7, 40), (40 - first, 40)):
        assert torch.equal(product(ext, qw, x[a:b].contiguous(), True), whole[a:b]), (a, b)
    few = x[:first - 1].contiguous()
    assert torch.equal(product(ext, qw, few, True), product(ext, qw, few, False))


@needs_amx
def test_amx_can_be_turned_off_and_reports_where_it_runs(ext):
    qw = QuantWeight.from_gguf(random_tensor("Q4_0", 37, 512, seed=4), "Q4_0", 512)
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(4))
    on = product(ext, qw, x, True)
    assert matrix_unit() == "amx"
    off = product(ext, qw, x, False)
    assert matrix_unit() == "fma"
    assert not torch.equal(on, off)  # another order of the float32 sums
    assert torch.allclose(on, off, rtol=1e-5, atol=1e-5)
    env = {**os.environ, "SELFSPEC_AMX": "0"}
    code = "from selfspec.kernels.build import matrix_unit; print(matrix_unit())"
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip() == "fma"


def test_without_amx_the_fma_kernels_run():
    if AMX:
        pytest.skip("this CPU has AMX: the other tests cover it")
    assert matrix_unit() == "fma"
    assert not built_extension().amx_on()


def test_reference_matches_the_dequantized_linear():
    """The reference itself computes the product of the weights it is given (so the kernel tests compare with
    the right thing)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (16, 64), generator=g).float() - 8
    s = torch.rand(16, 2, generator=g).half().float()
    x = torch.randn(3, 64, generator=g)
    w = (q.view(16, 2, 32) * s[:, :, None]).view(16, 64)
    assert torch.allclose(limb_reference(x, q, s), F.linear(x, w), rtol=1e-5, atol=1e-5)
