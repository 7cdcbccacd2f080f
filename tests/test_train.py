"""Training exit heads by self-distillation on tiny models: held-out KL goes down, save -> load gives
identical logits, resume equals an uninterrupted run, a mismatched head is refused, and the engine
stays lossless with the trained head."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, hf_greedy, tiny_model

from selfspec import DraftConfig, SelfSpec
from selfspec.errors import HeadMismatchError
from selfspec.heads.io import load_head
from selfspec.train.trainer import TrainConfig, train_head


def _seqs(model, n: int = 24, new: int = 24) -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        prompt = torch.randint(2, VOCAB, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
        out.append({"prompt_ids": prompt, "output_ids": hf_greedy(model, prompt, new)})
    return out


@pytest.fixture(scope="module")
def data():
    return _seqs(tiny_model("llama"), n=48)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["kangaroo", "linear", "layer"])
def test_training_lowers_heldout_kl_and_stays_lossless(kind, data, tmp_path):
    model = tiny_model("llama")
    ss = SelfSpec(model, None)
    cfg = TrainConfig(exit_layer=2, kind=kind, out=str(tmp_path / kind), epochs=8, batch_size=4, lr=3e-3,
                      warmup=5, heldout=0.25, rank=16)
    head, report = train_head(ss.split, data, cfg)
    assert report["heldout_after"]["kl"] < 0.93 * report["heldout_before"]["kl"]  # random target: hard to fit
    ss.set_draft(DraftConfig(head=str(tmp_path / kind), gamma=4))
    assert ss.head.kind == kind and ss.draft_config.exit_layer == 2
    for s in data[:3]:
        assert ss.generate(s["prompt_ids"], max_new_tokens=20).token_ids == s["output_ids"][:20]


def test_save_load_identical_logits_and_mismatch_errors(data, tmp_path):
    ss = SelfSpec(tiny_model("llama"), None)
    cfg = TrainConfig(exit_layer=3, kind="kangaroo", out=str(tmp_path / "h"), epochs=1, batch_size=8, max_steps=2)
    head, _ = train_head(ss.split, data, cfg)
    loaded = load_head(tmp_path / "h", ss.split)
    h = torch.randn(2, 7, ss.split.hidden_size)
    pos = torch.arange(7)[None].expand(2, -1)
    torch.testing.assert_close(loaded(h, pos), head(h, pos), rtol=0, atol=0)
    with pytest.raises(HeadMismatchError, match="exit layer 3, not 2"):
        load_head(tmp_path / "h", ss.split, exit_layer=2)
    other = SelfSpec(tiny_model("qwen3"), None)  # head_dim 16 vs 16 but another architecture
    with pytest.raises(HeadMismatchError, match="does not match this model.*model_type"):
        other.set_draft(DraftConfig(head=str(tmp_path / "h")))
    assert other.generate([5, 6], max_new_tokens=3).token_ids  # the failed load left the engine usable


@pytest.mark.slow
def test_resume_equals_uninterrupted_run(data, tmp_path):
    ss = SelfSpec(tiny_model("llama"), None)
    common = dict(exit_layer=2, kind="linear", rank=8, epochs=3, batch_size=4, checkpoint_every=2, seed=3)
    full, _ = train_head(ss.split, data, TrainConfig(out=str(tmp_path / "a"), **common))
    with pytest.raises(KeyboardInterrupt):
        train_head(ss.split, data, TrainConfig(out=str(tmp_path / "b"), **common), interrupt_at=5)
    resumed, report = train_head(ss.split, data, TrainConfig(out=str(tmp_path / "b"), **common))
    assert report["steps"] == 3 * 11  # 43 training sequences / 4 per step -> 11 steps an epoch
    for (n, a), (_, b) in zip(full.state_dict().items(), resumed.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=n)


def test_vocab_trim_drafts_only_kept_tokens_and_stays_lossless(data, tmp_path):
    ss = SelfSpec(tiny_model("llama"), None)
    cfg = TrainConfig(exit_layer=2, kind="linear", out=str(tmp_path / "t"), epochs=2, vocab_trim=20)
    train_head(ss.split, data, cfg)
    ss.set_draft(DraftConfig(head=str(tmp_path / "t"), gamma=3))
    assert len(ss.head.vocab_ids) == 20
    logits = ss.head(torch.randn(1, 2, ss.split.hidden_size), torch.arange(2)[None])
    assert torch.isfinite(logits).sum() == 2 * 20
    for s in data[:3]:
        assert ss.generate(s["prompt_ids"], max_new_tokens=20).token_ids == s["output_ids"][:20]


def test_sweep_measures_each_layer_and_recommends_one(data, tmp_path):
    from selfspec.train.sweep import SweepConfig, estimate, sweep

    ss = SelfSpec(tiny_model("llama"), None)
    for kind in ("lm", "linear"):
        cfg = SweepConfig(layers=[1, 2, 4], kind=kind, train_steps=3, max_gamma=3, out=str(tmp_path / "s.json"))
        res = sweep(ss.split, data[:8], cfg)
        rows = {r["exit_layer"]: r for r in res["rows"]}
        assert set(rows) == {1, 2, 4} and res["recommended_exit_layer"] in rows
        assert rows[4]["acceptance"] == 1.0  # exit at L with the lm head is the target itself
        assert rows[1]["draft_cost"] < rows[2]["draft_cost"] < rows[4]["draft_cost"]
    flat = {"layer": [1.0] * 5, "head": [0.0] * 5}  # each token through a layer costs the same
    assert estimate(0.0, 2, 4, flat, 4)["bound_gamma"] == 1  # nothing accepted: draft as little as possible
    hi = estimate(0.95, 1, 4, flat, 4)
    assert hi["bound_gamma"] == 4 and hi["bound"] > 1.5
