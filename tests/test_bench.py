"""The Spec-Bench harness (selfspec bench): answer files, summary math, resume, errors, report CLI.

Runs on a tiny random Llama with the default model's vocabulary size, so the default model's
tokenizer (from the converted cache) and its chat template drive it; one slow smoke test uses the
real model. No test asserts a speed."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from selfspec import DraftConfig, SelfSpec
from selfspec.bench.answers import load_run, read_answers
from selfspec.bench.config import BenchConfig
from selfspec.bench.divergences import compute_divergences
from selfspec.bench.methods import parse_method, split_specs
from selfspec.bench.questions import load_questions, select_questions, turn_prompt
from selfspec.bench.repetition import repeated_share
from selfspec.bench.report import write_report
from selfspec.bench.specbench import answer_text, run_bench
from selfspec.bench.summary import summarize
from selfspec.bench.tables import format_summary
from selfspec.bench.turn import hf_steps
from selfspec.cli import main
from selfspec.errors import InvalidConfigError

QUESTIONS = [
    {"question_id": 81, "category": "writing", "turns": ["Write a haiku about rain.", "Now make it rhyme."]},
    {"question_id": 161, "category": "translation", "turns": ["Translate into German: good morning"]},
    {"question_id": 241, "category": "qa", "turns": ["Who wrote Hamlet?"], "reference": ["Shakespeare"]},
]
ALL_METHODS = ["hf", "hf-prompt-lookup", "hf-early-exit:exit_layer=2", "plain", "selfspec-lm",
               "selfspec-lm-confidence"]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_ss():
    """A 4-layer random Llama that takes the default model's token ids; its tokenizer and chat template."""
    import transformers as tf

    from selfspec.models.loading import default_model_dir

    tok = tf.AutoTokenizer.from_pretrained(default_model_dir())
    cfg = tf.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2, initializer_range=0.2,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
    return SelfSpec(model.eval().requires_grad_(False), tok, DraftConfig(exit_layer=2, head="lm"), "tiny-llama")


def write_questions(path: Path, questions: list[dict]) -> str:
    path.write_text("".join(json.dumps(q) + "\n" for q in questions))
    return str(path)


def bench_cfg(tmp_path: Path, questions: list[dict], **kw) -> BenchConfig:
    q = write_questions(tmp_path / "question.jsonl", questions)
    base = dict(questions=q, out=str(tmp_path / "run"), max_new_tokens=8, warmup=2, exit_layer=2, gamma=3,
                methods=["hf", "plain", "selfspec-lm"])
    return BenchConfig(**{**base, **kw})


def test_run_writes_answer_files_manifest_and_table(tiny_ss, tmp_path):
    from selfspec.heads.io import new_head, save_head

    head = save_head(new_head("kangaroo", tiny_ss.split, 2), tmp_path / "head")
    methods = ALL_METHODS + [f"trained=selfspec:head={head},policy=confidence,threshold=0.3"]
    cfg = bench_cfg(tmp_path, QUESTIONS[:2], methods=methods, head=str(head))
    text = run_bench(cfg, ss=tiny_ss)
    run = tmp_path / "run"
    names = ["hf", "hf-prompt-lookup", "hf-early-exit-k2", "plain", "selfspec-lm", "selfspec-lm-confidence", "trained"]
    assert sorted(p.stem for p in (run / "answers").glob("*.jsonl")) == sorted(names)
    for name in names:
        recs = read_answers(run / "answers" / f"{name}.jsonl")
        assert sorted(recs) == [81, 161]
        for qid, rec in recs.items():
            assert rec["question_id"] == qid and rec["category"] in ("writing", "translation")
            assert rec["model_id"] == f"tiny-llama-{name}"
            c = rec["choices"][0]
            n_turns = 2 if qid == 81 else 1
            for key in ("turns", "new_tokens", "wall_time", "decoding_steps", "accept_lengths", "token_ids"):
                assert len(c[key]) == n_turns, (name, key)
            assert c["new_tokens"] == [len(t) for t in c["token_ids"]] and all(w > 0 for w in c["wall_time"])
            assert all(0 < n <= 8 for n in c["new_tokens"])
    # the second turn's prompt holds the method's own first answer, through the chat template
    q81 = load_questions(cfg.questions)[0]
    for name in ("hf", "selfspec-lm"):
        c = read_answers(run / "answers" / f"{name}.jsonl")[81]["choices"][0]
        assert c["turns"][0] == answer_text(tiny_ss, c["token_ids"][0])
        assert c["prompt_tokens"][1] == len(turn_prompt(tiny_ss, q81, c["turns"], 1)) > c["prompt_tokens"][0]
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["methods"]["trained"]["draft"]["head"] == str(head)
    assert manifest["methods"]["trained"]["info"]["head_kind"] == "kangaroo"
    assert manifest["methods"]["selfspec-lm-confidence"]["draft"]["policy"] == "confidence"
    assert manifest["sessions"][0]["bench"]["max_new_tokens"] == 8 and manifest["sessions"][0]["finished"]
    summary = json.loads((run / "summary.json").read_text())
    assert list(summary["groups"]) == ["mt_bench", "translation", "overall"]
    overall = summary["groups"]["overall"]
    assert overall["hf"]["speedup"] == pytest.approx(1.0) and overall["plain"]["mal"] == pytest.approx(1.0)
    for name in names:  # greedy float32: every method is lossless on this model
        assert overall[name]["identical"] == 2, name
    assert "bound" in overall["selfspec-lm"] and "bound" not in overall["hf-prompt-lookup"]
    mix = overall["selfspec-lm"]["rounds"]  # where the steps came from, recorded per turn
    assert mix["lookup"] + mix["head"] + mix["blank"] + mix["plain"] == pytest.approx(1.0)
    assert "rounds" not in overall["plain"]
    assert "Steps by draft source" in text
    assert json.loads((run / "divergences.json").read_text()) == []
    assert "### overall (2 questions)" in text and (run / "summary.md").read_text().strip() == text.strip()
    assert (run / "speedup.png").stat().st_size > 1000


def test_report_cli_and_compare(tiny_ss, tmp_path, capsys):
    run_bench(bench_cfg(tmp_path, QUESTIONS[1:2], out=str(tmp_path / "a")), ss=tiny_ss)
    run_bench(bench_cfg(tmp_path, QUESTIONS[1:2], out=str(tmp_path / "b"), methods=["hf", "plain"]), ss=tiny_ss)
    (tmp_path / "a" / "summary.md").unlink()
    assert main(["bench", "report", str(tmp_path / "a")]) == 0
    assert "| selfspec-lm |" in capsys.readouterr().out and (tmp_path / "a" / "summary.md").is_file()
    assert main(["bench", "report", str(tmp_path / "a"), "--compare", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "| translation | plain |" in out and "| translation | selfspec-lm |" not in out
    assert main(["bench", "report", str(tmp_path)]) == 2  # not a run directory: a clean error


def record(qid: int, cat: str, tokens: list[int], walls: list[float], accepts=None, steps=None, ids=None, drafts=None,
           rounds=None):
    c = {"turns": ["x"] * len(tokens), "new_tokens": tokens, "wall_time": walls,
         "decoding_steps": steps or [n - 1 for n in tokens], "accept_lengths": accepts or [[] for _ in tokens],
         "token_ids": ids or [list(range(n)) for n in tokens]}
    if drafts is not None:
        c["draft_tokens"] = drafts
    if rounds is not None:
        c["rounds"] = rounds
    return {"question_id": qid, "category": cat, "model_id": "m", "choices": [c]}


def test_speedup_is_a_ratio_of_means_and_mal_pools_steps(tmp_path):
    answers = tmp_path / "answers"
    answers.mkdir()
    hf = [record(81, "writing", [5, 5], [0.5, 0.5]), record(161, "translation", [20], [1.0]),
          record(241, "qa", [30], [1.0])]  # 10, 20, 30 tok/s
    fast = [record(81, "writing", [5, 5], [0.125, 0.125], accepts=[[2, 2], [3, 1]], drafts=[6, 6],  # 40 tok/s
                   rounds=[{"lookup": 1, "depths": {"1": 1}, "store": 1, "store_proposed": 4, "store_accepted": 1,
                            "head_proposed": [2, 1], "head_accepted": [1, 0]},
                           {"lookup": 0, "depths": {"1": 1, "2": 1}, "head_proposed": [3, 3, 1],
                            "head_accepted": [2, 1, 0]}]),
            record(161, "translation", [20], [1.0], accepts=[[4] * 4 + [3]], drafts=[20]),  # 20 tok/s
            record(241, "qa", [30], [1.0], accepts=[[1] * 29], drafts=[29], ids=[[7] * 30],  # 30 tok/s
                   rounds=[{"lookup": 0, "depths": {}, "blank": 10}])]  # 10 of its 29 steps blank, the rest plain
    for name, recs in (("hf", hf), ("fast", fast)):
        (answers / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (tmp_path / "manifest.json").write_text(json.dumps({
        "baseline": "hf", "method_order": ["hf", "fast"],
        "methods": {"hf": {"kind": "hf", "info": {}}, "fast": {"kind": "selfspec", "info": {"exit_layer": 1,
                                                                                            "num_layers": 4}}}}))
    s = summarize(load_run(tmp_path))
    table = format_summary(s)  # per group (mt_bench, translation, qa, overall): the head's first two positions
    assert "Head drafts accepted at chain positions 1 / 2" in table
    assert "| fast | 0.60 / 0.25 | - | - | 0.60 / 0.25 |" in table
    overall = s["groups"]["overall"]
    assert overall["fast"]["tokens_per_s"] == pytest.approx(30.0) and overall["hf"]["tokens_per_s"] == pytest.approx(20.0)
    assert overall["fast"]["speedup"] == pytest.approx(1.5)  # not the mean of ratios (2.0)
    assert overall["fast"]["median_ratio"] == pytest.approx(1.0)  # ratios 4, 1, 1
    assert overall["fast"]["mal"] == pytest.approx((8 + 19 + 29) / (4 + 5 + 29))
    assert overall["hf"]["mal"] == pytest.approx(1.0)  # no accept_lengths: new_tokens - 1 per decoding step
    assert overall["fast"]["identical"] == 2 and overall["hf"]["identical"] == 3
    d = (12 + 20 + 29) / 38  # drafts per step; c = 1/4
    assert overall["fast"]["bound"] == pytest.approx(overall["fast"]["mal"] / (d / 4 + 1))
    mt = s["groups"]["mt_bench"]["fast"]
    assert mt["speedup"] == pytest.approx(4.0) and mt["mal"] == pytest.approx(2.0) and mt["questions"] == 1
    # 4 steps: 1 lookup, 3 early-exit rounds (two at depth 1, one at depth 2), no plain step
    depths = mt["rounds"].pop("depths")
    assert mt["rounds"].pop("store_acceptance") == pytest.approx(0.25)  # the lookup step drafted from a token store
    # the head's drafts per chain position, pooled: proposed 5 / 4 / 1, accepted 3 / 1 / 0
    assert mt["rounds"].pop("head_acceptance") == pytest.approx([0.6, 0.25, 0.0])
    assert mt["rounds"] == pytest.approx({"lookup": 0.25, "head": 0.75, "plain": 0.0, "blank": 0.0, "store": 0.25})
    qa = s["groups"]["qa"]["fast"]["rounds"]
    assert qa["blank"] == pytest.approx(10 / 29) and qa["plain"] == pytest.approx(19 / 29)
    assert qa["head_acceptance"] == []  # rounds recorded without the head's drafts
    assert depths == pytest.approx({"1": 2 / 3, "2": 1 / 3})
    assert "rounds" not in s["groups"]["mt_bench"]["hf"]
    assert list(s["groups"]) == ["mt_bench", "translation", "qa", "overall"]


def test_repeating_turns_are_reported_apart(tmp_path):
    assert repeated_share(list(range(40))) == 0.0 and repeated_share([]) == 0.0
    assert repeated_share(list(range(16)) * 3) == pytest.approx(17 / 48)  # 33 windows, 16 distinct
    answers = tmp_path / "answers"
    answers.mkdir()
    loop, prose = list(range(16)) * 4, list(range(100, 164))  # 64 tokens each
    base = [record(81, "writing", [64, 64], [1.0, 1.0], ids=[loop, prose])]
    fast = [record(81, "writing", [64, 64], [0.25, 0.5], ids=[loop, prose])]
    for name, recs in (("plain", base), ("fast", fast)):
        (answers / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    s = summarize(load_run(tmp_path), "plain")
    r = s["repetition"]
    assert r["turns"] == 2 and r["repeating_turns"] == 1 and r["repeating_token_share"] == pytest.approx(0.5)
    assert r["speedup"]["fast"] == pytest.approx({"repeating": 4.0, "other": 2.0})
    assert r["speedup"]["plain"] == pytest.approx({"repeating": 1.0, "other": 1.0})
    assert "repeats itself" in format_summary(s)
    fast[0]["choices"][0]["token_ids"] = [prose, prose]  # the method's own text does not count: the baseline's does
    (answers / "fast.jsonl").write_text(json.dumps(fast[0]) + "\n")
    assert summarize(load_run(tmp_path), "plain")["repetition"]["repeating_turns"] == 1
    del base[0]["choices"][0]["token_ids"]  # no token ids recorded: nothing to split
    (answers / "plain.jsonl").write_text(json.dumps(base[0]) + "\n")
    s = summarize(load_run(tmp_path), "plain")
    assert s["repetition"] is None and "repeats itself" not in format_summary(s)


def test_decoding_alone_takes_each_turns_prefill_out(tmp_path):
    answers = tmp_path / "answers"
    answers.mkdir()
    base = record(161, "translation", [11], [1.5])  # llama.cpp: its own prompt_ms, 10 tokens in 1.0 s after it
    base["choices"][0]["peer"] = [{"prompt_ms": 500.0}]
    fast = record(161, "translation", [11, 6], [1.0, 0.5])  # 10 + 5 tokens in 0.5 + 0.25 s after the prefills
    fast["choices"][0]["prefill_time"] = [0.5, 0.25]
    older = record(161, "translation", [11], [0.9])  # no prefill recorded: no decoding-alone figure
    for name, rec in (("base", base), ("fast", fast), ("older", older)):
        (answers / f"{name}.jsonl").write_text(json.dumps(rec) + "\n")
    s = summarize(load_run(tmp_path), "base")["groups"]["overall"]
    assert s["fast"]["decode_tokens_per_s"] == pytest.approx(20.0) and s["fast"]["decode_speedup"] == pytest.approx(2.0)
    assert s["fast"]["speedup"] == pytest.approx((17 / 1.5) / (11 / 1.5))  # end to end, prefills included
    assert "decode_speedup" not in s["older"]
    assert "Decoding alone" in format_summary(summarize(load_run(tmp_path), "base"))


def test_hf_steps_from_forward_positions():
    assert hf_steps([0, 10, 11, 12], 10, 4) == (3, [1, 1, 1])  # plain generate: prefill + one token per step
    assert hf_steps([0, 10, 14, 15], 10, 8) == (3, [4, 1, 2])  # drafts accepted, the last step emits the rest
    assert hf_steps([0, 12, 13], 10, 5) == (2, [1, 1])  # the prefill already verified 2 prompt-lookup tokens
    assert hf_steps([0, None], 10, 2) == (1, [])


def test_resume_after_a_kill_loses_nothing_and_repeats_nothing(tiny_ss, tmp_path):
    cfg = bench_cfg(tmp_path, QUESTIONS)
    seen: list[tuple[str, int]] = []

    def kill_after_five(method, qid):
        seen.append((method, qid))
        if len(seen) == 5:  # mid-question: the second question has 2 of its 3 methods
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_bench(cfg, ss=tiny_ss, on_answer=kill_after_five)
    answers = tmp_path / "run" / "answers"
    before = {m: read_answers(answers / f"{m}.jsonl") for m in ("hf", "plain", "selfspec-lm")}
    assert sum(len(v) for v in before.values()) == 5
    with open(answers / "plain.jsonl", "ab") as f:  # a record torn by the kill
        f.write(b'{"question_id": 241, "category": "qa", "cho')
    again: list[tuple[str, int]] = []
    run_bench(cfg, ss=tiny_ss, on_answer=lambda m, q: again.append((m, q)))
    assert len(again) == 9 - 5 and not set(again) & set(seen)
    for m, old in before.items():
        lines = (answers / f"{m}.jsonl").read_text().splitlines()
        qids = [json.loads(line)["question_id"] for line in lines]
        assert sorted(qids) == [81, 161, 241], m  # each once, nothing lost
        new = read_answers(answers / f"{m}.jsonl")
        assert all(new[q] == rec for q, rec in old.items())  # finished answers kept as they were
    assert len(json.loads((tmp_path / "run" / "manifest.json").read_text())["sessions"]) == 2
    with pytest.raises(InvalidConfigError, match="different run"):
        run_bench(replace(cfg, max_new_tokens=9), ss=tiny_ss)


def test_malformed_question_file_names_the_line(tmp_path):
    good = json.dumps(QUESTIONS[0])
    for bad, msg in (("{not json", "line 2: not valid JSON"),
                     (json.dumps({"question_id": 5, "category": "qa"}), "line 2: 'turns'"),
                     (json.dumps({"question_id": "5", "category": "qa", "turns": ["q"]}), "line 2: 'question_id'"),
                     (good, "line 2: question_id 81 appears twice")):
        (tmp_path / "q.jsonl").write_text(good + "\n" + bad + "\n")
        with pytest.raises(InvalidConfigError, match=msg):
            load_questions(tmp_path / "q.jsonl")
    (tmp_path / "a.jsonl").write_text(json.dumps(record(81, "writing", [1], [1.0])) + "\n[1, 2]\n")
    with pytest.raises(InvalidConfigError, match="line 2"):
        read_answers(tmp_path / "a.jsonl")


def test_selection_limit_and_categories(tmp_path):
    qs = load_questions(write_questions(tmp_path / "q.jsonl", [
        {"question_id": i, "category": c, "turns": ["q"]}
        for i, c in [(81, "writing"), (91, "roleplay"), (101, "math"), (111, "coding"), (161, "translation"),
                     (162, "translation"), (241, "qa")]]))
    assert [q.question_id for q in select_questions(qs, [], 2)] == [81, 101, 161, 162, 241]
    assert [q.question_id for q in select_questions(qs, ["mt_bench,qa"], None)] == [81, 91, 101, 111, 241]
    assert [q.question_id for q in select_questions(qs, ["coding"], None)] == [111]
    with pytest.raises(InvalidConfigError, match="unknown categories"):
        select_questions(qs, ["poetry"], None)


def test_method_specs(tiny_ss, tmp_path):
    assert split_specs(["hf,plain,selfspec:exit_layer=2,gamma=3,hf-early-exit", "k1=selfspec:exit_layer=1"]) == [
        "hf", "plain", "selfspec:exit_layer=2,gamma=3", "hf-early-exit", "k1=selfspec:exit_layer=1"]
    cfg = BenchConfig(exit_layer=2, gamma=4, head="lm")
    m = parse_method("selfspec:exit_layer=3,policy=confidence,threshold=0.5", cfg, tiny_ss)
    assert m.name == "selfspec-k3-lm-g4-confidence0.5" and m.draft.exit_layer == 3 and m.draft.gamma == 4
    assert parse_method("hf-early-exit", cfg, tiny_ss).options == {"assistant_early_exit": 2}
    assert parse_method("hf-prompt-lookup:num_tokens=5", cfg, tiny_ss).name == "hf-prompt-lookup-n5"
    assert parse_method("x=selfspec-lm-confidence", cfg, tiny_ss).draft.policy == "confidence"
    d = parse_method("selfspec-default", cfg, tiny_ss)  # what a user gets, whatever the bench's defaults
    assert d.name == "selfspec-default" and d.draft.gamma is None and d.draft.lookup > 0
    assert d.draft.policy == "thompson-confidence" and d.info["costs"]["t_deep"][1] > 0
    adaptive = parse_method("selfspec:gamma=none,lookup=0", cfg, tiny_ss).draft
    assert adaptive.lookup == 0 and adaptive.policy == "thompson-confidence"  # a user's adaptive defaults
    assert parse_method("selfspec:gamma=none,policy=confidence,tune=off", cfg, tiny_ss).draft.threshold == 0.5
    assert parse_method("selfspec:explore=true", cfg, tiny_ss).draft.explore is True
    assert parse_method("selfspec:explore=off", cfg, tiny_ss).draft.explore is False
    for bad, msg in (("selfspec:explore=maybe", "invalid bool value"), ("nope", "unknown method"), ("selfspec-trained", "needs a trained exit head"),
                     ("selfspec:depth=3", "unknown selfspec setting"), ("selfspec:exit_layer=9", "out of range"),
                     ("selfspec-lm-greedy", "unknown drafting policy"), ("hf:x=1", "takes no settings")):
        with pytest.raises(InvalidConfigError if "range" not in msg else Exception, match=msg):
            parse_method(bad, cfg, tiny_ss)


def test_divergence_records_first_difference_and_margin(tiny_ss, tmp_path):
    cfg = bench_cfg(tmp_path, QUESTIONS[:1], methods=["hf"], divergences=False)
    run_bench(cfg, ss=tiny_ss)
    q = load_questions(cfg.questions)[0]
    hf = read_answers(tmp_path / "run" / "answers" / "hf.jsonl")[81]
    bad = json.loads(json.dumps(hf))
    ids = bad["choices"][0]["token_ids"][1]
    ids[3] = (ids[3] + 1) % 49152  # the second turn differs from its 4th token on
    answers = {"hf": {81: hf}, "bad": {81: bad}, "same": {81: hf}}
    texts = hf["choices"][0]["turns"]
    divs = compute_divergences(tiny_ss, lambda qid, t: turn_prompt(tiny_ss, q, texts, t), answers, "hf", 1e-3)
    assert len(divs) == 1
    d = divs[0]
    assert (d["method"], d["question_id"], d["turn"], d["position"]) == ("bad", 81, 1, 3)
    prompt = turn_prompt(tiny_ss, q, texts, 1) + hf["choices"][0]["token_ids"][1][:3]
    with torch.no_grad():
        logits = tiny_ss.model(torch.tensor([prompt])).logits[0, -1]
    top = torch.topk(logits, 2).values
    assert d["margin"] == pytest.approx(float(top[0] - top[1]), abs=1e-4)
    assert d["top1_token"] == d["baseline_token"] and d["token_gap"] > 0 and not d["near_tie"]
    run = tmp_path / "run"  # the report lists it
    (run / "answers" / "bad.jsonl").write_text(json.dumps(bad) + "\n")
    (run / "divergences.json").write_text(json.dumps(divs))
    text = write_report(run)
    assert "| bad | 1 | 0 |" in text and "| bad | 81 | 1 | 3 |" in text


@pytest.mark.slow
def test_cli_smoke_on_the_real_model(tmp_path):
    q = write_questions(tmp_path / "q.jsonl", QUESTIONS[1:2])
    assert main(["bench", q, "--out", str(tmp_path / "run"), "--max-new-tokens", "4", "--warmup", "2",
                 "--methods", "hf,selfspec-lm", "--threads", "1"]) == 0
    c = read_answers(tmp_path / "run" / "answers" / "selfspec-lm.jsonl")[161]["choices"][0]
    assert c["new_tokens"] == [4] and c["turns"][0]


def test_specee_methods_report_agreement_exits_and_plots(tiny_ss, tmp_path):
    from test_specee import random_predictors

    preds = random_predictors(tmp_path / "preds", exit_layer=1)
    keys = f"head=lm,exit_layer=1,gamma=3,predictors={preds},specee_threshold=0.3"
    qs = QUESTIONS[:2] + [{"question_id": 400, "category": "math_reasoning", "turns": ["What is 2 + 3?"]}]
    cfg = bench_cfg(tmp_path, qs, methods=["hf", f"specee-verified:{keys}", f"lossy=specee:{keys}"])
    text = run_bench(cfg, ss=tiny_ss)
    run = tmp_path / "run"
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["methods"]["lossy"]["info"]["lossy"] is True
    overall = json.loads((run / "summary.json").read_text())["groups"]["overall"]
    verified = next(m for m in overall if m.startswith("specee-verified"))
    assert overall[verified]["identical"] == 3 and overall[verified]["token_agreement"] == 1.0
    assert 1 <= overall["lossy"]["mean_exit_layer"] <= 4 and overall["lossy"]["predictor_ms_per_token"] > 0
    assert 0 <= overall["lossy"]["token_agreement"] <= 1
    math = json.loads((run / "summary.json").read_text())["groups"]["math_reasoning"]
    assert math["lossy"]["math_questions"] == 1
    rec = read_answers(run / "answers" / "lossy.jsonl")[81]["choices"][0]
    assert len(rec["specee"]) == 2 and rec["specee"][0]["exit_layers"]
    assert "Agreement with the baseline" in text
    assert (run / "pareto.png").stat().st_size > 1000 and (run / "exit_layers.png").stat().st_size > 1000
    with pytest.raises(InvalidConfigError, match="needs SpecEE predictors"):
        parse_method("specee:head=lm,exit_layer=1", BenchConfig(), tiny_ss)


# ---- bench-rounds (selfspec/bench/rounds.py) ---------------------------------------------------
def test_round_records_classify_each_kind():
    from selfspec.stats import GenerationStats, round_marks, round_record

    stats = GenerationStats()
    cases = [("plain", (0, 0, "early_exit"), ("plain step", 0, 0)),
             ("selfspec", (0, 0, "early_exit"), ("no draft", 0, 0)),
             ("selfspec", (0, 0, "blank"), ("blank", 0, 0)),
             ("selfspec", (3, 1, "early_exit"), ("head", 3, 1)),
             ("selfspec", (2, 2, "lookup"), ("lookup", 2, 2)),
             ("selfspec", (4, 0, "early_exit"), ("head", 4, 0))]
    for method, step, want in cases:
        before = round_marks(stats)
        stats.record_step(*step)
        r = round_record(method, before, stats, 0.01)
        assert (r.kind, r.drafted, r.accepted) == want


def test_bench_rounds_records_every_round_and_changes_no_output(tiny_ss, tmp_path):
    from selfspec.bench.rounds import RoundsBenchConfig, format_table, run
    from selfspec.bench.rounds import summarize as summarize_rounds
    from selfspec.config import GenerateConfig, ModelConfig
    from selfspec.stats import RoundRecord

    tiny_ss.set_draft(DraftConfig(exit_layer=2, head="lm", gamma=3, policy="fixed", lookup=5))
    questions = [{"question_id": 161 + i, "category": "translation",
                  "turns": ["Repeat after me: the cat sat on the mat, the cat sat on the mat, the cat sat"]}
                 for i in range(2)] + QUESTIONS[2:]
    cfg = RoundsBenchConfig(questions=write_questions(tmp_path / "q.jsonl", questions), limit=4, max_new_tokens=12,
                            out=str(tmp_path / "rounds.json"))
    ids = tiny_ss.encode([{"role": "user", "content": questions[0]["turns"][0]}])
    before = tiny_ss.generate(ids, GenerateConfig(max_new_tokens=12)).token_ids
    res = run(ModelConfig(), cfg, ss=tiny_ss)
    assert tiny_ss.engine.round_log is None  # unhooked after the run
    assert tiny_ss.generate(ids, GenerateConfig(max_new_tokens=12)).token_ids == before
    recs = res["records"]
    # each prompt: 11 plain steps (the prefill gave the first token); the speculative rounds emit 11 tokens
    assert sum(r["kind"] == "plain step" for r in recs) == 11 * len(questions)
    spec = [r for r in recs if r["method"] == "selfspec"]
    assert sum(r["accepted"] + 1 for r in spec) >= 11 * len(questions)
    assert {r["kind"] for r in spec} <= {"no draft", "blank", "head", "lookup"} and any(r["drafted"] for r in spec)
    s = res["summary"]
    assert sum(k["rounds"] for k in s["kinds"].values()) == len(spec)
    for k in s["kinds"].values():
        assert k["value"] == pytest.approx((1 + k["mean_accepted"]) / k["steps"])
    assert {r["prompt"] for r in recs} == set(range(len(questions)))  # every round knows its prompt
    # a round is priced in its own prompt's plain steps: a prompt whose steps take twice as long counts the same
    two = [RoundRecord("plain", "plain step", 0, 0, 0.01, 0), RoundRecord("plain", "plain step", 0, 0, 0.02, 1),
           RoundRecord("selfspec", "head", 1, 1, 0.012, 0), RoundRecord("selfspec", "head", 1, 1, 0.024, 1)]
    assert summarize_rounds(two)["kinds"]["head 1"]["steps"] == pytest.approx(1.2)
    assert json.loads((tmp_path / "rounds.json").read_text())["summary"]["kinds"] == s["kinds"]
    assert "plain step: median" in format_table(s)
    with pytest.raises(InvalidConfigError, match="plain steps"):
        summarize_rounds([RoundRecord("selfspec", "head", 1, 1, 0.01)])


def test_keep_drafters_keeps_each_methods_drafter_across_its_turns(tiny_ss, tmp_path, monkeypatch):
    """``keep_drafters``: each selfspec method's drafter is built at its first turn and kept for its later ones (two
    methods alternating, each with its own), as its own server keeps it; the answers are the same as with a drafter
    built afresh each turn (every run so far)."""
    import selfspec.bench.turn as bench_turn

    built: list[str] = []
    real = tiny_ss.set_draft
    monkeypatch.setattr(tiny_ss, "set_draft", lambda draft: built.append(draft.policy) or real(draft))
    methods = ["plain", "selfspec-lm", "selfspec-lm-confidence"]
    # each method's drafters, held (an id alone may be reused by a later drafter once an earlier one is freed)
    engines: dict[str, list] = {}
    real_use = bench_turn.use_draft

    def spy(ss, method, kept=None):
        real_use(ss, method, kept)
        engines.setdefault(method.name, []).append(ss.engine.drafter)

    def distinct(drafters: list) -> int:
        return len({id(d) for d in drafters})

    monkeypatch.setattr(bench_turn, "use_draft", spy)
    kept = run_bench(bench_cfg(tmp_path, QUESTIONS[:2], methods=methods, keep_drafters=True,
                               out=str(tmp_path / "kept")), ss=tiny_ss)
    assert all(distinct(ds) == 1 for ds in engines.values()) and len(engines) == 2
    n_kept, engines = len(built), {}
    built.clear()
    afresh = run_bench(bench_cfg(tmp_path, QUESTIONS[:2], methods=methods, out=str(tmp_path / "afresh")), ss=tiny_ss)
    assert all(distinct(ds) == 4 for ds in engines.values())  # the warm-up and three turns (question 81 has two)
    assert len(built) - n_kept == 2 * 3  # (parsing the methods builds each once either way)
    for name in methods:
        a = read_answers(tmp_path / "kept" / "answers" / f"{name}.jsonl")
        b = read_answers(tmp_path / "afresh" / "answers" / f"{name}.jsonl")
        assert {q: r["choices"][0]["token_ids"] for q, r in a.items()} == \
            {q: r["choices"][0]["token_ids"] for q, r in b.items()}
    assert "selfspec-lm" in kept and "selfspec-lm" in afresh
