"""Model configs as selfspec reads them from its caches.

Every architecture's own config class in transformers imports transformers' activations, which pull in its
kernel hub and torch._dynamo: +89 MB resident before a weight is read. A load from selfspec's packed cache reads
the saved config.json as transformers' base config class instead (every attribute the file has, nothing imported
beyond it); what needs the architecture's class (transformers' model modules) converts it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plain_config(path: Path) -> Any:
    """The config saved at ``path`` (a config.json) as transformers' base config class, whose import stays clear of
    the model code (every architecture's own config class imports transformers' activations, which pull in
    torch._dynamo: +89 MB). Its attributes are the file's; ``transformers_config`` gives the architecture's class."""
    from transformers import PretrainedConfig

    return PretrainedConfig.from_json_file(str(path))


def transformers_config(config: Any) -> Any:
    """``config`` as its architecture's own config class (a ``plain_config`` converted; others as they are)."""
    from transformers import PretrainedConfig

    if type(config) is not PretrainedConfig:
        return config
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    fields = {**config.to_dict(), "model_type": config.model_type}  # to_dict writes the base class's empty one
    return CONFIG_MAPPING[config.model_type].from_dict(fields)
