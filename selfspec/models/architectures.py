"""The architectures the layer-split forward supports: the Llama-style layout (model.embed_tokens, model.layers,
model.norm, model.rotary_emb, lm_head) under their transformers model_type."""

from __future__ import annotations

from selfspec.errors import UnsupportedArchitectureError

# model_type -> human name
SUPPORTED_ARCHITECTURES = {
    "llama": "Llama",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "gemma3_text": "Gemma 3 (text)",
    "phi3": "Phi-3",
}


def check_supported(model_type: str) -> None:
    if model_type not in SUPPORTED_ARCHITECTURES:
        names = ", ".join(f"{v} ({k})" for k, v in SUPPORTED_ARCHITECTURES.items())
        raise UnsupportedArchitectureError(
            f"unsupported architecture '{model_type}': selfspec supports {names}"
        )
