"""The deep-context head (heads.deep): lossless on every tiny architecture, and its per-sequence state
(its own KV cache and the stored final states) always equals what a fresh teacher-forced forward over
the accepted tokens gives, however drafts were rejected, looked up or skipped."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHS, hf_greedy, tiny_model
from test_engine_equality import NEW, prompt_of

from selfspec import DraftConfig, SelfSpec
from selfspec.drafting import head_state
from selfspec.drafting.policies import make_policy
from selfspec.errors import ExitLayerError
from selfspec.heads.io import new_head
from selfspec.quant.convert import quantize_model

pytestmark = pytest.mark.usefixtures("one_thread")


def deep_ss(arch: str, k: int, gamma: int | None = 3, lookup: int = 0, seed: int = 0,
            quantize: str | None = None, context_layers: list[int] | None = None,
            head_layers: int = 1) -> tuple[SelfSpec, object]:
    model = tiny_model(arch) if quantize is None else quantize_model(tiny_model(arch), quantize)
    ss = SelfSpec(model, None)
    head = new_head("deep", ss.split, k, **({"context_layers": context_layers} if context_layers else {}),
                    head_layers=head_layers)
    head.init_from_target()
    torch.manual_seed(seed)
    with torch.no_grad():  # a head that agrees sometimes, not always
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    ss.set_draft(DraftConfig(exit_layer=max(k, 1), head="lm", gamma=gamma, lookup=lookup))
    ss.engine.drafter.head = head
    ss.engine.drafter.exit_layer = k  # 0: the draft reads the embeddings (only a deep head may)
    return ss, head


@torch.inference_mode()
def teacher_forced(split, tokens: list[int], k: int, context_layers: tuple[int, ...] = (),
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The true exit states after ``k`` layers, the context a deep head reads (the previous position's final state,
    then its states after each of ``context_layers``; zeros before the first) and the positions of ``tokens``, from
    one forward (layer by layer: the run the engine's segments must equal)."""
    ids = torch.tensor([tokens])
    pos = torch.arange(ids.shape[1])[None]
    cache = split.new_cache(ids.shape[1])
    h, states = split.embed(ids), {}
    for i in range(split.num_layers):
        states[i] = h
        h = split.run_layers(h, i, i + 1, pos, cache)
    states[split.num_layers] = h
    ctx = torch.cat([states[split.num_layers], *(states[c] for c in context_layers)], dim=-1)
    return states[k], torch.cat([torch.zeros_like(ctx[:, :1]), ctx[:, :-1]], dim=1), pos


@pytest.mark.parametrize("arch", ARCHS)
def test_deep_head_is_lossless(arch):
    drafted = accepted = 0
    for k in (0, 1, 2):
        ss, _ = deep_ss(arch, k)
        for plen in (1, 9):
            prompt = prompt_of(plen, plen + k)
            ref = hf_greedy(ss.model, prompt, NEW)
            for policy in ("fixed", "confidence"):
                ss.engine.drafter.policy = make_policy(policy, 0.1)
                out = ss.generate(prompt, max_new_tokens=NEW)
                assert out.token_ids == ref, (k, plen, policy)
                drafted += sum(out.stats.proposed_per_position)
                accepted += sum(out.stats.accepted_per_position)
    assert 0 < accepted < drafted


@pytest.mark.parametrize("arch", ARCHS)
def test_deep_head_on_a_quantized_target_drafts_with_q4_and_is_lossless(arch):
    """On a block-quantized target the head's decoder layer drafts with Q4_0 weights: drafts change, output does
    not (greedy equals transformers' generate on the quantized model, chains and a tree). Exit layers 2 and 0
    (the quantized embeddings straight into the head: the bundled Qwen head's setting)."""
    prompt = prompt_of(9, 11)
    for k in (2, 0):
        ss, head = deep_ss(arch, k, quantize="Q4_0")
        assert head.draft_weights == "Q4_0"
        head.prepare()
        assert head._fast is not None and head._fast[1][0].qkv.path == "selfspec-quant"  # the block's packed weights
        ref = hf_greedy(ss.model, prompt, NEW)
        drafted = 0
        for policy, width in (("fixed", 0), ("confidence", 0), ("fixed", 2)):
            ss.engine.drafter.policy = make_policy(policy, 0.1)
            ss.engine.tree_width = width
            out = ss.generate(prompt, max_new_tokens=NEW)
            assert out.token_ids == ref, (k, policy, width)
            drafted += sum(out.stats.proposed_per_position)
        assert drafted > 0, k


def first_drafts_match_a_fresh_forward(ss, head, k: int, prompts: list[list[int]], context_layers: tuple[int, ...] = (),
                                       tol: float = 1e-4) -> int:
    """Generate each prompt (output the target's own) while recording each round's first draft, which reads the
    verified prefix only; it must equal the head's teacher-forced logits over the true exit states and context of
    that prefix (one fresh forward, ``teacher_forced``). -> the drafts proposed."""
    split = ss.split
    seen: list[tuple[int, torch.Tensor]] = []
    inner = head_state.deep_draft  # a greedy draft's features and logits (draft_step's, where it applies)

    def spy(head_, seq, h, f_prev, *rest):
        f_hat, part, ids = inner(head_, seq, h, f_prev, *rest)
        if f_prev is None:  # a round's first draft: at the pending token's position
            seen.append((seq.length, head.logits_of(f_hat)[0, -1].clone()))
        return f_hat, part, ids

    head_state.deep_draft = spy
    drafted = 0
    try:
        for prompt in prompts:
            seen.clear()
            out = ss.generate(prompt, max_new_tokens=NEW)
            assert out.token_ids == hf_greedy(ss.model, prompt, NEW)
            assert len(seen) >= 3
            drafted += sum(out.stats.proposed_per_position)
            h_k, ctx, pos = teacher_forced(split, prompt + out.token_ids, k, context_layers)
            with torch.inference_mode():
                ref = head(h_k, pos, head.new_state(pos.shape[1]), context=ctx)[0]
                if context_layers:  # the context layers' states change the drafts
                    blind = head(h_k, pos, head.new_state(pos.shape[1]), context=ctx[..., : split.hidden_size])[0]
                    assert not torch.allclose(ref, blind, atol=1e-3)
            for p, logits in seen:
                torch.testing.assert_close(logits, ref[p], atol=tol, rtol=tol)
    finally:
        head_state.deep_draft = inner
    return drafted


LOOKUP_PROMPT = [5, 6, 7, 5, 6, 7, 5, 6]


@pytest.mark.parametrize("lookup", [0, 4])
def test_deep_head_state_matches_a_fresh_forward(lookup):
    """Each round's first draft (read from the verified prefix only) equals the head's teacher-forced
    logits over the true exit and final states of that prefix."""
    ss, head = deep_ss("llama", 2, lookup=lookup, seed=1)
    first_drafts_match_a_fresh_forward(ss, head, 2, [LOOKUP_PROMPT if lookup else prompt_of(7, 4)])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fused_context_layers_are_lossless_and_the_state_matches_a_fresh_forward(arch):
    """A deep head with context layers (EAGLE-3's fused features): the prefill and every verification keep the
    verified tokens' states after those layers beside the final ones, drafts read zeros there, so each round's
    first draft equals the head's teacher-forced logits over the true [f, h_c1, h_c2] context; output stays the
    target's own, chains with lookup and a tree alike. A context layer at or below the exit layer is refused."""
    ss, head = deep_ss(arch, 0, lookup=4, seed=1, context_layers=[1, 3])
    assert head.args() == {"context_layers": [1, 3]} and ss.engine.drafter.context_layers == [1, 3]
    ss.engine.drafter.policy = make_policy("fixed", 0.1)
    assert first_drafts_match_a_fresh_forward(ss, head, 0, [prompt_of(7, 4), LOOKUP_PROMPT], (1, 3)) > 0
    ss.engine.tree_width = 2
    prompt = prompt_of(9, 11)
    assert ss.generate(prompt, max_new_tokens=NEW).token_ids == hf_greedy(ss.model, prompt, NEW)
    with pytest.raises(ExitLayerError, match="context layers"):
        new_head("deep", ss.split, 2, context_layers=[2])


@pytest.mark.parametrize("quantize", [None, "Q4_0"])
def test_a_head_of_two_layers_is_lossless_and_its_state_matches_a_fresh_forward(quantize):
    """``head_layers=2``: a second decoder layer with its own cache layer, rolled back with the first. Fresh from
    the target it is the identity (a one-layer head's logits exactly); perturbed, each round's first draft equals
    the head's teacher-forced logits over the verified prefix, chains (with lookup) and a tree, float32 and Q4_0
    drafting weights (the fast layers), and the output is the target's own."""
    ss, head = deep_ss("llama", 0, lookup=4, seed=2, quantize=quantize, head_layers=2)
    split = ss.split
    assert head.args() == {"head_layers": 2} and len(head.blocks) == 2
    one = new_head("deep", split, 0)
    two = new_head("deep", split, 0, head_layers=2)
    one.init_from_target()
    two.init_from_target()
    two.load_state_dict(one.state_dict(), strict=False)
    x, c = torch.randn(1, 5, split.hidden_size), torch.randn(1, 5, split.hidden_size)
    with torch.inference_mode():
        pos = torch.arange(5)[None]
        torch.testing.assert_close(two(x, pos, two.new_state(8), context=c), one(x, pos, one.new_state(8), context=c))
    ss.engine.drafter.policy = make_policy("fixed", 0.1)
    tol = 2e-3 if quantize else 1e-4
    assert first_drafts_match_a_fresh_forward(ss, head, 0, [prompt_of(7, 4), LOOKUP_PROMPT], tol=tol) > 0
    ss.engine.tree_width = 2
    prompt = prompt_of(9, 11)
    assert ss.generate(prompt, max_new_tokens=NEW).token_ids == hf_greedy(ss.model, prompt, NEW)


def test_head_linears_run_packed_and_follow_weight_updates():
    """At inference the head's own linears (fuse; a nested head's depth maps) go through the packed decoding
    kernels; an optimizer step (an in-place weight update) repacks them; with gradients on, the module runs."""
    ss, head = deep_ss("llama", 2)
    x = torch.randn(1, 3, 2 * ss.split.hidden_size)
    with torch.no_grad():
        ref = head.fuse(x)
        fast = head.linear(head.fuse)
        assert fast is not head.fuse and fast is head.linear(head.fuse)  # packed once
        torch.testing.assert_close(fast(x), ref, atol=1e-5, rtol=1e-5)
        head.fuse.weight.mul_(2.0)
        torch.testing.assert_close(head.linear(head.fuse)(x), 2 * ref, atol=1e-5, rtol=1e-5)
        assert head.linear(head.fuse)(x[:, :0]).shape == (1, 0, ss.split.hidden_size)  # no rows (nothing to catch up)
    assert head.linear(head.fuse) is head.fuse  # training: autograd through the module


@pytest.mark.parametrize("arch", ARCHS)
def test_head_context_bounds_the_catch_up_and_the_head_sees_only_its_run(arch, monkeypatch):
    """``head_context``: a stateful head catches up at most that many rows before a draft (at first the prompt's
    last ones), output stays the target's own, and each round's first draft equals the head's teacher-forced
    forward over just the positions it kept (from its restart to the pending token)."""
    context = 3
    ss, head = deep_ss(arch, 2, lookup=4, seed=1)
    drafter, split = ss.engine.drafter, ss.split
    drafter.head_context = context
    calls: list[int] = []
    seen: list[tuple[int, int, torch.Tensor]] = []
    features, inner = head.features, head_state.deep_draft

    def count(h, ctx, positions, state=None, tree=None, tail=None):
        if state is not None and tree is None:
            calls.append(h.shape[1])
        return features(h, ctx, positions, state, tree, tail)

    def spy(head_, seq, h, f_prev, *rest):
        f_hat, part, ids = inner(head_, seq, h, f_prev, *rest)
        if f_prev is None:  # a round's first draft, at the pending token's position
            seen.append((seq.length, seq.head.state.skipped, head.logits_of(f_hat)[0, -1].clone()))
        return f_hat, part, ids

    head.features = count
    monkeypatch.setattr(head_state, "deep_draft", spy)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 9, 11, 4]
    out = ss.generate(prompt, max_new_tokens=NEW)
    assert out.token_ids == hf_greedy(ss.model, prompt, NEW)
    assert calls and max(calls) <= context + 1  # the backlog kept, then the pending token's row
    assert seen and seen[0][1] == len(prompt) - context  # the first draft skipped all but the prompt's last rows
    h_k, ctx, pos = teacher_forced(split, prompt + out.token_ids, 2)
    with torch.inference_mode():
        for p, s, logits in seen:
            ref = head.forward(h_k[:, s : p + 1], pos[:, s : p + 1], head.new_state(pos.shape[1]), ctx[:, s : p + 1])
            torch.testing.assert_close(logits, ref[0, -1], atol=1e-4, rtol=1e-4)


def test_a_head_state_skips_and_rolls_back_in_positions():
    """A cached head's state counts skipped positions: ``seen`` is absolute, a rollback maps back into its run, and
    one back before the skip restarts the run there."""
    ss, head = deep_ss("llama", 2)
    state = head.new_state(16)
    head.skip(state, 5)
    assert head.seen(state) == 5
    state.reserve(0, 3)  # three entries: positions 5, 6, 7
    assert head.seen(state) == 8
    head.rollback(state, 6)
    assert (head.seen(state), state.lengths[0]) == (6, 1)
    head.skip(state, 4)  # a gap after held entries: the run restarts after it
    assert (head.seen(state), state.lengths[0]) == (10, 0)
    head.rollback(state, 2)
    assert (head.seen(state), state.skipped, state.lengths[0]) == (2, 2, 0)


def test_release_float_keeps_drafting_on_the_packed_copies_and_refuses_training():
    """On a block-quantized target the head drafts with Q4_0 copies; ``release_float`` drops its float32 matrices:
    output still equals transformers' greedy, the drafts are the same as before the release, and a forward with
    gradients (training) raises instead of silently using the empty weights."""
    ss, head = deep_ss("llama", 2, quantize="Q4_0")
    prompt = prompt_of(9, 11)
    before = ss.generate(prompt, max_new_tokens=NEW)
    freed = head.release_float()
    assert freed >= sum(m.in_features * m.out_features * 4 for m in (head.fuse, head.block.mlp.down_proj))
    assert head.released and head.fuse.weight.numel() == 0
    after = ss.generate(prompt, max_new_tokens=NEW)
    assert after.token_ids == before.token_ids == hf_greedy(ss.model, prompt, NEW)
    assert after.stats.accept_lengths == before.stats.accept_lengths  # the same drafts
    assert head.release_float() == 0  # once
    h = torch.zeros(1, 1, ss.split.hidden_size)
    with pytest.raises(RuntimeError, match="released"):
        head.features(h, h, torch.zeros(1, 1, dtype=torch.long), head.new_state(4))


def test_draft_reads_count_the_packed_copies_a_head_drafts_with():
    """What a draft reads of the head's own weights (bench-forward's bytes and GFLOP/s of the 'head' range): its Q4_0
    copies (18 bytes per 32 weights) and norms, the same before and after ``release_float`` drops the float32
    matrices; a head on a float32 target (nothing quantized) reads its float32 matrices."""
    ss, head = deep_ss("llama", 2, quantize="Q4_0")
    with torch.inference_mode():
        head.prepare()
    weights = sum(m.in_features * m.out_features for m in head.float_matrices())
    norms = sum(p.numel() * 4 for p in head.parameters() if p.ndim == 1)
    assert head.draft_reads() == (weights * 18 // 32 + norms, weights)
    head.release_float()
    assert head.draft_reads() == (weights * 18 // 32 + norms, weights)
    _, plain = deep_ss("llama", 2)
    with torch.inference_mode():
        plain.prepare()
    assert plain.draft_reads() == (weights * 4 + norms, weights)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("quantize", [None, "Q4_0"])
def test_draft_step_is_bit_for_bit_features_then_the_drafted_logits(arch, quantize):
    """``draft_step`` (one compiled ``head_step`` call) gives exactly what ``features`` then ``logits_part_of`` give:
    f^ of every row, the last row's logits over the drafted vocabulary and its ids, and the same keys and values in
    the head's cache, call after call (1-16 rows), for one and two head layers. It declines (None) where it does not
    apply: past 16 rows, without a trimmed vocabulary, with gradients on, and for a layout without a one-call plan
    (Gemma 3's sandwich norms)."""
    for layers in (1, 2):
        ss, head = deep_ss(arch, 0, quantize=quantize, head_layers=layers, seed=3)
        hidden, vocab = ss.split.hidden_size, ss.split.vocab_size
        g = torch.Generator().manual_seed(layers)
        with torch.inference_mode():
            h, c = torch.randn(1, 2, hidden, generator=g), torch.randn(1, 2, hidden, generator=g)
            assert head.draft_step(h, c, torch.arange(2)[None], head.new_state(8)) is None  # every row drafted
            head.trim_vocab(torch.arange(1, vocab, 3))
            head.prepare()
            fused, ref = head.new_state(64), head.new_state(64)
            if arch == "gemma3_text":  # its layers run the Python path: no plan
                assert head.draft_step(h, c, torch.arange(2)[None], fused) is None
                continue
            at = 0
            for n in (3, 1, 1, 16, 2):
                h, c = torch.randn(1, n, hidden, generator=g), torch.randn(1, n, hidden, generator=g)
                pos = torch.arange(at, at + n)[None]
                got = head.draft_step(h, c, pos, fused)
                assert got is not None, n
                f_hat = head.features(h, c, pos, ref)
                logits, ids = head.logits_part_of(f_hat[:, -1:])
                assert torch.equal(got[0], f_hat) and torch.equal(got[1], logits[0, -1]) and torch.equal(got[2], ids)
                at += n
                for a, b in ((fused.keys, ref.keys), (fused.values, ref.values)):
                    assert all(torch.equal(x[:, :, :at], y[:, :, :at]) for x, y in zip(a, b))
            assert fused.lengths == ref.lengths
            h17 = torch.randn(1, 17, hidden, generator=g)
            assert head.draft_step(h17, h17, torch.arange(at, at + 17)[None], fused) is None
        with torch.enable_grad():
            assert head.draft_step(h, c, pos, fused) is None


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_greedy_chain_drafts_through_draft_step_and_stays_lossless(arch):
    """With a trimmed draft vocabulary a greedy chain's drafts come from the compiled ``head_step`` (the first from
    ``draft_or_step``): it runs, the drafts are the same as through the two Python steps, and the output is
    transformers' greedy."""
    prompt = prompt_of(9, 11)
    runs = []
    for fused in (True, False):
        ss, head = deep_ss(arch, 0, quantize="Q4_0", seed=1)
        head.trim_vocab(torch.arange(0, ss.split.vocab_size, 2))
        head.prepare()
        calls: list[int] = []

        def spy(*args, step=head.draft_step, fused=fused, calls=calls):
            calls.append(args[0].shape[1])
            return step(*args) if fused else None

        head.draft_step = spy
        if not fused:  # nor a round's first draft in one call with the target's step (draft_or_step)
            head.front_ready = lambda rows: False
        out = ss.generate(prompt, max_new_tokens=NEW)
        assert out.token_ids == hf_greedy(ss.model, prompt, NEW)
        assert calls
        runs.append((out.stats.proposed_per_position, out.stats.accepted_per_position))
    assert runs[0] == runs[1] and sum(runs[0][0]) > 0


@pytest.mark.parametrize("layers", [1, 2])
def test_a_long_catch_up_computes_only_the_last_row_and_keeps_every_key(layers):
    """Past 16 rows (a request's first draft catches up on the prompt's last rows) the head's last layer runs
    attention and the MLP on the last row alone (``tail``): every row's keys and values are the full call's, bit for
    bit, and the last row's f^ equals it up to the kernels' summation order (a one-row kernel against a panel's)."""
    ss, head = deep_ss("llama", 0, quantize="Q4_0", head_layers=layers, seed=4)
    hidden = ss.split.hidden_size
    g = torch.Generator().manual_seed(0)
    h, c = torch.randn(1, 40, hidden, generator=g), torch.randn(1, 40, hidden, generator=g)
    pos = torch.arange(40)[None]
    mlp_rows: list[int] = []
    with torch.inference_mode():
        full, tail = head.new_state(64), head.new_state(64)
        ref = head.features(h, c, pos, full)
        layer = head._fast_block()[-1]
        inner = layer._mlp
        layer._mlp = lambda x, a, ops: mlp_rows.append(x.shape[1]) or inner(x, a, ops)
        got = head.features(h, c, pos, tail, tail=1)
        del layer._mlp
    assert mlp_rows == [1]
    torch.testing.assert_close(got[:, -1], ref[:, -1], atol=1e-4, rtol=1e-4)
    for a, b in ((tail.keys, full.keys), (tail.values, full.values)):
        assert all(torch.equal(x[:, :, :40], y[:, :, :40]) for x, y in zip(a, b))
