"""Shared fixtures: tiny random models of every supported architecture, built from configs in code,
and the real default model (SmolLM2-135M-Instruct) for the slow tests."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch.set_num_threads(min(2, torch.get_num_threads()))


def _pin_prefill_paths() -> None:
    """A prefill's path per weight type is timed once per machine (``selfspec.quant.weight.prefill_path``); timed
    while the suite loads the machine it could come out otherwise than alone, and the prefix cache is on only with
    the panels (or the AMX kernel). The suite pins the panels for either matrix unit, so what it asserts does not
    depend on a timing; tests of the timing or of another path set their own."""
    from selfspec.quant import weight
    from selfspec.quant.formats import FORMATS

    weight._prefill_paths.update({(name, unit): "panels" for name in FORMATS for unit in ("amx", "fma")})


_pin_prefill_paths()

VOCAB = 96
LAYERS = 4


def tiny_config(arch: str):
    """A 4-layer random model; sliding windows small enough to matter in the tests."""
    import transformers as tf

    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=None, pad_token_id=0, initializer_range=0.2,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        return tf.LlamaConfig(**common)
    if arch == "mistral":
        return tf.MistralConfig(sliding_window=9, **common)
    if arch == "qwen2":
        return tf.Qwen2Config(**common)
    if arch == "qwen3":
        return tf.Qwen3Config(head_dim=16, **common)
    if arch == "gemma3_text":
        return tf.Gemma3TextConfig(
            head_dim=16, sliding_window=7, layer_types=["sliding_attention", "full_attention"] * 2, **common
        )
    if arch == "phi3":
        return tf.Phi3Config(**common)
    raise ValueError(arch)


ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3"]
_cache: dict[str, object] = {}


def tiny_model(arch: str):
    if arch not in _cache:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(1234)
        m = AutoModelForCausalLM.from_config(tiny_config(arch), attn_implementation="sdpa", dtype=torch.float32)
        m.generation_config.eos_token_id = None
        m.generation_config.pad_token_id = 0
        _cache[arch] = m.eval().requires_grad_(False)
    return _cache[arch]


def tiny_tokenizer(chat_template: str | None = None):
    """A character-level fast tokenizer with ids below VOCAB (fits the tiny models); no chat template
    unless one is given, like a base model's."""
    import string

    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    tokens = ["<pad>", "<s>", "</s>", "<unk>"] + list(string.ascii_letters + string.digits + " .,!?'")
    assert len(tokens) <= VOCAB
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                  unk_token="<unk>")
    tok.chat_template = chat_template
    return tok


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos: list[int] | None = None) -> list[int]:
    """The reference: transformers' own greedy generate, float32."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=0,
            min_new_tokens=0, top_k=None, top_p=None, temperature=None,
        )
    new = out[0, len(prompt_ids):].tolist()
    if eos:  # cut the padding after the first EOS
        for i, t in enumerate(new):
            if t in eos:
                return new[: i + 1]
    return new


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from threads, and on a busy machine thread contention makes them crawl."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def default_ss():
    """The real default model with the untrained exit head (loads from the converted cache)."""
    from selfspec import SelfSpec

    return SelfSpec.load()
