"""A new way to draft is one class and one registry line: a toy drafter ("repeat the last token", sharing no
layers with the target) runs losslessly through batch-1 decoding, continuous batching and the real server,
without any other file knowing it."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, hf_greedy, tiny_model

from selfspec import DraftConfig, GenerateConfig, SelfSpec
from selfspec.batch.scheduler import decode_batch
from selfspec.drafting.base import BaseDrafter, DraftBlock
from selfspec.drafting.registry import DraftSetup, drafter_names, register_drafter
from selfspec.errors import InvalidConfigError


class RepeatLast(BaseDrafter):
    """Proposes the pending token again, ``max_drafts`` times (right whenever the text repeats a token)."""

    def __init__(self) -> None:
        self.rounds = 0

    def propose(self, seq, max_drafts, gen, limit=None) -> DraftBlock:
        self.rounds += 1
        return DraftBlock([seq.pending] * max_drafts, None, None, start=seq.length, source="repeat")


register_drafter("repeat-last", lambda ss, draft: DraftSetup(RepeatLast(), gamma=draft.gamma or 3))


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (5, 9, 3)]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_registered_drafter_is_lossless_alone_and_batched(arch):
    model = tiny_model(arch)
    ss = SelfSpec(model, None, DraftConfig(drafter="repeat-last", gamma=3))
    assert isinstance(ss.engine.drafter, RepeatLast) and "repeat-last" in drafter_names()
    prompts = _prompts()
    want = [hf_greedy(model, p, 24) for p in prompts]
    alone = [ss.generate(p, max_new_tokens=24, ignore_eos=True) for p in prompts]
    assert [r.token_ids for r in alone] == want
    assert ss.engine.drafter.rounds > 0 and sum(r.stats.steps for r in alone) < 3 * 24  # it drafted, it was used
    gens = [GenerateConfig(max_new_tokens=24, ignore_eos=True, method="selfspec")] * len(prompts)
    assert decode_batch(ss.engine, prompts, gens, method=None) == want
    sampled = GenerateConfig(max_new_tokens=12, temperature=0.9, seed=7, ignore_eos=True)
    assert ss.generate(prompts[0], sampled).token_ids == ss.generate(prompts[0], sampled).token_ids  # seeded


def test_an_unknown_drafter_is_a_clear_error():
    with pytest.raises(InvalidConfigError, match="unknown drafter 'nope'.*early-exit"):
        SelfSpec(tiny_model("llama"), None, DraftConfig(drafter="nope"))


@pytest.mark.slow
def test_a_registered_drafter_serves_the_same_text(default_ss):
    from test_server import KEY, ThreadedServer

    from selfspec.server.app import create_app

    ss = SelfSpec(default_ss.model, default_ss.tokenizer, DraftConfig(drafter="repeat-last", gamma=2),
                  model_id=default_ss.model_id)
    prompt = "List the numbers from one to ten: one, two,"
    ref = default_ss.generate(prompt, max_new_tokens=16, temperature=0.0, method="plain")
    srv = ThreadedServer(create_app(ss, api_key=KEY))
    try:
        r = srv.client().completions.create(model=ss.model_id, prompt=prompt, max_tokens=16, temperature=0)
        assert r.choices[0].text == ref.text
        assert ss.engine.drafter.rounds > 0
    finally:
        srv.stop()
