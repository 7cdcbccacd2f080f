"""The forward ranges ``selfspec bench-forward`` times (RANGES) and the weights each reads: bytes (for GB/s) and
matrix weights (for GFLOP/s)."""

from __future__ import annotations

import torch

from selfspec.models.split import SplitModel

RANGES = ("full", "greedy", "shallow", "deep", "head")


@torch.inference_mode()
def param_bytes(module: torch.nn.Module) -> int:
    """Bytes of the weights a forward through ``module`` reads: its parameters and, for block-quantized
    modules, their packed codes, scales and offsets (each shared weight once)."""
    seen: set[int] = set()
    total = 0
    for m in module.modules():
        qw = getattr(m, "qweight", None)
        if qw is not None and id(qw) not in seen:
            seen.add(id(qw))
            total += qw.nbytes
    return total + sum(p.numel() * p.element_size() for p in module.parameters())


def _matrix_weights(module: torch.nn.Module) -> int:
    """Weights (elements) of the matrices a forward multiplies with: 2 * n * this = its FLOPs at n rows."""
    total = 0
    for m in module.modules():
        qw = getattr(m, "qweight", None)
        if qw is not None:
            total += qw.shape[0] * qw.shape[1]
        elif isinstance(m, torch.nn.Linear):
            total += m.weight.numel()
    return total


def range_bytes(split: SplitModel, head, exit_layer: int) -> dict[str, int]:
    """Bytes of weights each range reads: its decoder layers, plus the final norm and the whole LM head
    weight for full / deep (tied or not); for the head, its own parameters plus the LM head rows it
    computes (the trimmed vocabulary if any) and, for the 'lm' head, the target's final norm. The head's own
    weights are what it drafts with (``ExitHead.draft_reads``: its packed copies once ``prepare`` built them)."""
    layers = [param_bytes(layer) for layer in split.layers]
    lm = param_bytes(split.lm_head)
    top = param_bytes(split.norm) + lm
    k, L = exit_layer, split.num_layers
    rows = len(head.vocab_ids) or split.vocab_size
    head_bytes = head.draft_reads()[0] + lm * rows // split.vocab_size
    if head.kind == "lm":
        head_bytes += param_bytes(split.norm)
    return {"full": sum(layers) + top, "greedy": sum(layers) + top, "shallow": sum(layers[:k]), "deep": sum(layers[k:L]) + top,
            "head": head_bytes}


def range_weights(split: SplitModel, head, exit_layer: int) -> dict[str, int]:
    """Matrix weights each range multiplies with (for GFLOP/s), counted like ``range_bytes``."""
    layers = [_matrix_weights(layer) for layer in split.layers]
    lm = split.vocab_size * split.hidden_size
    rows = len(head.vocab_ids) or split.vocab_size
    k, L = exit_layer, split.num_layers
    return {"full": sum(layers) + lm, "greedy": sum(layers) + lm, "shallow": sum(layers[:k]), "deep": sum(layers[k:L]) + lm,
            "head": head.draft_reads()[1] + rows * split.hidden_size}
