"""Where selfspec keeps what it builds and measures: one small module every other one may import."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def cache_root() -> Path:
    """selfspec's cache directory: $SELFSPEC_CACHE, else $XDG_CACHE_HOME/selfspec or ~/.cache/selfspec."""
    if os.environ.get("SELFSPEC_CACHE"):
        return Path(os.environ["SELFSPEC_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "selfspec"


@contextmanager
def atomic_dir(target: Path) -> Iterator[Path]:
    """A temporary directory beside ``target`` to write into; on success it replaces ``target`` in one
    rename, on an error it is removed: readers never see a half-written directory."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    try:
        yield tmp
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``path`` through a temporary file beside it and one rename: readers, and other processes writing
    the same entry, never see a half-written file (the file gets the usual permissions, as ``write_text``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
