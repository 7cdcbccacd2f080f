"""``selfspec make-prompts``: prompts of the kinds Spec-Bench measures, built from offline text, for the target to
answer (``selfspec answer-prompts --source PROMPTS``) so that a head trains on the target's own answers to the work
users give it.

A head trained on chat alone accepts less on translation, summarization, question answering, retrieval-augmented
answers and word problems (docs/TRAINING.md), so the set mixes six kinds, each made from ShareGPT's conversations
(never from Spec-Bench):

- ``chat``: a conversation's first user turn, as asked;
- ``translation``: one to three sentences of an answer: ``Translate German to English: ...`` for the German, French
  and Spanish answers ShareGPT holds, ``Translate English to <language>: ...`` for English ones;
- ``summarization``: ``Summarize: <document>``, the document a long answer or a pasted article (prose only);
- ``qa``: a short one-line question, as asked;
- ``rag``: passages (the answer to a short question among two others, shuffled), then the question;
- ``math``: a word problem from templates with random names and numbers (ShareGPT has few).

Decontamination: with ``--exclude question.jsonl`` a prompt sharing any 13-word sequence with a Spec-Bench turn is
dropped (GPT-3's contamination check), besides the conversations whose first turn is a Spec-Bench question.

The output is a ShareGPT-format JSON array (one human turn a record, its ``kind`` beside it) and ``<out>.mix.json``
records the mix asked for, the counts made and the settings. The prompts are made from one side of the stable
train / held-out split (``--split``), and each record's id falls on that side too (``is_heldout``), so prompts made
from held-out conversations stay held out through ``answer-prompts`` and ``collect-features``.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from selfspec.cli_options import add_command, config_from_args
from selfspec.config import opt
from selfspec.errors import InvalidConfigError
from selfspec.paths import atomic_write_text
from selfspec.progress import announce
from selfspec.train.sharegpt import KINDS, ConversationSource, is_heldout

NGRAM = 13  # words of a sequence shared with a Spec-Bench turn that make a prompt contaminated

_STOPWORDS = {
    "English": {"the", "and", "is", "of", "to", "in", "that", "it", "for", "with", "you", "are", "this"},
    "German": {"und", "der", "die", "das", "ist", "nicht", "ich", "sie", "mit", "für", "auf", "ein", "eine", "zu"},
    "French": {"le", "la", "les", "et", "est", "une", "des", "pour", "dans", "que", "qui", "pas", "sur", "vous"},
    "Spanish": {"el", "los", "las", "y", "es", "una", "para", "por", "con", "del", "como", "pero", "más", "que"},
}


@dataclass
class MakePromptsConfig(ConversationSource):
    """Settings of ``selfspec make-prompts`` (the conversations of ``split`` are the raw text)."""

    out: str = opt("runs/prompts.json", "Output ShareGPT-format JSON file of prompts (one human turn each).")
    count: int = opt(3000, "Prompts in all, shared out by --mix.")
    mix: str = opt("chat:3,translation:2,summarization:2,qa:2,rag:2,math:2",
                   "Kinds and their weights, kind:weight comma-separated (kinds: " + ", ".join(KINDS) + ").")
    max_document_chars: int = opt(3000, "Longest document to summarize and longest passage set, in characters.")
    seed: int = opt(0, "Seed of the choices (which texts, names, numbers, languages, passage order).")

    def weights(self) -> dict[str, float]:
        """The mix as {kind: share}, shares summing to 1; an unknown kind or a bad weight is an error."""
        out: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in self.mix.split(","))):
            kind, _, w = part.partition(":")
            if kind not in KINDS:
                raise InvalidConfigError(f"mix: unknown kind '{kind}' (known: {', '.join(KINDS)})")
            try:
                out[kind] = float(w or 1)
            except ValueError:
                raise InvalidConfigError(f"mix: weight of '{kind}' must be a number, got '{w}'") from None
            if out[kind] < 0:
                raise InvalidConfigError(f"mix: weight of '{kind}' must be >= 0, got {out[kind]}")
        total = sum(out.values())
        if total <= 0:
            raise InvalidConfigError(f"mix: no kind has a positive weight ('{self.mix}')")
        return {k: w / total for k, w in out.items()}


# ---- text pieces --------------------------------------------------------------------------------------------------

def language_of(text: str) -> str | None:
    """'English', 'German', 'French' or 'Spanish' by the share of each one's commonest words; None: unclear."""
    words = re.findall(r"[^\W\d_]+", text.lower())
    if len(words) < 8:
        return None
    share = {lang: sum(w in sw for w in words) / len(words) for lang, sw in _STOPWORDS.items()}
    best = max(share, key=lambda lang: share[lang])
    others = max(v for lang, v in share.items() if lang != best)
    return best if share[best] >= 0.1 and share[best] > 2 * others else None


def is_prose(text: str) -> bool:
    """Running text: no code fences or tables, few list or heading lines, mostly letters."""
    if "```" in text or "\t" in text or text.count("|") >= 4:  # code, or a table
        return False
    lines = [ln for ln in text.splitlines() if ln.strip()]
    marked = sum(bool(re.match(r"\s*([-*#>]|\d+[.)])", ln)) for ln in lines)
    letters = sum(c.isalpha() or c.isspace() for c in text)
    return bool(lines) and marked <= len(lines) // 3 and letters >= 0.85 * len(text)


_CHATTY = re.compile(r"^(sure|of course|certainly|i'm sorry|i am sorry|i apologize|as an ai|yes|no problem|here is|"
                     r"here are|here's|thank you)\b", re.IGNORECASE)


def is_document(text: str) -> bool:
    """Prose that reads as a document (to summarize, or a passage), not a chat reply's opening."""
    return is_prose(text) and not _CHATTY.match(text.strip()) and language_of(text) == "English"


def sentences(text: str) -> list[str]:
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+", " ".join(text.split())) if s.strip()]


def cut(text: str, limit: int) -> str:
    """``text`` up to ``limit`` characters, ended at the last sentence end before the limit when there is one."""
    if len(text) <= limit:
        return text
    head = text[:limit]
    end = max(head.rfind(". "), head.rfind("! "), head.rfind("? "))
    return head[: end + 1] if end > limit // 2 else head


def ngrams(text: str, n: int = NGRAM) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def specbench_ngrams(path: str | Path | None) -> set[tuple[str, ...]]:
    """Every NGRAM-word sequence of every Spec-Bench turn (empty when no file is given)."""
    if not path:
        return set()
    grams: set[tuple[str, ...]] = set()
    for line in Path(path).read_text().splitlines():
        if line.strip():
            for turn in json.loads(line).get("turns", []):
                grams |= ngrams(turn)
    return grams


# ---- the kinds ----------------------------------------------------------------------------------------------------

@dataclass
class Texts:
    """The raw text of the conversations, by use."""

    first_turns: list[tuple[str, str]]  # (conversation id, first user turn)
    answers: list[tuple[str, str]]  # (conversation id, an assistant turn)
    questions: list[tuple[str, str, str]]  # (conversation id, a short question, its answer)


def gather(cfg: MakePromptsConfig) -> Texts:
    t = Texts([], [], [])
    for cid, msgs in cfg.conversations(max_turns=4):
        first = msgs[0]["content"]
        t.first_turns.append((cid, first))
        t.answers.extend((cid, m["content"]) for m in msgs if m["role"] == "assistant")
        if len(first) <= 150 and "\n" not in first and first.endswith("?") and len(msgs) > 1:
            t.questions.append((cid, first, msgs[1]["content"]))
    return t


def _chat(t: Texts, rng: random.Random, cfg: MakePromptsConfig) -> Iterator[tuple[str, str]]:
    for cid, first in rng.sample(t.first_turns, len(t.first_turns)):
        if len(first) <= 2000:
            yield cid, first


def _translation(t: Texts, rng: random.Random, cfg: MakePromptsConfig) -> Iterator[tuple[str, str]]:
    foreign, english = [], []
    for cid, text in t.answers:
        lang = language_of(text)
        if lang and lang != "English":
            foreign.append((cid, text, lang))
        elif lang == "English" and is_prose(text):
            english.append((cid, text))
    rng.shuffle(foreign)
    rng.shuffle(english)

    def from_foreign() -> Iterator[tuple[str, str]]:
        for cid, text, lang in foreign:
            for s in sentences(text):  # each sentence of the few foreign answers: a prompt
                if 30 <= len(s) <= 400 and language_of(s) == lang and is_prose(s):
                    yield cid, f"Translate {lang} to English: {s}"

    def from_english() -> Iterator[tuple[str, str]]:
        for cid, text in english:
            ss = sentences(text)
            if not ss:
                continue
            i = rng.randrange(len(ss))
            piece = " ".join(ss[i : i + rng.randint(1, 3)])
            if 30 <= len(piece) <= 500 and is_prose(piece):
                yield cid, f"Translate English to {rng.choice(['German', 'French', 'Spanish'])}: {piece}"

    pools: list[Iterator[tuple[str, str]]] = [from_foreign(), from_english()]
    while pools:  # alternate, so that into-English prompts (Spec-Bench's direction) make half while they last
        for p in list(pools):
            item = next(p, None)
            if item is None:
                pools.remove(p)
            else:
                yield item


def _summarization(t: Texts, rng: random.Random, cfg: MakePromptsConfig) -> Iterator[tuple[str, str]]:
    docs = [(cid, x) for cid, x in t.answers + t.first_turns if len(x) >= 1200 and is_document(x)]
    for cid, doc in rng.sample(docs, len(docs)):
        yield cid, "Summarize: " + cut(" ".join(doc.split()), cfg.max_document_chars)


def _qa(t: Texts, rng: random.Random, cfg: MakePromptsConfig) -> Iterator[tuple[str, str]]:
    for cid, q, _ in rng.sample(t.questions, len(t.questions)):
        yield cid, q


def _rag(t: Texts, rng: random.Random, cfg: MakePromptsConfig) -> Iterator[tuple[str, str]]:
    prose = [x for _, x in t.answers if len(x) >= 300 and is_document(x)]
    if len(prose) < 2:
        return
    per = cfg.max_document_chars // 3
    for cid, q, answer in rng.sample(t.questions, len(t.questions)):
        if not is_document(answer):
            continue
        passages = [cut(" ".join(answer.split()), per)] + [cut(" ".join(x.split()), per) for x in rng.sample(prose, 2)]
        rng.shuffle(passages)
        yield cid, " ".join(passages) + "\n" + q


NAMES = ["Maria", "Tom", "Aisha", "Kenji", "Lena", "Omar", "Priya", "Lucas", "Sofia", "Daniel", "Mei", "Jamal"]
ITEMS = [("apples", 1, 4), ("notebooks", 2, 6), ("tickets", 8, 40), ("cupcakes", 2, 5), ("plants", 5, 20),
         ("books", 6, 25), ("T-shirts", 9, 30), ("boxes of pencils", 2, 8)]
MATH = [
    "{a} buys {n} {item} at ${p} each and pays with a ${bill} bill. How much change does {a} get?",
    "{a} has {n} {item}. {b} has {k} times as many. How many {item} do they have together?",
    "A shop sells {item} for ${p} each. On Saturday it sold {n} and on Sunday {m} more than on Saturday. How much "
    "money did it make over the weekend?",
    "{a} saves ${p} every week. How many weeks does it take to save ${total}?",
    "{a} read {n} pages on Monday, twice as many on Tuesday and {m} fewer than Tuesday on Wednesday. How many pages "
    "did {a} read in all?",
    "A recipe needs {k} eggs for {n} {item}. How many eggs are needed for {big} {item}?",
    "{a} ran {n} km on each of {k} days and {m} km on the last day. What was the average distance per day?",
    "The price of {item} went up by {pct}% from ${p}. {a} buys {n} at the new price. How much does {a} pay?",
    "{a} and {b} share {total} {item} in the ratio {k}:{m}. How many does {b} get?",
    "A train leaves at {h}:00 and travels {n} km at {v} km per hour. At what time does it arrive?",
]


def _math(t: Texts, rng: random.Random, cfg: MakePromptsConfig) -> Iterator[tuple[str, str]]:
    i = 0
    while True:
        tpl = rng.choice(MATH)
        a, b = rng.sample(NAMES, 2)
        item, lo, hi = rng.choice(ITEMS)
        p, n, m, k = rng.randint(lo, hi), rng.randint(3, 24), rng.randint(2, 12), rng.randint(2, 5)
        v = rng.choice([40, 60, 80, 90, 120])
        if "{v}" in tpl:  # a distance the speed divides
            n = v * rng.randint(1, 5)
        yield f"math-{i}", tpl.format(a=a, b=b, item=item, p=p, n=n, m=m, k=k, v=v, big=n * rng.randint(2, 4),
                                      pct=rng.choice([10, 20, 25, 50]), bill=p * n + rng.choice([5, 10, 20, 50]),
                                      total=p * rng.randint(6, 30), h=rng.randint(6, 18))
        i += 1


MAKERS = {"chat": _chat, "translation": _translation, "summarization": _summarization, "qa": _qa, "rag": _rag,
          "math": _math}


def side_id(cid: str, kind: str, share: float, heldout: bool) -> str:
    """An id for a prompt made from conversation ``cid`` that falls on the held-out side of the split (``heldout``)
    or the training side, as the conversations it was made from do."""
    j = 0
    while is_heldout(f"{cid}/{kind}{j}", share) != heldout:
        j += 1
    return f"{cid}/{kind}{j}"


def make_prompts(cfg: MakePromptsConfig) -> dict[str, Any]:
    """Write ``cfg.out`` and ``<out>.mix.json`` (see the module docstring); returns the mix record."""
    if cfg.count < 1:
        raise InvalidConfigError(f"count must be >= 1, got {cfg.count}")
    weights = cfg.weights()
    texts = gather(cfg)
    banned = specbench_ngrams(cfg.exclude or None)
    wanted = {k: round(w * cfg.count) for k, w in weights.items()}
    records: list[dict[str, Any]] = []
    made: dict[str, int] = {}
    dropped: dict[str, int] = {}
    for kind in KINDS:
        if not wanted.get(kind):
            continue
        rng = random.Random(f"{cfg.seed}-{kind}")
        seen: set[str] = set()
        made[kind] = dropped[kind] = 0
        for cid, prompt in MAKERS[kind](texts, rng, cfg):
            if made[kind] >= wanted[kind]:
                break
            if prompt in seen:
                continue
            seen.add(prompt)
            if banned and not banned.isdisjoint(ngrams(prompt)):
                dropped[kind] += 1
                continue
            records.append({"id": side_id(cid, kind, cfg.heldout, cfg.split == "heldout"), "kind": kind,
                            "conversations": [{"from": "human", "value": prompt}]})
            made[kind] += 1
    random.Random(cfg.seed).shuffle(records)
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, "[\n" + ",\n".join(json.dumps(r, ensure_ascii=False) for r in records) + "\n]\n")
    mix = {"asked": wanted, "made": made, "dropped_as_specbench": dropped, "prompts": len(records),
           "conversations": len(texts.first_turns), "config": asdict(cfg)}
    atomic_write_text(out.with_suffix(".mix.json"), json.dumps(mix, indent=1) + "\n")
    short = {k: f"{made[k]}/{wanted[k]}" for k in made if made[k] < wanted[k]}
    if short:
        announce(f"make-prompts: fewer prompts than asked for {short} (the source has no more of that kind)")
    return mix


def add_parser(sub: Any) -> None:
    add_command(sub, "make-prompts", (MakePromptsConfig,), cmd_make_prompts,
                "Prompts of Spec-Bench's kinds made from ShareGPT's text, for answer-prompts.")


def cmd_make_prompts(args: Any) -> int:
    mix = make_prompts(config_from_args(args, MakePromptsConfig))
    print(json.dumps({k: mix[k] for k in ("asked", "made", "dropped_as_specbench", "prompts")}, indent=1))
    return 0
