"""KV-cache rollback and bad-input handling."""

from __future__ import annotations

import pytest
import torch
from conftest import LAYERS, VOCAB, hf_greedy, tiny_model

from selfspec import DraftConfig, GenerateConfig, SelfSpec
from selfspec.errors import (
    ContextOverflowError,
    EmptyPromptError,
    ExitLayerError,
    InvalidConfigError,
    SelfSpecError,
)
from selfspec.stats import GenerationStats


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "phi3"])
def test_logits_after_rejection_equal_fresh_forward(arch):
    model = tiny_model(arch)
    ss = SelfSpec(model, None, DraftConfig(exit_layer=2, head="lm", gamma=5))
    eng, gen = ss.engine, GenerateConfig(max_new_tokens=60)
    prompt = torch.randint(2, VOCAB, (9,), generator=torch.Generator().manual_seed(0)).tolist()
    seq = eng.new_sequence(len(prompt), gen)
    stats = GenerationStats()
    out = [eng.prefill(seq, prompt, gen, speculative=True)]
    rejections = 0
    with torch.inference_mode():
        while len(out) < 50:
            before = seq.length
            block = eng.speculative_step(seq, gen, 5, stats)
            out += block
            assert seq.length == before + len(block)
            assert all(n == seq.length for n in seq.cache.lengths)  # every layer rolled back
            if len(block) < 6:
                rejections += 1
                # next step's logits from the rolled-back cache == a fresh full forward
                ids = torch.tensor([[seq.pending]])
                probe = seq.cache  # work on a copy of the pointers only
                saved = list(probe.lengths)
                h = ss.split.forward_all(ids, seq.positions(seq.length, 1), probe)
                got = ss.split.logits(h)[0, -1]
                probe.lengths = saved
                full = model(torch.tensor([prompt + out])).logits[0, -1]
                torch.testing.assert_close(got, full, atol=1e-4, rtol=1e-4)
    assert rejections > 0


def test_bad_inputs_give_clear_errors_and_engine_still_works():
    model = tiny_model("llama")
    ss = SelfSpec(model, None, DraftConfig(exit_layer=2, head="lm"))
    prompt = [5, 6, 7]
    ref = hf_greedy(model, prompt, 12)
    with pytest.raises(ExitLayerError, match="out of range.*1..4"):
        ss.set_draft(DraftConfig(exit_layer=LAYERS + 1, head="lm"))
    with pytest.raises(ExitLayerError):
        ss.set_draft(DraftConfig(exit_layer=0, head="lm"))
    with pytest.raises(EmptyPromptError):
        ss.generate([], max_new_tokens=4)
    with pytest.raises(EmptyPromptError):
        ss.generate("", max_new_tokens=4)
    for bad in (0, -3):
        with pytest.raises(InvalidConfigError, match="max_new_tokens"):
            ss.generate(prompt, max_new_tokens=bad)
    with pytest.raises(ContextOverflowError, match="context is 256 tokens"):
        ss.generate(list(range(2, 2 + 250)), max_new_tokens=10)
    with pytest.raises(ContextOverflowError):
        ss.generate([3] * 300, max_new_tokens=1)
    with pytest.raises(InvalidConfigError, match="top_p"):
        ss.generate(prompt, max_new_tokens=4, temperature=1.0, top_p=0.0)
    with pytest.raises(InvalidConfigError, match="policy"):
        ss.set_draft(DraftConfig(exit_layer=2, head="lm", policy="nope"))
    with pytest.raises(InvalidConfigError, match="gamma"):
        ss.set_draft(DraftConfig(exit_layer=2, head="lm", gamma=0))
    with pytest.raises(SelfSpecError, match="no exit head"):
        ss.set_draft(DraftConfig(exit_layer=2, head="/nonexistent/head"))
    # after all of that, the engine still generates the target's greedy output
    assert ss.generate(prompt, max_new_tokens=12).token_ids == ref
    assert ss.draft_config.exit_layer == 2


def test_unknown_model_path_and_unsupported_architecture(tmp_path):
    import transformers as tf

    from selfspec.errors import ModelNotFoundError, UnsupportedArchitectureError

    with pytest.raises(ModelNotFoundError, match="/no/such/model"):
        SelfSpec.load("/no/such/model")
    with pytest.raises(ModelNotFoundError, match="missing.gguf"):
        SelfSpec.load(str(tmp_path / "missing.gguf"))
    gpt2 = tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64)
    gpt2.save_pretrained(tmp_path / "gpt2")  # a config only: the check runs before any weights are read
    with pytest.raises(UnsupportedArchitectureError, match=r"unsupported architecture 'gpt2'.*Llama.*Qwen2.*Phi-3"):
        SelfSpec.load(str(tmp_path / "gpt2"))
    with pytest.raises(UnsupportedArchitectureError, match="gpt2"):
        SelfSpec(tf.GPT2LMHeadModel(gpt2), None)
