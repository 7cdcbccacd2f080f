"""The decode loop, as a ladder of small functions (after gpt-fast):

    prefill            prompt through all layers -> first token (the target's own)
    decode_one_token   one token through all layers (the plain, in-engine baseline)
    speculative_step   draft with layers [0, k) + exit head, verify with layers [k, L), roll back
    generate_tokens    the loop; yields blocks of output tokens as they are accepted

Stop conditions that depend on text (EOS inside an accepted block, stop strings) are applied by
the caller token by token on the yielded blocks, so output stops exactly where plain decoding
would. The engine itself only never goes past ``max_new_tokens``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from selfspec.config import GenerateConfig
from selfspec.drafting.base import DraftBlock
from selfspec.drafting.early_exit import EarlyExitDrafter
from selfspec.errors import ContextOverflowError, EmptyPromptError, InvalidConfigError
from selfspec.models.split import Ride, SplitModel
from selfspec.sampling import logits_to_probs, make_generator, pick
from selfspec.specee.decode import SPECEE_METHODS, SpecEERunner
from selfspec.state import SequenceState
from selfspec.stats import GenerationStats
from selfspec.verify import greedy_tree_verify, greedy_verify, speculative_verify, tree_sample_verify

if TYPE_CHECKING:
    from selfspec.batch.scheduler import BatchConfig

METHODS = ("selfspec", "plain", *SPECEE_METHODS)
MAX_TREE_NODES = 16  # the tree's head-drafted nodes (root included); the packed kernels take up to 16 rows


def validate_request(prompt_len: int, gen: GenerateConfig, context_length: int) -> None:
    if prompt_len == 0:
        raise EmptyPromptError("the prompt is empty: give at least one token")
    if not isinstance(gen.max_new_tokens, int) or gen.max_new_tokens <= 0:
        raise InvalidConfigError(f"max_new_tokens must be a positive integer, got {gen.max_new_tokens}")
    if gen.temperature < 0:
        raise InvalidConfigError(f"temperature must be >= 0, got {gen.temperature}")
    if not 0.0 < gen.top_p <= 1.0:
        raise InvalidConfigError(f"top_p must be in (0, 1], got {gen.top_p}")
    if gen.top_k < 0:
        raise InvalidConfigError(f"top_k must be >= 0, got {gen.top_k}")
    if gen.method not in METHODS:
        raise InvalidConfigError(f"unknown method '{gen.method}' (known: {', '.join(METHODS)})")
    if prompt_len + gen.max_new_tokens > context_length:
        raise ContextOverflowError(
            f"this model's context is {context_length} tokens, but the prompt has {prompt_len} tokens "
            f"and {gen.max_new_tokens} new tokens were requested ({prompt_len + gen.max_new_tokens} in all)"
        )


@dataclass
class BatchEntry:
    """One sequence's part in ``Engine.step_batch``."""

    seq: SequenceState
    gen: GenerateConfig
    stats: GenerationStats
    remaining: int = 1  # tokens it may still emit (a round never drafts past remaining - 1)
    speculative: bool = False  # drafts (selfspec) or plain steps
    prompt: list[int] | None = None  # not prefilled yet: this round is its prefill
    draft_cap: int = 1 << 30  # at most this many drafts from the exit head this round (the batch's rule)
    lookup_cap: int = 1 << 30  # at most this many lookup drafts this round


class Engine:
    def __init__(self, split: SplitModel, drafter: EarlyExitDrafter | None = None, gamma: int = 4,
                 tree_width: int = 0, specee: SpecEERunner | None = None) -> None:
        if gamma < 1:
            raise InvalidConfigError(f"gamma must be >= 1, got {gamma}")
        if tree_width < 0:
            raise InvalidConfigError(f"tree_width must be >= 0, got {tree_width}")
        self.split, self.drafter, self.gamma, self.tree_width = split, drafter, gamma, tree_width
        self.specee = specee  # SpecEE's predictors over this drafter's candidates (methods specee, specee-verified)

    # ---- pieces -----------------------------------------------------------------------
    def check_method(self, method: str) -> None:
        """A clear error when ``method`` needs something this engine lacks (SpecEE predictors)."""
        if method in SPECEE_METHODS and (self.specee is None or self.drafter is None):
            raise InvalidConfigError(
                f"method '{method}' needs SpecEE predictors for the exit head: none were found beside it "
                "(train them with `selfspec train-predictors`, or set DraftConfig.predictors)"
            )

    def new_sequence(self, prompt_len: int, gen: GenerateConfig) -> SequenceState:
        cache = self.split.new_cache(prompt_len + gen.max_new_tokens + 1)
        generator = None if gen.greedy else make_generator(gen.seed, self.split.device)
        return SequenceState(cache=cache, generator=generator)

    def prefill(self, seq: SequenceState, prompt_ids: list[int], gen: GenerateConfig, speculative: bool) -> int:
        split = self.split
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=split.device)
        pos = seq.positions(0, len(prompt_ids))
        if speculative:
            k = self.drafter.depth_of(seq)
            h_k = split.run_layers(split.embed(ids), 0, k, pos, seq.cache)
            h = split.run_layers(h_k, k, split.num_layers, pos, seq.cache)
            self.drafter.start(seq, h_k, h)
        else:
            h = split.forward_all(ids, pos, seq.cache)
        seq.length = len(prompt_ids)
        seq.pending = pick(split.logits(h[:, -1:])[0, -1], gen, seq.generator)
        return seq.pending

    def decode_one_token(self, seq: SequenceState, gen: GenerateConfig) -> int:
        ids = torch.tensor([[seq.pending]], dtype=torch.long, device=self.split.device)
        h = self.split.forward_all(ids, seq.positions(seq.length, 1), seq.cache)
        seq.length += 1
        seq.pending = pick(self.split.logits(h)[0, -1], gen, seq.generator)
        return seq.pending

    def start_sequence(self, prompt_ids: list[int], gen: GenerateConfig, speculative: bool,
                       stats: GenerationStats) -> SequenceState:
        """A request's sequence after its prefill: its cache, its drafting state (seeded policy, depth) when
        ``speculative``, its first token pending and in ``tokens``; ``stats`` counts the prompt and that token."""
        seq = self.new_sequence(len(prompt_ids), gen)
        if speculative:
            self.drafter.begin(seq, gen.seed)
        first = self.prefill(seq, prompt_ids, gen, speculative)
        seq.tokens = [*prompt_ids, first]
        stats.prompt_tokens, stats.new_tokens = len(prompt_ids), 1
        return seq

    def generate_batch(self, prompts: list[list[int]], gens: list[GenerateConfig],
                       eos_token_ids: list[int] | None = None, method: str | None = "plain",
                       stats: list[GenerationStats] | None = None, batch: BatchConfig | None = None) -> list[list[int]]:
        """Several requests decoded together (``selfspec.batch.Scheduler``; all admitted at once unless
        ``batch.max_batch`` is smaller), each with its own prompt length, settings and seed, each until its
        ``max_new_tokens`` or, unless it ignores EOS, an EOS token. ``method`` decodes every request that
        way (None: each its own ``gen.method``). Each output equals that request's own batch-1 output.
        -> new token ids per request, EOS included (``stats``, when given, gets one entry per request)."""
        from selfspec.batch.scheduler import BatchConfig, Scheduler

        if len(prompts) != len(gens):
            raise InvalidConfigError(f"generate_batch: {len(prompts)} prompts but {len(gens)} generation configs")
        sched = Scheduler(self, batch or BatchConfig(max_batch=max(1, len(prompts))), eos_token_ids)
        gens = [g if method is None else replace(g, method=method) for g in gens]
        for ids, gen in zip(prompts, gens):  # every request checked before any is added
            validate_request(len(ids), gen, self.split.context_length)
            self.check_method(gen.method)
        reqs = [sched.add(ids, gen) for ids, gen in zip(prompts, gens)]
        sched.run()
        if stats is not None:
            stats.extend(r.stats for r in reqs)
        return [r.out for r in reqs]

    def step_batch(self, entries: list[BatchEntry]) -> list[list[int]]:
        """One round for several sequences at once, each as it would run alone: a new request's prompt (its
        prefill), a plain step's pending token, or a speculative round's draft block (a chain, a lookup
        match or a token tree, drafted per sequence under its own policy). All their rows then go through
        the layers together (``SplitModel.run_rides``: each enters at its own layer, attends only to its own
        cache, and every weight is read once per stage) and the LM head once; each sequence then picks,
        verifies and rolls back on its own. Ragged blocks and ragged acceptance need no padding and no
        realignment. -> the new tokens of each entry (a prefill's: its first token)."""
        split, drafter = self.split, self.drafter
        rides, blocks = [], []
        plan = {j: (min(drafter.policy_of(e.seq).max_drafts(self.gamma), e.remaining - 1, e.draft_cap),
                    min(e.remaining - 1, e.lookup_cap))  # (head drafts, lookup drafts) at most; asked once a round
                for j, e in enumerate(entries) if e.prompt is None and e.speculative}
        chains = self._draft_chains(entries, plan)  # entry index -> its early-exit chain, drafted in lockstep
        for j, e in enumerate(entries):
            seq, block = e.seq, chains.get(j)
            if e.prompt is not None:  # a prefill; a speculative one keeps its exit states for the drafter
                ids = torch.tensor([e.prompt], dtype=torch.long, device=split.device)
                ride = Ride(0, split.embed(ids), seq.positions(0, len(e.prompt)), seq.cache,
                            capture=drafter.depth_of(seq) if e.speculative else None)
            elif not e.speculative:
                ride = self.ride_of(seq, None)
            else:
                max_drafts, limit = plan[j]
                looked = [] if block is not None or self.drafts_tree(max_drafts) else drafter.lookup_drafts(seq, limit)
                if block is None and self.drafts_tree(max_drafts):
                    block = self.propose_tree(seq, max_drafts, limit)
                if block is not None:
                    ride = self.ride_of(seq, block)
                else:  # a lookup block or nothing: the rows ride from the embeddings, their exit states kept
                    k = drafter.next_depth(seq)
                    ids = torch.tensor([[seq.pending, *looked]], dtype=torch.long, device=split.device)
                    ride = Ride(0, split.embed(ids), seq.positions(seq.length, len(looked) + 1), seq.cache, capture=k)
                    if looked:
                        block = DraftBlock(looked, None, None, start=seq.length, source="lookup", exit_layer=k)
            rides.append(ride)
            blocks.append(block)
        hs = split.run_rides(rides)
        rows = [h[:, -1:] if e.prompt is not None or not e.speculative else h for e, h in zip(entries, hs)]
        logits = split.logits(torch.cat(rows, dim=1)).split([r.shape[1] for r in rows], dim=1)  # LM head read once
        out = []
        for e, ride, block, h, lg in zip(entries, rides, blocks, hs, logits):
            seq = e.seq
            if e.prompt is not None:
                if e.speculative:
                    drafter.start(seq, ride.captured, h)
                seq.length = len(e.prompt)
                seq.pending = pick(lg[0, -1], e.gen, seq.generator)
                seq.tokens = [*e.prompt, seq.pending]
                out.append([seq.pending])
            elif not e.speculative:
                seq.length += 1
                seq.pending = pick(lg[0, -1], e.gen, seq.generator)
                seq.tokens.append(seq.pending)
                e.stats.record_step(0, 0)
                out.append([seq.pending])
            elif block is not None and block.tree is not None:
                out.append(self.accept_tree(seq, e.gen, block, h, e.stats, lg))
            else:
                if block is None:
                    block = DraftBlock([], None, None, start=seq.length, exit_layer=ride.capture)
                if block.exit_states is None:
                    block.exit_states = ride.captured
                out.append(self.verify_block(seq, e.gen, block, h, e.stats, lg))
        return out

    def _draft_chains(self, entries: list[BatchEntry], plan: dict[int, tuple[int, int]]) -> dict[int, DraftBlock]:
        """The early-exit chains of a batched round (entries that draft from the head: no tree, no lookup match),
        drafted together (``EarlyExitDrafter.propose_chains``). ``plan``: entry -> (head drafts, lookup drafts)."""
        drafter, want = self.drafter, {}
        for j, (max_drafts, limit) in plan.items():
            e = entries[j]
            if max_drafts > 0 and not self.drafts_tree(max_drafts) and not drafter.lookup_drafts(e.seq, limit):
                want[j] = (max_drafts, drafter.next_depth(e.seq))
        if not want:
            return {}
        blocks = drafter.propose_chains([entries[j].seq for j in want], [m for m, _ in want.values()],
                                        [entries[j].gen for j in want], [k for _, k in want.values()])
        return dict(zip(want, blocks))

    def drafts_tree(self, max_drafts: int) -> bool:
        """Whether a round of up to ``max_drafts`` drafts is a token tree (trees on, a draft wanted, a head that can)."""
        return self.tree_width > 1 and max_drafts > 0 and self.drafter.supports_tree

    def speculative_step(
        self, seq: SequenceState, gen: GenerateConfig, max_drafts: int, stats: GenerationStats,
        limit: int | None = None,
    ) -> list[int]:
        split, drafter = self.split, self.drafter
        p = seq.length
        if self.drafts_tree(max_drafts):
            return self.tree_step(seq, gen, max_drafts, stats, max_drafts if limit is None else limit)
        block = drafter.propose(seq, max_drafts, gen, limit=max_drafts if limit is None else limit)
        h = split.run_layers(block.exit_states, block.exit_layer or drafter.exit_layer, split.num_layers,
                             seq.positions(p, len(block.tokens) + 1), seq.cache)
        return self.verify_block(seq, gen, block, h, stats)

    def verify_block(self, seq: SequenceState, gen: GenerateConfig, block: DraftBlock, h: torch.Tensor,
                     stats: GenerationStats, target_logits: torch.Tensor | None = None) -> list[int]:
        """Verify a chain of drafts from the last-layer states of its rows ``h`` ``# [1, g + 1, hidden]``
        (pending token and drafts), roll the cache back to the accepted length, sync the drafter, emit.
        ``target_logits`` ``# [1, g + 1, vocab]``: those states' logits when already computed (a batch)."""
        split, p, g = self.split, block.start, len(block.tokens)
        if target_logits is None:
            target_logits = split.logits(h)  # [1, g + 1, vocab]
        drafts = torch.tensor([block.tokens], dtype=torch.long, device=split.device)  # [1, g]
        if gen.greedy:
            res = greedy_verify(drafts, target_logits)
        else:
            target_probs = logits_to_probs(target_logits, gen.temperature, gen.top_k, gen.top_p)
            if block.probs is not None:
                draft_probs = block.probs.unsqueeze(0)
            else:  # greedy (one-hot) drafts under sampling: still exactly lossless
                draft_probs = F.one_hot(drafts, split.vocab_size).to(target_probs.dtype)
            res = speculative_verify(drafts, draft_probs, target_probs, seq.generator)
        m, nxt = int(res.num_accepted[0]), int(res.next_token[0])
        seq.cache.truncate(p + 1 + m)  # keep the pending token and the accepted drafts
        seq.length, seq.pending = p + 1 + m, nxt
        self.drafter.accepted(seq, block, m, h)
        stats.record_step(g, m, block.source)
        if g and block.source != "lookup" and block.exit_layer is not None:
            stats.draft_depths[block.exit_layer] = stats.draft_depths.get(block.exit_layer, 0) + 1
        out = block.tokens[:m] + [nxt]
        seq.tokens.extend(out)
        return out

    def tree_step(self, seq: SequenceState, gen: GenerateConfig, depth: int, stats: GenerationStats,
                  limit: int) -> list[int]:
        """One round with a token tree: draft it, verify every node in one block of the deep layers
        under a tree mask, accept the longest agreeing path, and move that path's KV entries into
        place in every layer (the head's state is redone from the path by the drafter)."""
        block = self.propose_tree(seq, depth, limit)
        r = self.ride_of(seq, block)
        h = self.split.run_layers(r.h, r.layer, self.split.num_layers, r.positions, r.cache, tree=r.tree)
        return self.accept_tree(seq, gen, block, h, stats)

    def ride_of(self, seq: SequenceState, block: DraftBlock | None) -> Ride:
        """The rows a round sends through the deep layers: a draft block's exit states from its depth (a tree's
        nodes under its tree mask), or with no block (a plain step) the pending token from the embeddings."""
        split = self.split
        if block is None:
            ids = torch.tensor([[seq.pending]], dtype=torch.long, device=split.device)
            return Ride(0, split.embed(ids), seq.positions(seq.length, 1), seq.cache)
        k = block.exit_layer or self.drafter.exit_layer
        if block.tree is None:
            return Ride(k, block.exit_states, seq.positions(block.start, len(block.tokens) + 1), seq.cache)
        nodes = list(range(len(block.tree)))
        return Ride(k, block.exit_states, block.tree.positions(nodes, block.start, split.device), seq.cache,
                    block.tree.attention(nodes, block.start, split.device))

    def propose_tree(self, seq: SequenceState, depth: int, limit: int) -> DraftBlock:
        """A token tree of at most ``depth`` levels (capped so its head-drafted nodes fit MAX_TREE_NODES)."""
        depth = min(depth, max(1, (MAX_TREE_NODES - 1) // self.tree_width))
        block = self.drafter.propose_tree(seq, depth, self.tree_width, limit)
        block.levels = depth
        return block

    def accept_tree(self, seq: SequenceState, gen: GenerateConfig, block: DraftBlock, h: torch.Tensor,
                    stats: GenerationStats, target_logits: torch.Tensor | None = None) -> list[int]:
        """Verify a tree block from its nodes' last-layer states ``h`` ``# [1, nodes, hidden]`` (``target_logits``
        ``# [1, nodes, vocab]`` when already computed), keep the accepted path's KV entries, sync, emit."""
        tree, p, depth = block.tree, seq.length, block.levels
        target_logits = (self.split.logits(h) if target_logits is None else target_logits)[0]  # [nodes, vocab]
        if gen.greedy:
            keep, nxt = greedy_tree_verify(tree.parents, tree.tokens, target_logits.argmax(-1))
        else:
            probs = logits_to_probs(target_logits, gen.temperature, gen.top_k, gen.top_p)
            keep, nxt = tree_sample_verify(tree.parents, tree.tokens, probs, seq.generator)
        m = len(keep) - 1
        seq.cache.compact(p, keep)
        seq.length, seq.pending = p + 1 + m, nxt
        path = DraftBlock([tree.tokens[i] for i in keep[1:]], None, block.exit_states[:, keep], start=p,
                          exit_layer=block.exit_layer)
        self.drafter.accepted(seq, path, m, h[:, keep], proposed=depth)
        stats.record_step(depth, m, "early_exit")
        stats.draft_depths[block.exit_layer] = stats.draft_depths.get(block.exit_layer, 0) + 1
        out = path.tokens + [nxt]
        seq.tokens.extend(out)
        return out

    # ---- the loop ---------------------------------------------------------------------
    @torch.inference_mode()
    def generate_tokens(
        self, prompt_ids: list[int], gen: GenerateConfig, stats: GenerationStats | None = None
    ) -> Iterator[list[int]]:
        """Yield blocks of new tokens (the first block is the prefill's token). The caller may stop
        iterating at any time (EOS, stop string); the engine never exceeds ``max_new_tokens``."""
        validate_request(len(prompt_ids), gen, self.split.context_length)
        stats = stats if stats is not None else GenerationStats()
        self.check_method(gen.method)
        specee = gen.method in SPECEE_METHODS
        speculative = (gen.method == "selfspec" or specee) and self.drafter is not None
        t0 = time.perf_counter()
        seq = self.start_sequence(prompt_ids, gen, speculative, stats)
        if specee:
            self.specee.start(seq)
        stats.prefill_time = time.perf_counter() - t0
        stats.wall_time = stats.prefill_time
        yield [seq.pending]
        while stats.new_tokens < gen.max_new_tokens:
            remaining = gen.max_new_tokens - stats.new_tokens
            if gen.method == "specee":
                block = self.specee.lossy_step(seq, gen, stats)
            elif gen.method == "specee-verified" and not self.drafter.lookup_available(seq):
                cap = min(self.specee.settings.max_drafts, self.drafter.policy_of(seq).max_drafts(self.gamma), remaining - 1)
                drafted, h = self.specee.verified_round(seq, cap, stats)
                block = self.verify_block(seq, gen, drafted, h, stats)
            elif speculative:  # selfspec; specee-verified when a lookup block is there (free drafts, same verification)
                max_drafts = min(self.drafter.policy_of(seq).max_drafts(self.gamma), remaining - 1)
                block = self.speculative_step(seq, gen, max_drafts, stats, limit=remaining - 1)
            else:
                block = [self.decode_one_token(seq, gen)]
                seq.tokens.append(block[0])
                stats.record_step(0, 0)
            block = block[:remaining]
            stats.new_tokens += len(block)
            stats.wall_time = time.perf_counter() - t0
            yield block
