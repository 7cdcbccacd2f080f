"""Where lookup blocks come from, and which policy sizes each: the continuation of the text's last n-gram where it
occurred before in the request's own text (``selfspec.drafting.lookup``), else in text the target wrote before (a
token store, ``selfspec.drafting.store``). Each source learns its own acceptance, per bucket of match lengths
(``ByMatchLength``); a lookup block right after one accepted whole (the answer is copying a span) learns apart too
(the streak's policies). What a sequence needs of this between rounds is its ``SequenceState.lookup``."""

from __future__ import annotations

from selfspec.drafting.lookup import NgramIndex
from selfspec.drafting.policies import DraftPolicy, FixedPolicy
from selfspec.drafting.policy_tables import ByMatchLength
from selfspec.drafting.store import TokenStore
from selfspec.state import SequenceState


class LookupSources:
    """Lookup drafts of at most ``lookup`` tokens (0: off) from ``ngram``-grams (down to 2): the occurrence matching
    furthest back (``longest``; else the latest, ``NgramIndex``), else the token ``store``'s. Each block's policy is
    the one of its match length in its source's table: ``lookup_policy``, ``streak_policy`` after a lookup block
    accepted whole (None: ``lookup_policy`` then too), ``store_policy`` for the store's blocks (None for a table:
    full-length blocks)."""

    def __init__(self, lookup: int = 0, ngram: int = 3, lookup_policy: ByMatchLength | None = None,
                 streak_policy: ByMatchLength | None = None, longest: bool = True, store: TokenStore | None = None,
                 store_policy: ByMatchLength | None = None) -> None:
        self.lookup, self.ngram, self.longest = lookup, ngram, longest
        self.lookup_policy = lookup_policy or ByMatchLength(FixedPolicy, ())
        self.streak_policy = streak_policy
        self.store = store
        self.store_policy = store_policy or ByMatchLength(FixedPolicy, ())

    def index(self, seq: SequenceState) -> NgramIndex:
        """The sequence's n-gram index (rebuilt when its token list was replaced)."""
        index = seq.lookup.index
        if not isinstance(index, NgramIndex) or index.tokens is not seq.tokens:
            index = seq.lookup.index = NgramIndex(seq.tokens, self.ngram, longest=self.longest)
        return index

    def drafts(self, seq: SequenceState, limit: int) -> list[int]:
        """The lookup drafts a round would propose (at most ``limit``, and as many as the block's policy wants);
        empty when lookup is off or the text's last n-gram has no earlier occurrence."""
        if self.lookup <= 0 or not seq.tokens:
            return []
        state = seq.lookup
        found = self.index(seq).match(min(limit, self.lookup))
        state.from_store = False
        if not found.tokens and self.store is not None:  # nothing in the request's text: text the target wrote before
            found = self.store.match(seq.tokens, min(limit, self.lookup))
            state.from_store = True
        if not found.tokens:
            return []
        state.match = found.length  # the block's policy, here and when its verdict comes
        return list(found.tokens[: self.policy_of(seq).max_drafts(self.lookup)])

    def source(self, seq: SequenceState) -> str:
        """The source of the block ``drafts`` just proposed: "store" or "lookup" (the request's text)."""
        return "store" if seq.lookup.from_store else "lookup"

    def policy_of(self, seq: SequenceState) -> DraftPolicy:
        """The policy of ``seq``'s lookup block: a store block's by its match length; the streak's after a lookup
        block accepted whole, else the lookup policy, each the one of the block's match length."""
        state = seq.lookup
        if state.from_store:
            return self.store_policy.of(state.match)
        table = self.lookup_policy
        if self.streak_policy is not None and state.streak:
            table = self.streak_policy
        return table.of(state.match)

    def available(self, seq: SequenceState) -> bool:
        """Whether a lookup block would be proposed now (the text's last n-gram occurred before)."""
        if self.lookup <= 0 or not seq.tokens:
            return False
        return bool(self.index(seq).continuation(1)) or (
            self.store is not None and bool(self.store.match(seq.tokens, 1).tokens))

    @staticmethod
    def verified(seq: SequenceState, looked: bool, drafted: int, num_accepted: int) -> None:
        """After a verified block of ``drafted`` drafts (``looked``: a lookup block): the streak goes on while
        lookup blocks are accepted whole."""
        seq.lookup.streak = looked and num_accepted == drafted > 0
