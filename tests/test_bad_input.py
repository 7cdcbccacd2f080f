"""Bad input from the command line and the Python API: one clear line naming the problem (no traceback), and
nothing cached or kept is harmed; a load killed while it writes its packed weights, and two processes loading the
same file for the first time at once. A tiny random Llama as a GGUF file; the server's own bad requests are in
test_server.py (MALFORMED)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from test_usability import write_tiny_gguf

from selfspec import DraftConfig, ModelConfig, SelfSpec
from selfspec.cli import main
from selfspec.errors import SelfSpecError
from selfspec.kernels.build import cpu_extension


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny GGUF, a truncated copy, random bytes named .gguf, a GPT-2 directory (unsupported)."""
    root = tmp_path_factory.mktemp("bad-input")
    good = root / "tiny.gguf"
    write_tiny_gguf(good)
    data = good.read_bytes()
    (root / "truncated.gguf").write_bytes(data[: len(data) // 3])
    (root / "random.gguf").write_bytes(os.urandom(200_000))
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, bos_token_id=0,
                               eos_token_id=0)).save_pretrained(root / "gpt2")
    (root / "afile").write_text("a file, not a directory")
    return root


@pytest.fixture
def cache(tmp_path, monkeypatch):
    cpu_extension()  # built (or found) in the usual cache first: a fresh cache would compile the kernels again
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def cli_error(capsys, argv: list[str]) -> str:
    """Run the CLI in this process; it must exit 2 with exactly one error line and no traceback."""
    capsys.readouterr()
    assert main(argv) == 2
    captured = capsys.readouterr()
    errors = [ln for ln in captured.err.splitlines() if ln.startswith("selfspec: error:")]
    assert len(errors) == 1, captured.err
    assert "Traceback" not in captured.err and captured.out == ""
    return errors[0]


PROBES = [  # (name, argv after the model, what the line must say)
    ("exit layer out of range", ["--exit-layer", "99", "--head", "lm"], "exit layer 99 is out of range"),
    ("gamma < 1", ["--gamma", "0"], "gamma must be >= 1"),
    ("max tokens < 1", ["--max-new-tokens", "0"], "max_new_tokens must be a positive integer"),
    ("temperature < 0", ["--temperature", "-1"], "temperature must be >= 0"),
    ("a missing head directory", ["--head", "/nonexistent/head"], "no exit head at '/nonexistent/head'"),
    ("threads 0", ["--threads", "0"], "threads must be >= 1"),
]


@pytest.mark.parametrize("name,args,says", PROBES, ids=[p[0] for p in PROBES])
def test_cli_settings_errors_are_one_line_and_leave_the_cache_whole(files, cache, capsys, name, args, says):
    assert main(["generate", "ab", "--model", str(files / "tiny.gguf"), "--max-new-tokens", "2", "--exit-layer", "2",
                 "--head", "lm", "--gamma", "2", "--tune", "off"]) == 0  # packs the file into the cache
    before = snapshot(cache)
    line = cli_error(capsys, ["generate", "ab", "--model", str(files / "tiny.gguf"), "--exit-layer", "2", "--gamma", "2",
                              "--tune", "off", *args])
    assert says in line
    after = snapshot(cache)
    assert {k: v for k, v in after.items() if k in before} == before  # nothing kept was rewritten or removed


@pytest.mark.parametrize("model,says", [
    ("missing.gguf", "does not exist"),
    ("truncated.gguf", "is not a readable GGUF file"),
    ("random.gguf", "is not a readable GGUF file"),
    ("gpt2", "unsupported architecture 'gpt2'"),
])
def test_cli_bad_model_files_are_one_line(files, cache, capsys, model, says):
    for command in (["generate", "ab", "--max-new-tokens", "2"], ["serve", "--port", "1"]):
        assert says in cli_error(capsys, [*command, "--model", str(files / model)])
    assert not (cache / "packed").exists() or not any((cache / "packed").iterdir())  # no half cache left


def test_cli_prompt_errors(files, cache, capsys):
    model = ["--model", str(files / "tiny.gguf"), "--exit-layer", "2", "--head", "lm", "--gamma", "2", "--tune", "off"]
    assert "the prompt is empty" in cli_error(capsys, ["generate", "", *model])
    assert "context is 256 tokens" in cli_error(capsys, ["generate", "a" * 300, *model, "--max-new-tokens", "4"])


def test_an_unwritable_cache_is_named(files, monkeypatch, capsys):
    monkeypatch.setenv("SELFSPEC_CACHE", str(files / "afile" / "cache"))  # root ignores permissions: a file as parent
    line = cli_error(capsys, ["generate", "ab", "--model", str(files / "tiny.gguf")])
    assert "cache directory" in line and "cannot be written" in line and "SELFSPEC_CACHE" in line


def test_api_errors_are_typed_and_leave_the_model_usable(files, cache):
    ss = SelfSpec.load(str(files / "tiny.gguf"), DraftConfig(exit_layer=2, head="lm", gamma=2, tune="off"))
    want = ss.generate("ab", max_new_tokens=4).token_ids
    bad = [lambda: ss.generate("", max_new_tokens=4), lambda: ss.generate([], max_new_tokens=4),
           lambda: ss.generate("ab", max_new_tokens=0), lambda: ss.generate("ab", max_new_tokens=4, temperature=-1),
           lambda: ss.generate("a" * 300, max_new_tokens=4), lambda: ss.set_draft(DraftConfig(gamma=0)),
           lambda: ss.set_draft(DraftConfig(exit_layer=99, head="lm")), lambda: ss.set_draft(DraftConfig(head="/nope")),
           lambda: SelfSpec.load(ModelConfig(model=str(files / "tiny.gguf"), threads=0)),
           lambda: SelfSpec.load(str(files / "random.gguf")), lambda: SelfSpec.load(str(files / "gpt2"))]
    for call in bad:
        with pytest.raises(SelfSpecError):
            call()
        assert ss.generate("ab", max_new_tokens=4).token_ids == want  # state untouched by the failed call


KILLED_WRITE = textwrap.dedent("""
    import os, signal, sys
    import safetensors.torch as st
    def half_then_die(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"half a file")
        os.kill(os.getpid(), signal.SIGKILL)
    st.save_file = half_then_die
    from selfspec import SelfSpec
    SelfSpec.load(sys.argv[1])
""")

LOAD = textwrap.dedent("""
    import sys
    from selfspec import DraftConfig, SelfSpec
    ss = SelfSpec.load(sys.argv[1], DraftConfig(exit_layer=2, head="lm", gamma=2, tune="off"))
    print(ss.generate("ab", max_new_tokens=6).token_ids)
""")


def _run(script: str, gguf: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script, str(gguf)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
@pytest.mark.parametrize("concurrent", [False, True], ids=["killed-then-load", "two-first-loads"])
def test_a_killed_load_leaves_no_half_cache_and_first_loads_can_race(files, tmp_path, monkeypatch, concurrent):
    """A load killed while it writes its packed weights leaves nothing that a later load reads; two processes
    that load the same file for the first time at once both get the right answer, and the cache is whole."""
    env = {**os.environ, "SELFSPEC_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes((files / "tiny.gguf").read_bytes())
    ext = cpu_extension()
    if ext is not None:  # the children use this process's kernel build instead of compiling their own
        (tmp_path / "cache").mkdir()
        (tmp_path / "cache" / "kernels").symlink_to(Path(ext.__file__).parent.parent)
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "reference-cache"))
    ref = SelfSpec.load(ModelConfig(model=str(gguf), dtype="float32"),
                        DraftConfig(exit_layer=2, head="lm", gamma=2, tune="off"))
    want = ref.generate("ab", max_new_tokens=6).token_ids
    if not concurrent:
        killed = _run(KILLED_WRITE, gguf, env)
        killed.communicate(timeout=300)
        assert killed.returncode == -9
        procs = [_run(LOAD, gguf, env)]
    else:
        procs = [_run(LOAD, gguf, env), _run(LOAD, gguf, env)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        assert json.loads(out.strip().splitlines()[-1]) == want
    packed = list((tmp_path / "cache" / "packed").glob("*/packed.safetensors"))
    assert len(packed) == 1 and packed[0].stat().st_size > 1000
    assert not [p for p in (tmp_path / "cache" / "packed").iterdir() if p.name.startswith(".")]  # no temp dirs
