"""Lookup drafts (prompt lookup decoding inside the engine): the n-gram index, and losslessness of
steps whose drafts come from n-gram matches, greedy on every tiny architecture and the real model."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHS, VOCAB, hf_greedy, tiny_model

from selfspec import DraftConfig, SelfSpec
from selfspec.drafting.lookup import NgramIndex


def test_ngram_index_worked_example():
    toks = [7, 3, 9, 4, 1, 7, 3]
    idx = NgramIndex(toks, ngram=2)
    assert idx.continuation(3) == [9, 4, 1]
    assert idx.continuation(10) == [9, 4, 1, 7, 3]
    toks += [9, 5]  # the shared list grows; [9, 5] never occurred before
    assert idx.continuation(4) == []
    toks += [7, 3]  # latest earlier [7, 3] is now at positions 5-6 -> continues with 9, 5
    assert idx.continuation(2) == [9, 5]


def test_longest_ngram_wins():
    toks = [1, 2, 3, 8, 5, 2, 3, 9, 1, 2, 3]  # [1 2 3] -> 8 (trigram) though [2 3] -> 9 is more recent
    assert NgramIndex(toks, ngram=3).continuation(1) == [8]
    assert NgramIndex(toks, ngram=2).continuation(1) == [9]


@pytest.mark.parametrize("arch", ARCHS)
def test_lookup_drafts_are_lossless(arch, monkeypatch):
    """Random tiny models do not copy, so the n-gram index is replaced by an oracle that proposes the
    reference continuation with one token corrupted at a varying place (or none): lookup blocks are
    then accepted whole, in part and not at all, and the output must stay the reference."""
    import selfspec.drafting.early_exit as ee

    model = tiny_model(arch)
    ss = SelfSpec(model, None)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(2, VOCAB, (9,), generator=g).tolist()
    ref = hf_greedy(model, prompt, 30)
    calls = []

    class Oracle:
        def __init__(self, tokens: list[int], ngram: int) -> None:
            self.tokens = tokens

        def continuation(self, n: int) -> list[int]:
            done = len(self.tokens) - len(prompt)  # tokens emitted so far, the pending one included
            out = list(ref[done : done + n])
            calls.append(len(out))
            bad = len(calls) % 4  # 0: keep all; else corrupt position bad - 1 (when it exists)
            if 0 < bad <= len(out):
                out[bad - 1] = (out[bad - 1] + 1) % VOCAB
            return out if len(calls) % 5 else []  # every fifth step: no match (early-exit draft)

    monkeypatch.setattr(ee, "NgramIndex", Oracle)
    for k, gamma in ((1, 2), (3, 4)):
        ss.set_draft(DraftConfig(exit_layer=k, head="lm", gamma=gamma, policy="fixed", lookup=5))
        out = ss.generate(prompt, max_new_tokens=30)
        assert out.token_ids == ref, f"exit {k}"
        assert out.stats.lookup_steps > 0 and out.stats.lookup_accepted > 0
        assert out.stats.new_tokens == 30


@pytest.mark.slow
def test_lookup_on_real_model_copies_and_stays_lossless(default_ss):
    ss = default_ss
    ss.set_draft(DraftConfig())  # the defaults: lookup on, costs-aware lengths
    text = ("Repeat this sentence exactly, twice: The quick brown fox jumps over the lazy dog near the "
            "river bank at dawn.")
    ids = ss.encode([{"role": "user", "content": text}])
    with torch.inference_mode():
        ref = ss.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                do_sample=False, max_new_tokens=48, top_k=None, top_p=None, temperature=None,
                                pad_token_id=ss.tokenizer.eos_token_id)[0, len(ids):].tolist()
    out = ss.generate(ids, max_new_tokens=48)
    assert out.token_ids == ref[: len(out.token_ids)] and len(out.token_ids) == len(ref)
    assert out.stats.lookup_accepted > 0


def test_lookup_blocks_after_a_whole_acceptance_learn_apart(monkeypatch):
    """With adaptive lengths, a lookup block right after a lookup block accepted whole is sized and learned by the
    streak's own policy; after a partial acceptance or an early-exit round, by the lookup policy. Output stays the
    reference (the oracle's corrupted proposals are accepted whole, in part and not at all)."""
    import selfspec.drafting.early_exit as ee

    model = tiny_model("llama")
    ss = SelfSpec(model, None)
    prompt = torch.randint(2, VOCAB, (9,), generator=torch.Generator().manual_seed(6)).tolist()
    ref = hf_greedy(model, prompt, 40)
    calls: list[int] = []

    class Oracle:
        def __init__(self, tokens: list[int], ngram: int) -> None:
            self.tokens = tokens

        def continuation(self, n: int) -> list[int]:
            done = len(self.tokens) - len(prompt)
            out = list(ref[done : done + n])
            calls.append(n)
            if len(calls) % 3 == 0 and len(out) > 1:  # every third proposal: its last token wrong
                out[-1] = (out[-1] + 1) % VOCAB
            return out if len(calls) % 7 else []

    monkeypatch.setattr(ee, "NgramIndex", Oracle)
    ss.set_draft(DraftConfig(exit_layer=1, head="lm", gamma=None, tune="off", lookup=5))
    drafter = ss.engine.drafter
    assert drafter.lookup_streak_policy is not None and drafter.lookup_streak_policy is not drafter.lookup_policy
    log: list[tuple[str, int, int]] = []
    for name, policy in (("lookup", drafter.lookup_policy), ("streak", drafter.lookup_streak_policy),
                         ("early", drafter.policy)):
        def spy(proposed, accepted, _name=name, _observe=policy.observe):
            log.append((_name, proposed, accepted))
            _observe(proposed, accepted)
        monkeypatch.setattr(policy, "observe", spy)
    out = ss.generate(prompt, max_new_tokens=40)
    assert out.token_ids == ref
    assert {"lookup", "streak"} <= {name for name, _, _ in log}
    for (prev, p_prop, p_acc), (name, _, _) in zip(log, log[1:]):
        if name != "early":
            whole = prev in ("lookup", "streak") and p_acc == p_prop > 0
            assert (name == "streak") == whole, log
