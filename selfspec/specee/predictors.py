"""SpecEE's per-layer predictors: at layer i, a small MLP over the candidate features (candidates.py)
says whether the full model's token already equals this layer's best candidate.

    features [3c] -> standardize -> Linear(3c, hidden) -> ReLU -> Linear(hidden, 1) -> sigmoid

One MLP per kept layer (the offline level of the two-level schedule: layers where exits happen).
Saved beside the exit head that supplies the candidates: ``predictors.json`` (layers, candidates,
exit distribution, held-out report, the head it was trained with) + ``predictors.safetensors``.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from selfspec.errors import HeadMismatchError, ModelNotFoundError
from selfspec.specee.candidates import num_features

CONFIG_NAME, WEIGHTS_NAME = "predictors.json", "predictors.safetensors"


class ExitPredictor(nn.Module):
    mean: torch.Tensor  # [features] buffers (register_buffer)
    std: torch.Tensor

    def __init__(self, features: int, hidden: int = 512) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(features))
        self.register_buffer("std", torch.ones(features))
        self.mlp = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, feats: torch.Tensor) -> torch.Tensor:  # [n, features] -> [n] logit of "exit now"
        return self.mlp((feats - self.mean) / self.std).squeeze(-1)

    def fold(self) -> None:
        """Fold the standardization into the first layer (decoding: three small ops per check)."""
        first, last = cast(nn.Linear, self.mlp[0]), cast(nn.Linear, self.mlp[2])  # built as Linears (__init__)
        w1, b1 = first.weight.detach().float(), first.bias.detach().float()
        w1 = w1 / self.std.float()
        self._folded = (b1 - w1 @ self.mean.float(), w1.contiguous(), last.weight.detach().float()[0],
                        float(last.bias))

    def prob_of(self, feats: list[float]) -> float:
        """sigmoid(MLP(feats)) for one token's features (after ``fold``)."""
        b1, w1, w2, b2 = self._folded
        hidden = torch.addmv(b1, w1, torch.tensor(feats)).relu_()
        return 1.0 / (1.0 + math.exp(-(float(w2.dot(hidden)) + b2)))


class ExitPredictors(nn.Module):
    """The predictors of one (model, head): ``self[layer]`` for every kept layer."""

    def __init__(self, layers: list[int], candidates: int = 4, hidden: int = 512,
                 meta: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.layers = sorted(layers)
        self.candidates, self.hidden = candidates, hidden
        self.nets = nn.ModuleDict({str(i): ExitPredictor(num_features(candidates), hidden) for i in self.layers})
        self.meta: dict[str, Any] = dict(meta or {})

    def __getitem__(self, layer: int) -> ExitPredictor:
        return cast(ExitPredictor, self.nets[str(layer)])  # built as ExitPredictors (ModuleDict is not generic)

    def prob(self, layer: int, feats: torch.Tensor) -> torch.Tensor:  # [n, 3c] -> [n]
        return torch.sigmoid(self[layer](feats))

    def keep_layers(self, layers: list[int]) -> None:
        """Drop the predictors of every layer not in ``layers`` (the offline schedule)."""
        self.layers = sorted(i for i in self.layers if i in layers)
        self.nets = nn.ModuleDict({str(i): self.nets[str(i)] for i in self.layers})

    def save(self, path: str | Path, extra: dict[str, Any] | None = None) -> Path:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        cfg = {"layers": self.layers, "candidates": self.candidates, "hidden": self.hidden, **self.meta, **(extra or {})}
        state = {k: v.detach().float().contiguous().cpu() for k, v in self.state_dict().items()}
        tmp = path / (WEIGHTS_NAME + ".tmp")
        save_file(state, str(tmp))
        os.replace(tmp, path / WEIGHTS_NAME)
        (path / (CONFIG_NAME + ".tmp")).write_text(json.dumps(cfg, indent=2))
        os.replace(path / (CONFIG_NAME + ".tmp"), path / CONFIG_NAME)
        self.meta = {k: v for k, v in cfg.items() if k not in ("layers", "candidates", "hidden")}
        return path


def has_predictors(path: str | Path) -> bool:
    return (Path(path) / CONFIG_NAME).is_file()


def load_predictors(path: str | Path, exit_layer: int | None = None, num_layers: int | None = None) -> ExitPredictors:
    """Predictors saved in ``path`` (a head directory). ``exit_layer``: the head's, which they must match."""
    path = Path(path)
    if not has_predictors(path):
        raise ModelNotFoundError(f"no SpecEE predictors in '{path}' (expected {CONFIG_NAME}; train them with "
                                 "`selfspec train-predictors`)")
    cfg = json.loads((path / CONFIG_NAME).read_text())
    if exit_layer is not None and cfg.get("exit_layer", exit_layer) != exit_layer:
        raise HeadMismatchError(f"predictors in '{path}' were trained with candidates from exit layer "
                                f"{cfg['exit_layer']}, not {exit_layer}")
    if num_layers is not None and cfg.get("num_layers", num_layers) != num_layers:
        raise HeadMismatchError(f"predictors in '{path}' are for a {cfg['num_layers']}-layer model, not {num_layers}")
    meta = {k: v for k, v in cfg.items() if k not in ("layers", "candidates", "hidden")}
    preds = ExitPredictors(cfg["layers"], cfg["candidates"], cfg["hidden"], meta)
    preds.load_state_dict(load_file(str(path / WEIGHTS_NAME)))
    preds.eval().requires_grad_(False)
    for i in preds.layers:
        preds[i].fold()
    return preds
