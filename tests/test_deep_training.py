"""Distillation data and deep-head training on tiny parts: the ShareGPT reader survives a torn file and
splits stably, feature shards hold what one fresh forward computes (and resume), and train-deep learns,
resumes and saves a head the engine loads and decodes with losslessly."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch
from conftest import hf_greedy, tiny_model, tiny_tokenizer

from selfspec import DraftConfig, SelfSpec
from selfspec.errors import ExitLayerError, InvalidConfigError, ModelNotFoundError
from selfspec.heads.io import load_head
from selfspec.train.deep import DeepTrainConfig, train_deep_head
from selfspec.train.features import (
    FeatureConfig,
    collect_features,
    encode_conversation,
    load_exit_features,
    load_features,
)
from selfspec.train.loop import autocast_dtype, fitted_schedule
from selfspec.train.sharegpt import conversations, is_heldout, iter_records, messages_of

pytestmark = pytest.mark.usefixtures("one_thread")

TEMPLATE = "{% for m in messages %}{{ m['role'][0] }}: {{ m['content'] }}. {% endfor %}"
WORDS = "the cat sat on a mat and it was happy so we all ran to see it there".split()


def conv(i: int) -> dict:
    g = torch.Generator().manual_seed(i)
    text = lambda n: " ".join(WORDS[j] for j in torch.randint(len(WORDS), (n,), generator=g).tolist())  # noqa: E731
    return {"id": f"c{i}", "conversations": [{"from": "human", "value": text(6)}, {"from": "gpt", "value": text(20)},
                                            {"from": "human", "value": text(4)}, {"from": "gpt", "value": text(15)}]}


@pytest.fixture(scope="module")
def sharegpt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("sg") / "sharegpt.json"
    text = json.dumps([conv(i) for i in range(40)])
    path.write_text(text[: len(text) - 30])  # cut off inside the last record, like the PyPI copy
    return path


def test_sharegpt_reader_torn_file_and_stable_split(sharegpt_file, tmp_path):
    recs = list(iter_records(sharegpt_file))
    assert len(recs) == 39  # the torn 40th is dropped
    assert messages_of(recs[0])[0]["role"] == "user" and messages_of(recs[0])[1]["role"] == "assistant"
    assert messages_of({"conversations": [{"from": "gpt", "value": "hi"}]}) == []
    train = [c for c, _ in conversations(str(sharegpt_file), "train", heldout=0.25)]
    held = [c for c, _ in conversations(str(sharegpt_file), "heldout", heldout=0.25)]
    assert train and held and not set(train) & set(held) and len(train) + len(held) == 39
    assert all(is_heldout(c, 0.25) for c in held)
    bench = tmp_path / "q.jsonl"  # a Spec-Bench question equal to a conversation's first turn is excluded
    bench.write_text(json.dumps({"turns": [recs[0]["conversations"][0]["value"].upper() + "!"]}) + "\n")
    side = "heldout" if is_heldout("c0", 0.25) else "train"
    assert "c0" not in [c for c, _ in conversations(str(sharegpt_file), side, 0.25, exclude=bench)]


def test_features_equal_a_fresh_forward_and_resume(sharegpt_file, tmp_path):
    ss = SelfSpec(tiny_model("llama"), tiny_tokenizer(TEMPLATE))
    cfg = FeatureConfig(out=str(tmp_path / "f"), source=str(sharegpt_file), layers="1,2", max_tokens=64,
                        max_conversations=3, shard_tokens=100)
    assert collect_features(ss.split, ss.tokenizer, cfg)["conversations"] == 3
    cfg.max_conversations = 5  # a second run continues after the first three
    prog = collect_features(ss.split, ss.tokenizer, cfg)
    assert prog["conversations"] == 5
    fs = load_features(cfg.out)
    assert len(fs) == 5 and fs.num_tokens == prog["tokens"]
    msgs = [m for _, m in conversations(str(sharegpt_file), "train", 0.02)][3]
    ids, mask = encode_conversation(ss.tokenizer, msgs, 64)
    seq = fs.sequence(3)
    assert seq["ids"].tolist() == ids and seq["assistant"].tolist() == mask and any(mask) and not all(mask)
    with torch.inference_mode():
        out = ss.model(torch.tensor([ids]), output_hidden_states=True)
    torch.testing.assert_close(seq["h2"].float(), out.hidden_states[2][0], atol=2e-3, rtol=2e-3)
    assert seq["label"].tolist() == out.logits[0].argmax(-1).tolist()
    with pytest.raises(InvalidConfigError, match="other settings"):
        collect_features(ss.split, ss.tokenizer, FeatureConfig(out=cfg.out, source=str(sharegpt_file), layers="1"))
    skipped = FeatureConfig(out=str(tmp_path / "g"), source=str(sharegpt_file), layers="1,2", max_tokens=64, skip=3,
                            max_conversations=1)  # a fresh directory starting past the first three
    collect_features(ss.split, ss.tokenizer, skipped)
    assert load_features(skipped.out).sequence(0)["ids"].tolist() == ids
    with pytest.raises(InvalidConfigError, match="other settings"):  # resuming it from elsewhere would mix sets
        collect_features(ss.split, ss.tokenizer, replace(skipped, skip=0))


def collected_features(sharegpt_file, tmp_path, layers: str) -> tuple[SelfSpec, FeatureConfig]:
    """A tiny llama target and its features over the test conversations (states after ``layers``), in tmp_path/f."""
    ss = SelfSpec(tiny_model("llama"), tiny_tokenizer(TEMPLATE))
    feats = FeatureConfig(out=str(tmp_path / "f"), source=str(sharegpt_file), layers=layers, max_tokens=96)
    collect_features(ss.split, ss.tokenizer, feats)
    return ss, feats


@pytest.mark.slow
def test_train_deep_learns_resumes_and_decodes_losslessly(sharegpt_file, tmp_path):
    ss, feats = collected_features(sharegpt_file, tmp_path, "2")
    cfg = DeepTrainConfig(features=feats.out, heldout_features=feats.out, exit_layer=2, out=str(tmp_path / "h"),
                          epochs=6, batch_tokens=400, lr=5e-3, warmup=2, vocab_trim=40)
    head, report = train_deep_head(ss.split, cfg)
    assert report["heldout_after"]["top1"] > report["heldout_before"]["top1"] + 0.1
    assert report["heldout_after"]["ce"] < report["heldout_before"]["ce"]
    loaded = load_head(cfg.out, ss.split)
    assert loaded.kind == "deep" and len(loaded.vocab_ids) == 40
    with torch.inference_mode():  # a greedy draft picks from the 40 rows' logits: the same token and confidence
        f = torch.randn(4, 1, ss.split.hidden_size)
        part, ids = loaded.logits_part_of(f)
        full = loaded.logits_of(f)
        assert torch.equal(ids[part.argmax(-1)], full.argmax(-1))
        assert torch.allclose(part.softmax(-1).amax(-1), full.softmax(-1).amax(-1))
        tie = torch.zeros(40)  # ties: the first maximum is the lowest id either way
        spread = torch.full((ss.split.vocab_size,), float("-inf")).index_copy_(0, ids, tie)
        assert int(ids[tie.argmax()]) == int(spread.argmax())
    ss.set_draft(DraftConfig(head=cfg.out, gamma=3, lookup=0))
    prompt = ss.encode([{"role": "user", "content": "the cat sat on"}])
    out = ss.generate(prompt, max_new_tokens=20)
    assert out.token_ids == hf_greedy(ss.model, prompt, 20)
    assert sum(out.stats.accepted_per_position) > 0
    # resume: a finished run loads its checkpoint and trains no further steps
    _, again = train_deep_head(ss.split, cfg)
    assert again["steps"] == report["steps"] and again["heldout_before"] is None
    assert list(report["heldout_sets"]) == [feats.out] and report["heldout_sets"][feats.out]["after"] == report["heldout_after"]
    # fine-tuning starts where the trained head ended
    tuned = DeepTrainConfig(**{**cfg.__dict__, "out": str(tmp_path / "t"), "init": cfg.out, "epochs": 1})
    _, rep2 = train_deep_head(ss.split, tuned)
    assert rep2["heldout_before"]["top1"] > report["heldout_after"]["top1"] - 0.05
    with pytest.raises(InvalidConfigError, match="not stored"):
        train_deep_head(ss.split, DeepTrainConfig(features=feats.out, heldout_features="", exit_layer=1,
                                                  out=str(tmp_path / "x")))


@pytest.mark.slow
def test_train_deep_in_bfloat16_learns_and_a_time_box_fits_its_schedule(sharegpt_file, tmp_path):
    ss, feats = collected_features(sharegpt_file, tmp_path, "2")
    cfg = DeepTrainConfig(features=feats.out, heldout_features=feats.out, exit_layer=2, out=str(tmp_path / "h"),
                          epochs=6, batch_tokens=400, lr=5e-3, warmup=2, vocab_trim=40, precision="bfloat16")
    _, report = train_deep_head(ss.split, cfg)
    assert report["autocast"] == "torch.bfloat16" and report["schedule_steps"] == report["total_steps"]
    assert report["heldout_after"]["top1"] > report["heldout_before"]["top1"] + 0.1  # held-out: evaluated in float32
    ss.set_draft(DraftConfig(head=cfg.out, gamma=3, lookup=0))
    prompt = ss.encode([{"role": "user", "content": "the cat sat on"}])
    assert ss.generate(prompt, max_new_tokens=20).token_ids == hf_greedy(ss.model, prompt, 20)
    # a time box far shorter than the epochs: the cosine is fitted to the steps that fit, and ends at its floor there
    boxed = replace(cfg, out=str(tmp_path / "b"), epochs=10_000, minutes=0.03, precision="float32")
    _, rep = train_deep_head(ss.split, boxed)
    assert rep["autocast"] == "none" and rep["schedule_steps"] < rep["total_steps"]
    lrs = [h["lr"] for h in json.loads((tmp_path / "b" / "train_report.json").read_text())["history"]]
    assert max(lrs) == pytest.approx(cfg.lr) and len(lrs) == rep["steps"] and lrs[-1] < 0.5 * cfg.lr
    _, unfitted = train_deep_head(ss.split, replace(boxed, out=str(tmp_path / "u"), fit_schedule=False))
    lrs = [h["lr"] for h in json.loads((tmp_path / "u" / "train_report.json").read_text())["history"]]
    assert unfitted["schedule_steps"] == unfitted["total_steps"] and lrs[-1] > 0.9 * cfg.lr  # cut off at its peak
    with pytest.raises(InvalidConfigError, match="precision 'fp16'"):
        autocast_dtype("fp16")


def test_a_resumed_time_box_is_the_whole_runs_not_a_fresh_one(sharegpt_file, tmp_path):
    """Answers, features and training are time-boxed; rerunning a run whose box is spent (as the recipe does after
    a kill) continues with the minutes left, here none: no more answers, conversations or steps (before, each
    rerun got a whole box again, so a killed recipe ran past its 45 minutes)."""
    from selfspec.train.answers import AnswerConfig, answer_prompts

    ss, feats = collected_features(sharegpt_file, tmp_path, "2")
    acfg = AnswerConfig(out=str(tmp_path / "own.json"), source=str(sharegpt_file), max_new_tokens=8, batch=2,
                        minutes=1e-5)
    made = answer_prompts(ss, acfg)
    assert 0 < made["answers"] < 30
    again = answer_prompts(ss, acfg)
    assert again["answers"] == made["answers"] and again["new_tokens"] == made["new_tokens"]
    assert again["seconds"] >= made["seconds"]  # the whole run's seconds
    fcfg = FeatureConfig(out=str(tmp_path / "g"), source=str(sharegpt_file), layers="2", max_tokens=96, minutes=1e-5)
    read = collect_features(ss.split, ss.tokenizer, fcfg)["conversations"]
    assert 0 < read < 30 and collect_features(ss.split, ss.tokenizer, fcfg)["conversations"] == read
    cfg = DeepTrainConfig(features=feats.out, heldout_features=feats.out, exit_layer=2, out=str(tmp_path / "h"),
                          epochs=10_000, batch_tokens=400, lr=5e-3, warmup=2, vocab_trim=40, minutes=0.005,
                          checkpoint_every=1, precision="float32")
    _, rep = train_deep_head(ss.split, cfg)
    _, rerun = train_deep_head(ss.split, cfg)
    assert 0 < rep["steps"] <= rerun["steps"] <= rep["steps"] + 1
    # the whole run's training clock, from the last checkpoint on (its write, a few ms, is not in it); not this run's
    # held-out evaluation, which each run does again (eval_seconds)
    assert rerun["seconds"] >= rep["seconds"] - 0.05 and rerun["eval_seconds"] > 0


@pytest.mark.slow
def test_soft_labels_are_the_targets_distribution_and_train_a_head(sharegpt_file, tmp_path):
    """``--soft-weight``: the classification loss reads the target's own distribution over the draft vocabulary,
    computed from the stored final states and those LM-head rows (the full softmax's, renormalized over the rows);
    a head trained on soft labels alone learns the target's argmax and decodes losslessly."""
    from selfspec.train.deep import target_probs

    ss, feats = collected_features(sharegpt_file, tmp_path, "2")
    fs = load_features(feats.out)
    rows = torch.tensor([5, 9, 17, 30, 2])
    final = fs.tensors["final"][:6].float()
    with torch.inference_mode():
        full = ss.split.logits(final[None])[0].softmax(-1)[:, rows]
    torch.testing.assert_close(target_probs(ss.split, final, ss.split.lm_rows(rows)), full / full.sum(-1, keepdim=True))
    top2 = target_probs(ss.split, final, ss.split.lm_rows(rows), top_k=2)  # --soft-top-k 2: HASS's top-K
    kept = full.topk(2, dim=-1).indices
    assert ((top2 > 0).sum(-1) == 2).all() and torch.equal(top2.topk(2, dim=-1).indices.sort().values, kept.sort().values)
    want = torch.zeros_like(full).scatter_(-1, kept, full.gather(-1, kept))
    torch.testing.assert_close(top2, want / want.sum(-1, keepdim=True))
    cfg = DeepTrainConfig(features=feats.out, heldout_features=feats.out, exit_layer=2, out=str(tmp_path / "s"),
                          epochs=6, batch_tokens=400, lr=5e-3, warmup=2, vocab_trim=40, soft_weight=1.0)
    _, report = train_deep_head(ss.split, cfg)
    assert report["heldout_after"]["top1"] > report["heldout_before"]["top1"] + 0.1
    ss.set_draft(DraftConfig(head=cfg.out, gamma=3, lookup=0))
    prompt = ss.encode([{"role": "user", "content": "the cat sat on"}])
    assert ss.generate(prompt, max_new_tokens=20).token_ids == hf_greedy(ss.model, prompt, 20)
    from selfspec.train.nested import NestedTrainConfig, train_nested_head

    first_loss = {}  # the nested head's loss reads them too
    for w in (0.0, 1.0):
        nested = NestedTrainConfig(**{**cfg.__dict__, "out": str(tmp_path / f"n{w}"), "depths": "2", "epochs": 3,
                                      "soft_weight": w})
        _, rep = train_nested_head(ss.split, nested)
        assert rep["heldout_after"][feats.out][2]["top1"] > rep["heldout_before"][feats.out][2]["top1"] + 0.1
        first_loss[w] = json.loads((tmp_path / f"n{w}" / "train_report.json").read_text())["history"][0]["loss"]
    assert first_loss[0.0] != pytest.approx(first_loss[1.0])  # the same first batch and weights, another loss
    with pytest.raises(InvalidConfigError, match=r"soft_weight must be in \[0, 1\]"):
        train_deep_head(ss.split, replace(cfg, out=str(tmp_path / "bad"), soft_weight=1.5))
    with pytest.raises(InvalidConfigError, match="soft_top_k must be >= 0"):
        replace(cfg, soft_top_k=-1)


def test_a_fitted_schedule_spans_the_steps_that_fit():
    assert fitted_schedule(11, 6.3, 800.0, 560) == 11 + 126
    assert fitted_schedule(11, 1.0, 10_000.0, 560) == 560  # never past the epochs
    assert fitted_schedule(11, 6.3, 0.0, 560) == 12  # at least one more step


@pytest.mark.slow
def test_deep_head_at_exit_layer_0_drafts_from_the_embeddings_losslessly(sharegpt_file, tmp_path):
    """Exit layer 0: the head reads the token embeddings (looked up from the stored ids, no stored h0) and the
    deep context, so a draft runs no target layer; it learns, fine-tunes from a head at another layer, and
    decodes losslessly as chains and trees. Other heads still need a layer."""
    ss, feats = collected_features(sharegpt_file, tmp_path, "2")
    fs = load_exit_features(feats.out, 0, ss.split)
    assert "h0" not in load_features(feats.out).tensors
    assert torch.equal(fs.tensors["h0"], ss.model.get_input_embeddings()(fs.tensors["ids"].long()).half())
    cfg = DeepTrainConfig(features=feats.out, heldout_features=feats.out, exit_layer=0, out=str(tmp_path / "h0"),
                          epochs=6, batch_tokens=400, lr=5e-3, warmup=2, vocab_trim=40)
    head, report = train_deep_head(ss.split, cfg)
    assert head.exit_layer == 0 and report["heldout_after"]["top1"] > report["heldout_before"]["top1"] + 0.1
    prompt = ss.encode([{"role": "user", "content": conv(3)["conversations"][0]["value"]}])
    ref = hf_greedy(ss.model, prompt, 30)
    for width in (0, 2):
        ss.set_draft(DraftConfig(head=cfg.out, gamma=3, lookup=0, policy="fixed", tree_width=width))
        out = ss.generate(prompt, max_new_tokens=30)
        assert out.token_ids == ref and sum(out.stats.accepted_per_position) > 0, width
    k2 = DeepTrainConfig(**{**cfg.__dict__, "exit_layer": 2, "out": str(tmp_path / "h2"), "epochs": 1})
    train_deep_head(ss.split, k2)
    _, moved = train_deep_head(ss.split, DeepTrainConfig(**{**cfg.__dict__, "out": str(tmp_path / "m"), "init": k2.out,
                                                              "epochs": 1}))
    assert load_head(tmp_path / "m", ss.split).exit_layer == 0 and moved["steps"] > 0
    with pytest.raises(ExitLayerError, match="only for a 'deep' head"):
        ss.set_draft(DraftConfig(head="lm", exit_layer=0))


@pytest.mark.slow
def test_train_deep_with_context_layers_fine_tunes_a_head_and_decodes_losslessly(sharegpt_file, tmp_path):
    """``--context-layers``: the head reads the previous token's stored states after those layers too. Fine-tuned
    from a head without them, it starts exactly where that head was (their fuse columns start at zero), learns,
    saves them in its config, and the engine keeps those states at every verification: lossless, drafts accepted.
    Layers the features do not hold are named."""
    ss, feats = collected_features(sharegpt_file, tmp_path, "1,3")
    base = DeepTrainConfig(features=feats.out, heldout_features=feats.out, exit_layer=0, out=str(tmp_path / "b"),
                           epochs=3, batch_tokens=400, lr=5e-3, warmup=2, vocab_trim=40)
    _, before = train_deep_head(ss.split, base)
    cfg = replace(base, out=str(tmp_path / "c"), init=base.out, context_layers="1,3", epochs=4)
    head, report = train_deep_head(ss.split, cfg)
    assert abs(report["heldout_before"]["top1"] - before["heldout_after"]["top1"]) < 1e-6
    assert report["heldout_after"]["ce"] < report["heldout_before"]["ce"]
    assert float(head.fuse.weight[:, 2 * ss.split.hidden_size :].abs().sum()) > 0  # the new columns learned
    loaded = load_head(cfg.out, ss.split)
    assert loaded.context_layers == [1, 3]
    ss.set_draft(DraftConfig(head=cfg.out, gamma=3, lookup=0, policy="fixed"))
    assert ss.engine.drafter.context_layers == [1, 3]
    prompt = ss.encode([{"role": "user", "content": conv(3)["conversations"][0]["value"]}])
    out = ss.generate(prompt, max_new_tokens=30)
    assert out.token_ids == hf_greedy(ss.model, prompt, 30) and sum(out.stats.accepted_per_position) > 0
    with pytest.raises(InvalidConfigError, match=r"\['h2'\] are not stored"):
        train_deep_head(ss.split, replace(cfg, out=str(tmp_path / "x"), context_layers="2"))


def test_answer_prompts_are_the_targets_greedy_answers_and_resume(sharegpt_file, tmp_path):
    from selfspec.train.answers import AnswerConfig, answer_prompts

    ss = SelfSpec(tiny_model("llama"), tiny_tokenizer(TEMPLATE))
    out = tmp_path / "own.json"
    cfg = AnswerConfig(out=str(out), source=str(sharegpt_file), max_new_tokens=8, max_conversations=2)
    with pytest.raises(ModelNotFoundError, match="does not exist"):  # a missing source leaves no output behind
        answer_prompts(ss, AnswerConfig(**{**cfg.__dict__, "source": str(tmp_path / "nope.json")}))
    assert not out.exists()
    out.write_text("")  # a run stopped before its first answer: resumed from nothing
    first = list(iter_records(out)) if answer_prompts(ss, cfg)["answers"] == 2 else None
    report = answer_prompts(ss, AnswerConfig(**{**cfg.__dict__, "max_conversations": 4}))
    recs = list(iter_records(out))
    assert report["answers"] == 4 and recs[:2] == first  # resumed: the first two kept, two more appended
    assert json.loads(out.read_text()) == recs  # a complete run leaves valid JSON
    train = dict(conversations(str(sharegpt_file), "train", 0.02))
    for rec in recs:
        prompt = rec["conversations"][0]["value"]
        assert prompt == train[rec["id"]][0]["content"]  # same id, same side of the split
        ref = hf_greedy(ss.model, ss.encode([{"role": "user", "content": prompt}]), 8, ss.eos_token_ids)
        assert rec["conversations"][1]["value"] == ss.tokenizer.decode([t for t in ref if t not in ss.eos_token_ids])
    # collect-features reads the file like ShareGPT itself
    feats = collect_features(ss.split, ss.tokenizer, FeatureConfig(out=str(tmp_path / "f"), source=str(out), layers="1"))
    assert feats["conversations"] == 4
    one = load_features(tmp_path / "f")
    both = load_features(f"{tmp_path / 'f'}, {tmp_path / 'f'}")  # comma-separated directories: their union
    assert both.num_tokens == 2 * one.num_tokens and len(both) == 2 * len(one)
    assert torch.equal(both.sequence(len(one))["ids"], one.sequence(0)["ids"])


def test_sampled_answers_are_seeded_per_prompt_keep_their_kind_and_resume(tmp_path):
    from selfspec.train.answers import AnswerConfig, answer_prompts, prompt_seed

    ss = SelfSpec(tiny_model("llama"), tiny_tokenizer(TEMPLATE))
    prompts = tmp_path / "prompts.json"  # as make-prompts writes them: one human turn and its kind
    kinds = ["translation", "math", "translation", "rag", "math"]
    prompts.write_text(json.dumps([{"id": f"p{i}", "kind": k, "conversations": [{"from": "human", "value": " ".join(
        WORDS[i : i + 5])}]} for i, k in enumerate(kinds)]))
    cfg = AnswerConfig(source=str(prompts), out=str(tmp_path / "a.json"), max_new_tokens=8, temperature=0.7, seed=3,
                       max_conversations=2)
    answer_prompts(ss, cfg)
    answer_prompts(ss, replace(cfg, max_conversations=0))  # resumed
    whole = replace(cfg, out=str(tmp_path / "b.json"), max_conversations=0)
    answer_prompts(ss, whole)
    recs = list(iter_records(tmp_path / "a.json"))
    assert recs == list(iter_records(tmp_path / "b.json"))  # a resumed run writes what an uninterrupted one does
    assert [r["kind"] for r in recs] == [r["kind"] for r in json.loads(prompts.read_text())]
    assert all(r["temperature"] == 0.7 for r in recs)
    greedy = 0
    for rec in recs:
        msgs = [{"role": "user", "content": rec["conversations"][0]["value"]}]
        alone = ss.generate(msgs, max_new_tokens=8, method="plain", temperature=0.7, seed=prompt_seed(3, rec["id"]))
        row = [t for t in alone.token_ids if t not in ss.eos_token_ids]
        assert rec["conversations"][1]["value"] == ss.tokenizer.decode(row)  # each equals its request alone
        ref = ss.generate(msgs, max_new_tokens=8, method="plain").token_ids
        greedy += row == [t for t in ref if t not in ss.eos_token_ids]
    assert greedy < len(recs)  # sampled, not the greedy answers
    with pytest.raises(InvalidConfigError, match="temperature"):
        answer_prompts(ss, replace(cfg, temperature=-1.0))
    # --kinds reads one kind of such a file (a held-out set per kind), and is refused on ShareGPT itself
    feats = collect_features(ss.split, ss.tokenizer, FeatureConfig(out=str(tmp_path / "f"), source=str(tmp_path / "a.json"),
                                                                   layers="1", kinds="math,rag"))
    assert feats["conversations"] == 3
    with pytest.raises(InvalidConfigError, match="no kind"):
        list(FeatureConfig(kinds="math").conversations())
    with pytest.raises(InvalidConfigError, match="unknown kind.*tranlsation"):  # a typo, not an empty set
        FeatureConfig(source=str(tmp_path / "a.json"), kinds="math,tranlsation").conversations()


@pytest.mark.slow
def test_train_nested_every_depth_learns_and_decodes_losslessly(sharegpt_file, tmp_path):
    """Sorted training: every depth improves on its held-out top-1, the artifact loads at each depth and the
    engine decodes with it losslessly; resuming a finished run trains no further steps."""
    from selfspec.train.nested import NestedTrainConfig, train_nested_head

    ss, feats = collected_features(sharegpt_file, tmp_path, "1,2,3")
    cfg = NestedTrainConfig(features=feats.out, heldout_features=feats.out, exit_layer=2, depths="1,2,3",
                            out=str(tmp_path / "n"), epochs=6, batch_tokens=400, lr=5e-3, warmup=2, vocab_trim=40)
    head, report = train_nested_head(ss.split, cfg)
    before, after = report["heldout_before"][feats.out], report["heldout_after"][feats.out]
    for d in (1, 2, 3):
        assert after[d]["top1"] > before[d]["top1"] + 0.05, d
    assert head.kind == "nested" and head.depths == [1, 2, 3]
    prompt = ss.encode([{"role": "user", "content": "the cat sat on"}])
    ref = hf_greedy(ss.model, prompt, 20)
    for d in (1, 3):
        ss.set_draft(DraftConfig(head=cfg.out, exit_layer=d, gamma=3, lookup=0, policy="fixed"))
        out = ss.generate(prompt, max_new_tokens=20)
        assert out.token_ids == ref and sum(out.stats.accepted_per_position) > 0, d
    _, again = train_nested_head(ss.split, cfg)
    assert again["steps"] == report["steps"] and again["heldout_before"] == {}
    with pytest.raises(InvalidConfigError, match="must be one of the depths"):
        train_nested_head(ss.split, NestedTrainConfig(features=feats.out, exit_layer=4, depths="1,2"))


@pytest.mark.slow
def test_train_recipe_end_to_end_resumes_and_its_head_decodes_losslessly(sharegpt_file, tmp_path):
    """train-recipe on a tiny model: every stage runs, the draft vocabulary is one of the candidates chosen by
    the measured prediction, the report has acceptance per position before and after, the head (bfloat16 on
    disk) loads and decodes losslessly, and a second run resumes from the ledger without redoing a stage."""
    from selfspec.train.recipe import RecipeConfig, train_recipe

    ss = SelfSpec(tiny_model("llama"), tiny_tokenizer(TEMPLATE), DraftConfig(head="lm", exit_layer=2, gamma=1))
    cfg = RecipeConfig(out=str(tmp_path / "run"), minutes=0.5, source=str(sharegpt_file), heldout=0.25, answer_skip=5,
                       heldout_answers=3, heldout_conversations=3, answer_tokens=12, answer_batch=2,
                       vocab_sizes="20,40", eval_prompts=2, eval_tokens=8)
    report = train_recipe(ss, cfg)
    assert set(report["stages"]) == {"answers-heldout", "answers-train", "features-heldout", "features-own-heldout",
                                     "features-train", "features-own-train", "train", "vocab", "head", "eval"}
    sizes = report["vocab"]["sizes"]
    assert [r["size"] for r in sizes] == [20, 40]
    assert report["vocab"]["chosen"] == max(sizes, key=lambda r: (r["predicted_speedup"], -r["size"]))["size"]
    assert sizes[1]["label_in_vocab"] >= sizes[0]["label_in_vocab"]
    for when in ("before", "after"):
        assert len(report["eval"][when]["acceptance_rate_per_position"]) == 3
    needed = report["eval"]["tuning"]["acceptance_needed"]  # what drafts must reach at the measured costs
    assert set(needed) == {"1x", "1.3x", "1.6x"}
    reached = [a for a in needed.values() if a is not None]
    assert reached == sorted(reached) and all(0 <= a <= 1 for a in reached)
    assert report["train"]["steps"] > 0 and report["data"]["answers-train"]["answers"] > 0
    assert 0 < report["own_answers_used"] <= 1  # the share of the answers whose features were read
    head_dir = tmp_path / "run" / "head"
    from safetensors import safe_open

    with safe_open(str(head_dir / "head.safetensors"), "pt") as f:
        assert f.get_tensor("fuse.weight").dtype == torch.bfloat16
    head = load_head(head_dir, ss.split)
    assert head.kind == "deep" and len(head.vocab_ids) == report["vocab"]["chosen"]
    assert json.loads((head_dir / "head_config.json").read_text())["draft"]["tree_width"] >= 0
    ss.set_draft(DraftConfig(head=str(head_dir), gamma=3, lookup=0))
    prompt = ss.encode([{"role": "user", "content": "the cat sat on"}])
    assert ss.generate(prompt, max_new_tokens=16).token_ids == hf_greedy(ss.model, prompt, 16)
    ledger = json.loads((tmp_path / "run" / "recipe.json").read_text())
    again = train_recipe(ss, cfg)  # resumed: every stage recorded, nothing run again
    assert again["stages"] == report["stages"] and again["vocab"] == report["vocab"]
    assert json.loads((tmp_path / "run" / "recipe.json").read_text())["stages"] == ledger["stages"]

    # --init: the same data, training resumed from the trained head (its bfloat16 file), not from layer k
    shutil.copytree(tmp_path / "run", tmp_path / "ft", ignore=shutil.ignore_patterns("trained*", "head", "report.json"))
    ledger["stages"] = {k: v for k, v in ledger["stages"].items() if k.startswith(("answers", "features"))}
    (tmp_path / "ft" / "recipe.json").write_text(json.dumps(ledger))
    tuned = train_recipe(ss, replace(cfg, out=str(tmp_path / "ft"), init=str(head_dir)))
    first, second = (list(r["train"]["heldout_sets"].values()) for r in (report, tuned))
    for a, b in zip(first, second, strict=True):
        assert abs(b["before"]["top1"] - a["after"]["top1"]) < 0.03  # it starts where the first run ended
        assert b["before"]["top1"] > a["before"]["top1"] + 0.05


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text", "phi3"])
def test_train_recipe_on_other_architectures_quantized(sharegpt_file, tmp_path, arch):
    """The recipe on the layouts furthest from Llama's (q/k norms; scaled embeddings and sliding windows; fused
    projections), block-quantized as a user's GGUF is: every stage runs and its head decodes losslessly."""
    from selfspec.quant.convert import quantize_model
    from selfspec.train.recipe import RecipeConfig, train_recipe

    model = quantize_model(tiny_model(arch), "Q8_0" if arch == "phi3" else "Q4_0")
    ss = SelfSpec(model, tiny_tokenizer(TEMPLATE), DraftConfig(head="lm", exit_layer=2, gamma=1))
    cfg = RecipeConfig(out=str(tmp_path / "run"), minutes=0.1, source=str(sharegpt_file), heldout=0.25, answer_skip=5,
                       heldout_answers=2, heldout_conversations=2, answer_tokens=8, answer_batch=2,
                       vocab_sizes="40", eval_prompts=1, eval_tokens=8)
    report = train_recipe(ss, cfg)
    assert report["train"]["steps"] > 0 and report["vocab"]["chosen"] == 40
    ss.set_draft(DraftConfig(head=str(tmp_path / "run" / "head"), gamma=3, lookup=0, policy="fixed", tune="off"))
    for text in ("the cat sat on", "hello world"):
        prompt = ss.encode([{"role": "user", "content": text}])
        out = ss.generate(prompt, max_new_tokens=16)
        assert out.token_ids == hf_greedy(ss.model, prompt, 16, eos=ss.eos_token_ids), (arch, text)
        assert sum(out.stats.proposed_per_position) > 0  # the head drafted and was verified



class _ToyHead(torch.nn.Module):
    """The DeepFeatures protocol in two linears: f = A h + B ctx (enough to see which context a pass reads)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        from selfspec.heads.kangaroo import RMSNorm

        g = torch.Generator().manual_seed(0)
        self.a = torch.nn.Parameter(torch.randn(hidden, hidden, generator=g) * 0.3)
        self.b = torch.nn.Parameter(torch.randn(hidden, hidden, generator=g) * 0.3)
        self.norm_out = RMSNorm(hidden, 1e-6)

    def features(self, h, context, positions):
        return h @ self.a.T + context @ self.b.T


def test_a_rollout_of_three_passes_reads_each_pass_from_the_one_before():
    """Training-time test: pass j's context at position t is pass j - 1's features at t - 1 (the first position keeps
    the true state), and each unrolled pass adds unroll_weight times its CE."""
    import torch.nn.functional as F

    from selfspec.train.deep import deep_loss

    torch.manual_seed(0)
    B, T, H, V = 2, 7, 8, 11
    head, lm = _ToyHead(H), torch.randn(V, H)
    h, final = torch.randn(B, T, H), torch.randn(B, T, H)
    ctx = torch.cat([torch.randn(B, 1, H), final[:, :-1]], dim=1)
    labels = torch.randint(0, V, (B, T))
    labels[0, -1] = -100
    batch = {"h": h, "ctx": ctx, "final": final, "labels": labels}
    cfg = DeepTrainConfig(unroll_weight=0.5, reg_weight=0.0)
    valid = labels >= 0

    def ce(f):
        return F.cross_entropy(head.norm_out(f)[valid] @ lm.T, labels[valid])

    def shifted(f):
        return torch.cat([ctx[:, :1], f[:, :-1]], dim=1)

    f1 = head.features(h, ctx, None)
    f2 = head.features(h, shifted(f1), None)
    f3 = head.features(h, shifted(f2), None)
    one, m1 = deep_loss(head, lm, batch, replace(cfg, rollout=1))
    two, m2 = deep_loss(head, lm, batch, cfg)  # the default: one unrolled pass
    three, m3 = deep_loss(head, lm, batch, replace(cfg, rollout=3))
    torch.testing.assert_close(one, ce(f1))
    torch.testing.assert_close(two, ce(f1) + 0.5 * ce(f2))
    torch.testing.assert_close(three, ce(f1) + 0.5 * ce(f2) + 0.5 * ce(f3))
    assert "top1_unrolled" not in m1 and "top1_pass3" not in m2 and {"top1_unrolled", "top1_pass3"} <= set(m3)
    three.backward()  # gradients flow through the unrolled passes to both linears
    assert head.a.grad is not None and head.b.grad.abs().sum() > 0
    with pytest.raises(InvalidConfigError, match="rollout must be >= 1"):
        DeepTrainConfig(rollout=0)


def test_a_cuda_device_is_checked_and_a_cpu_run_moves_nothing(monkeypatch):
    from selfspec.train.deep import to_device
    from selfspec.train.loop import training_device

    with pytest.raises(InvalidConfigError, match="device must be 'cpu' or 'cuda'"):
        DeepTrainConfig(device="tpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(InvalidConfigError, match="no CUDA device"):
        training_device(DeepTrainConfig(device="cuda"))
    assert training_device(DeepTrainConfig()) == torch.device("cpu")
    batch = {"h": torch.zeros(1, 2, 3)}
    assert to_device(batch, torch.device("cpu")) is batch
    assert autocast_dtype("auto", "cuda") == torch.bfloat16 and autocast_dtype("float32", "cuda") is None
