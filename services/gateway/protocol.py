"""Request bodies the gateway accepts, as pydantic models (they also make FastAPI's /openapi.json).

Field names and ranges are the OpenAI API's (plus vLLM/SGLang extensions such as top_k, min_p,
ignore_eos, chat_template_kwargs); the native `/generate` body is SGLang's. Unknown fields are
ignored, so newer clients keep working; known fields out of range fail validation (-> 400).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_N = 128
MAX_TOP_LOGPROBS = 20


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


def _check_stop(value: str | list[str] | None) -> str | list[str] | None:
    stops = [value] if isinstance(value, str) else (value or [])
    if any(stop == "" for stop in stops):
        raise ValueError("stop strings must be non-empty")
    return value


def _check_top_k(value: int | None) -> int | None:
    if value is not None and value < -1:
        raise ValueError(f"top_k must be -1 or 0 (off) or >= 1, got {value}")
    return value


class StreamOptions(_Body):
    include_usage: bool = False


class ContentPart(_Body):
    """One part of a message's content; only text parts are supported."""

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """One chat message. Extra fields (name, tool_calls, tool_call_id, reasoning_content) are kept
    and passed to the chat template, as transformers passes whole message dicts."""

    model_config = ConfigDict(extra="allow")

    role: str = Field(min_length=1)
    content: str | list[ContentPart] | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, value: str | list[ContentPart] | None) -> str | list[ContentPart] | None:
        if isinstance(value, list):
            for part in value:
                if part.type != "text" or part.text is None:
                    raise ValueError(f"content parts of type {part.type!r} are not supported (text only)")
        return value

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template sees it: content parts joined into one string."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "\n".join(part.text or "" for part in self.content)
        elif self.content is None:
            message["content"] = ""
        return message


class _OpenAISampling(_Body):
    """Sampling and streaming fields shared by chat and text completions."""

    model: str
    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_non_empty(cls, value: str | list[str] | None) -> str | list[str] | None:
        return _check_stop(value)

    @field_validator("top_k")
    @classmethod
    def _top_k_range(cls, value: int | None) -> int | None:
        return _check_top_k(value)

    @model_validator(mode="after")
    def _no_penalties(self) -> _OpenAISampling:
        # Silently ignoring a penalty would return text the client did not ask for.
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0:
                raise ValueError(f"{name} is not supported by pdserve workers (only 0)")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatCompletionRequest(_OpenAISampling):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_OpenAISampling):
    """POST /v1/completions. `prompt` is a string, a list of strings, token ids or lists of ids."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported")
        if isinstance(self.prompt, list) and len(self.prompt) == 0:
            raise ValueError("prompt must not be empty")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens


class NativeSamplingParams(_Body):
    """`sampling_params` of the native /generate body (SGLang's names)."""

    temperature: float | None = Field(None, ge=0)
    max_new_tokens: int | None = Field(None, ge=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=1)  # SGLang takes n here; one sample per prompt is supported

    @field_validator("stop")
    @classmethod
    def _stop_non_empty(cls, value: str | list[str] | None) -> str | list[str] | None:
        return _check_stop(value)

    @field_validator("top_k")
    @classmethod
    def _top_k_range(cls, value: int | None) -> int | None:
        return _check_top_k(value)

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class NativeGenerateRequest(_Body):
    """POST /generate: `text` (a string or a batch) or `input_ids` (ids or a batch of ids)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: NativeSamplingParams = Field(default_factory=NativeSamplingParams)
    stream: bool = False
    rid: str | None = None
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    model: str | None = None

    @model_validator(mode="after")
    def _one_prompt_kind(self) -> NativeGenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text or input_ids")
        return self
