"""The pipeline (selfspec.pipeline): PPSD and Mirror-SD, over two processes and over two threads (one
device). Lossless greedy on every architecture with the untrained exit and with the deep-context head,
ragged acceptance (rejections at the first draft and whole blocks), blocks drafted ahead and Mirror-SD
branches actually used, the sampling distribution kept (statistical, and a broken verifier fails it), a
stage that dies or raises mid-generation (a clear error, no hang), and the cost model."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import ARCHS, LAYERS, VOCAB, hf_greedy, tiny_model
from test_bench import tiny_ss  # noqa: F401 (a fixture: a tiny model with the default tokenizer)
from test_deep_head import deep_ss
from test_engine_equality import prompt_of

from selfspec import DraftConfig, SelfSpec
from selfspec.config import GenerateConfig, PipelineConfig
from selfspec.costs import DraftCosts
from selfspec.errors import InvalidConfigError
from selfspec.pipeline import Pipeline, PipelineError
from selfspec.pipeline.costs import predict
from selfspec.verify import greedy_verify

GAMMA = 3
CASES = ((1, 20), (7, 17), (13, 9), (4, 1))


@pytest.fixture(autouse=True)
def _keep_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def exit_ss(arch: str, k: int = LAYERS - 1) -> SelfSpec:
    return SelfSpec(tiny_model(arch), None, DraftConfig(exit_layer=k, head="lm", gamma=GAMMA, policy="fixed"))


def check_lossless(pipe: Pipeline, model) -> list:
    stats = []
    for n, new in CASES:
        p = prompt_of(n, n + 5)
        out, st = pipe.generate(p, max_new_tokens=new)
        assert out == hf_greedy(model, p, new), (n, new)
        stats.append(st)
    p = prompt_of(7, 12)
    eos = hf_greedy(model, p, 20)[4]
    out, _ = pipe.generate(p, max_new_tokens=20, eos_token_ids=[eos])
    assert out == hf_greedy(model, p, 20, eos=[eos])
    return stats


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_ppsd_over_two_processes_equals_transformers(arch):
    ss = exit_ss(arch)
    with Pipeline.of(ss, PipelineConfig(gamma=GAMMA)) as pipe:
        stats = check_lossless(pipe, ss.model)
    accepts = [a for st in stats for a in st.accept_lengths]
    if arch in ("mistral", "qwen2"):  # rejected at every position of the block, and accepted whole
        assert set(accepts) == set(range(1, GAMMA + 2))
    if arch in ("llama", "mistral"):
        assert min(accepts) == 1 and max(accepts) >= GAMMA
        assert sum(st.ahead_used for st in stats) > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_mirror_on_one_device_equals_transformers(arch):
    """Twice: with the thread's look-ahead (greedy stops drafting branches once the verdict is in: how many it
    drafts depends on timing, so only the output is checked), then with the verdict never seen early (every
    branch drafted, as with the process transport: the branch counts no longer depend on the machine's load)."""
    ss = exit_ss(arch, LAYERS - 2)  # the early signal comes from layer 3
    with Pipeline.of(ss, PipelineConfig(mode="mirror", transport="thread", gamma=GAMMA, mirror_top_k=3)) as pipe:
        check_lossless(pipe, ss.model)
        pipe.link.poll = lambda: None  # type: ignore[method-assign]
        stats = check_lossless(pipe, ss.model)
    assert sum(st.branches for st in stats) > 0
    if arch in ("llama", "mistral"):
        assert sum(st.branch_used for st in stats) > 0  # a branch opened from the target's early signal was taken


@pytest.mark.slow
@pytest.mark.parametrize("mode,transport", [("ppsd", "process"), ("mirror", "thread"), ("ppsd", "thread")])
def test_deep_context_head_in_the_pipeline(mode, transport):
    """The verdicts carry the accepted rows' final states; drafting ahead reads the head's predicted ones."""
    for arch in ("llama", "qwen3"):
        ss, _ = deep_ss(arch, 2)
        with Pipeline.of(ss, PipelineConfig(mode=mode, transport=transport, gamma=GAMMA)) as pipe:
            stats = check_lossless(pipe, ss.model)
        assert sum(st.rounds for st in stats) > 0


PROMPT = [5, 17, 33, 8, 61]


def _third_token_tv(draw, n: int, model) -> float:
    """TV distance between the empirical distribution of the third new token and the exact one (the second
    and third come from speculative rounds, the third often from a block drafted ahead)."""
    with torch.inference_mode():
        x = torch.tensor([PROMPT])
        p1 = torch.softmax(model(x).logits[0, -1] / 0.8, -1)  # [V]
        x2 = torch.cat([x.expand(VOCAB, -1), torch.arange(VOCAB)[:, None]], 1)
        p2 = torch.softmax(model(x2).logits[:, -1] / 0.8, -1)  # [V, V]: p(x2 | x1)
        x3 = torch.cat([x2.repeat_interleave(VOCAB, 0), torch.arange(VOCAB).repeat(VOCAB)[:, None]], 1)
        p3 = torch.softmax(model(x3).logits[:, -1] / 0.8, -1).view(VOCAB, VOCAB, VOCAB)  # p(x3 | x1, x2)
        exact = torch.einsum("a,ab,abc->c", p1, p2, p3)
    counts = torch.zeros(VOCAB)
    for s in range(n):
        counts[draw(s)[2]] += 1
    return 0.5 * float((counts / n - exact).abs().sum())


@pytest.mark.slow
def test_pipelined_sampling_keeps_the_distribution(monkeypatch):
    ss = SelfSpec(tiny_model("llama"), None, DraftConfig(exit_layer=1, head="lm", gamma=2, policy="fixed"))
    gen = GenerateConfig(max_new_tokens=3, temperature=0.8, ignore_eos=True)
    n = 1500
    plain = _third_token_tv(lambda s: ss.generate(PROMPT, max_new_tokens=3, method="plain", temperature=0.8,
                                                  seed=s, ignore_eos=True).token_ids, n, ss.model)
    with Pipeline.of(ss, PipelineConfig(mode="mirror", transport="thread", gamma=2)) as pipe:
        used = []

        def draw(s: int) -> list[int]:
            out, st = pipe.generate(PROMPT, gen, seed=10_000 + s)
            used.append(st.ahead_used)
            return out

        piped = _third_token_tv(draw, n, ss.model)
        assert sum(used) > 50  # blocks drafted ahead were used
        a = pipe.generate(PROMPT, gen, max_new_tokens=12, seed=3)[0]
        assert a == pipe.generate(PROMPT, gen, max_new_tokens=12, seed=3)[0]  # seeded: reproducible
    assert piped < max(1.5 * plain, plain + 0.03)

    from selfspec import round as core  # the deep stage verifies with the round core's verify_chain

    def accept_all(drafts, q, target, generator):  # a broken verifier: every (greedy) draft accepted
        res = greedy_verify(drafts, target)
        res.num_accepted[:] = drafts.shape[1]
        res.next_token[:] = torch.multinomial(target[0, -1], 1, generator=generator)
        return res

    monkeypatch.setattr(core, "speculative_verify", accept_all)
    with Pipeline.of(ss, PipelineConfig(transport="thread", gamma=2)) as pipe:
        broken = _third_token_tv(lambda s: pipe.generate(PROMPT, gen, seed=20_000 + s, draft_sampling="greedy")[0],
                                 n, ss.model)
    assert broken > 2 * max(piped, plain)  # the test can fail


class DyingPipeline(Pipeline):
    """Kills the deep process after its third verdict."""

    def _verdict(self):
        if self.stats.rounds == 3:
            self.worker.kill()
            self.worker.join()
        return super()._verdict()


@pytest.mark.slow
def test_a_dead_deep_process_is_a_clear_error_not_a_hang():
    ss = exit_ss("llama")
    pipe = DyingPipeline.of(ss, PipelineConfig(gamma=1, timeout=30))
    with pytest.raises(PipelineError, match="deep stage"):
        pipe.generate(prompt_of(3, 8), max_new_tokens=40)
    with pytest.raises(PipelineError, match="not running"):  # and stays an error
        pipe.generate(prompt_of(3, 8), max_new_tokens=4)
    pipe.close()
    with Pipeline.of(ss, PipelineConfig(gamma=1)) as again:  # a new pipeline works
        assert again.generate(prompt_of(3, 8), max_new_tokens=5)[0] == hf_greedy(ss.model, prompt_of(3, 8), 5)


@pytest.mark.slow
def test_a_deep_process_that_cannot_start_is_a_clear_error():
    from selfspec.config import ModelConfig
    from selfspec.pipeline import ModelSource

    ss = exit_ss("llama")
    t0 = time.monotonic()
    with pytest.raises(PipelineError, match="exited while starting"):
        Pipeline(ss.split, ss.engine.drafter, PipelineConfig(timeout=600),
                 ModelSource(ModelConfig(model="/no/such/model")))
    # the child's exit ends the wait, not the group's timeout: a spawned process that imports torch takes seconds
    # (a minute on a loaded machine), far from 600
    assert time.monotonic() - t0 < 300
    with Pipeline.of(ss, PipelineConfig(gamma=2)) as pipe:  # the next one starts
        assert pipe.generate([3, 4], max_new_tokens=3)[0] == hf_greedy(ss.model, [3, 4], 3)


def test_a_deep_thread_that_raises_is_a_clear_error(monkeypatch):
    from selfspec.pipeline import deep  # the deep stage verifies with the round core's verify_chain

    ss = exit_ss("llama")
    calls = []
    verify_chain = deep.verify_chain

    def flaky(*args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected failure")
        return verify_chain(*args)

    monkeypatch.setattr(deep, "verify_chain", flaky)
    pipe = Pipeline.of(ss, PipelineConfig(transport="thread", gamma=1, timeout=30))
    with pytest.raises(PipelineError, match="injected failure"):
        pipe.generate(prompt_of(3, 8), max_new_tokens=40)
    with pytest.raises(PipelineError, match="not running"):
        pipe.generate(prompt_of(3, 8), max_new_tokens=4)
    pipe.close()


def test_bad_settings_are_clear_errors():
    ss = exit_ss("llama")
    with pytest.raises(InvalidConfigError, match="gamma"):
        Pipeline.of(ss, PipelineConfig(gamma=0, transport="thread"))
    with pytest.raises(InvalidConfigError, match="mirror_layer"):
        Pipeline.of(ss, PipelineConfig(mode="mirror", transport="thread", mirror_layer=LAYERS))
    with Pipeline.of(ss, PipelineConfig(transport="thread")) as pipe:
        with pytest.raises(InvalidConfigError, match="non-empty prompt"):
            pipe.generate([], max_new_tokens=4)
        assert pipe.generate([3, 4], max_new_tokens=2)[0] == hf_greedy(ss.model, [3, 4], 2)  # still fine


def test_cost_model():
    costs = DraftCosts(2, t_shallow=0.0015, t_head=0.0026, t_deep={1: 0.0245, 2: 0.025, 4: 0.027})
    low, high = predict(costs, 0.3, 1), predict(costs, 0.9, 2)
    assert low.speedup_pipelined < low.speedup_sequential  # a wrong guess puts the redraft on the critical path
    assert high.speedup_pipelined > high.speedup_sequential > 1  # drafting hidden behind verification
    ahead = 3 * 0.0015 + 3 * 0.0026  # g = 2: three shallow passes, two drafts and the guess from the head
    assert high.t_round_pipelined == pytest.approx(max(ahead, costs.deep(3)) + (1 - 0.9 ** 3) * ahead)
    assert low.mean_accepted_length == pytest.approx(1.3)


@pytest.mark.slow
def test_the_server_serves_through_the_pipeline_and_survives_a_dead_stage(default_ss):
    """The real model with Mirror-SD over two processes: greedy equals transformers'; behind the OpenAI API
    its answers equal the engine's;
    a deep stage killed mid-request fails that request with 503, the server stays up, the next request
    starts a new pipeline and is right again."""
    import threading

    import httpx
    from test_server import KEY, ThreadedServer

    from selfspec.config import ModelConfig
    from selfspec.server.app import create_app

    ss = default_ss
    prompt = "Name three colours of the rainbow."
    ref = ss.generate(prompt, max_new_tokens=24).text
    service = ss.use_pipeline(PipelineConfig(mode="mirror"), ModelConfig())
    ids = ss.encode(prompt)
    out, st = service.start().generate(ids, max_new_tokens=40, ignore_eos=True)
    assert out == hf_greedy(ss.model, ids, 40) and st.branches > 0  # the real model, token for token
    srv = ThreadedServer(create_app(ss, api_key=KEY))
    try:
        client = srv.client()
        r = client.completions.create(model=ss.model_id, prompt=prompt, max_tokens=24, temperature=0)
        assert r.choices[0].text == ref
        text = "".join(c.choices[0].text for c in client.completions.create(
            model=ss.model_id, prompt=prompt, max_tokens=24, temperature=0, stream=True))
        assert text == ref
        answer = {}

        def long_request():
            answer["r"] = httpx.post(srv.url + "/v1/completions", timeout=120, headers={"Authorization": f"Bearer {KEY}"},
                                     json={"model": ss.model_id, "prompt": prompt, "max_tokens": 400,
                                           "temperature": 0, "ignore_eos": True})

        t = threading.Thread(target=long_request)
        t.start()
        deadline = time.monotonic() + 60
        while not service.busy:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.5)
        service.pipe.worker.kill()
        t.join(60)
        assert answer["r"].status_code == 503
        assert answer["r"].json()["error"]["code"] == "pipeline_stage_failed"
        assert httpx.get(srv.url + "/health").json()["status"] == "ok"
        r = client.completions.create(model=ss.model_id, prompt=prompt, max_tokens=24, temperature=0)
        assert r.choices[0].text == ref and service.started == 2
    finally:
        srv.stop()
        ss.use_pipeline(None)


@pytest.mark.slow
def test_bench_pipeline_writes_rows_for_every_method(tiny_ss, tmp_path):  # noqa: F811 (the fixture)
    """``selfspec bench-pipeline`` on a tiny model: a row per method, every output equal to plain, the cost
    model beside them, the results files."""
    import json

    from test_bench import QUESTIONS, write_questions

    from selfspec.bench.pipeline import METHODS, PipelineBenchConfig, run

    ss = tiny_ss
    q = write_questions(tmp_path / "q.jsonl", QUESTIONS)
    result = run(PipelineBenchConfig(questions=q, per_group=1, max_new_tokens=6, out=str(tmp_path / "out")), ss=ss)
    rows = {r["method"]: r for r in result["rows"]}
    assert set(rows) == set(METHODS)
    assert all(r["identical"] == r["questions"] == 3 for r in rows.values())
    assert rows["mirror"]["branches_per_round"] > 0 and "ahead_used" in rows["ppsd-1dev"]
    assert set(result["cost_model"]) == {"one_thread_per_stage", "two_devices"}
    saved = json.loads((tmp_path / "out" / "pipeline.json").read_text())
    assert saved["config"]["per_group"] == 1 and (tmp_path / "out" / "pipeline.md").read_text().startswith("| method")
    with pytest.raises(InvalidConfigError, match="methods"):
        run(PipelineBenchConfig(questions=q, methods=["ppsd"]), ss=ss)
