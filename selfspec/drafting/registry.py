"""Ways to draft, by name: ``DraftConfig.drafter`` picks one, ``register_drafter`` adds one.

A way to draft is a factory ``(ss, draft) -> DraftSetup``: given the loaded ``SelfSpec`` and its
``DraftConfig``, it builds a ``Drafter`` (``selfspec.drafting.base``) and says how the engine should run
it (most drafts per round, token-tree width). Adding one is a file with a ``BaseDrafter`` subclass and
a factory, and one ``register_drafter`` line::

    class RepeatLast(BaseDrafter):                 # proposes the pending token again, g times
        def propose(self, seq, max_drafts, gen, limit=None):
            return DraftBlock([seq.pending] * max_drafts, None, None, start=seq.length, source="repeat")

    register_drafter("repeat-last", lambda ss, draft: DraftSetup(RepeatLast(), gamma=draft.gamma or 3))
    SelfSpec.load(draft=DraftConfig(drafter="repeat-last"))   # batch-1, batches, the server: all lossless
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from selfspec.config import DraftConfig
from selfspec.drafting import setup
from selfspec.drafting.base import Drafter
from selfspec.errors import InvalidConfigError


@dataclass
class DraftSetup:
    """A built way to draft, and how the engine runs it."""

    drafter: Drafter
    gamma: int  # most drafts per round
    tree_width: int = 0  # > 1: token trees of this width (the drafter must support them)
    draft: DraftConfig | None = None  # the config as resolved (exit layer, policy...); None: as given
    head: Any = None  # the exit head, if the drafter has one
    tuning: Any = None  # the calibration it was built from (selfspec.tuning.Tuning), if any
    specee: Any = None  # SpecEE's predictors over the drafter (selfspec.specee.decode.SpecEERunner), if any


DrafterFactory = Callable[[Any, DraftConfig], DraftSetup]
_DRAFTERS: dict[str, DrafterFactory] = {}


def register_drafter(name: str, factory: DrafterFactory) -> None:
    """Make ``DraftConfig(drafter=name)`` build drafts with ``factory(ss, draft)``."""
    _DRAFTERS[name] = factory


def drafter_names() -> list[str]:
    return sorted(_DRAFTERS)


def build_draft(ss: Any, draft: DraftConfig) -> DraftSetup:
    """The ``DraftSetup`` of ``draft.drafter`` for the loaded ``ss``."""
    factory = _DRAFTERS.get(draft.drafter)
    if factory is None:
        raise InvalidConfigError(f"unknown drafter '{draft.drafter}' (known: {', '.join(drafter_names())})")
    built = factory(ss, draft)
    if built.draft is None:
        built.draft = draft
    return built


def _early_exit(ss: Any, draft: DraftConfig) -> DraftSetup:
    drafter, gamma, draft, tuning = setup.early_exit(ss, draft)
    return DraftSetup(drafter, gamma, draft.tree_width or 0, draft, drafter.head, tuning,
                      setup.specee_runner(ss.split, drafter, draft))


register_drafter("early-exit", _early_exit)
