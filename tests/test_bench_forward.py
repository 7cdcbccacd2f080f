"""selfspec bench-forward on a tiny random Llama: every figure present and well formed, plot written,
CLI options parsed. No test asserts a speed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import LAYERS, tiny_model, tiny_tokenizer

from selfspec import DraftConfig, SelfSpec
from selfspec.bench.forward import (
    LIMBS,
    PEAK_KINDS,
    ForwardBenchConfig,
    measure_bandwidth,
    measure_peaks,
    run,
)
from selfspec.bench.forward_ranges import RANGES
from selfspec.bench.forward_report import format_peaks, format_tables
from selfspec.cli import build_parser, main
from selfspec.cli_options import config_from_args
from selfspec.config import ModelConfig
from selfspec.kernels.build import cpu_extension, cpu_flags, matrix_unit

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.slow
def test_bench_forward_tiny(tmp_path: Path) -> None:
    ss = SelfSpec(tiny_model("llama"), None, DraftConfig(gamma=2))
    cfg = ForwardBenchConfig(block_sizes=[1, 2], contexts=[8], reps=1, bandwidth_mb=8, prefill_tokens=[8, 40],
                             prefill_reps=1, out=str(tmp_path / "fwd.json"), plot=str(tmp_path / "fwd.png"))
    res = run(ModelConfig(), cfg, ss=ss)
    saved = json.loads(Path(cfg.out).read_text())
    assert saved["config"]["block_sizes"] == [1, 2] and saved["bandwidth_gbps"] > 0
    k = saved["model_info"]["exit_layer"]
    assert k == max(1, LAYERS // 4)
    assert saved["bytes"]["full"] == saved["bytes"]["shallow"] + saved["bytes"]["deep"] > 0
    figs = {(f["backend"], f["table_context"], f["range"], f["n"]): f for f in saved["figures"]}
    assert len(figs) == len(saved["figures"]) == 2 * 1 * len(RANGES) * 2
    for b in ("fast", "reference"):
        for r in RANGES:
            for n in (1, 2):
                f = figs[b, 8, r, n]
                assert f["ms"] > 0 and f["gbps"] > 0 and f["floor_ms"] > 0 and f["bandwidth_fraction"] > 0
                assert f["kernel"] and f["dtype"] == "float32" and f["threads"] == 1 and "torch" in f
                if n == 1:
                    assert f["ratio"] == 1.0
                else:
                    assert f["ratio"] == pytest.approx(f["ms"] / figs[b, 8, r, 1]["ms"])
    assert figs["reference", 8, "full", 1]["kernel"] == "transformers-modules"
    assert Path(cfg.plot).stat().st_size > 0
    table = format_tables(res)
    assert "context 8" in table and table.count("| fast |") == len(RANGES)
    pre = {(p["backend"], p["tokens"]): p for p in saved["prefill"]}
    assert set(pre) == {(b, n) for b in ("fast", "reference") for n in (8, 40)}
    assert all(p["ms"] > 0 and p["gflops"] > 0 and p["ms_per_token"] == pytest.approx(p["ms"] / p["tokens"])
               for p in pre.values())
    assert "| 40 |" in table and "reference / fast" in table
    if cpu_extension() is not None:
        assert saved["peaks_gflops"]["fma_f32"] > 0 and "multiply peaks on 1 threads" in table
        f = figs["fast", 8, "full", 2]
        assert f["fma_peak_fraction"] == pytest.approx(f["gflops"] / saved["peaks_gflops"]["fma_f32"])


def test_plot_goes_beside_out_unless_given() -> None:
    assert ForwardBenchConfig(out="x/fwd.json").plot_path() == Path("x/fwd.png")
    assert ForwardBenchConfig(out="x/fwd.json", plot="y/p.png").plot_path() == Path("y/p.png")
    assert ForwardBenchConfig(out="x/fwd.json", plot="").plot_path() is None


def test_cli_bench_forward_writes_everything_under_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``selfspec bench-forward --out DIR/fwd.json``: the results and the plot land in DIR, nothing in the
    working directory (where the default runs/ would be)."""
    model_dir = tmp_path / "model"
    tiny_model("llama").save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    out = tmp_path / "results" / "fwd.json"
    assert main(["bench-forward", "--model", str(model_dir), "--threads", "1", "--block-sizes", "1,2",
                 "--contexts", "8", "--backends", "fast", "--reps", "1", "--bandwidth-mb", "8",
                 "--prefill-tokens", "16", "--prefill-reps", "1", "--out", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert saved["block_sizes"] == [1, 2] and [p["tokens"] for p in saved["prefill"]] == [16]
    assert out.with_suffix(".png").stat().st_size > 0
    assert sorted(p.name for p in out.parent.iterdir()) == ["fwd.json", "fwd.png"]
    assert list(cwd.iterdir()) == []


def test_measure_bandwidth() -> None:
    assert measure_bandwidth(4) > 0


@pytest.mark.skipif(cpu_extension() is None, reason="selfspec's CPU kernels are not built here")
def test_measure_peaks_names_what_this_cpu_has() -> None:
    """Each multiply instruction's loop runs where the build has it and reads 0 elsewhere (which loops ran, not how
    fast, is what is checked)."""
    ext = cpu_extension()
    peaks = measure_peaks(threads=1, seconds=0.01)
    assert set(peaks) == set(PEAK_KINDS)
    assert 0 < peaks["fma_f32"] < 1e5  # GFLOP/s: a loop that ran, and was timed in seconds, not cycles
    flags = cpu_flags().split()
    avx512 = "avx512f" in flags and os.environ.get("SELFSPEC_ISA", "") != "avx2"  # the AVX2 build has neither
    assert (peaks["vnni_int8"] > 0) == (avx512 and "avx512_vnni" in flags)
    assert (peaks["bf16_dot"] > 0) == (avx512 and "avx512_bf16" in flags)
    assert (peaks["amx_bf16"] > 0) == (matrix_unit() == "amx")
    assert ext.compute_peak(9, 0.01, 1) == 0.0 and ext.compute_peak(0, 0.0, 1) == 0.0  # no such kind; no time
    assert LIMBS == 3
    two = ext.compute_peak(0, 0.01, 2)
    assert two > 0  # two threads' loops, the slowest one's time


def test_format_peaks_shows_what_is_absent() -> None:
    line = format_peaks({"fma_f32": 200.0, "vnni_int8": 260.0, "bf16_dot": 130.0, "amx_bf16": 0.0}, 2)
    assert "float32 FMA 200 GFLOP/s" in line and "int8 VNNI 260 (1.30x FMA)" in line
    assert "bf16 dot 130 (0.65x FMA)" in line and "AMX bf16 tiles -" in line


def test_cli_parses_bench_forward() -> None:
    args = build_parser().parse_args(["bench-forward", "--block-sizes", "1", "--block-sizes", "2,4",
                                      "--backends", "fast", "--exit-layer", "3", "--threads", "1"])
    cfg = config_from_args(args, ForwardBenchConfig)
    assert cfg.block_sizes == [1, 2, 4] and cfg.backends == ["fast"] and cfg.exit_layer == 3
    assert cfg.contexts == [256, 1024] and cfg.reps == 8
    assert config_from_args(args, ModelConfig).threads == 1
    assert args.func.__module__ == "selfspec.bench.forward"
