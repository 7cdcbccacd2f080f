"""``selfspec build-store``: a token store (``selfspec.drafting.store``) from the target's own answers.

    selfspec answer-prompts --model default --minutes 10 --exclude ../shared/specbench/question.jsonl \\
        --out runs/store/answers.json                     # the target's greedy answers to ShareGPT first turns
    selfspec build-store --model default --answers runs/store/answers.json --out runs/store/default.npy
    selfspec generate "Hi" --store runs/store/default.npy

The answers' text (the "gpt" turns) is tokenized again with the model's tokenizer, one document per answer
(docs/ADAPTIVE.md, "A token store").
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from selfspec.cli_options import add_command, config_from_args
from selfspec.config import ModelConfig, opt
from selfspec.drafting.store import TokenStore
from selfspec.errors import InvalidConfigError
from selfspec.models.loading import load_model
from selfspec.train.sharegpt import iter_records


@dataclass
class StoreConfig:
    """Settings of ``selfspec build-store``."""

    answers: str = opt("runs/own-answers.json", "ShareGPT-format JSON file(s) of the target's answers "
                       "(`selfspec answer-prompts`), comma-separated.")
    out: str = opt("runs/store.npy", "Output .npy file (the store's token ids).")
    max_tokens: int = opt(0, "Keep at most this many tokens, the first answers first (0: all).")


def answer_texts(paths: list[str]) -> list[str]:
    """The model turns' text of every record of these ShareGPT-format files, in order."""
    texts = []
    for p in paths:
        if not Path(p).is_file():
            raise InvalidConfigError(f"answers file not found: {p}")
        for rec in iter_records(p):
            texts += [t["value"] for t in rec.get("conversations", []) if t.get("from") == "gpt" and t.get("value")]
    return texts


def build_store(tokenizer: Any, cfg: StoreConfig) -> dict[str, Any]:
    """Write the store of ``cfg.answers`` to ``cfg.out``; returns a summary."""
    texts = answer_texts([p for p in cfg.answers.split(",") if p])
    if not texts:
        raise InvalidConfigError(f"no answers in {cfg.answers}")
    docs, total = [], 0
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if cfg.max_tokens and total + len(ids) > cfg.max_tokens:
            break
        docs.append(ids)
        total += len(ids)
    store = TokenStore.from_documents(docs)
    path = store.save(cfg.out)
    return {"out": str(path), "documents": len(docs), "tokens": len(store), "index_bytes": store.nbytes,
            "config": asdict(cfg)}


def add_parser(sub: Any) -> None:
    add_command(sub, "build-store", (ModelConfig, StoreConfig), cmd_build_store,
                "A token store for lookup drafts from the target's own answers.")


def cmd_build_store(args: Any) -> int:
    _, tokenizer = load_model(config_from_args(args, ModelConfig))
    print(json.dumps(build_store(tokenizer, config_from_args(args, StoreConfig)), indent=1))
    return 0
