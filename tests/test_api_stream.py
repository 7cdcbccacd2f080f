"""Python API on the real default model: chat template, streaming, stop strings, stats, CLI."""

from __future__ import annotations

import subprocess
import sys

import pytest

from selfspec import DraftConfig
from selfspec.textstream import TextStream

MSG = [{"role": "user", "content": "Name three colors of the rainbow, one per line."}]


class CharTokenizer:
    """Each id is one character; id 0 decodes to an incomplete UTF-8 marker."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join("\ufffd" if i == 0 else chr(i) for i in ids)


def test_textstream_holds_back_stop_prefixes_and_partial_chars():
    ts = TextStream(CharTokenizer(), stop=["END"])
    out = [ts.push(ord(c)) for c in "abE"]
    assert out == ["a", "b", ""]  # "E" may start "END"
    assert ts.push(ord("x")) == "Ex"
    assert ts.push(0) == ""  # partial character waits
    ts.ids[-1] = ord("y")  # the byte completed
    assert ts.push(ord("E")) == "y"
    assert ts.push(ord("N")) == "" and ts.push(ord("D")) == ""
    assert ts.stopped and ts.text == "abExy"
    ts2 = TextStream(CharTokenizer(), stop=["END"])
    for c in "okEN":
        ts2.push(ord(c))
    assert ts2.flush() == "EN"  # unfinished stop prefix at the end is text


@pytest.mark.slow
def test_stream_equals_generate_and_stops(default_ss):
    ss = default_ss
    ss.set_draft(DraftConfig(exit_layer=20, head="lm", gamma=4))
    full = ss.generate(MSG, max_new_tokens=48)
    events = list(ss.stream(MSG, max_new_tokens=48))
    assert "".join(e.text for e in events) == full.text
    assert sum((e.token_ids for e in events), []) == full.token_ids
    assert events[-1].result is not None and events[-1].result.text == full.text
    assert full.text == ss.tokenizer.decode(full.token_ids, skip_special_tokens=True)  # generate decodes once
    assert full.stats.steps >= 1 and full.stats.new_tokens == len(full.token_ids)
    plain = ss.generate(MSG, max_new_tokens=48, method="plain")
    assert plain.token_ids == full.token_ids and plain.stats.mean_accepted_length == 1.0
    # a stop string taken from the output: text ends right before it, finish_reason "stop"
    words = full.text.split()
    assert len(words) > 4, full.text
    stop = words[3]
    cut = ss.generate(MSG, max_new_tokens=48, stop=[stop])
    assert cut.finish_reason == "stop" and stop not in cut.text
    assert full.text.startswith(cut.text) and len(cut.text) == full.text.index(stop)
    streamed = "".join(e.text for e in ss.stream(MSG, max_new_tokens=48, stop=[stop]))
    assert streamed == cut.text


@pytest.mark.slow
def test_cli_generate_streams_text_and_stats():
    r = subprocess.run(
        [sys.executable, "-m", "selfspec.cli", "generate", "Say hello.", "--max-new-tokens", "12",
         "--exit-layer", "12", "--head", "lm"],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    assert "mean accepted length" in r.stderr and "exit layer 12" in r.stderr
    bad = subprocess.run([sys.executable, "-m", "selfspec.cli", "generate", "x", "--exit-layer", "31", "--head", "lm"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "exit layer 31 is out of range" in bad.stderr
    missing = subprocess.run([sys.executable, "-m", "selfspec.cli", "generate", "x", "--model", "/no/such/model"],
                             capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2 and "/no/such/model" in missing.stderr


@pytest.mark.slow
def test_cli_generate_through_the_pipeline_gives_the_same_text():
    """`selfspec generate --pipeline mirror`: the deep stage in a second process; the text is the engine's."""
    args = [sys.executable, "-m", "selfspec.cli", "generate", "Name three colours.", "--max-new-tokens", "20"]
    plain = subprocess.run(args, capture_output=True, text=True, timeout=300)
    piped = subprocess.run([*args, "--pipeline", "mirror"], capture_output=True, text=True, timeout=300)
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout == plain.stdout and piped.stdout.strip()
    assert "pipeline mirror over a process" in piped.stderr


@pytest.mark.slow
def test_textstream_decodes_a_window_and_equals_the_whole_texts_decoding(default_ss):
    """The text streamed id by id (each push decoding a few ids, not all) equals the tokenizer's decoding of all
    ids, on text whose pieces merge: accents, CJK, emoji split over several byte-level ids, spaces, newlines,
    special tokens; and an id sequence cut inside a character ends in its U+FFFD as the whole decoding does."""
    tok = default_ss.tokenizer  # SmolLM2's byte-level BPE
    text = ("Grüße aus Köln — naïve café 🎉🎉 日本語のテキスト, 한국어 and  double  spaces\n\n\tcode: x = f(y) "
            "# über\r\nend 🤖.")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    ids = ids + [tok.eos_token_id] + ids  # a special token in between (skipped)
    whole = tok.decode(ids, skip_special_tokens=True)
    ts = TextStream(tok)
    streamed = "".join(ts.push(i) for i in ids) + ts.flush()
    assert streamed == whole == ts.text
    assert ts.read - ts.prefix <= 8  # the window stayed short
    emoji = tok("🎉", add_special_tokens=False)["input_ids"]
    assert len(emoji) > 1  # byte-level: one character, several ids
    ts = TextStream(tok)
    cut = ids[:3] + emoji[:-1]
    assert "".join(ts.push(i) for i in cut) + ts.flush() == tok.decode(cut, skip_special_tokens=True)


def test_textstream_window_keeps_sentencepiece_spaces():
    """A Metaspace decoder drops the leading space of the first piece it decodes; the window's text before the
    new ids is decoded from the same start, so the spaces between pieces survive."""
    from tokenizers import Tokenizer, decoders, models

    pieces = ["<unk>", "\u2581hello", "\u2581world", "!", "\u2581", "a", "b"]
    backend = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return backend.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = [1, 2, 3, 4, 5, 6, 2, 1, 3]
    ts = TextStream(Tok())
    assert "".join(ts.push(i) for i in ids) + ts.flush() == backend.decode(ids) == "hello world! ab world hello!"


@pytest.mark.slow
@pytest.mark.parametrize("stop", [None, ["lazy"]])
def test_an_output_nobody_streams_decodes_once_and_gives_the_same_result(default_ss, stop):
    """``RequestOutput(incremental=False)`` (what ``generate`` uses) hands out no text until the end, then the
    same result as the incremental one: text, ids and finish at an EOS; with stop strings it stays incremental."""
    from selfspec.config import GenerateConfig
    from selfspec.outputs import RequestOutput

    tok = default_ss.tokenizer
    ids = tok.encode("The quick brown fox jumps over the lazy dog, caf\u00e9 \u00fcber alles.")
    eos = tok.eos_token_id
    cfg = GenerateConfig(eos_token_ids=[eos], stop=stop)
    results = []
    for incremental in (True, False):
        out = RequestOutput(tok, cfg, incremental=incremental)
        assert out.lazy == (not incremental and stop is None)
        events = [out.push(ids[i : i + 3]) for i in range(0, len(ids), 3) if not out.finished]
        if not out.finished:
            events.append(out.push([eos, 5]))
        if out.lazy:
            assert all(e.text == "" for e in events[:-1])
        res = events[-1].result
        assert res is not None
        results.append((res.text, res.token_ids, res.finish_reason, "".join(e.text for e in events)))
    assert results[0] == results[1]
    assert results[0][2] == "stop" and results[0][0] == results[0][3]
