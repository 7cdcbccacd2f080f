"""Two-level scheduling of SpecEE's predictors (docs/SPECEE.md).

Offline (``predictors.py``): predictors exist only at the layers where exits actually happen, chosen
from the exit-layer distribution measured on target-generated text.

Online (``OnlineSchedule``, one per sequence): of those, check only the layers within ``radius`` of
the exit layers of the last ``window`` tokens. Text is locally similar, so a token tends to exit near
where its neighbours did. While any recent token ran through every layer (no exit), or fewer than
``window`` tokens were seen, every offline layer is checked, so the schedule never locks itself out.
``window = 0`` turns the online level off.
"""

from __future__ import annotations

from collections import deque


class OnlineSchedule:
    def __init__(self, layers: list[int], window: int = 4, radius: int = 2) -> None:
        self.layers = sorted(layers)
        self.window, self.radius = window, radius
        self.recent: deque[int | None] = deque(maxlen=max(window, 1))

    def layers_to_check(self) -> list[int]:
        if self.window <= 0 or len(self.recent) < self.window or None in self.recent:
            return self.layers
        return [i for i in self.layers if any(abs(i - e) <= self.radius for e in self.recent if e is not None)]

    def observe(self, exit_layer: int | None) -> None:
        """The layer a token exited at (None: it ran through every layer)."""
        self.recent.append(exit_layer)
