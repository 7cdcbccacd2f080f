"""Self-distillation data: text the target generates itself from seed prompts, stored on disk.

The file is JSONL, one sequence a line: ``{"prompt_ids": [...], "output_ids": [...]}`` (token ids,
so training needs no re-tokenization). Generation appends line by line and flushes, so an
interrupted run resumes where it stopped. Seed prompts come from the project's default set
(selfspec.train.prompts), a JSONL file ({"prompt": ...} or {"messages": [...]} or {"text": ...}
per line), a text file (one prompt per line) or a `datasets` dataset (``hf:NAME[:SPLIT[:COLUMN]]``).
Never train on the Spec-Bench questions: benchmarks would then measure memorization.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from selfspec.errors import InvalidConfigError, ModelNotFoundError
from selfspec.progress import progress
from selfspec.train.prompts import default_prompts


def load_seed_prompts(source: str | None, n: int, seed: int = 0) -> list[Any]:
    """Seed prompts (str or chat message lists) from ``source`` (None: the default set)."""
    if source in (None, "", "default"):
        return default_prompts(n, seed)
    if source.startswith("hf:"):
        import datasets

        name, split, column = (source[3:].split(":") + ["train", "text"])[:3]
        ds = datasets.load_dataset(name, split=split)
        return [str(r[column]) for r in ds.select(range(min(n, len(ds))))]
    path = Path(source)
    if not path.is_file():
        raise ModelNotFoundError(f"seed prompt file '{source}' does not exist")
    if path.suffix != ".jsonl":
        return [line.strip() for line in path.read_text().splitlines() if line.strip()][:n]
    out: list[Any] = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            out.append(rec["messages"] if "messages" in rec else rec.get("prompt", rec.get("text")))
        except (json.JSONDecodeError, AttributeError) as e:
            raise InvalidConfigError(f"{source} line {i}: not a JSON object ({e})") from e
        if out[-1] is None:
            raise InvalidConfigError(f"{source} line {i}: needs a 'prompt', 'messages' or 'text' field")
    return out[:n]


def read_sequences(path: str | Path) -> list[dict[str, list[int]]]:
    """The stored sequences; a torn last line (killed writer) is dropped."""
    path = Path(path)
    if not path.is_file():
        return []
    seqs = []
    for line in path.read_text().splitlines():
        try:
            seqs.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return seqs


def generate_data(
    ss: Any,
    prompts: list[Any],
    out: str | Path,
    max_new_tokens: int = 160,
    batch_size: int = 16,
    chat: bool = True,
) -> list[dict[str, list[int]]]:
    """Greedy continuations of ``prompts`` by the target (transformers' batched generate, left
    padded), appended to ``out``; prompts already there are skipped (resume)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = read_sequences(out)
    with open(out, "w") as f:  # rewrite the intact prefix (drops a torn last line)
        f.writelines(json.dumps(s) + "\n" for s in done)
    todo = prompts[len(done) :]
    encoded = [ss.encode([{"role": "user", "content": p}] if chat and isinstance(p, str) else p) for p in todo]
    pad = ss.tokenizer.pad_token_id if ss.tokenizer.pad_token_id is not None else ss.eos_token_ids[0]
    eos = set(ss.eos_token_ids)
    bar = progress(total=len(prompts), initial=len(done), desc="self-distillation data", unit="prompt")
    with open(out, "a") as f, torch.inference_mode():
        for b in range(0, len(encoded), batch_size):
            batch = encoded[b : b + batch_size]
            width = max(len(x) for x in batch)
            ids = torch.tensor([[pad] * (width - len(x)) + x for x in batch])
            mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in batch])
            gen = ss.model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                                    pad_token_id=pad, top_k=None, top_p=None, temperature=None)
            for x, row in zip(batch, gen[:, width:].tolist()):
                cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
                rec = {"prompt_ids": x, "output_ids": row[:cut]}
                done.append(rec)
                f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())
            bar.update(len(batch))
    bar.close()
    return done
