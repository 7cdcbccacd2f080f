"""Teacher-forced target features over chat text, stored in shards (``selfspec collect-features``).

One forward of the target over a whole conversation labels every token at once: per token the
target's next-token choice (its argmax, the label greedy acceptance is about), its final-layer
state (what a deep-context head reads for the previous token) and its states after a few shallow
layers (the exit states a head at that layer reads). That is far more labelled tokens per CPU
minute than generating text, and the labels still come from the target itself.

Layout of ``<out>/shard-00000.safetensors`` (T tokens of S conversations):

    ids       # [T] int32     token ids, conversations back to back
    offsets   # [S + 1] int64 conversation boundaries
    label     # [T] int32     the target's argmax after each token
    assistant # [T] bool      token belongs to an assistant turn
    final     # [T, hidden] float16  last layer's output (before the final norm)
    h<k>      # [T, hidden] float16  state after layers [0, k), for each stored k

``<out>/progress.json`` counts the conversations done, so a killed run resumes where it stopped.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from selfspec.cli_options import add_command, config_from_args
from selfspec.config import ModelConfig, int_set, opt
from selfspec.errors import InvalidConfigError
from selfspec.progress import progress
from selfspec.train.cli import load_target
from selfspec.train.sharegpt import ConversationSource


@dataclass
class FeatureConfig(ConversationSource):
    """Settings of ``selfspec collect-features``."""

    out: str = opt("runs/features/train", "Output directory of the feature shards.")
    layers: str = opt("1,2,4", "Exit layers whose states are stored (comma-separated; 0 is the embedding).")
    max_tokens: int = opt(512, "Longest conversation prefix, in tokens.")
    max_turns: int = opt(4, "Most chat turns per conversation.")
    max_conversations: int = opt(0, "Stop after this many conversations (0: no limit).")
    minutes: float = opt(0.0, "Stop after this many minutes in all (0: no limit); a rerun continues with the minutes left.")
    shard_tokens: int = opt(50_000, "Tokens per shard file.")


def parse_layers(text: str, num_layers: int) -> list[int]:
    layers = int_set(text, "layers")
    bad = [k for k in layers if not 0 <= k < num_layers]
    if bad:
        raise InvalidConfigError(f"exit layers {bad} out of range: this model has layers 0..{num_layers - 1}")
    return layers


def encode_conversation(tokenizer: Any, messages: list[dict[str, str]], max_tokens: int) -> tuple[list[int], list[bool]]:
    """Chat-template token ids of ``messages`` (cut at ``max_tokens``) and which belong to assistant turns."""
    ids: list[int] = []
    mask: list[bool] = []
    for i, m in enumerate(messages):
        full = tokenizer.apply_chat_template(messages[: i + 1], tokenize=True, return_dict=False)
        full = list(full["input_ids"] if isinstance(full, dict) else full)
        if full[: len(ids)] != ids:  # template not prefix-stable: label the rest by the last role
            full = ids + full[len(ids):]
        mask += [m["role"] == "assistant"] * (len(full) - len(ids))
        ids = full
        if len(ids) >= max_tokens:
            break
    return ids[:max_tokens], mask[:max_tokens]


@torch.inference_mode()
def conversation_features(split: Any, ids: list[int], layers: list[int]) -> dict[str, torch.Tensor]:
    """One teacher-forced forward: the stored states and the target's argmax per token."""
    t = torch.tensor([ids], device=split.device)
    pos = torch.arange(len(ids), device=split.device)[None]
    cache = split.new_cache(len(ids))
    h = split.embed(t)
    out: dict[str, torch.Tensor] = {}
    done = 0
    for k in [*layers, split.num_layers]:
        h = split.run_layers(h, done, k, pos, cache)
        done = k
        out["final" if k == split.num_layers else f"h{k}"] = h[0].to(torch.float16)
    labels = [split.logits(h[:, i : i + 128]).argmax(-1)[0] for i in range(0, len(ids), 128)]
    out["label"] = torch.cat(labels).to(torch.int32)
    return out


def _write_shard(path: Path, parts: list[dict[str, torch.Tensor]], extra: dict[str, torch.Tensor]) -> None:
    lengths = [len(p["label"]) for p in parts]
    tensors = {k: torch.cat([p[k] for p in parts]).contiguous() for k in parts[0]}
    tensors["offsets"] = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    tensors.update(extra)
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)


def collect_features(split: Any, tokenizer: Any, cfg: FeatureConfig) -> dict[str, Any]:
    """Write feature shards for ``cfg``; resumes from ``progress.json``. Returns the progress record."""
    layers = parse_layers(cfg.layers, split.num_layers)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    prog_path = out / "progress.json"
    prog: dict[str, Any] = json.loads(prog_path.read_text()) if prog_path.is_file() else {
        "conversations": 0, "tokens": 0, "shards": 0, "seconds": 0.0, "config": asdict(cfg)}
    if any(prog["config"].get(k, 0) != getattr(cfg, k) for k in ("layers", "max_tokens", "skip")):
        raise InvalidConfigError(f"{out} holds features of other settings ({prog['config']}); use another --out")
    convs = cfg.conversations(cfg.max_turns)
    for _ in range(prog["conversations"]):  # resume: skip what earlier runs stored (after cfg.skip)
        next(convs, None)
    # the time box is the whole collection's: a resumed run has what earlier runs spent (up to their last shard) left
    t0, budget = time.perf_counter(), cfg.minutes * 60 - prog["seconds"] if cfg.minutes > 0 else float("inf")
    parts: list[dict[str, torch.Tensor]] = []
    pending_convs = 0
    bar = progress(total=cfg.max_conversations or None, initial=prog["conversations"], desc="target features", unit="conv")

    def flush() -> None:
        nonlocal parts, pending_convs
        if parts:
            _write_shard(out / f"shard-{prog['shards']:05d}.safetensors", parts, {})
            prog["shards"] += 1
            prog["conversations"] += pending_convs
            prog["tokens"] += sum(len(p["label"]) for p in parts)
            prog["seconds"] = prog["seconds"] + time.perf_counter() - last[0]  # unrounded: the time box reads it
            last[0] = time.perf_counter()
            prog_path.write_text(json.dumps(prog, indent=1))
        parts, pending_convs = [], 0

    last = [t0]
    for _cid, msgs in convs:
        if cfg.max_conversations and prog["conversations"] + pending_convs >= cfg.max_conversations:
            break
        if time.perf_counter() - t0 > budget:
            break
        ids, mask = encode_conversation(tokenizer, msgs, cfg.max_tokens)
        pending_convs += 1
        bar.update()
        if len(ids) < 8 or not any(mask):
            continue
        feats = conversation_features(split, ids, layers)
        feats["ids"] = torch.tensor(ids, dtype=torch.int32)
        feats["assistant"] = torch.tensor(mask, dtype=torch.bool)
        parts.append(feats)
        if sum(len(p["label"]) for p in parts) >= cfg.shard_tokens:
            flush()
    flush()
    bar.close()
    return prog


@dataclass
class FeatureSet:
    """All shards of a feature directory, concatenated (``# [T, ...]`` tensors, ``offsets # [S + 1]``)."""

    tensors: dict[str, torch.Tensor]
    offsets: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return len(self.tensors["label"])

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def sequence(self, i: int) -> dict[str, torch.Tensor]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return {k: v[a:b] for k, v in self.tensors.items()}


def load_features(path: str | Path, keys: list[str] | None = None, max_tokens: int = 0) -> FeatureSet:
    """Shards of ``path`` (only ``keys`` of the state tensors, when given), up to ``max_tokens`` tokens.
    ``path`` may name several directories, comma-separated: their union, in that order."""
    dirs = [d.strip() for d in str(path).split(",") if d.strip()]
    shards = []
    for d in dirs:
        found = sorted(Path(d).glob("shard-*.safetensors"))
        if not found:
            raise InvalidConfigError(f"no feature shards in '{d}' (run `selfspec collect-features` first)")
        shards += found
    cols: dict[str, list[torch.Tensor]] = {}
    offsets, base = [torch.zeros(1, dtype=torch.int64)], 0
    for s in shards:
        data = load_file(str(s))
        for k, v in data.items():
            if k != "offsets" and (keys is None or k in keys or k in ("ids", "label", "assistant")):
                cols.setdefault(k, []).append(v)
        offsets.append(data["offsets"][1:] + base)
        base += int(data["offsets"][-1])
        if max_tokens and base >= max_tokens:
            break
    return FeatureSet({k: torch.cat(v) for k, v in cols.items()}, torch.cat(offsets))


def load_exit_features(path: str | Path, exit_layer: int, split: Any, max_tokens: int = 0,
                       extra: list[str] | None = None) -> FeatureSet:
    """``load_features`` for a head at ``exit_layer``: its exit states and the final states (and the ``extra``
    state keys). Exit layer 0 reads the token embeddings, which no shard needs to store: they are looked up from
    the stored ids (float16, as stored states are)."""
    key = f"h{exit_layer}"
    fs = load_features(path, [key, "final", *(extra or [])], max_tokens)
    if key not in fs.tensors and exit_layer == 0:
        ids = fs.tensors["ids"].long()
        with torch.no_grad():
            parts = [split.embed(ids[None, i : i + 4096].to(split.device))[0].to("cpu", torch.float16)
                     for i in range(0, len(ids), 4096)]
        fs.tensors[key] = torch.cat(parts)
    return fs


def add_parser(sub: Any) -> None:
    add_command(sub, "collect-features", (ModelConfig, FeatureConfig), cmd_collect_features,
                "Teacher-force the target over chat text and store features for head training.")


def cmd_collect_features(args: Any) -> int:
    ss = load_target(args)
    prog = collect_features(ss.split, ss.tokenizer, config_from_args(args, FeatureConfig))
    print(json.dumps(prog, indent=1))
    return 0
