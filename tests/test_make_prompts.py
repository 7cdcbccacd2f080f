"""selfspec make-prompts: every kind made from a small ShareGPT-format file, the mix recorded, Spec-Bench text kept
out, each prompt on its source conversation's side of the split, and the file readable by answer-prompts."""

from __future__ import annotations

import json

import pytest

from selfspec.errors import InvalidConfigError
from selfspec.train.make_prompts import KINDS, MakePromptsConfig, language_of, make_prompts
from selfspec.train.sharegpt import conversations, is_heldout

PROSE = ("The river rises in the northern hills and flows for many miles through farmland and small towns. In spring "
         "the snow melts and the water runs high, so the villages along its banks have built walls and channels. "
         "Fishermen still work the lower reaches, where the current slows and the water widens into a broad delta. ")
GERMAN = ("Die Stadt liegt an einem großen Fluss und ist für ihre alten Brücken bekannt. Im Sommer kommen viele "
          "Besucher, die mit dem Boot auf dem Wasser fahren und die Häuser der Altstadt sehen wollen. Es ist nicht "
          "leicht, dort im August ein freies Zimmer zu finden, aber die Mühe lohnt sich.")
SPECBENCH_TEXT = ("pawn shops are booming in singapore as the crisis has reached the middle class and many families "
                  "now pledge their gold jewellery to pay the bills")


def _conv(i: int, question: str, answer: str) -> dict:
    return {"id": f"c{i}", "conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]}


@pytest.fixture
def source(tmp_path):
    recs = [_conv(i, f"What is the story of river number {i}?", f"River {i} is long. " + PROSE * 5) for i in range(40)]
    recs += [_conv(100 + i, f"Erzähl mir etwas über Stadt {i}.", GERMAN) for i in range(10)]
    recs.append(_conv(999, "Tell me about the news.", "The news of the day. " + SPECBENCH_TEXT + ". " + PROSE * 4))
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(recs))
    bench = tmp_path / "question.jsonl"
    bench.write_text(json.dumps({"question_id": 1, "category": "translation", "turns": [SPECBENCH_TEXT]}) + "\n")
    return path, bench


def test_every_kind_is_made_and_the_mix_recorded(source, tmp_path):
    path, bench = source
    cfg = MakePromptsConfig(source=str(path), out=str(tmp_path / "p.json"), count=60, heldout=0.3, split="train")
    mix = make_prompts(cfg)
    recs = json.loads((tmp_path / "p.json").read_text())
    assert {r["kind"] for r in recs} == set(KINDS) and len(recs) == mix["prompts"] == sum(mix["made"].values())
    saved = json.loads((tmp_path / "p.mix.json").read_text())
    assert saved["made"] == mix["made"] and saved["config"]["count"] == 60 and saved["asked"]["chat"] == 14  # 3 of 13 weights
    by_kind = {k: [r["conversations"][0]["value"] for r in recs if r["kind"] == k] for k in KINDS}
    assert all(p.startswith("Summarize: ") for p in by_kind["summarization"])
    assert any(p.startswith("Translate German to English: ") for p in by_kind["translation"])
    assert all(p.endswith("?") for p in by_kind["rag"] + by_kind["qa"])
    for r in recs:  # each prompt on its conversation's side (train here)
        assert not is_heldout(r["id"], 0.3)
        source_id = r["id"].split("/")[0]
        assert source_id.startswith("math-") or not is_heldout(source_id, 0.3)
    held = make_prompts(MakePromptsConfig(source=str(path), out=str(tmp_path / "h.json"), count=30, heldout=0.3,
                                          split="heldout"))
    held_recs = json.loads((tmp_path / "h.json").read_text())
    assert held["prompts"] == len(held_recs) > 0 and all(is_heldout(r["id"], 0.3) for r in held_recs)
    answered = list(conversations(str(tmp_path / "p.json"), "train", 0.3, None, max_turns=2, min_turns=1))
    assert len(answered) == len(recs)  # answer-prompts reads a prompt alone
    assert make_prompts(cfg)["made"] == mix["made"]  # the same seed, the same set
    assert json.loads((tmp_path / "p.json").read_text()) == recs


def test_specbench_text_is_kept_out(source, tmp_path):
    path, bench = source
    base = dict(source=str(path), count=400, mix="summarization:1,translation:1", heldout=0.0)
    kept = make_prompts(MakePromptsConfig(**base, out=str(tmp_path / "a.json")))
    text = (tmp_path / "a.json").read_text()
    assert "pawn shops are booming" in text  # without --exclude, the contaminated answer is used
    clean = make_prompts(MakePromptsConfig(**base, out=str(tmp_path / "b.json"), exclude=str(bench)))
    assert "pawn shops are booming" not in (tmp_path / "b.json").read_text()
    assert sum(clean["dropped_as_specbench"].values()) >= 1
    assert sum(clean["made"].values()) < sum(kept["made"].values())


def test_bad_mix_is_a_clear_error():
    with pytest.raises(InvalidConfigError, match="unknown kind 'poetry'"):
        MakePromptsConfig(mix="chat:1,poetry:2").weights()
    with pytest.raises(InvalidConfigError, match="no kind has a positive weight"):
        MakePromptsConfig(mix="chat:0").weights()
    assert MakePromptsConfig(mix="chat:1,math:3").weights() == {"chat": 0.25, "math": 0.75}


def test_language_of():
    assert language_of(PROSE) == "English" and language_of(GERMAN) == "German"
    assert language_of("ok") is None
