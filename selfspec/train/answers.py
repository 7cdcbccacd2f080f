"""``selfspec answer-prompts``: the target's own answers (greedy, or sampled with ``--temperature``) to ShareGPT
first turns or ``make-prompts`` prompts, written as a ShareGPT-format JSON file that ``collect-features --source
FILE`` reads like the original.

Why: a head trained on ChatGPT's answers sees text the target would not write. Its labels are the
target's own argmax, but the context is someone else's, and on the target's own answers (what it
drafts at run time) it agrees less (see docs/TRAINING.md). Teacher-forcing the target's own greedy
text fixes the context: there the label at each position is simply the next token of the text.

Each record keeps its conversation's ShareGPT id, so the stable train / held-out split by id puts it
on the same side as the conversation it answers, and a prompt's ``kind`` (make-prompts) stays beside it.
Sampled answers (EAGLE-3 and HASS train on both) are seeded per prompt by ``--seed`` and the prompt's id, so
a resumed run writes what an uninterrupted one would. The file is a JSON array written record by record
and left open until the run ends; :func:`selfspec.train.sharegpt.iter_records` reads a cut-off file,
so a killed run resumes after the last complete record.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from selfspec.api import SelfSpec
from selfspec.cli_options import add_command, config_from_args
from selfspec.config import DraftConfig, GenerateConfig, ModelConfig, opt
from selfspec.errors import InvalidConfigError
from selfspec.progress import progress
from selfspec.train.sharegpt import ConversationSource, iter_records


@dataclass
class AnswerConfig(ConversationSource):
    """Settings of ``selfspec answer-prompts`` (the first user turn of each conversation is answered)."""

    out: str = opt("runs/own-answers.json", "Output ShareGPT-format JSON file (appended to; rerun to resume).")
    max_conversations: int = opt(0, "Answer at most this many (0: no limit).")
    max_prompt_chars: int = opt(1500, "Longest first turn, in characters (longer ones are cut).")
    max_new_tokens: int = opt(256, "Longest answer, in tokens.")
    temperature: float = opt(0.0, "0: the target's greedy answers; > 0: answers sampled from its distribution at "
                             "this temperature (e.g. 0.7), a seeded generator per prompt.")
    seed: int = opt(0, "Seed of the sampled answers (with the prompt's id: the same file on every run).")
    minutes: float = opt(0.0, "Stop after this many minutes in all (0: no limit); a rerun continues with the minutes left.")
    batch: int = opt(8, "Prompts answered together (continuous batching; each answer equals its batch-1 greedy "
                     "output). A batch's step reads the weights once for all its rows, so it answers many "
                     "prompts in little more than one's time.")


def _write(f: Any, rec: dict[str, Any], first: bool) -> None:
    f.write(("[\n" if first else ",\n") + json.dumps(rec, ensure_ascii=False))
    f.flush()


def prompt_seed(seed: int, cid: str) -> int:
    """The sampling seed of one prompt: fixed by ``seed`` and the prompt's id, not by its place in a run."""
    return int.from_bytes(hashlib.sha256(f"{seed}|{cid}".encode()).digest()[:4], "little")


def answer_prompts(ss: Any, cfg: AnswerConfig) -> dict[str, Any]:
    """Append the target's answers for ``cfg`` to ``cfg.out``; returns a summary."""
    if cfg.temperature < 0:
        raise InvalidConfigError(f"temperature must be >= 0, got {cfg.temperature}")
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = list(iter_records(out)) if out.is_file() else []
    seen = {r["id"] for r in done}
    todo: list[tuple[str, str]] = []  # (conversation id, prompt): read first, so a missing source writes nothing
    for cid, msgs in cfg.conversations(max_turns=2, min_turns=1):  # a prompt alone (make-prompts) is answered too
        if cfg.max_conversations and len(done) + len(todo) >= cfg.max_conversations:
            break
        if cid not in seen:
            todo.append((cid, msgs[0]["content"][: cfg.max_prompt_chars]))
    kinds = {} if cfg.source == "sharegpt" else {str(r.get("id")): r["kind"] for r in iter_records(cfg.source)
                                                 if "kind" in r}
    ledger = out.with_suffix(".progress.json")  # seconds and tokens of earlier runs: the time box is the whole run's
    spent = json.loads(ledger.read_text()) if ledger.is_file() and done else {"seconds": 0.0, "new_tokens": 0}
    tmp = out.with_suffix(".tmp")  # rewrite the complete records (drops a torn last one), then swap in:
    with open(tmp, "w", encoding="utf-8") as f:  # a run killed here loses nothing
        for i, old in enumerate(done):
            _write(f, old, i == 0)
    os.replace(tmp, out)
    t0 = time.perf_counter() - spent["seconds"]
    budget = cfg.minutes * 60 if cfg.minutes > 0 else float("inf")
    tokens = spent["new_tokens"]
    bar = progress(total=len(done) + len(todo), initial=len(done), desc="own answers", unit="prompt")
    with open(out, "a", encoding="utf-8") as f:
        for i in range(0, len(todo), max(1, cfg.batch)):
            if time.perf_counter() - t0 > budget:
                break
            chunk = todo[i : i + max(1, cfg.batch)]
            # selfspec's own engine, lossless: each answer is the target's greedy output, or a sample of its exact
            # distribution (plain decoding, batched; each equals its request alone)
            configs = [GenerateConfig(max_new_tokens=cfg.max_new_tokens, method="plain", temperature=cfg.temperature,
                                      seed=prompt_seed(cfg.seed, cid) if cfg.temperature > 0 else None)
                       for cid, _ in chunk]
            results = ss.generate_batch([[{"role": "user", "content": p}] for _, p in chunk], configs)
            for (cid, prompt), res in zip(chunk, results, strict=True):
                ids = res.token_ids
                row = ids[: next((j for j, t in enumerate(ids) if t in ss.eos_token_ids), len(ids))]
                tokens += len(row)
                rec: dict[str, Any] = {"id": cid, "conversations": [{"from": "human", "value": prompt},
                                                                    {"from": "gpt", "value": ss.tokenizer.decode(row)}]}
                if cid in kinds:
                    rec["kind"] = kinds[cid]
                if cfg.temperature > 0:
                    rec["temperature"] = cfg.temperature
                _write(f, rec, not done)
                done.append(rec)
                bar.update()
            ledger.write_text(json.dumps({"seconds": time.perf_counter() - t0, "new_tokens": tokens}))
        f.write("\n]\n" if done else "[]\n")
    bar.close()
    seconds = time.perf_counter() - t0
    return {"answers": len(done), "new_tokens": tokens, "seconds": round(seconds, 1),
            "tokens_per_second": round(tokens / seconds, 1) if seconds else 0.0, "config": asdict(cfg)}


def add_parser(sub: Any) -> None:
    add_command(sub, "answer-prompts", (ModelConfig, AnswerConfig), cmd_answer_prompts,
                "The target's own answers (greedy or sampled) to ShareGPT or make-prompts prompts (training text).")


def cmd_answer_prompts(args: Any) -> int:
    ss = SelfSpec.load(config_from_args(args, ModelConfig), DraftConfig())  # the default draft: fastest greedy
    report = answer_prompts(ss, config_from_args(args, AnswerConfig))
    print(json.dumps(report, indent=1))
    return 0
