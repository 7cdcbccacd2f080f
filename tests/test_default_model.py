"""The real default model (SmolLM2-135M-Instruct, dequantized float32): selfspec's greedy output is
token-for-token transformers' greedy generate on 10 varied prompts of 128 new tokens, across exit
layers, gamma and both drafting policies (untrained exit head)."""

from __future__ import annotations

import gc

import pytest
import torch

from selfspec import DraftConfig

PROMPTS = [
    "Explain why the sky is blue to a ten-year-old.",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "Translate to German: I would like to book a table for two people tonight.",
    "Summarize in two sentences: The Industrial Revolution began in Britain in the late 18th century "
    "and spread to Europe and North America, transforming economies from agriculture to manufacturing.",
    "What is 48 divided by 6, plus 7? Think step by step.",
    "List five fruits that are rich in vitamin C.",
    "Write a haiku about autumn leaves.",
    "Who wrote the novel 'Pride and Prejudice', and when was it published?",
    "Give me a JSON object describing a cat with name, age and color.",
    "What are the main differences between TCP and UDP?",
]
# (exit layer, gamma, policy): every prompt runs one setting, the settings cover shallow to deep exits
SETTINGS = [(4, 3, "fixed"), (8, 4, "fixed"), (12, 5, "confidence"), (16, 2, "fixed"), (20, 4, "confidence"),
            (24, 4, "fixed"), (27, 6, "confidence"), (29, 3, "fixed"), (10, 8, "confidence"), (30, 4, "fixed")]


@pytest.mark.slow
def test_default_model_greedy_equals_transformers(default_ss):
    ss = default_ss
    assert ss.split.num_layers == 30
    mismatches = []
    for text, (k, gamma, policy) in zip(PROMPTS, SETTINGS):
        ids = ss.encode([{"role": "user", "content": text}])
        with torch.inference_mode():
            ref = ss.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    do_sample=False, max_new_tokens=128, top_k=None, top_p=None,
                                    temperature=None, pad_token_id=ss.tokenizer.eos_token_id)[0, len(ids):].tolist()
        if ss.eos_token_ids[0] in ref:  # generate pads after EOS
            ref = ref[: ref.index(ss.eos_token_ids[0]) + 1]
        ss.set_draft(DraftConfig(exit_layer=k, head="lm", gamma=gamma, policy=policy, threshold=0.4))
        out = ss.generate(ids, max_new_tokens=128)
        if out.token_ids != ref:
            mismatches.append((text, k, gamma, policy))
        if k == 30:  # the perfect draft accepts everything
            assert all(r == 1.0 for r in out.stats.acceptance_rate_per_position)
    assert not mismatches


@pytest.mark.slow
def test_default_model_lossless_with_bundled_trained_head(default_ss):
    """The trained head shipped for the default model (selfspec/assets/heads) changes speed, never text."""
    from selfspec.heads.io import bundled_head_dir

    ss = default_ss
    bundled = bundled_head_dir(ss.model_id)
    assert bundled is not None, "the default model's trained head is missing from selfspec/assets/heads"
    settings = [(3, "fixed", 0), (5, "confidence", 0), (2, "fixed", 0), (4, "confidence", 0), (4, "fixed", 2)]
    for text, (gamma, policy, width) in zip(PROMPTS[::3] + PROMPTS[1:2], settings):
        ids = ss.encode([{"role": "user", "content": text}])
        with torch.inference_mode():
            ref = ss.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    do_sample=False, max_new_tokens=64, top_k=None, top_p=None,
                                    temperature=None, pad_token_id=ss.tokenizer.eos_token_id)[0, len(ids):].tolist()
        if ss.eos_token_ids[0] in ref:
            ref = ref[: ref.index(ss.eos_token_ids[0]) + 1]
        ss.set_draft(DraftConfig(head="auto", gamma=gamma, policy=policy, threshold=0.3, tree_width=width))
        assert ss.head.kind != "lm" and len(ss.head.vocab_ids) > 0  # the trained, vocabulary-trimmed head
        assert ss.head.draft_weights == "Q4_0"  # its block drafts with 4-bit weights on the quantized target
        out = ss.generate(ids, max_new_tokens=64)
        assert out.token_ids == ref, (text, gamma, policy, width)
        assert sum(out.stats.accepted_per_position) > 0  # it drafts something the target accepts


@pytest.mark.slow
def test_demo_shows_identical_texts_side_by_side(capsys):
    from selfspec.config import ModelConfig
    from selfspec.demo import DemoConfig, run

    rows = run(ModelConfig(), DemoConfig(max_new_tokens=12))
    assert [r["method"] for r in rows] == ["transformers generate", "selfspec plain", "selfspec (default)"]
    assert all(r["identical"] and r["tok_s"] > 0 for r in rows)
    assert "same text as transformers" in capsys.readouterr().out


@pytest.mark.slow
def test_a_load_leaves_nothing_for_full_garbage_collections_to_walk(default_ss):
    """SelfSpec.load() freezes what it leaves (selfspec.memory.freeze_gc): the model, torch's and transformers'
    objects are out of the cyclic collector's generations, so a full collection mid-request walks only what
    requests made since (it walked ~220,000 objects, ~150 ms, in a fresh server's second request)."""
    assert gc.get_freeze_count() > 10_000
    tracked = {id(o) for o in gc.get_objects()}  # the generations a collection walks (frozen objects are not in them)
    assert id(default_ss.split) not in tracked and id(default_ss.engine) not in tracked
    assert id(default_ss.model) not in tracked and id(default_ss.tokenizer) not in tracked

