"""Answer files and run directories: ``answers/<method>.jsonl`` holds one Spec-Bench answer record a line, appended
one durable line at a time and read back whole; a run directory (selfspec.bench.specbench) is read as a whole."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from selfspec.errors import InvalidConfigError


def read_answers(path: Path, repair: bool = False) -> dict[int, dict]:
    """question_id -> answer record. A torn last line (a run killed mid-write) is ignored, and with
    ``repair`` cut from the file; any other bad line is an error naming the line."""
    data = path.read_bytes() if path.exists() else b""
    lines = data.split(b"\n")
    tail = lines.pop()  # the text after the last newline: b"" for a well-formed file
    out: dict[int, dict] = {}
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            out.setdefault(int(rec["question_id"]), rec)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise InvalidConfigError(f"{path}, line {i}: not an answer record ({e})") from e
    if tail.strip():
        try:
            rec = json.loads(tail)
            out.setdefault(int(rec["question_id"]), rec)
            fix = b"\n"  # complete record, only its newline missing
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            fix = None
        if repair:
            with open(path, "r+b") as f:
                if fix is None:
                    f.truncate(len(data) - len(tail))
                else:
                    f.seek(0, 2)
                    f.write(fix)
    return out


class AnswerFile:
    """One method's answers: a JSONL file, appended one durable line per finished question."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def load(self) -> dict[int, dict]:
        return read_answers(self.path, repair=True)

    def append(self, record: dict) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())


@dataclass
class Run:
    """A run directory: manifest.json, answers/<method>.jsonl, divergences.json."""

    path: Path
    manifest: dict[str, Any]
    answers: dict[str, dict[int, dict]]
    divergences: list[dict] = field(default_factory=list)

    def kind(self, method: str) -> str:
        info = self.manifest.get("methods", {}).get(method)
        if info:
            return info["kind"]
        return method if method in ("hf", "plain") or method.startswith("hf-") else "selfspec"


def load_run(path: str | Path) -> Run:
    path = Path(path)
    folder = path / "answers"
    if not folder.is_dir():
        raise InvalidConfigError(f"'{path}' is not a bench run directory (no answers/ folder)")
    manifest = json.loads((path / "manifest.json").read_text()) if (path / "manifest.json").is_file() else {}
    order = list(manifest.get("method_order", []))
    names = order + sorted(p.stem for p in folder.glob("*.jsonl") if p.stem not in order)
    answers = {n: read_answers(folder / f"{n}.jsonl") for n in names if (folder / f"{n}.jsonl").is_file()}
    div = path / "divergences.json"
    divergences = json.loads(div.read_text()) if div.is_file() else []
    return Run(path, manifest, answers, divergences)


def choice(rec: dict) -> dict:
    """An answer record's one choice (Spec-Bench's records hold a list of them)."""
    return rec["choices"][0]
