"""The batch-1 decode loop, as a ladder of small functions (after gpt-fast) over the round core
(``selfspec.round``: prefill, rows_of, verify, commit, cut):

    prefill            prompt through all layers -> first token (the target's own)
    decode_one_token   one token through all layers (the plain, in-engine baseline)
    speculative_step   propose a block, its rows through the deep layers, verify, commit (roll back)
    generate_tokens    the loop; yields blocks of output tokens as they are accepted

Stop conditions that depend on text (EOS inside an accepted block, stop strings) are applied by
the caller token by token on the yielded blocks (``selfspec.outputs``), so output stops exactly where
plain decoding would. The engine itself only never goes past ``max_new_tokens``. Several sequences
at once: ``selfspec.batch`` (its round is ``selfspec.batch.step``).
"""

from __future__ import annotations

import time
from collections.abc import Generator

import torch

from selfspec import round as core
from selfspec.config import GenerateConfig
from selfspec.drafting.base import DraftBlock, Drafter
from selfspec.errors import ContextOverflowError, EmptyPromptError, InvalidConfigError
from selfspec.models.split import Ride, SplitModel
from selfspec.prefix_cache import MIN_ROWS, PrefixCache, why_not_exact
from selfspec.sampling import greedy, make_generator, pick
from selfspec.specee.decode import SPECEE_METHODS, SpecEERunner
from selfspec.state import SequenceState
from selfspec.stats import GenerationStats, RoundRecord, round_marks, round_record

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




class Engine:
    def __init__(self, split: SplitModel, drafter: Drafter | None = None, gamma: int = 4,
                 tree_width: int = 0, specee: SpecEERunner | None = None, prefix: PrefixCache | None = None) -> None:
        if gamma < 1:
            raise InvalidConfigError(f"gamma must be >= 1, got {gamma}")
        if tree_width < 0:
            raise InvalidConfigError(f"tree_width must be >= 0, got {tree_width}")
        self.split, self.drafter, self.gamma, self.tree_width = split, drafter, gamma, tree_width
        self.specee = specee  # SpecEE's predictors over this drafter's candidates (methods specee, specee-verified)
        self.prefix = prefix  # earlier prompts' keys and values (selfspec.prefix_cache), None: every prompt prefilled
        # a list: every round of generate_tokens appends its RoundRecord (kind, drafts, wall time: bench-rounds)
        self.round_log: list[RoundRecord] | None = None
        self._tails_exact: bool | None = None  # whether a prefill's last layer may skip rows (``prefill_tail``)

    # ---- pieces -----------------------------------------------------------------------
    def need_drafter(self) -> Drafter:
        """The drafter, where only a speculative request gets (``speculative`` checked it is there)."""
        assert self.drafter is not None, "a speculative round needs a drafter"
        return self.drafter

    def need_specee(self) -> SpecEERunner:
        """SpecEE's runner, where only a SpecEE request gets (``check_method`` checked it is there)."""
        assert self.specee is not None, "a SpecEE round needs SpecEE predictors"
        return self.specee

    def check_method(self, method: str) -> None:
        """A clear error when ``method`` needs something this engine lacks (SpecEE predictors)."""
        if method in SPECEE_METHODS and (self.specee is None or self.drafter is None):
            raise InvalidConfigError(
                f"method '{method}' needs SpecEE predictors for the exit head: none were found beside it "
                "(train them with `selfspec train-predictors`, or set DraftConfig.predictors)"
            )

    def speculative(self, method: str) -> bool:
        """Whether requests of ``method`` draft (with this engine's drafter)."""
        return method in ("selfspec", *SPECEE_METHODS) and self.drafter is not None

    def new_sequence(self, prompt_len: int, gen: GenerateConfig) -> SequenceState:
        cache = self.split.new_cache(prompt_len + gen.max_new_tokens + 1)
        generator = None if gen.greedy else make_generator(gen.seed, self.split.device)
        return SequenceState(cache=cache, generator=generator)

    def reuse_prefix(self, seq: SequenceState, prompt_ids: list[int], gen: GenerateConfig, speculative: bool) -> int:
        """Into ``seq``'s new cache, the longest cached prefix of the prompt that leaves what the prefill must
        compute (selfspec.prefix_cache: exact, so the output is the same either way). -> positions reused."""
        if self.prefix is None or gen.method not in ("plain", "selfspec"):
            return 0
        need = self.need_drafter().prompt_rows_needed() if speculative else 0
        return 0 if need is None else self.prefix.reuse(prompt_ids, seq.cache, need)

    def remember_prompt(self, seq: SequenceState, prompt_ids: list[int], computed: int) -> None:
        """After a prefill that computed the prompt's last ``computed`` rows in one call: kept for later requests."""
        if self.prefix is not None:
            self.prefix.store(prompt_ids, seq.cache, computed)

    def capture_depth(self, seq: SequenceState, gen: GenerateConfig) -> int | None:
        """The depth whose states a speculative request's prefill keeps for its drafter, None when the drafter is
        given nothing (no ``Drafter.start``): a selfspec request whose drafter reads nothing of the prompt
        (``prompt_rows_needed`` 0: lookup alone, a head the calibration turned off), whose prefill is then plain
        decoding's, one pass over every layer. (SpecEE's rounds run the head whatever the calibration chose.)"""
        drafter = self.need_drafter()
        return None if gen.method == "selfspec" and drafter.prompt_rows_needed() == 0 else drafter.depth_of(seq)

    def prefill_tail(self, gen: GenerateConfig, speculative: bool, capture: int | None) -> int | None:
        """How many of a prefill's last rows need their last-layer states (``SplitModel.run_layers``'s ``tail``; the
        rest only their keys and values): the last row's logits, and what the drafter reads of the prompt's final
        states (``prompt_rows_needed``), but never under PANEL_ROWS, so that every row the prefill does compute has
        the bits a whole prompt's prefill gives it. None (every row) where that cannot be promised
        (``prefix_cache.why_not_exact``), the drafter reads the whole prompt, or for SpecEE's methods."""
        if self._tails_exact is None:
            self._tails_exact = why_not_exact(self.split) is None
        if not self._tails_exact or gen.method not in ("plain", "selfspec"):
            return None
        need = self.need_drafter().prompt_rows_needed() if speculative and capture is not None else 0
        return None if need is None else max(need, MIN_ROWS)

    def prefill(self, seq: SequenceState, prompt_ids: list[int], gen: GenerateConfig, speculative: bool,
                first: int = 0) -> int:
        """The prompt into ``seq`` (the drafter given its states when ``speculative``), from position ``first``
        (the cache holds those before: ``reuse_prefix``); -> the first token."""
        drafter = self.drafter if speculative else None
        capture = self.capture_depth(seq, gen) if drafter is not None else None
        h_k, h = core.prefill(self.split, seq, prompt_ids, gen, capture, first,
                              None if drafter is None else drafter.context_layers,
                              tail=self.prefill_tail(gen, speculative, capture))
        if drafter is not None and capture is not None:
            drafter.start(seq, h_k, h, first)
        return seq.pending

    def decode_one_token(self, seq: SequenceState, gen: GenerateConfig,
                         stats: GenerationStats | None = None) -> int:
        if gen.greedy:  # the whole step in one compiled call where it applies (split.step)
            step = self.split.step(seq.pending, seq.length, seq.cache)
            if step is not None:
                return core.commit_plain(seq, step.token, stats)[0]
        ids = torch.tensor([[seq.pending]], dtype=torch.long, device=self.split.device)
        h = self.split.forward_all(ids, seq.positions(seq.length, 1), seq.cache)
        if gen.greedy:  # the argmax alone (split.greedy_ids: the plan's final norm, LM head and argmax)
            return core.commit_plain(seq, int(self.split.greedy_ids(h)[0, -1]), stats)[0]
        return core.commit_plain(seq, pick(self.split.logits(h)[0, -1], gen, seq.generator), stats)[0]

    def start_sequence(self, prompt_ids: list[int], gen: GenerateConfig, speculative: bool,
                       stats: GenerationStats) -> SequenceState:
        """A request's sequence after its prefill (what the prefix cache holds of the prompt reused, the prompt
        kept for later ones): its cache, its drafting state (seeded policy, depth) when ``speculative``, its first
        token pending and in ``tokens``; ``stats`` counts the prompt (and the part reused) and that token."""
        seq = self.new_sequence(len(prompt_ids), gen)
        if speculative:
            self.need_drafter().begin(seq, gen.seed)
        first = self.reuse_prefix(seq, prompt_ids, gen, speculative)
        self.prefill(seq, prompt_ids, gen, speculative, first)
        self.remember_prompt(seq, prompt_ids, len(prompt_ids) - first)
        stats.prompt_tokens, stats.cached_tokens, stats.new_tokens = len(prompt_ids), first, 1
        return seq

    def drafts_tree(self, max_drafts: int) -> bool:
        """Whether a round of up to ``max_drafts`` drafts is a token tree (trees on, a draft wanted, a head that can)."""
        return self.tree_width > 1 and max_drafts > 0 and self.need_drafter().supports_tree

    def propose(self, seq: SequenceState, gen: GenerateConfig, max_drafts: int, limit: int) -> DraftBlock:
        """This round's block: a token tree, or the drafter's chain (a lookup match when there is one; a blank
        round's block may carry the target's verdict, ``Drafter.propose_or_step``)."""
        if self.drafts_tree(max_drafts):
            return self.propose_tree(seq, max_drafts, limit)
        return self.need_drafter().propose_or_step(seq, max_drafts, gen, limit=limit)

    def propose_tree(self, seq: SequenceState, depth: int, limit: int) -> DraftBlock:
        """A token tree of at most ``depth`` levels (capped so its head-drafted nodes fit MAX_TREE_NODES)."""
        depth = min(depth, max(1, (MAX_TREE_NODES - 1) // self.tree_width))
        block = self.need_drafter().propose_tree(seq, depth, self.tree_width, limit)
        block.levels = depth
        return block

    def ride_of(self, seq: SequenceState, block: DraftBlock | None) -> Ride:
        """The rows a round sends through the (deep) layers (``round.rows_of``)."""
        return core.rows_of(self.split, seq, block, self.drafter.exit_layer if self.drafter is not None else 0)

    def speculative_step(self, seq: SequenceState, gen: GenerateConfig, max_drafts: int, stats: GenerationStats,
                         limit: int | None = None) -> list[int]:
        """One round: propose (chain, lookup match or tree), the block's rows through the layers it has not
        been through, verify, commit. -> the emitted tokens."""
        block = self.propose(seq, gen, max_drafts, max_drafts if limit is None else limit)
        drafter = self.need_drafter()
        if block.verdict is not None:  # a blank round whose drafting call ran the plain step too (propose_or_step)
            return core.commit(seq, drafter, block, 0, *block.verdict, stats)
        if (gen.greedy and not block.tokens and block.exit_states is None and block.tree is None
                and not drafter.reads_final_states):  # nothing drafted, nothing to keep: a plain step's one call
            step = self.split.step(seq.pending, seq.length, seq.cache)
            if step is not None:
                return core.commit(seq, drafter, block, 0, step.token, None, stats)
        r = self.ride_of(seq, block)
        h, ctx = core.through_layers(self.split, r, drafter.context_layers)
        return self.accept(seq, gen, block, h, stats, context=ctx)

    def accept(self, seq: SequenceState, gen: GenerateConfig, block: DraftBlock, h: torch.Tensor,
               stats: GenerationStats, target_logits: torch.Tensor | None = None,
               context: torch.Tensor | None = None) -> list[int]:
        """Verify ``block`` from its rows' last-layer states ``h`` ``# [1, rows, hidden]`` (``target_logits``
        ``# [1, rows, vocab]`` when already computed: a batch) and commit the verdict; the drafter keeps
        ``context`` (``round.through_layers``) when given, else ``h``."""
        final = h if context is None else context
        if gen.greedy:  # only each row's argmax is needed (split.greedy_ids: the LM head's screen)
            ids = self.split.greedy_ids(h)[0] if target_logits is None else greedy(target_logits[0])  # [rows]
            if block.tree is not None:
                path, nxt = core.greedy_tree(block, ids)
                return core.commit_path(seq, self.need_drafter(), block, path, nxt, final, stats)
            m, nxt = core.greedy_chain(block.tokens, ids.tolist())
            return core.commit(seq, self.drafter, block, m, nxt, final, stats)
        target_logits = self.split.logits(h) if target_logits is None else target_logits
        if block.tree is not None:
            path, nxt = core.verify_tree(gen, block, target_logits[0], seq.generator)
            return core.commit_path(seq, self.need_drafter(), block, path, nxt, final, stats)
        m, nxt = core.verify_chain(gen, block.tokens, block.probs, target_logits, seq.generator)
        return core.commit(seq, self.drafter, block, m, nxt, final, stats)

    # ---- the loop ---------------------------------------------------------------------
    @torch.inference_mode()
    def generate_tokens(
        self, prompt_ids: list[int], gen: GenerateConfig, stats: GenerationStats | None = None
    ) -> Generator[list[int], None, None]:
        """Yield blocks of new tokens (the first block is the prefill's token). The caller may stop
        iterating at any time (EOS, stop string); the engine never exceeds ``max_new_tokens``."""
        validate_request(len(prompt_ids), gen, self.split.context_length)
        stats = stats if stats is not None else GenerationStats()
        self.check_method(gen.method)
        t0 = time.perf_counter()
        seq = self.start_sequence(prompt_ids, gen, self.speculative(gen.method), stats)
        if gen.method in SPECEE_METHODS:
            self.need_specee().start(seq)
        stats.prefill_time = stats.wall_time = time.perf_counter() - t0
        yield [seq.pending]
        while stats.new_tokens < gen.max_new_tokens:
            remaining = gen.max_new_tokens - stats.new_tokens
            log = self.round_log  # a list: the round is timed and classified (bench-rounds)
            before, t = (round_marks(stats), time.perf_counter()) if log is not None else ((0, 0, 0, 0), 0.0)
            block, _ = core.cut(self.round(seq, gen, remaining, stats), remaining)
            if log is not None:
                log.append(round_record(gen.method, before, stats, time.perf_counter() - t))
            stats.new_tokens += len(block)
            stats.wall_time = time.perf_counter() - t0
            yield block

    def round(self, seq: SequenceState, gen: GenerateConfig, remaining: int, stats: GenerationStats) -> list[int]:
        """One round of ``gen.method`` for ``seq``, at most ``remaining`` tokens wanted. -> the emitted tokens."""
        if gen.method == "specee":
            return self.need_specee().lossy_step(seq, gen, stats)
        if not self.speculative(gen.method):
            return [self.decode_one_token(seq, gen, stats)]
        drafter = self.need_drafter()
        cap = min(drafter.max_drafts(seq, self.gamma, remaining), remaining - 1)
        if gen.method == "specee-verified" and not drafter.lookup_available(seq):
            specee = self.need_specee()
            drafted, h = specee.verified_round(seq, min(cap, specee.settings.max_drafts), stats)
            return self.accept(seq, gen, drafted, h, stats)
        # selfspec; specee-verified when a lookup block is there (free drafts, same verification)
        return self.speculative_step(seq, gen, cap, stats, limit=remaining - 1)
