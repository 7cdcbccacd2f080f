"""SpecEE (selfspec/specee): candidate features from LM-head rows, the KV of skipped layers made right,
specee-verified lossless (greedy on every architecture, sampling distribution), the lossy mode labelled
and measured, predictors trained, saved and loaded, and the two-level schedule."""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import ARCHS, LAYERS, VOCAB, hf_greedy, tiny_model, tiny_tokenizer

from selfspec import DraftConfig, GenerateConfig, SelfSpec
from selfspec.batch.scheduler import decode_batch
from selfspec.errors import HeadMismatchError, InvalidConfigError
from selfspec.specee.candidates import CandidateScorer, candidate_features, candidate_logits, features_list
from selfspec.specee.predictors import ExitPredictors, load_predictors
from selfspec.specee.ragged import run_token
from selfspec.specee.schedule import OnlineSchedule

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = list(range(5, 25))


def random_predictors(path, exit_layer: int = 1, seed: int = 0, layers=(1, 2, 3)) -> str:
    """Untrained predictors whose probabilities spread over (0, 1): exits at every layer happen."""
    torch.manual_seed(seed)
    preds = ExitPredictors(list(layers), 4, 16, meta={"exit_layer": exit_layer, "num_layers": LAYERS})
    for i in preds.layers:
        torch.nn.init.normal_(preds[i].mlp[2].weight, 0.0, 0.3)
        torch.nn.init.normal_(preds[i].mlp[2].bias, 0.0, 1.0)
    preds.save(path)
    return str(path)


def specee_ss(arch: str, tmp_path, **draft) -> SelfSpec:
    path = random_predictors(tmp_path / f"p-{arch}")
    cfg = dict(head="lm", exit_layer=1, gamma=3, predictors=path, specee_threshold=0.3, specee_window=0)
    return SelfSpec(tiny_model(arch), tiny_tokenizer(), DraftConfig(**{**cfg, **draft}))


@pytest.mark.parametrize("arch", ARCHS)
def test_candidate_logits_from_lm_head_rows_equal_the_full_logits(arch, tmp_path):
    ss = SelfSpec(tiny_model(arch), tiny_tokenizer(), DraftConfig(head="lm", exit_layer=1, gamma=1))
    split = ss.split
    g = torch.Generator().manual_seed(0)
    h = torch.randn(7, split.hidden_size, generator=g)
    cands = torch.randint(VOCAB, (7, 4), generator=g)
    full = split.logits(h[None])[0]  # [7, vocab]
    assert torch.allclose(candidate_logits(split, h, cands), full.gather(1, cands), atol=1e-5)
    from selfspec.models.fast import Norm

    norm = Norm(split.norm)
    for j in range(7):  # the decoding path: norm folded into the rows, plain-Python features
        scorer = CandidateScorer(norm.weight, norm.eps, split.lm_head.weight[cands[j]], split.softcap)
        assert torch.allclose(torch.tensor(scorer(h[j])), full[j, cands[j]], atol=1e-4)
    logits, prev, draft = full.gather(1, cands), torch.softmax(torch.randn(7, 4, generator=g), -1), torch.rand(7, 4)
    feats, probs = candidate_features(logits, prev, draft)
    for j in range(7):
        f, p = features_list(logits[j].tolist(), prev[j].tolist(), draft[j].tolist())
        assert torch.allclose(torch.tensor(f), feats[j], atol=1e-5) and torch.allclose(torch.tensor(p), probs[j], atol=1e-6)
    assert torch.allclose(feats[:, :4], logits.sort(-1, descending=True).values)  # sorted by this layer's logits


def _full_cache(ss: SelfSpec, tokens: list[int]):
    cache = ss.split.new_cache(len(tokens) + 1)
    pos = torch.arange(len(tokens))[None]
    ss.split.forward_all(torch.tensor([tokens]), pos, cache)
    return cache


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "mistral"])
def test_kv_of_skipped_layers_equals_a_full_forward(arch, tmp_path):
    """Lossy SpecEE: after every token (some exit at layer 1, 2 or 3, in any order), every cache entry any
    later token can read equals a full forward's over the same tokens; paying the debt completes them."""
    ss = specee_ss(arch, tmp_path, specee_threshold=0.5)
    eng, runner = ss.engine, ss.engine.specee
    rng = random.Random(arch)
    for i in runner.predictors.layers:  # random decisions: exits at every layer, in every order
        runner.predictors[i].prob_of = lambda feats: rng.random()
    gen = ss.resolve(max_new_tokens=40, method="specee", ignore_eos=True)
    with torch.inference_mode():
        seq = eng.new_sequence(len(PROMPT), gen)
        seq.tokens = [*PROMPT, eng.prefill(seq, PROMPT, gen, speculative=True)]
        runner.start(seq)
        from selfspec.stats import GenerationStats

        stats = GenerationStats()
        saw_debt = 0
        for _ in range(30):
            runner.lossy_step(seq, gen, stats)
            debt = seq.specee.debt
            saw_debt = max(saw_debt, len(debt))
            p = seq.length
            ref = _full_cache(ss, seq.tokens[:p])
            for layer in range(LAYERS):
                n = seq.cache.lengths[layer]
                assert n == p - sum(1 for r in debt if r.layer <= layer)  # missing: exactly the indebted rows
                assert torch.allclose(seq.cache.keys[layer][:, :, :n], ref.keys[layer][:, :, :n], atol=1e-4)
                assert torch.allclose(seq.cache.values[layer][:, :, :n], ref.values[layer][:, :, :n], atol=1e-4)
        assert saw_debt >= 2 and len(set(stats.exit_layers)) == LAYERS  # exits at 1, 2, 3 and none (4)
        run_token(ss.split, seq.cache, seq.specee.debt, None, seq.length)
        ref = _full_cache(ss, seq.tokens[: seq.length])
        for layer in range(LAYERS):
            assert seq.cache.lengths[layer] == seq.length
            assert torch.allclose(seq.cache.keys[layer][:, :, : seq.length], ref.keys[layer][:, :, : seq.length], atol=1e-4)


def test_ragged_rows_join_at_their_layers():
    """The module's worked example on a tiny model: positions 7, 8 indebted at layers 3 and 2."""
    ss = SelfSpec(tiny_model("llama"), tiny_tokenizer(), DraftConfig(head="lm", exit_layer=1, gamma=1))
    split = ss.split
    toks = list(range(3, 13))  # positions 0..9
    with torch.inference_mode():
        cache = split.new_cache(16)
        pos = torch.arange(7)[None]
        split.forward_all(torch.tensor([toks[:7]]), pos, cache)
        from selfspec.specee.ragged import DebtRow

        h7 = split.run_layers(split.embed(torch.tensor([[toks[7]]])), 0, 3, torch.tensor([[7]]), cache)
        h8 = split.run_layers(split.embed(torch.tensor([[toks[8]]])), 0, 2, torch.tensor([[8]]), cache)
        seen = []
        e, h, debt = run_token(split, cache, [DebtRow(3, h7), DebtRow(2, h8)], split.embed(torch.tensor([[toks[9]]])),
                               9, [1, 2, 3], lambda i, x: seen.append(i) or False)
        assert e == LAYERS and debt == [] and seen == [1, 2, 3] and h.shape[1] == 3
        ref = split.forward_all(torch.tensor([toks]), torch.arange(10)[None], split.new_cache(16))
        assert torch.allclose(h[0], ref[0, 7:], atol=1e-4)
        assert cache.lengths == [10] * LAYERS


@pytest.mark.parametrize("arch", ARCHS)
def test_specee_verified_greedy_equals_transformers(arch, tmp_path):
    ss = specee_ss(arch, tmp_path)
    ref = hf_greedy(ss.model, PROMPT, 40)
    out = ss.generate(PROMPT, max_new_tokens=40, method="specee-verified", ignore_eos=True)
    assert out.token_ids == ref
    assert out.stats.exit_layers and sum(out.stats.accepted_per_position) > 0  # drafts were made and accepted
    for n in (1, 2, 7):  # max_new_tokens exact
        assert ss.generate(PROMPT, max_new_tokens=n, method="specee-verified", ignore_eos=True).token_ids == ref[:n]


def test_specee_verified_with_a_deep_head_and_lookup(tmp_path):
    from selfspec.heads.io import new_head, save_head

    ss = SelfSpec(tiny_model("qwen2"), tiny_tokenizer())
    head = new_head("deep", ss.split, 1)
    head.init_from_target()
    save_head(head, tmp_path / "deep")
    random_predictors(tmp_path / "deep")  # beside the head: found by predictors='auto'
    ss.set_draft(DraftConfig(head=str(tmp_path / "deep"), gamma=3, specee_threshold=0.3, lookup=4))
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
    ref = hf_greedy(ss.model, prompt, 30)
    assert ss.generate(prompt, max_new_tokens=30, method="specee-verified", ignore_eos=True).token_ids == ref
    lossy = ss.generate(prompt, max_new_tokens=30, method="specee", ignore_eos=True)
    assert len(lossy.token_ids) == 30 and lossy.stats.exit_compared > 0


def _second_token_tv(ss: SelfSpec, method: str, n: int, seed: int) -> float:
    """TV distance between the empirical distribution of the second new token (the first one a speculative
    round emits) and the exact one, sum over x1 of p(x1) p(x2 | x1)."""
    with torch.inference_mode():
        x = torch.tensor([PROMPT])
        p1 = torch.softmax(ss.model(x).logits[0, -1] / 0.8, -1)
        xs = torch.cat([x.expand(VOCAB, -1), torch.arange(VOCAB)[:, None]], 1)
        p2 = torch.softmax(ss.model(xs).logits[:, -1] / 0.8, -1)
        exact = p1 @ p2
    counts = torch.zeros(VOCAB)
    for s in range(n):
        out = ss.generate(PROMPT, max_new_tokens=2, method=method, temperature=0.8, seed=seed + s, ignore_eos=True)
        counts[out.token_ids[1]] += 1
    return 0.5 * float((counts / n - exact).abs().sum())


@pytest.mark.slow
def test_specee_verified_sampling_keeps_the_distribution(tmp_path):
    ss = specee_ss("llama", tmp_path, specee_threshold=0.0)  # every draft exits at layer 1: many rejections
    n = 1500
    plain = _second_token_tv(ss, "plain", n, 0)
    verified = _second_token_tv(ss, "specee-verified", n, 10_000)
    lossy = _second_token_tv(ss, "specee", n, 20_000)  # the lossy mode samples among layer-1 candidates
    assert verified < max(1.5 * plain, plain + 0.03)
    assert lossy > 2 * max(verified, plain)  # the test can fail
    a = ss.generate(PROMPT, max_new_tokens=12, method="specee-verified", temperature=0.8, seed=3).token_ids
    assert a == ss.generate(PROMPT, max_new_tokens=12, method="specee-verified", temperature=0.8, seed=3).token_ids


def test_specee_needs_predictors_and_checks_settings(tmp_path):
    ss = SelfSpec(tiny_model("llama"), tiny_tokenizer(), DraftConfig(head="lm", exit_layer=1, gamma=2))
    with pytest.raises(InvalidConfigError, match="needs SpecEE predictors"):
        ss.generate(PROMPT, max_new_tokens=4, method="specee")
    with pytest.raises(InvalidConfigError, match="unknown method"):
        ss.generate(PROMPT, max_new_tokens=4, method="speccee")
    path = random_predictors(tmp_path / "p", exit_layer=2)
    with pytest.raises(HeadMismatchError, match="exit layer 2, not 1"):
        ss.set_draft(DraftConfig(head="lm", exit_layer=1, predictors=path))
    with pytest.raises(InvalidConfigError, match="specee_threshold"):
        ss.set_draft(DraftConfig(head="lm", exit_layer=2, predictors=path, specee_threshold=1.5))
    ss.set_draft(DraftConfig(head="lm", exit_layer=2, gamma=2, predictors=path))
    assert ss.generate(PROMPT, max_new_tokens=6, method="specee").token_ids  # state is fine after the errors
    help_text = next(f.metadata["help"] for f in GenerateConfig.__dataclass_fields__.values() if f.name == "method")
    assert "LOSSY" in help_text


def test_online_schedule_checks_layers_near_recent_exits():
    s = OnlineSchedule([2, 10, 12, 20, 25], window=2, radius=2)
    assert s.layers_to_check() == [2, 10, 12, 20, 25]  # too few tokens seen
    s.observe(11)
    s.observe(12)
    assert s.layers_to_check() == [10, 12]
    s.observe(None)  # a token that ran every layer: check everything again
    assert s.layers_to_check() == [2, 10, 12, 20, 25]
    assert OnlineSchedule([3, 4], window=0).layers_to_check() == [3, 4]


def test_train_predictors_report_save_and_decode(tmp_path):
    from selfspec.train.predictors import PredictorConfig, oracle_exits, train_predictors

    template = "{% for m in messages %}{{ m['role'][0] }}: {{ m['content'] }}. {% endfor %}"
    ss = SelfSpec(tiny_model("llama"), tiny_tokenizer(template), DraftConfig(head="lm", exit_layer=1, gamma=2))
    g = torch.Generator().manual_seed(0)
    words = "the cat sat on a mat and it was happy".split()
    text = lambda n: " ".join(words[j] for j in torch.randint(len(words), (n,), generator=g).tolist())  # noqa: E731
    recs = [{"id": f"c{i}", "conversations": [{"from": "human", "value": text(5)}, {"from": "gpt", "value": text(12)}]}
            for i in range(12)]
    src = tmp_path / "own.json"
    src.write_text(json.dumps(recs))
    cfg = PredictorConfig(source=str(src), max_conversations=12, heldout_conversations=3, hidden=16, keep_layers=2,
                          epochs=2, max_tokens=96)
    preds, meta = train_predictors(ss.split, ss.head, ss.tokenizer, cfg)
    assert len(preds.layers) == 2 and all(1 <= i < LAYERS for i in preds.layers)
    assert set(meta["thresholds"]) == {"specee", "specee-verified"}
    for row in meta["report"]["layers"].values():
        assert 0 <= row["precision@0.5"] <= 1 and 0 <= row["recall@0.5"] <= 1
    assert sum(meta["oracle_exit_distribution"].values()) == meta["data"]["tokens"]
    preds.save(tmp_path / "p")
    loaded = load_predictors(tmp_path / "p", exit_layer=1, num_layers=LAYERS)
    assert loaded.layers == preds.layers and loaded.meta["thresholds"] == meta["thresholds"]
    ss.set_draft(DraftConfig(head="lm", exit_layer=1, gamma=2, predictors=str(tmp_path / "p")))
    assert ss.generate(PROMPT, max_new_tokens=12, method="specee-verified").token_ids == hf_greedy(ss.model, PROMPT, 12)
    # oracle exit: the first layer from which the label stays 1
    labels = torch.tensor([[0, 1, 1], [1, 0, 1], [0, 0, 0], [1, 1, 1]])
    assert oracle_exits(labels, 1, 4).tolist() == [2, 3, 4, 1]


@pytest.mark.slow
def test_default_model_bundled_predictors(default_ss):
    """The default model's bundled head carries SpecEE predictors: specee-verified is its own greedy text;
    the lossy mode exits early for some tokens and says how often the full model agreed."""
    ss = default_ss
    ss.set_draft(DraftConfig())
    runner = ss.engine.specee
    assert runner is not None and runner.layers and runner.layers[0] >= ss.head.exit_layer
    assert runner.settings.threshold["specee"] >= 0.9  # the lossy default keeps >= 99% simulated agreement
    for text in ("Explain photosynthesis in two sentences.", "List three prime numbers and add them."):
        ids = ss.encode([{"role": "user", "content": text}])
        ref = hf_greedy(ss.model, ids, 48, ss.eos_token_ids)
        out = ss.generate(ids, max_new_tokens=48, method="specee-verified")
        assert out.token_ids == ref
    ss.set_draft(DraftConfig(specee_threshold=0.8))
    lossy = ss.generate(ids, max_new_tokens=48, method="specee", ignore_eos=True)
    assert len(lossy.token_ids) == 48 and min(lossy.stats.exit_layers) < ss.split.num_layers
    assert lossy.stats.predictor_checks > 0
    ss.set_draft(DraftConfig())


def test_specee_requests_step_alone_inside_a_batch(tmp_path):
    """In a batch (selfspec.batch), SpecEE requests run their own loop, one round per batch step, next to
    plain and selfspec requests: each output equals the same request alone."""
    ss = specee_ss("llama", tmp_path)
    prompts = [PROMPT, PROMPT[:5], PROMPT[2:]]
    gens = [ss.resolve(max_new_tokens=12, ignore_eos=True, method=m) for m in ("specee-verified", "specee", "plain")]
    with torch.inference_mode():
        batched = decode_batch(ss.engine, prompts, gens, method=None)
    assert batched == [ss.generate(p, g).token_ids for p, g in zip(prompts, gens)]
