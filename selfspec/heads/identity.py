"""What a trained head is, and what it fits: the model fingerprint a head must agree with to be loaded
(``model_fingerprint``, ``check_fingerprint``), and what tells one head from another in the calibration and cost
caches (``head_identity``)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from selfspec.errors import HeadMismatchError
from selfspec.heads.base import CONFIG_NAME, WEIGHTS_NAME
from selfspec.models.split import SplitModel


def model_fingerprint(split: SplitModel) -> dict[str, Any]:
    """What a trained head must agree with to be loaded into a model."""
    c = split.config
    return {
        "model_type": c.model_type,
        "num_layers": split.num_layers,
        "hidden_size": split.hidden_size,
        "vocab_size": split.vocab_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": split.num_kv_heads,
        "head_dim": split.head_dim,
    }


def head_identity(head: Any) -> str:
    """What tells one trained head from another in the calibration caches: its directory (resolved: a relative and an
    absolute path to one head are one head), the weights' size and a digest of its ``head_config.json`` (which
    records its exit layer, draft vocabulary and training), so a head retrained or replaced in the same directory (a
    new bundled head) is calibrated again. Without a directory: kind and exit layer."""
    if not head.source:
        return f"{head.kind}@{head.exit_layer}"
    where = Path(head.source).resolve()
    out = str(where)
    if (where / WEIGHTS_NAME).is_file():
        out += f"#{(where / WEIGHTS_NAME).stat().st_size}"
    if (where / CONFIG_NAME).is_file():
        out += "#" + hashlib.sha256((where / CONFIG_NAME).read_bytes()).hexdigest()[:12]
    return out


def check_fingerprint(saved: dict[str, Any], split: SplitModel, where: str) -> None:
    want = model_fingerprint(split)
    diff = {k: (saved.get(k), v) for k, v in want.items() if saved.get(k) != v}
    if diff:
        details = ", ".join(f"{k}: head has {a}, model has {b}" for k, (a, b) in diff.items())
        raise HeadMismatchError(f"exit head {where} does not match this model ({details})")
