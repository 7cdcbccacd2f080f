"""User-facing behaviour: the GGUF conversion cache, ``python -m selfspec``, base models without a chat
template (API, server, CLI) and progress bars that stay out of logs. Tiny random models, fast."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import VOCAB, tiny_model, tiny_tokenizer

from selfspec import DraftConfig, ModelConfig, SelfSpec
from selfspec.errors import InvalidConfigError, NoChatTemplateError, UnsupportedArchitectureError
from selfspec.models import loading

MSGS = [{"role": "user", "content": "Hi there"}]


# ---- local GGUF files are converted once and cached -------------------------------------------------
@pytest.fixture
def fake_conversion(tmp_path, monkeypatch):
    """A cache under tmp_path, a config read that says 'llama', and a convert_gguf that writes a
    complete-looking folder and records each call."""
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    calls: list[tuple] = []
    model_type = {"value": "llama"}

    def convert(gguf, out, sha256=None):
        calls.append((gguf, out))
        out.mkdir(parents=True)
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            (out / name).write_text("{}")
        return out

    monkeypatch.setattr(loading, "convert_gguf", convert)
    monkeypatch.setattr(loading, "load_config", lambda where, gguf: SimpleNamespace(model_type=model_type["value"]))
    return SimpleNamespace(calls=calls, model_type=model_type, root=tmp_path / "cache" / "models")


def test_local_gguf_is_converted_once_and_read_from_the_cache(tmp_path, fake_conversion):
    gguf = tmp_path / "weights" / "Tiny-Model.Q8_0.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF" + b"\0" * 60)

    where, name = loading.resolve_model(str(gguf))
    assert name is None  # from_pretrained reads the safetensors cache, not the GGUF
    cached = loading.gguf_cache_dir(gguf)
    assert where == str(cached) and cached.parent == fake_conversion.root
    assert cached.name.startswith("Tiny-Model.Q8_0-") and len(cached.name) == len("Tiny-Model.Q8_0-") + 16
    assert len(fake_conversion.calls) == 1 and fake_conversion.calls[0][0] == gguf

    # again, by a relative path, and as a folder + gguf_file: the same cache, no new conversion
    assert loading.resolve_model(str(gguf)) == (str(cached), None)
    assert loading.resolve_model(os.path.relpath(gguf)) == (str(cached), None)
    assert loading.resolve_model(str(gguf.parent), gguf.name) == (str(cached), None)
    assert len(fake_conversion.calls) == 1

    # the file changes (size and mtime): a fresh conversion into a new folder
    gguf.write_bytes(b"GGUF" + b"\1" * 100)
    where2, _ = loading.resolve_model(str(gguf))
    assert where2 != where and len(fake_conversion.calls) == 2

    # the same bytes elsewhere are another file: keyed by the absolute path too
    other = tmp_path / "Tiny-Model.Q8_0.gguf"
    other.write_bytes(gguf.read_bytes())
    os.utime(other, ns=(gguf.stat().st_atime_ns, gguf.stat().st_mtime_ns))
    assert loading.gguf_cache_dir(other) != loading.gguf_cache_dir(gguf)


def write_tiny_gguf(path) -> None:
    """The tiny random Llama as an F32 GGUF file, laid out as llama.cpp's converter does (q / k rows
    permuted for its rotary layout, a byte-level tokenizer over the tiny character vocabulary)."""
    import gguf

    model, tok = tiny_model("llama"), tiny_tokenizer()
    cfg, sd = model.config, {k: v.numpy() for k, v in model.state_dict().items()}
    tokens = tok.convert_ids_to_tokens(list(range(len(tok))))
    tokens += [f"<extra_{i}>" for i in range(VOCAB - len(tokens))]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def permute(x, heads):
        return x.reshape(heads, 2, x.shape[0] // heads // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)

    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    names = {"input_layernorm": "attn_norm", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_q.weight", permute(sd[p + "self_attn.q_proj.weight"], cfg.num_attention_heads))
        w.add_tensor(f"blk.{i}.attn_k.weight", permute(sd[p + "self_attn.k_proj.weight"], cfg.num_key_value_heads))
        for hf, gg in names.items():
            w.add_tensor(f"blk.{i}.{gg}.weight", sd[p + hf + ".weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_real_gguf_file_loads_through_its_cache_quietly(tmp_path, monkeypatch, capsys):
    from selfspec.kernels.build import cpu_extension

    cpu_extension()  # the kernels from the real cache (once per process), not built again under the one below
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny-llama.gguf"
    write_tiny_gguf(gguf)
    draft = DraftConfig(exit_layer=2, head="lm", gamma=2, tune="off")  # no calibration: loading is the subject
    capsys.readouterr()
    ss = SelfSpec.load(ModelConfig(model=str(gguf), dtype="float32"), draft)  # the float32 conversion
    err = capsys.readouterr().err  # not a terminal: no bars at all, transformers' included; one line per stage
    assert err.splitlines() == ["selfspec: converting tiny-llama.gguf to float32 safetensors (once per file)"], err
    assert ss.model_id == "tiny-llama"
    assert (loading.gguf_cache_dir(gguf) / "model.safetensors").is_file()
    ids = torch.tensor([[5, 9, 14, 30, 2, 7]])
    torch.testing.assert_close(ss.model(ids).logits, tiny_model("llama")(ids).logits)  # F32: exact weights
    assert ss.encode("Hi there") == list(tiny_tokenizer()("Hi there")["input_ids"])

    def no_conversion(*args, **kw):
        raise AssertionError("converted again")

    monkeypatch.setattr(loading, "convert_gguf", no_conversion)
    again = SelfSpec.load(ModelConfig(model=str(tmp_path), gguf_file=gguf.name, dtype="bfloat16"), draft)
    assert again.model.dtype == torch.bfloat16  # the float32 cache, loaded in the requested dtype
    native = SelfSpec.load(str(gguf), draft)  # dtype 'auto': loaded natively (this file's tensors are F32)
    err = capsys.readouterr().err  # the cached conversion said nothing; packing the file is a one-time stage
    assert err.splitlines() == ["selfspec: packing tiny-llama.gguf's weights into selfspec's cache (once per file)"], err
    torch.testing.assert_close(native.model(ids).logits, tiny_model("llama")(ids).logits)


def test_gguf_architecture_is_checked_before_converting(tmp_path, fake_conversion):
    gguf = tmp_path / "gpt2.gguf"
    gguf.write_bytes(b"GGUF")
    fake_conversion.model_type["value"] = "gpt2"
    with pytest.raises(UnsupportedArchitectureError, match="gpt2"):
        loading.resolve_model(str(gguf))
    assert fake_conversion.calls == []


# ---- python -m selfspec -------------------------------------------------------------------------
def test_python_m_selfspec_is_the_cli():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "selfspec", "--help"], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "usage: selfspec" in r.stdout and "generate" in r.stdout


# ---- base models: no chat template ---------------------------------------------------------------
@pytest.fixture(scope="module")
def base_ss():
    """A tiny random Llama with a character tokenizer that has no chat template (a base model)."""
    return SelfSpec(tiny_model("llama"), tiny_tokenizer(), DraftConfig(exit_layer=2, head="lm"), "tiny-base")


def test_chat_messages_to_a_base_model_raise_a_clear_error(base_ss):
    assert not base_ss.has_chat_template
    with pytest.raises(NoChatTemplateError, match="no chat template.*plain text"):
        base_ss.encode(MSGS)
    assert isinstance(NoChatTemplateError("x"), InvalidConfigError)
    ids = base_ss.encode("Hi there")
    assert ids == list(base_ss.tokenizer("Hi there")["input_ids"])
    assert len(base_ss.generate("Hi there", max_new_tokens=3, ignore_eos=True).token_ids) == 3

    chat = SelfSpec(base_ss.model, tiny_tokenizer("{% for m in messages %}{{ m['content'] }}{% endfor %}"),
                    DraftConfig(exit_layer=2, head="lm"))
    assert chat.has_chat_template and chat.encode(MSGS) == ids


def test_server_answers_chat_to_a_base_model_with_a_400(base_ss):
    from fastapi.testclient import TestClient

    from selfspec.server.app import create_app

    with TestClient(create_app(base_ss)) as client:
        r = client.post("/v1/chat/completions", json={"model": "tiny-base", "messages": MSGS, "max_tokens": 2})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["code"] == "no_chat_template" and err["type"] == "invalid_request_error"
        assert err["param"] == "messages" and "/v1/completions" in err["message"]
        r = client.post("/v1/completions", json={"model": "tiny-base", "prompt": "Hi there", "max_tokens": 2,
                                                   "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_cli_generate_falls_back_to_plain_text_for_a_base_model(tmp_path, capsys):
    from selfspec.cli import main

    folder = tmp_path / "tiny-base"
    tiny_model("llama").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    capsys.readouterr()  # transformers' own bars while saving: not ours to judge
    argv = ["generate", "Hi there", "--model", str(folder), "--exit-layer", "2", "--head", "lm",
            "--max-new-tokens", "3", "--quiet"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "no chat template" in err and "plain text" in err and len(err.strip().splitlines()) == 1
    assert main([*argv, "--no-chat"]) == 0
    assert "no chat template" not in capsys.readouterr().err


# ---- progress bars -----------------------------------------------------------------------------------
class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bars_only_on_a_terminal(monkeypatch):
    from selfspec.progress import progress, progress_enabled

    monkeypatch.delenv("SELFSPEC_PROGRESS", raising=False)
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # a log file or a pipe
    assert not progress_enabled()
    bar = progress(range(3), desc="task")
    assert bar.disable and list(bar) == [0, 1, 2]
    bar.close()
    assert sys.stderr.getvalue() == ""
    monkeypatch.setenv("SELFSPEC_PROGRESS", "1")
    assert progress_enabled() and not progress(total=1, file=io.StringIO()).disable

    monkeypatch.setattr(sys, "stderr", FakeTTY())
    monkeypatch.delenv("SELFSPEC_PROGRESS")
    assert progress_enabled()
    inner = progress(total=2, inner=True)
    assert not inner.disable and inner.leave is False
    inner.close()
    monkeypatch.setenv("SELFSPEC_PROGRESS", "0")
    assert not progress_enabled()
    # log mode (long runs logged to a file): plain lines, no carriage returns
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    monkeypatch.setenv("SELFSPEC_PROGRESS", "log")
    assert list(progress(range(3), desc="logged")) == [0, 1, 2]
    lines = sys.stderr.getvalue().splitlines()
    assert "\r" not in sys.stderr.getvalue() and lines[0].startswith("logged:") and "3/3" in lines[-1]


def test_quiet_transformers_silences_and_restores_transformers_bars():
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    from selfspec.progress import quiet_transformers

    before, gguf_tqdm = hf_logging.is_progress_bar_enabled(), gguf_utils.tqdm
    with quiet_transformers():
        assert not hf_logging.is_progress_bar_enabled()
        assert gguf_utils.tqdm(range(2), file=io.StringIO()).disable
    assert hf_logging.is_progress_bar_enabled() == before and gguf_utils.tqdm is gguf_tqdm
