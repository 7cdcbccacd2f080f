"""Build, save and load exit heads (``head_config.json`` + ``head.safetensors``)."""

from __future__ import annotations

import json
import os
import tempfile
from importlib.resources import files
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from selfspec.errors import ExitLayerError, HeadMismatchError, InvalidConfigError, ModelNotFoundError
from selfspec.heads.base import CONFIG_NAME, WEIGHTS_NAME, ExitHead, LMExitHead
from selfspec.heads.deep import DeepContextHead
from selfspec.heads.identity import check_fingerprint, model_fingerprint
from selfspec.heads.kangaroo import KangarooAdapter
from selfspec.heads.layer import DecoderLayerHead
from selfspec.heads.linear import LinearHead
from selfspec.heads.nested import NestedDeepHead
from selfspec.heads.weights import weights_follow
from selfspec.models.split import SplitModel

HEAD_KINDS: dict[str, type[ExitHead]] = {
    "kangaroo": KangarooAdapter, "linear": LinearHead, "layer": DecoderLayerHead, "deep": DeepContextHead,
    "nested": NestedDeepHead,
}


# Heads that may draft from exit layer 0 (the token embeddings, no target layer at all): those that read the
# deep context f(p - 1), where what the head knows comes from (EAGLE's input: embedding + feature).
FROM_EMBEDDINGS = ("deep",)


def check_exit_layer(exit_layer: int, split: SplitModel, kind: str | None = None) -> None:
    lowest = 0 if kind in FROM_EMBEDDINGS else 1
    if not isinstance(exit_layer, int) or not lowest <= exit_layer <= split.num_layers:
        raise ExitLayerError(
            f"exit layer {exit_layer} is out of range: this model has {split.num_layers} layers, "
            f"so the exit layer must be in {lowest}..{split.num_layers}"
            + (" (0, the embeddings, only for a 'deep' head)" if exit_layer == 0 else "")
        )


def new_head(kind: str, split: SplitModel, exit_layer: int, **args: Any) -> ExitHead:
    """A fresh head of ``kind`` ('lm' or one of HEAD_KINDS); ``args`` are the kind's own settings."""
    check_exit_layer(exit_layer, split, kind)
    if kind == "lm":
        return LMExitHead(split, exit_layer)
    if kind not in HEAD_KINDS:
        raise HeadMismatchError(f"unknown head kind '{kind}' (known: lm, {', '.join(HEAD_KINDS)})")
    return HEAD_KINDS[kind](split, exit_layer, **args)


def read_head_config(path: str | Path) -> dict[str, Any]:
    cfg_path = Path(path) / CONFIG_NAME
    if not cfg_path.is_file():
        raise ModelNotFoundError(f"no exit head at '{path}' (expected {CONFIG_NAME} and {WEIGHTS_NAME})")
    return json.loads(cfg_path.read_text())


def save_head(head: ExitHead, path: str | Path, extra: dict[str, Any] | None = None,
              weights_dtype: torch.dtype | None = None) -> Path:
    """Write the head atomically (a temp dir renamed into place), with what it was trained for.
    ``weights_dtype`` (e.g. bfloat16) stores the floating-point weights smaller; loading casts them back
    to the target's dtype (a draft's rounding never changes the output, only its acceptance)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    cfg = {
        "kind": head.kind, "exit_layer": head.exit_layer, "args": head.args(),
        "vocab_size_drafted": len(head.vocab_ids) or head.split.vocab_size,
        "model": model_fingerprint(head.split), **(extra or {}),
    }
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    state = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    if weights_dtype is not None:
        state = {k: v.to(weights_dtype) if v.is_floating_point() else v for k, v in state.items()}
    save_file(state, str(tmp / WEIGHTS_NAME))
    (tmp / CONFIG_NAME).write_text(json.dumps(cfg, indent=2))
    if path.exists():
        for f in path.iterdir():
            f.unlink()
        path.rmdir()
    os.replace(tmp, path)
    return path


def load_head(path: str | Path, split: SplitModel, exit_layer: int | None = None) -> ExitHead:
    cfg = read_head_config(path)
    check_fingerprint(cfg.get("model", {}), split, f"'{path}'")
    depths = cfg.get("args", {}).get("depths", [cfg["exit_layer"]])
    if exit_layer is not None and exit_layer in depths:  # a nested head drafts from any of its depths
        cfg = {**cfg, "exit_layer": exit_layer}
    if exit_layer is not None and exit_layer != cfg["exit_layer"]:
        raise HeadMismatchError(
            f"exit head '{path}' was trained for exit layer {cfg['exit_layer']}, not {exit_layer}"
            + (f" (its depths: {depths})" if len(depths) > 1 else "")
        )
    with weights_follow():  # every weight comes from the file (checked below): none computed first
        head = new_head(cfg["kind"], split, cfg["exit_layer"], **cfg.get("args", {}))
    state = load_file(str(Path(path) / WEIGHTS_NAME), device=str(split.device))
    head.trim_vocab(state.pop("vocab_ids", None))  # its length varies with the trim
    own = {n: t for n, t in head.state_dict().items() if n != "vocab_ids"}
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    wrong = [n for n in own if n in state and state[n].shape != own[n].shape]
    if missing or unexpected or wrong:
        raise HeadMismatchError(
            f"exit head '{path}' weights do not fit a '{cfg['kind']}' head for this model: "
            f"missing {missing}, unexpected {unexpected}, other shapes {wrong}"
        )
    head.load_state_dict(state, strict=False)
    head.to(dtype=split.dtype)
    head.recommended_draft = dict(cfg.get("draft", {}))
    head.source = str(path)
    return head.eval().requires_grad_(False)


def bundled_head_dir(model_id: str) -> Any:
    """The trained head shipped with selfspec for a model, if any (see docs/TRAINING.md)."""
    path = files("selfspec") / "assets" / "heads" / model_id
    return path if path.joinpath(CONFIG_NAME).is_file() else None


def resolve_head(spec: str, split: SplitModel, model_id: str, exit_layer: int | None) -> ExitHead:
    """The exit head a ``DraftConfig.head`` names: 'auto' (the bundled trained head for ``model_id`` when its
    layer fits ``exit_layer``, else 'lm'), 'nested' (the bundled nested head), 'lm', or a head directory."""
    if spec == "auto":
        bundled = bundled_head_dir(model_id)
        fits = bundled is not None and exit_layer in (None, int(read_head_config(bundled)["exit_layer"]))
        spec = str(bundled) if fits else "lm"
    if spec == "nested":
        bundled = bundled_head_dir(model_id + "-nested")
        if bundled is None:
            raise InvalidConfigError(f"no bundled nested head for '{model_id}': train one with "
                                     "`selfspec train-nested` and pass its directory as the head")
        spec = str(bundled)
    if spec == "lm":
        return new_head("lm", split, exit_layer if exit_layer is not None else max(1, split.num_layers // 4))
    return load_head(spec, split, exit_layer)
