"""The token store (selfspec.drafting.store): its matches, its file, and lossless drafting from it, batch-1 and
batched, with every source of lookup block learning apart."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import VOCAB, hf_greedy, tiny_model

from selfspec import DraftConfig, SelfSpec
from selfspec.batch.scheduler import BatchConfig
from selfspec.drafting import store as store_module
from selfspec.drafting.store import SEPARATOR, TokenStore, resolve_store
from selfspec.errors import InvalidConfigError
from selfspec.train.store import StoreConfig, build_store


def test_store_worked_example():
    store = TokenStore(np.array([5, 7, 3, 9, 4, -1, 8, 7, 3, 9, 2, -1, 6, 7, 3, 9, 2, 7]), ngram=3)
    assert store.match([1, 7, 3, 9], 4) == ([2, 7], 3)  # three occurrences match 3 back and vote: 2, then 7
    assert store.match([8, 7, 3, 9], 4) == ([2], 4)  # one matches further back: it alone, cut at the separator
    assert store.match([7, 3, 8], 4) == ([], 0)  # never stored
    assert store.match([3, 9], 4) == ([], 0)  # shorter than an n-gram
    assert store.match([1, 7, 3, 9], 0) == ([], 0)
    assert len(store) == 16
    # a tie in the vote: the earliest occurrence's token
    assert TokenStore(np.array([7, 3, 9, 4, -1, 7, 3, 9, 2])).match([1, 7, 3, 9], 2) == ([4], 3)


def test_store_never_crosses_a_separator():
    store = TokenStore.from_documents([[1, 2, 3], [4, 5, 6, 7]], ngram=2)
    assert store.tokens.tolist() == [1, 2, 3, SEPARATOR, 4, 5, 6, 7, SEPARATOR]
    assert store.match([9, 2, 3], 5) == ([], 0)  # [2 3] ends its document: nothing follows it
    assert store.match([4, 5], 5) == ([6, 7], 2)
    assert store.match([3, 4, 5], 5) == ([6, 7], 2)  # the text's 3 does not join the documents


def test_store_longest_of_many_occurrences():
    docs = [[50 + i % 7, 1, 2, 3, 100 + i] for i in range(store_module.CANDIDATES)]
    docs.append([7, 8, 9, 1, 2, 3, 99])  # the only one matching 6 back, but past CANDIDATES earlier ones
    store = TokenStore.from_documents(docs, ngram=3)
    assert store.match([7, 8, 9, 1, 2, 3], 1) == ([100], 3)  # all tie at 3 (one vote each): the earliest
    assert store.match([50, 1, 2, 3], 1).length == 4  # the documents that start with 50 match 4 back
    docs.insert(0, [7, 8, 9, 1, 2, 3, 99])
    assert TokenStore.from_documents(docs, ngram=3).match([7, 8, 9, 1, 2, 3], 2) == ([99], 6)


def test_store_file_round_trip_and_errors(tmp_path):
    store = TokenStore.from_documents([[3, 4, 5, 6]])
    path = store.save(tmp_path / "s.npy")
    assert TokenStore.load(path).match([3, 4, 5], 3) == ([6], 3)
    with pytest.raises(InvalidConfigError, match="not found"):
        TokenStore.load(tmp_path / "missing.npy")
    np.save(tmp_path / "bad.npy", np.zeros((2, 2), dtype=np.int32))
    with pytest.raises(InvalidConfigError, match="1-D array of token ids"):
        TokenStore.load(tmp_path / "bad.npy")
    (tmp_path / "text.npy").write_text("not numpy")
    with pytest.raises(InvalidConfigError, match="not a .npy array"):
        TokenStore.load(tmp_path / "text.npy")
    assert resolve_store("none") is None and resolve_store(str(path)) is resolve_store(str(path))  # loaded once
    with pytest.raises(InvalidConfigError, match="at least 2 tokens"):
        TokenStore(np.array([1, 2, 3]), ngram=1)


def test_build_store_from_answers(tmp_path):
    class Tok:
        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return [ord(c) for c in text]

    answers = tmp_path / "a.json"
    answers.write_text('[\n{"id": "x_0", "conversations": [{"from": "human", "value": "q"}, '
                       '{"from": "gpt", "value": "abcd"}]},\n{"id": "y_0", "conversations": [{"from": "human", '
                       '"value": "r"}, {"from": "gpt", "value": "abce"}]}\n]\n')
    report = build_store(Tok(), StoreConfig(answers=str(answers), out=str(tmp_path / "s.npy")))
    assert report["documents"] == 2 and report["tokens"] == 8
    assert TokenStore.load(tmp_path / "s.npy").match([ord("a"), ord("b"), ord("c")], 2) == ([ord("d")], 3)
    with pytest.raises(InvalidConfigError, match="not found"):
        build_store(Tok(), StoreConfig(answers=str(tmp_path / "none.json")))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_store_drafts_are_lossless(arch, tmp_path):
    """A store holding the reference continuation once with a wrong token (the earlier document: taken first while
    both match alike) and once as it is: store blocks are rejected and accepted, and the output stays the
    reference, batch-1 and batched."""
    model = tiny_model(arch)
    ss = SelfSpec(model, None)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(2, VOCAB, (9,), generator=g).tolist() for _ in range(2)]
    refs = [hf_greedy(model, p, 30) for p in prompts]
    docs = []
    for p, ref in zip(prompts, refs):
        text = [*p, *ref]
        wrong = list(text)
        # the second new token wrong: the first round's store block (both documents match alike, the earlier one is
        # taken) proposes it first, whatever the block sizes; after it the right document matches further back (up to
        # MAX_MATCH = 32 tokens, more than this answer), so later store blocks come from it. A wrong token further on
        # (7, 13, 21 before) was skipped whenever a block ended just before it, as measured costs decide
        wrong[len(p) + 1] = (wrong[len(p) + 1] + 1) % VOCAB
        docs += [wrong, text]
    path = TokenStore.from_documents(docs).save(tmp_path / "store.npy")
    for gamma in (None, 4):
        draft = DraftConfig(exit_layer=1, head="lm", gamma=gamma, policy="fixed" if gamma else "confidence",
                            lookup=5, store=str(path), tune="off")
        ss.set_draft(draft)
        out = ss.generate(prompts[0], max_new_tokens=30)
        assert out.token_ids == refs[0]
        st = out.stats
        assert st.store_steps > 0 and 0 < st.store_accepted < st.store_proposed, st.summary()
        assert st.lookup_steps >= st.store_steps
        for cap in (1, 2):  # through the scheduler's round (batches of 2 and more draft no lookup: BatchConfig)
            batch = ss.generate_batch(prompts, batch=BatchConfig(max_batch=cap), max_new_tokens=30)
            assert [r.token_ids for r in batch] == refs
            assert (sum(r.stats.store_steps for r in batch) > 0) == (cap == 1)
    ss.set_draft(DraftConfig(exit_layer=1, head="lm", gamma=4, policy="fixed", lookup=5, store="none"))
    assert ss.generate(prompts[0], max_new_tokens=30).stats.store_steps == 0


def test_unknown_store_is_named(tmp_path):
    ss = SelfSpec(tiny_model("llama"), None)
    with pytest.raises(InvalidConfigError, match="token store not found"):
        ss.set_draft(DraftConfig(exit_layer=1, head="lm", gamma=2, store=str(tmp_path / "nope.npy")))
