"""Statistics of one generation: what the API returns and the benchmarks record."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

LOOKUP_SOURCES = ("lookup", "store")  # draft sources that copy earlier text (the request's own, or a token store's)
BLANK = "blank"  # a block's source when the head ran for the first draft and the confidence stop refused it


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose keys and values came from the prefix cache (not prefilled)
    new_tokens: int = 0
    steps: int = 0  # target verification steps after the prefill (plain decoding: one per token)
    accept_lengths: list[int] = field(default_factory=list)  # tokens emitted per step, bonus included
    proposed_per_position: list[int] = field(default_factory=list)  # draft tokens proposed at position i
    accepted_per_position: list[int] = field(default_factory=list)  # ... and accepted
    lookup_steps: int = 0  # steps whose drafts came from an n-gram match (lookup), not the early exit
    lookup_proposed: int = 0  # lookup drafts proposed (not in the per-position lists, which are the early exit's)
    lookup_accepted: int = 0  # lookup drafts accepted
    store_steps: int = 0  # of the lookup steps, those whose drafts came from the token store (selfspec.drafting.store)
    store_proposed: int = 0  # ... their drafts proposed
    store_accepted: int = 0  # ... and accepted
    exit_layers: list[int] = field(default_factory=list)  # SpecEE: layer each token (draft) exited at (L: none)
    predictor_checks: int = 0  # SpecEE: predictor evaluations
    predictor_time: float = 0.0  # SpecEE: seconds in candidate features + predictors
    exit_compared: int = 0  # lossy SpecEE: early-exit tokens whose full-model choice became known
    exit_agreed: int = 0  # ... and equalled what the exit emitted (greedy)
    draft_depths: dict[int, int] = field(default_factory=dict)  # exit depth -> draft rounds from it (early exit, trees)
    blank_steps: int = 0  # steps whose head ran for a first draft the confidence stop refused (a plain step's token)
    prefill_time: float = 0.0  # seconds, prompt forward and first token
    wall_time: float = 0.0  # seconds, whole generation (prefill included)

    @property
    def mean_accepted_length(self) -> float:
        """Output tokens per target verification step, bonus included (plain decoding: 1.0)."""
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted_per_position, self.proposed_per_position)]

    @property
    def mean_exit_layer(self) -> float:
        return sum(self.exit_layers) / len(self.exit_layers) if self.exit_layers else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_time if self.wall_time > 0 else 0.0

    def record_step(self, proposed: int, accepted: int, source: str = "early_exit") -> None:
        self.steps += 1
        self.blank_steps += source == BLANK
        if source in LOOKUP_SOURCES:
            self.lookup_steps += 1
            self.lookup_proposed += proposed
            self.lookup_accepted += accepted
            if source == "store":
                self.store_steps += 1
                self.store_proposed += proposed
                self.store_accepted += accepted
            self.accept_lengths.append(accepted + 1)
            return
        self.accept_lengths.append(accepted + 1)
        while len(self.proposed_per_position) < proposed:
            self.proposed_per_position.append(0)
            self.accepted_per_position.append(0)
        for i in range(proposed):
            self.proposed_per_position[i] += 1
            if i < accepted:
                self.accepted_per_position[i] += 1

    def merge(self, other: GenerationStats) -> None:
        """Pool ``other`` into these stats (several generations reported as one)."""
        self.prompt_tokens += other.prompt_tokens
        self.cached_tokens += other.cached_tokens
        self.new_tokens += other.new_tokens
        self.steps += other.steps
        self.lookup_steps += other.lookup_steps
        self.lookup_proposed += other.lookup_proposed
        self.lookup_accepted += other.lookup_accepted
        self.store_steps += other.store_steps
        self.store_proposed += other.store_proposed
        self.store_accepted += other.store_accepted
        self.blank_steps += other.blank_steps
        self.accept_lengths += other.accept_lengths
        self.exit_layers += other.exit_layers
        self.predictor_checks += other.predictor_checks
        self.predictor_time += other.predictor_time
        self.exit_compared += other.exit_compared
        self.exit_agreed += other.exit_agreed
        grow = len(other.proposed_per_position) - len(self.proposed_per_position)
        self.proposed_per_position += [0] * max(0, grow)
        self.accepted_per_position += [0] * max(0, grow)
        for i, (p, a) in enumerate(zip(other.proposed_per_position, other.accepted_per_position)):
            self.proposed_per_position[i] += p
            self.accepted_per_position[i] += a
        self.prefill_time += other.prefill_time
        self.wall_time += other.wall_time

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            mean_accepted_length=self.mean_accepted_length,
            mean_exit_layer=self.mean_exit_layer,
            acceptance_rate_per_position=self.acceptance_rate_per_position,
            tokens_per_second=self.tokens_per_second,
        )
        return d

    def summary(self) -> str:
        rates = " ".join(f"{r:.2f}" for r in self.acceptance_rate_per_position)
        return (
            f"{self.new_tokens} tokens in {self.wall_time:.2f}s ({self.tokens_per_second:.1f} tok/s), "
            f"{self.steps} steps, mean accepted length {self.mean_accepted_length:.2f}"
            + (f", acceptance per position [{rates}]" if rates else "")
            + (f", lookup: {self.lookup_steps} steps, {self.lookup_accepted}/{self.lookup_proposed} drafts accepted"
               if self.lookup_steps else "")
            + (f" (token store: {self.store_steps} steps, {self.store_accepted}/{self.store_proposed})"
               if self.store_steps else "")
            + (f", {self.blank_steps} blank steps (the head's first draft refused)" if self.blank_steps else "")
            + (f", {self.cached_tokens} of {self.prompt_tokens} prompt tokens from the prefix cache"
               if self.cached_tokens else "")
            + (f", mean exit layer {self.mean_exit_layer:.1f}, predictors {self.predictor_checks} checks "
               f"{1000 * self.predictor_time:.0f} ms" if self.exit_layers else "")
            + (f", exits agreeing with the full model {self.exit_agreed}/{self.exit_compared}"
               if self.exit_compared else "")
            + (", rounds per depth " + " ".join(f"{d}:{n}" for d, n in sorted(self.draft_depths.items()))
               if len(self.draft_depths) > 1 else "")
        )


@dataclass
class RoundRecord:
    """One decoding round as ``Engine.round_log`` records it (``selfspec bench-rounds``)."""

    method: str  # the request's method ('plain', 'selfspec', ...)
    kind: str  # 'plain step' (the plain method), 'no draft', 'blank' (the head ran, its draft refused), 'head'
    # (early-exit chain or tree) or 'lookup'
    drafted: int  # drafts proposed (a tree: its depth)
    accepted: int  # drafts accepted
    seconds: float  # wall time of the round (propose, verify, commit)
    prompt: int = -1  # which of a benchmark's prompts (bench-rounds sets it; -1: unknown)


def round_marks(stats: GenerationStats) -> tuple[int, int, int, int]:
    """What ``round_record`` compares after a round: (steps, lookup steps, drafts proposed, blank steps so far)."""
    return stats.steps, stats.lookup_steps, sum(stats.proposed_per_position) + stats.lookup_proposed, stats.blank_steps


def round_record(method: str, before: tuple[int, int, int, int], stats: GenerationStats,
                 seconds: float) -> RoundRecord:
    """The round between ``before`` (``round_marks`` then) and now, from the stats it updated."""
    steps, lookups, proposed, blanks = round_marks(stats)
    drafted = proposed - before[2]
    accepted = stats.accept_lengths[-1] - 1 if steps > before[0] and stats.accept_lengths else 0
    if method == "plain":
        kind = "plain step"
    elif drafted == 0:
        kind = "blank" if blanks > before[3] else "no draft"
    else:
        kind = "lookup" if lookups > before[1] else "head"
    return RoundRecord(method, kind, drafted, accepted, seconds)
