"""Kept results files (selfspec.bench.results), the CPU's identity (selfspec.machine), and llama.cpp's build check
(selfspec.bench.llamacpp.build): tiny synthetic runs and stand-in binaries, no model."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from selfspec.bench import llamacpp, results
from selfspec.bench.specbench import cmd
from selfspec.errors import InvalidConfigError
from selfspec.machine import parse_cpuinfo

ZEN4 = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n" \
       "flags\t\t: fpu avx2 avx512f avx512_vnni avx512_bf16\n\nprocessor\t: 1\nvendor_id\t: GenuineIntel\n"
XEON = "vendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 207\nmodel name\t: Intel(R) Xeon(R)\n" \
       "flags\t\t: avx2 avx512f amx_tile amx_bf16 amx_int8\n"


def test_cpu_kind_and_flags_from_cpuinfo():
    zen = parse_cpuinfo(ZEN4)
    assert (zen.kind, zen.family, zen.model, zen.has_amx) == ("amd-zen4", 25, 17, False)
    assert "avx512_bf16" in zen.flags and zen.vendor == "AuthenticAMD"  # the first processor's block only
    assert "avx512_vnni" in zen.describe()
    xeon = parse_cpuinfo(XEON)
    assert (xeon.kind, xeon.has_amx) == ("intel-family6-model207", True)
    assert parse_cpuinfo("vendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t: 2\n").kind == "amd-zen5"
    assert parse_cpuinfo("vendor_id\t: AuthenticAMD\ncpu family\t: 23\nmodel\t: 49\n").kind == "amd-zen2"
    assert parse_cpuinfo("").kind  # unknown: the architecture's name, never empty


def _rec(qid: int, cat: str, tokens: int, wall: float, ids: list[int], accepts: list[int] | None = None) -> dict:
    c = {"turns": ["x"], "new_tokens": [tokens], "wall_time": [wall], "decoding_steps": [tokens - 1],
         "accept_lengths": [accepts or []], "token_ids": [ids]}
    return {"question_id": qid, "category": cat, "model_id": "m", "choices": [c]}


def fake_run(path: Path, finished: str = "2026-12-02 01:00:00", llama_speed: float = 1.0) -> Path:
    """hf 10 tok/s, plain 40, the default 60 (MAL 2), llama.cpp 20 and its n-gram 20 * llama_speed."""
    speeds = {"hf": 10.0, "plain": 40.0, "selfspec-default": 60.0, "llama-cpp": 20.0,
              "llama-cpp:spec=ngram": 20.0 * llama_speed}
    kinds = {"hf": "hf", "plain": "plain", "selfspec-default": "selfspec", "llama-cpp": "llama-cpp",
             "llama-cpp:spec=ngram": "llama-cpp"}
    (path / "answers").mkdir(parents=True)
    for m, tps in speeds.items():
        recs = [_rec(q, cat, 20, 20 / tps, list(range(20)) if m != "llama-cpp" else [0] * 20,
                     [2] * 9 + [1] if m == "selfspec-default" else None)
                for q, cat in ((81, "writing"), (161, "translation"))]
        (path / "answers" / f"{m}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    manifest = {"format": "selfspec-specbench/1", "baseline": "hf", "method_order": list(speeds),
                "model": {"model_id": "/x/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf"},
                "generate": {"max_new_tokens": 64},
                "methods": {m: {"kind": k, "spec": m, "info": {}} for m, k in kinds.items()},
                "sessions": [{"finished": finished, "bench": {"limit": 1}, "machine": {
                    "torch_threads": 2, "versions": {"selfspec": "0.1.0"}, "git": "abc123"}}]}
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


def test_results_file_replaces_the_same_cpu_model_and_length(tmp_path):
    root = tmp_path / "results"
    first = results.write_results(fake_run(tmp_path / "a", "2026-12-01 10:00:00"), root, ["selfspec", "bench"])
    assert first.parent.parent == root and first.name == "2026-12-01-qwen2.5-coder-0.5b-instruct.q4-k-m-64.json"
    rec = json.loads(first.read_text())
    assert rec["format"] == results.FORMAT and rec["command"] == "selfspec bench" and rec["threads"] == 2
    other = root / first.parent.name / "2026-11-01-smollm2-64.json"  # another model's file stays
    other.write_text(first.read_text())
    second = results.write_results(fake_run(tmp_path / "b", "2026-12-02 10:00:00"), root)
    assert second.exists() and not first.exists() and other.exists()
    assert not list(root.rglob("*.tmp"))


def test_headline_ratios_and_llama_cpps_best(tmp_path):
    rec = results.record(fake_run(tmp_path / "r", llama_speed=1.5))
    h = results.headline(rec)
    assert h["baseline_tps"] == pytest.approx(10.0)
    assert h["plain"] == pytest.approx(4.0) and h["default"] == pytest.approx(6.0)
    assert h["default_over_plain"] == pytest.approx(1.5) and h["mal"] == pytest.approx(19 / 10)
    assert h["llama_method"] == "llama-cpp:spec=ngram" and h["llama"] == pytest.approx(3.0)  # the faster of the two
    assert h["identical"] == "2/2" and h["llama_identical"] == "2/2"
    table = "\n".join(results.main_table([(Path("f.json"), rec)]))
    assert "**6.00x** (1.90)" in table and "3.00x (ngram)" in table


def test_render_and_write_docs_fill_only_the_marked_blocks(tmp_path, capsys):
    root = tmp_path / "results"
    results.write_results(fake_run(tmp_path / "r"), root, ["selfspec", "bench", "q.jsonl"])
    readme, bench = tmp_path / "README.md", tmp_path / "BENCHMARKS.md"
    readme.write_text(f"# top\n{results.BEGIN}\nold table\n{results.END}\nrest\n")
    bench.write_text(f"# bench\n{results.BEGIN}\n{results.END}\n")
    assert cmd(type("A", (), {"rest": ["report", str(root), "--write-docs", "--readme", str(readme),
                                       "--benchmarks", str(bench)]})()) == 0
    text = readme.read_text()
    assert "old table" not in text and text.startswith("# top\n") and text.endswith("rest\n")
    assert "**6.00x**" in text and "`selfspec bench q.jsonl`" in text
    full = bench.read_text()
    assert "#### Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf" in full and "speedup.png" in full
    assert (root / "amd-zen4" / "speedup.png").exists() or list(root.glob("*/speedup.png"))
    capsys.readouterr()
    bench.write_text("no markers\n")
    readme.write_text(f"# top\n{results.BEGIN}\nold table\n{results.END}\n")
    with pytest.raises(InvalidConfigError, match="no '<!-- results:begin -->'"):
        results.write_docs(root, readme, bench)
    assert bench.read_text() == "no markers\n"
    assert "old table" in readme.read_text()  # neither file is written when one has no block


def test_bad_results_files_are_clear_errors(tmp_path):
    with pytest.raises(InvalidConfigError, match="does not exist"):
        results.load_results(tmp_path / "none")
    (tmp_path / "cpu").mkdir()
    with pytest.raises(InvalidConfigError, match="holds no results files"):
        results.load_results(tmp_path)
    (tmp_path / "cpu" / "x.json").write_text("{not json")
    with pytest.raises(InvalidConfigError, match="not a results file"):
        results.load_results(tmp_path)
    (tmp_path / "cpu" / "x.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(InvalidConfigError, match="format 'other'"):
        results.load_results(tmp_path)


# ---- llama.cpp's build check ---------------------------------------------------------------------
SERVER = """#!/usr/bin/env python3
import http.server, json, os, signal, sys
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
faulty = os.environ.get("FAKE_FAULT", "") in ("always", "native") and "{mode}" == "native"
faulty = faulty or (os.environ.get("FAKE_FAULT") == "always" and "--no-repack" not in args)
class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"{{}}")
    def do_POST(self):
        if faulty:
            os.kill(os.getpid(), signal.SIGILL)
        self.send_response(200); self.end_headers(); self.wfile.write(json.dumps({{"tokens": [1, 2]}}).encode())
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


@pytest.mark.parametrize("fault, build, args", [("", "native", []), ("native", "portable, no AMX", []),
                                                 ("always", "portable, no AMX", ["--no-repack"])])
def test_llama_cpp_build_falls_back_when_the_native_build_faults(tmp_path, monkeypatch, fault, build, args):
    """A stand-in server that dies with SIGILL on its first prompt (as ggml's AMX kernels did on an AMX CPU)
    makes build() rebuild it portable without AMX, and then, if needed, run it with --no-repack."""
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("FAKE_FAULT", fault)
    compiled: list[list[str]] = []

    def fake_compile(tree, build_dir, options, bin_dir, jobs):
        compiled.append(options)
        bin_dir.mkdir(parents=True, exist_ok=True)
        exe = bin_dir / "llama-server"
        exe.write_text(SERVER.format(mode="native" if "-DGGML_NATIVE=ON" in options else "portable"))
        exe.chmod(exe.stat().st_mode | stat.S_IXUSR)

    monkeypatch.setattr(llamacpp, "compile_tree", fake_compile)
    monkeypatch.setattr(llamacpp, "_source_tree", lambda root: root / "src")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    bin_dir = llamacpp.build(gguf=gguf)
    info = llamacpp.build_info(bin_dir)
    assert info is not None and (info["build"], info["server_args"], info["smoke"]) == (build, args, "ok")
    assert ["-DGGML_NATIVE=ON" in o for o in compiled] == ([True] if not fault else [True, False])
    if fault:
        assert "-DGGML_AMX_TILE=OFF" in compiled[1] and "signal" in info["faults"][0]
    assert llamacpp.LlamaServer(gguf, 2).extra == args  # every later server gets the flags that run here
    assert llamacpp.build(gguf=gguf) == bin_dir and len(compiled) == (1 if not fault else 2)  # checked once


def test_portable_options_follow_the_cpus_flags():
    opts = llamacpp.cmake_options(False, frozenset({"avx2", "avx512f", "amx_tile"}))
    assert "-DGGML_AVX2=ON" in opts and "-DGGML_AVX512=ON" in opts and "-DGGML_AVX512_BF16=OFF" in opts
    assert "-DGGML_AMX_TILE=OFF" in opts and "-DGGML_NATIVE=OFF" in opts
    assert os.path.basename(llamacpp.cmake_options(True, frozenset())[-1]) == "-DGGML_NATIVE=ON"
