"""Request and response bodies of the OpenAI-compatible endpoints (pydantic v2).

Requests follow the OpenAI API: fields it has that selfspec cannot honour (``n > 1``, ``logprobs``,
penalties, tools, ...) are refused with a 400 naming the field rather than silently ignored;
unknown fields are ignored. Two vLLM-style extensions (pass them with the openai client's
``extra_body``): ``top_k`` and ``ignore_eos``. Responses are written to parse with the ``openai``
package's own types (``Completion``, ``ChatCompletion``, ``ChatCompletionChunk``, ...).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's own default for /v1/completions
CHAT_DEFAULT_MAX_TOKENS = 512  # OpenAI has no cap for chat; ours is this, or what is left of the context
MAX_STOP = 4  # OpenAI's limit on stop sequences
GREEDY_BELOW = 1e-5  # temperatures this small are greedy (as vLLM); dividing logits by them overflows


def _refuse(name: str, value: Any, allowed: Any) -> Any:
    if value is not None and value != allowed:
        raise ValueError(f"'{name}' = {value!r} is not supported by this server (only {allowed!r})")
    return value


class StreamOptions(BaseModel):
    include_usage: bool = False


class GenerationRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="OpenAI default 1.0; 0 is greedy.")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)  # what torch.Generator.manual_seed takes
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM-style extensions
    top_k: int | None = Field(None, ge=0)
    ignore_eos: bool = False
    method: Literal["selfspec", "plain", "specee-verified", "specee"] | None = Field(
        None, description="selfspec extension: the decoding method ('specee' is LOSSY); None: the server's.")

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences, got {len(v)}")
        return v

    @field_validator("n")
    @classmethod
    def _n(cls, v: int | None) -> int | None:
        return _refuse("n", v, 1)

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, v: float | None, info: Any) -> float | None:
        return _refuse(info.field_name, v, 0.0)

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict | None) -> dict | None:
        return _refuse("logit_bias", v or None, None)

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> str | list[int]:
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError(f"one prompt per request (n=1), got a batch of {len(v)}")
            v = v[0]
        if not v:
            raise ValueError("the prompt is empty")
        return v

    @field_validator("echo")
    @classmethod
    def _echo(cls, v: bool | None) -> bool | None:
        return _refuse("echo", v or None, None)

    @field_validator("logprobs", "suffix")
    @classmethod
    def _none_only(cls, v: Any, info: Any) -> Any:
        return _refuse(info.field_name, v, None)

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v: int | None) -> int | None:
        return _refuse("best_of", v, 1)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_message(self) -> dict[str, str]:
        content = self.content or ""
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: ResponseFormat | None = None

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v: bool | None) -> bool | None:
        return _refuse("logprobs", v or None, None)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v: int | None) -> int | None:
        return _refuse("top_logprobs", v or None, None)

    @field_validator("tools")
    @classmethod
    def _tools(cls, v: list | None) -> list | None:
        return _refuse("tools", v or None, None)

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v: Any) -> Any:
        return _refuse("tool_choice", None if v == "none" else v, None)

    def template_messages(self) -> list[dict[str, str]]:
        return [m.as_template_message() for m in self.messages]


# ---- responses -------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache, not prefilled (selfspec/prefix_cache.py)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: None = None


class CompletionResponse(BaseModel):
    """Also the streamed chunk (OpenAI streams ``text_completion`` objects)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: Literal["stop", "length"]
    logprobs: None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ChatDelta(BaseModel):
    """Only the keys that are set are sent (``{"content": "..."}``, ``{}`` on the last chunk)."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer
    def _drop_none(self) -> dict[str, Any]:
        return {k: v for k, v in (("role", self.role), ("content", self.content)) if v is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "selfspec"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
