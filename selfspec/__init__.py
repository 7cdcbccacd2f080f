"""selfspec: lossless early-exit self-speculative decoding for Hugging Face decoder-only LLMs."""

from selfspec.api import GenerationResult, SelfSpec, StreamEvent
from selfspec.batch.scheduler import BatchConfig
from selfspec.config import DraftConfig, GenerateConfig, ModelConfig
from selfspec.stats import GenerationStats

__version__ = "0.1.0"
__all__ = [
    "BatchConfig",
    "DraftConfig",
    "GenerateConfig",
    "GenerationResult",
    "GenerationStats",
    "ModelConfig",
    "SelfSpec",
    "StreamEvent",
]
