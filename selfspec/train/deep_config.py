"""The settings of ``selfspec train-deep``: one dataclass, read by the training loop and the command."""

from __future__ import annotations

from dataclasses import dataclass

from selfspec.config import opt
from selfspec.errors import InvalidConfigError

PRECISIONS = ("auto", "float32", "bfloat16")  # DeepTrainConfig.precision


@dataclass
class DeepTrainConfig:
    """Settings of ``selfspec train-deep``."""

    features: str = opt("runs/features/train", "Training feature shards (selfspec collect-features); several "
                        "directories, comma-separated, are used together.")
    heldout_features: str = opt("runs/features/heldout", "Held-out feature shards (other conversations), for "
                                "evaluation; several directories, comma-separated, are each evaluated.")
    exit_layer: int = opt(2, "Exit layer k: the head reads h_k (one of the stored layers; 0, the token embeddings, is looked up "
                          "from the stored ids).")
    out: str = opt("runs/deep-head", "Output directory of the trained head.")
    epochs: float = opt(2.0, "Passes over the training tokens (fractions allowed).")
    batch_tokens: int = opt(4096, "Tokens per optimizer step (whole conversations, padded).")
    lr: float = opt(2e-3, "Peak learning rate (AdamW, warm-up then cosine decay).")
    warmup: int = opt(30, "Warm-up steps.")
    weight_decay: float = opt(0.0, "AdamW weight decay.")
    unroll_weight: float = opt(0.5, "Weight of each unrolled pass's CE (passes 2 .. rollout: the head reading its own "
                               "predicted features).")
    rollout: int = opt(2, "Passes of the training-time test (EAGLE-3's): pass 1 reads the true previous final states, "
                       "pass j the head's own features of pass j - 1, as the j-th draft position does (1: no unrolled "
                       "pass; SpecForge trains with 7).")
    reg_weight: float = opt(1.0, "Weight of the feature regression MSE(rms(f^), rms(f)).")
    soft_weight: float = opt(0.0, "Weight of the soft labels in the classification loss: cross-entropy against the target's own "
                             "distribution over the draft vocabulary (from the stored final states, EAGLE's p), the hard "
                             "label's (the target's argmax) getting 1 - this.")
    soft_top_k: int = opt(0, "With --soft-weight: the soft labels keep only the target's K most probable draft tokens, "
                          "renormalized (HASS's top-K distillation); 0: its whole distribution over the draft vocabulary.")
    vocab_trim: int = opt(8192, "Draft vocabulary: the N most frequent target labels in the training data (0: all).")
    assistant_only: bool = opt(False, "Train only on positions inside assistant turns.")
    max_tokens: int = opt(0, "Use at most this many training tokens (0: all stored).")
    minutes: float = opt(0.0, "Stop training after this many minutes in all (0: no limit; a resumed run has the minutes left); "
                      "the head is saved either way.")
    seed: int = opt(0, "Seed of the batch order and the head's initialization.")
    init: str = opt("", "Start from this trained deep head's weights (fine-tuning) instead of the target's layer k; "
                    "it may come from another exit layer (the weights fit; its input changes).")
    head_layers: int = opt(1, "Decoder layers in the head (more than 1: the extra ones start as the identity, so "
                           "--init from a one-layer head starts where it was).")
    context_layers: str = opt("", "Target layers whose states of the previous token the head reads besides the final one "
                              "(EAGLE-3's fused features; comma-separated, each stored in the features; '': none).")
    precision: str = opt("auto", "Matmul precision of training: 'float32'; 'bfloat16' (autocast: the head's matmuls in "
                         "bf16, its weights, optimizer, losses and held-out evaluation in float32); 'auto': bfloat16 where "
                         "this CPU multiplies bf16 natively (AVX-512 BF16, AMX), float32 elsewhere.",
                         choices=list(PRECISIONS))
    fit_schedule: bool = opt(True, "With --minutes: the cosine learning-rate schedule ends when the time box does (its "
                             "length in steps refitted every step from the pace so far) instead of being cut off partway through --epochs.")
    device: str = opt("cpu", "Where the head trains: 'cpu', or 'cuda' (an accelerator: the head, its LM rows and each "
                      "batch there, bfloat16 autocast under precision 'auto'; the target and its features stay on the "
                      "CPU, and the saved head is the same either way).")
    checkpoint_every: int = opt(100, "Write a checkpoint every this many steps.")
    resume: bool = opt(True, "Continue from <out>.checkpoint.pt when it exists.")

    def __post_init__(self) -> None:
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise InvalidConfigError(f"device must be 'cpu' or 'cuda' (or 'cuda:N'), got '{self.device}'")
        if self.rollout < 1:
            raise InvalidConfigError(f"rollout must be >= 1 (pass 1 is the first draft position), got {self.rollout}")
        if not 0.0 <= self.soft_weight <= 1.0:
            raise InvalidConfigError(f"soft_weight must be in [0, 1] (the soft labels' share of the loss), got {self.soft_weight}")
        if self.soft_top_k < 0:
            raise InvalidConfigError(f"soft_top_k must be >= 0 (0: every draft token), got {self.soft_top_k}")
