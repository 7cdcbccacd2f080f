"""Where selfspec keeps what it builds and measures: one small module every other one may import."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """selfspec's cache directory: $SELFSPEC_CACHE, else $XDG_CACHE_HOME/selfspec or ~/.cache/selfspec."""
    if os.environ.get("SELFSPEC_CACHE"):
        return Path(os.environ["SELFSPEC_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "selfspec"
