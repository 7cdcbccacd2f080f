"""Spec-Bench's questions: the question file, its reporting groups, the questions a run chooses, and the prompt of
a question's turn."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from selfspec.errors import InvalidConfigError

if TYPE_CHECKING:
    from selfspec.api import SelfSpec

DEFAULT_QUESTIONS = "../shared/specbench/question.jsonl"
GROUPS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


def group_of(question_id: int, category: str) -> str:
    """Spec-Bench's reporting group: MT-bench (ids 81-160, eight categories) or the category itself."""
    if category in MT_BENCH_CATEGORIES or 81 <= question_id <= 160:
        return "mt_bench"
    return category


@dataclass
class Question:
    question_id: int
    category: str
    turns: list[str]

    @property
    def group(self) -> str:
        return group_of(self.question_id, self.category)


def load_questions(path: str | Path) -> list[Question]:
    """Read a Spec-Bench question file; a bad line is an error naming the file and line number."""
    path = Path(path)
    if not path.is_file():
        raise InvalidConfigError(f"question file '{path}' does not exist")
    out: list[Question] = []
    seen: set[int] = set()
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise InvalidConfigError(f"{path}, line {i}: not valid JSON ({e.msg})") from e
        qid, cat, turns = (d.get(k) if isinstance(d, dict) else None for k in ("question_id", "category", "turns"))
        if not isinstance(qid, int) or isinstance(qid, bool):
            raise InvalidConfigError(f"{path}, line {i}: 'question_id' must be an integer, got {qid!r}")
        if not isinstance(cat, str) or not cat:
            raise InvalidConfigError(f"{path}, line {i}: 'category' must be a non-empty string, got {cat!r}")
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
            raise InvalidConfigError(f"{path}, line {i}: 'turns' must be a non-empty list of non-empty strings")
        if qid in seen:
            raise InvalidConfigError(f"{path}, line {i}: question_id {qid} appears twice")
        seen.add(qid)
        out.append(Question(qid, cat, turns))
    if not out:
        raise InvalidConfigError(f"question file '{path}' has no questions")
    return out


def select_questions(questions: list[Question], categories: list[str], limit: int | None) -> list[Question]:
    """Filter by group / category names, then keep ``limit`` evenly spaced questions per group."""
    wanted = {c.strip() for v in categories for c in v.split(",") if c.strip()}
    known = {q.group for q in questions} | {q.category for q in questions}
    unknown = sorted(wanted - known)
    if unknown:
        raise InvalidConfigError(f"unknown categories {unknown} (known: {', '.join(sorted(known))})")
    chosen = [q for q in questions if not wanted or q.group in wanted or q.category in wanted]
    if limit is None:
        return chosen
    if limit < 1:
        raise InvalidConfigError(f"limit must be >= 1, got {limit}")
    by_group: dict[str, list[Question]] = {}
    for q in chosen:
        by_group.setdefault(q.group, []).append(q)
    keep: set[int] = set()  # question ids
    for qs in by_group.values():
        n = min(limit, len(qs))
        keep.update(qs[i * len(qs) // n].question_id for i in range(n))
    return [q for q in chosen if q.question_id in keep]


def turn_prompt(ss: SelfSpec, q: Question, answers: list[str], turn: int) -> list[int]:
    """Prompt ids of turn ``turn``: the earlier user turns and the given earlier answers, chat template."""
    messages: list[dict[str, str]] = []
    for t in range(turn):
        messages += [{"role": "user", "content": q.turns[t]}, {"role": "assistant", "content": answers[t]}]
    return ss.encode(messages + [{"role": "user", "content": q.turns[turn]}])
