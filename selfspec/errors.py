"""Errors with messages that name the problem. All derive from SelfSpecError (a ValueError),
so callers (CLI, server) can turn them into clean user-facing messages / 4xx answers."""


class SelfSpecError(ValueError):
    """Base class of every error selfspec raises for bad input."""


class ModelNotFoundError(SelfSpecError):
    """The model path / id / GGUF file does not exist or cannot be loaded."""


class UnsupportedArchitectureError(SelfSpecError):
    """The model's architecture is not one selfspec supports."""


class ExitLayerError(SelfSpecError):
    """The exit layer is outside [1, num_layers]."""


class EmptyPromptError(SelfSpecError):
    """The prompt has no tokens."""


class ContextOverflowError(SelfSpecError):
    """Prompt (plus requested new tokens) does not fit in the model's context."""


class HeadMismatchError(SelfSpecError):
    """A trained exit head does not match the model it is loaded into."""


class InvalidConfigError(SelfSpecError):
    """A generation or draft setting has an invalid value."""


class NoChatTemplateError(InvalidConfigError):
    """Chat messages were sent to a model whose tokenizer has no chat template (a base model)."""


class PipelineError(SelfSpecError):
    """A pipeline stage (selfspec.pipeline) failed or stopped answering; the server answers 503."""
