"""Lookup drafts (prompt lookup decoding inside the engine): the n-gram index, and losslessness of
steps whose drafts come from n-gram matches, greedy on every tiny architecture and the real model."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHS, VOCAB, hf_greedy, tiny_model

from selfspec import DraftConfig, SelfSpec
from selfspec.drafting import lookup
from selfspec.drafting.lookup import NgramIndex, common_suffix
from selfspec.drafting.policies import FixedPolicy
from selfspec.drafting.policy_tables import ByMatchLength


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
    assert NgramIndex(toks, ngram=3).match(1) == ([8], 3)
    # matched by its last 2 tokens, the occurrence that matches furthest back still wins
    assert NgramIndex(toks, ngram=2).match(1) == ([8], 3)
    assert NgramIndex(toks, ngram=2, longest=False).match(1) == ([9], 2)  # DraftConfig(lookup_match=False)


def test_match_length_ties_and_recent_occurrences():
    toks = [4, 2, 3, 8, 4, 2, 3, 9, 6, 2, 3, 7, 5, 4, 2, 3]
    # [2 3] ends at 2, 6 and 10; the first two match [4 2 3] (length 3; 4 is preceded by nothing and by 8), the
    # latest of those continues with 9
    assert NgramIndex(toks, ngram=2).match(2) == ([9, 6], 3)
    assert common_suffix(toks, 2) == 3 and common_suffix(toks, 10) == 2 and common_suffix(toks, 6) == 3
    assert common_suffix(toks, 6, cap=2) == 2
    long = [1, 2, 3, 4, 5, 6] * 3
    assert NgramIndex(long, ngram=3).match(3) == ([1, 2, 3], 12)  # the latest full period matches 12 tokens back
    # only the RECENT latest occurrences are kept: the one long match before them is out of reach
    text = [9, 1, 5] + [x for i in range(lookup.RECENT) for x in (7, 1, 5, 6 + i % 2)] + [9, 1, 5]
    assert NgramIndex(text, ngram=2).match(1).length == 2
    assert NgramIndex([3, 4], ngram=2).match(4) == ([], 0) and NgramIndex([], ngram=2).match(4) == ([], 0)


class OracleIndex:
    """Stands in for the drafter's NgramIndex: a subclass's ``continuation`` proposes; every match is 2 tokens
    long (one bucket of each ByMatchLength) unless ``match`` is overridden too."""

    def __init__(self, tokens: list[int], ngram: int, **kw: object) -> None:
        self.tokens = tokens

    def continuation(self, n: int) -> list[int]:
        raise NotImplementedError

    def match(self, n: int) -> lookup.Match:
        out = self.continuation(n)
        return lookup.Match(out, 2 if out else 0)


@pytest.mark.parametrize("arch", ARCHS)
def test_lookup_drafts_are_lossless(arch, monkeypatch):
    """Random tiny models do not copy, so the n-gram index is replaced by an oracle that proposes the
    reference continuation with one token corrupted at a varying place (or none): lookup blocks are
    then accepted whole, in part and not at all, and the output must stay the reference."""
    import selfspec.drafting.sources as ee

    model = tiny_model(arch)
    ss = SelfSpec(model, None)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(2, VOCAB, (9,), generator=g).tolist()
    ref = hf_greedy(model, prompt, 30)
    calls = []

    class Oracle(OracleIndex):
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
    import selfspec.drafting.sources as ee

    model = tiny_model("llama")
    ss = SelfSpec(model, None)
    prompt = torch.randint(2, VOCAB, (9,), generator=torch.Generator().manual_seed(6)).tolist()
    ref = hf_greedy(model, prompt, 40)
    calls: list[int] = []

    class Oracle(OracleIndex):
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
    assert drafter.sources.streak_policy is not None and drafter.sources.streak_policy is not drafter.sources.lookup_policy
    log: list[tuple[str, int, int]] = []
    assert isinstance(drafter.sources.lookup_policy, ByMatchLength) and isinstance(drafter.sources.streak_policy, ByMatchLength)
    for name, policy in (("lookup", drafter.sources.lookup_policy.of(2)), ("streak", drafter.sources.streak_policy.of(2)),
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


def test_by_match_length_buckets():
    made: list[FixedPolicy] = []
    table = ByMatchLength(lambda: made.append(FixedPolicy()) or made[-1])
    buckets = {n: table.bucket(n) for n in (0, 1, 2, 3, 4, 5, 6, 8, 9, 16, 17, 40)}
    assert buckets == {0: 0, 1: 0, 2: 0, 3: 1, 4: 2, 5: 2, 6: 3, 8: 3, 9: 4, 16: 4, 17: 5, 40: 5}
    assert table.of(4) is table.of(5) and table.of(4) is not table.of(6) and len(made) == 2


def test_lookup_blocks_learn_by_match_length(monkeypatch):
    """Lookup blocks are sized and learned by the policy of their match length's bucket (short and long matches
    apart); the output stays the reference."""
    import selfspec.drafting.sources as ee

    model = tiny_model("llama")
    ss = SelfSpec(model, None)
    prompt = torch.randint(2, VOCAB, (9,), generator=torch.Generator().manual_seed(7)).tolist()
    ref = hf_greedy(model, prompt, 40)
    lengths: list[int] = []

    class Oracle(OracleIndex):
        def match(self, n: int) -> lookup.Match:
            done = len(self.tokens) - len(prompt)
            out = list(ref[done : done + n])
            lengths.append(2 if len(lengths) % 2 else 12)
            if len(lengths) % 3 == 0 and len(out) > 1:
                out[-1] = (out[-1] + 1) % VOCAB
            return lookup.Match(out, lengths[-1]) if out else lookup.Match([], 0)

        def continuation(self, n: int) -> list[int]:
            return self.match(n).tokens

    monkeypatch.setattr(ee, "NgramIndex", Oracle)
    ss.set_draft(DraftConfig(exit_layer=1, head="lm", gamma=None, tune="off", lookup=5))
    drafter = ss.engine.drafter
    log: list[tuple[int, int]] = []  # (the block's match length, the bucket whose policy learned from it)
    for table in (drafter.sources.lookup_policy, drafter.sources.streak_policy):
        assert isinstance(table, ByMatchLength)
        for n in (2, 12):
            policy = table.of(n)

            def spy(proposed, accepted, _b=table.bucket(n), _observe=policy.observe):
                log.append((lengths[-1], _b))
                _observe(proposed, accepted)
            monkeypatch.setattr(policy, "observe", spy)
    out = ss.generate(prompt, max_new_tokens=40)
    assert out.token_ids == ref
    assert {b for _, b in log} == {0, 4}
    assert all(ByMatchLength(FixedPolicy).bucket(n) == b for n, b in log)
    ss.set_draft(DraftConfig(exit_layer=1, head="lm", gamma=None, tune="off", lookup=5, lookup_match=False))
    drafter = ss.engine.drafter
    assert isinstance(drafter.sources.lookup_policy, ByMatchLength) and drafter.sources.lookup_policy.of(2) is drafter.sources.lookup_policy.of(30)
    assert drafter.sources.longest is False
