"""Where selfspec keeps what it builds and measures: one small module every other one may import."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from selfspec.errors import InvalidConfigError


def cache_root() -> Path:
    """selfspec's cache directory: $SELFSPEC_CACHE, else $XDG_CACHE_HOME/selfspec or ~/.cache/selfspec."""
    if os.environ.get("SELFSPEC_CACHE"):
        return Path(os.environ["SELFSPEC_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "selfspec"


def check_cache_writable(root: Path | None = None) -> Path:
    """The cache directory, created if needed; a clear error (naming it and ``SELFSPEC_CACHE``) when it cannot be
    written, before any work whose result would have nowhere to go."""
    root = root or cache_root()
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, prefix=".write-check."):
            pass
    except OSError as e:
        raise InvalidConfigError(f"selfspec's cache directory '{root}' cannot be written ({e.strerror or e}): set "
                                 "SELFSPEC_CACHE to a writable directory") from e
    return root


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_dead_writers(target: Path) -> None:
    """Remove ``atomic_dir``'s temporary directories for ``target`` whose writing process no longer runs (it was
    killed mid-write: what it left is never read, only its disk space is lost)."""
    for tmp in target.parent.glob(f".{target.name}.*.*"):
        pid = tmp.name[len(target.name) + 2:].split(".", 1)[0]
        if tmp.is_dir() and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def atomic_dir(target: Path) -> Iterator[Path]:
    """A temporary directory beside ``target`` to write into; on success it replaces ``target`` in one
    rename, on an error it is removed: readers never see a half-written directory. The temporary name carries
    the writer's pid, so the leftovers of a writer that was killed are removed by the next one."""
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_writers(target)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.{os.getpid()}."))
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
