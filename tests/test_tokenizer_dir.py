"""A GGUF's cached tokenizer directory opened straight from its tokenizer.json (``open_tokenizer_dir``) encodes,
decodes and applies the chat template exactly as ``AutoTokenizer`` opening the same directory does; where a
directory's two openings would differ, the first open finds out and ``AutoTokenizer`` opens it from then on."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from selfspec.config import ModelConfig
from selfspec.models.gguf import FAST_OPEN_MARK, open_tokenizer_dir, same_tokenizer
from selfspec.models.loading import _native_key, cache_root, local_gguf

pytestmark = pytest.mark.slow  # every test reads the real default model's tokenizer (default_ss made its directory)

TEXTS = [
    "Hello there!",
    "  leading spaces, trailing spaces  \n\n\ttabs\tand\r\nCRLF",
    "Übersetzen Sie: 'Guten Morgen, wie geht es dir?' — ins Englische.",
    "日本語のテキストと emoji 🙂🚀 and ünïcödé",
    "def f(x):\n    return x ** 2  # squares\n",
    "special markers in text: <|im_start|>user\nhi<|im_end|> <|endoftext|>",
    "numbers 3.14159 1,000,000 and URLs https://example.com/a?b=c",
    "",
]

CHATS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another, in German: ünïcödé?"}],
    [{"role": "user", "content": "  spaced\n\n  lines  "}, {"role": "assistant", "content": "ok"}],
]


@pytest.fixture(scope="module")
def pair(default_ss):
    """(the directory opened by open_tokenizer_dir, the same by AutoTokenizer); default_ss made the directory."""
    folder = cache_root() / "tokenizers" / _native_key(local_gguf(ModelConfig()))
    assert (folder / "tokenizer.json").is_file()
    return open_tokenizer_dir(folder), AutoTokenizer.from_pretrained(str(folder))


def test_encode_decode_equal(pair):
    fast, ref = pair
    for text in TEXTS:
        for special in (True, False):
            ids = fast(text, add_special_tokens=special)["input_ids"]
            assert ids == ref(text, add_special_tokens=special)["input_ids"], text
        for skip in (True, False):
            assert fast.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    assert fast.decode(list(range(0, 5000, 7))) == ref.decode(list(range(0, 5000, 7)))


def test_chat_template_equal(pair):
    fast, ref = pair
    assert fast.chat_template == ref.chat_template and fast.chat_template
    for chat in CHATS:
        for gen in (True, False):
            text = fast.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
            assert text == ref.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
            a = fast.apply_chat_template(chat, add_generation_prompt=gen, tokenize=True)
            b = ref.apply_chat_template(chat, add_generation_prompt=gen, tokenize=True)
            assert list(a["input_ids"] if hasattr(a, "keys") else a) == list(b["input_ids"] if hasattr(b, "keys") else b)


def test_special_tokens_equal(pair):
    fast, ref = pair
    for name in ("eos_token_id", "pad_token_id", "bos_token_id", "unk_token_id", "all_special_ids", "model_max_length"):
        assert getattr(fast, name) == getattr(ref, name), name
    assert len(fast) == len(ref) and fast.get_vocab() == ref.get_vocab()


def test_the_loaded_model_uses_it(default_ss):
    """A load after the first (the directory exists) opens the tokenizer this way."""
    from selfspec.models.gguf import load_gguf_tokenizer

    gguf = local_gguf(ModelConfig())
    tok = load_gguf_tokenizer(gguf, cache_root() / "tokenizers" / _native_key(gguf))
    assert type(tok).__name__ in ("TokenizersBackend", "PreTrainedTokenizerFast")
    assert tok("Hi there")["input_ids"] == default_ss.tokenizer("Hi there")["input_ids"]


def test_first_open_compares_and_keeps_the_verdict(default_ss, tmp_path, monkeypatch):
    import json
    import shutil

    import transformers

    src = cache_root() / "tokenizers" / _native_key(local_gguf(ModelConfig()))
    folder = tmp_path / "tok"
    shutil.copytree(src, folder, ignore=shutil.ignore_patterns(FAST_OPEN_MARK))
    opened = open_tokenizer_dir(folder)  # first open: compared with AutoTokenizer's, found the same
    assert json.loads((folder / FAST_OPEN_MARK).read_text()) == {"same": True}
    assert opened("Hi there")["input_ids"] == default_ss.tokenizer("Hi there")["input_ids"]

    calls = []
    real = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *a, **k: calls.append(a) or real(*a, **k))
    open_tokenizer_dir(folder)
    assert calls == []  # a directory found the same: AutoTokenizer is not built again

    (folder / FAST_OPEN_MARK).unlink()
    monkeypatch.setattr("selfspec.models.gguf.same_tokenizer", lambda a, b: False)  # as if they differed
    tok = open_tokenizer_dir(folder)
    assert json.loads((folder / FAST_OPEN_MARK).read_text()) == {"same": False} and len(calls) == 1
    assert tok("Hi there")["input_ids"] == default_ss.tokenizer("Hi there")["input_ids"]
    open_tokenizer_dir(folder)
    assert len(calls) == 2  # from then on AutoTokenizer opens it


def test_same_tokenizer_sees_a_difference(pair):
    fast, ref = pair
    assert same_tokenizer(fast, ref)
    other = open_tokenizer_dir(cache_root() / "tokenizers" / _native_key(local_gguf(ModelConfig())))
    other.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert not same_tokenizer(other, ref)
