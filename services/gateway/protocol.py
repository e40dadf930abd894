"""Request bodies the gateway accepts, as pydantic models (they also make FastAPI's /openapi.json).

Field names and ranges are the OpenAI API's (plus vLLM/SGLang extensions such as top_k, min_p,
ignore_eos, chat_template_kwargs); the native `/generate` body is SGLang's. Unknown fields are
ignored, so newer clients keep working; known fields out of range fail validation (-> 400).

Every bound a field has here is one the server enforces, and the OpenAPI document shows it: numbers
stay inside the range of the protobuf field they end up in (protos/v1/common.proto SamplingParams),
strings must be valid Unicode (a lone UTF-16 surrogate cannot be encoded into a protobuf string or
an HTTP body), and the models are strict (JSON `true` is not the number 1, "5" is not 5). Bounds
that depend on the served model (vocabulary, context length, model name) and the fan-out limit
are checked by the handlers and written into the document by openapi.py.

A body's `sampling(...)` is its one conversion into what the workers get: the proto
SamplingParams of one generation, built straight from the parsed fields (`SamplingFields.to_proto`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from pdserve.sampling_params import MAX_PENALTY, MAX_TOP_LOGPROBS
from protos.v1 import common_pb2
from services.gateway.constraints import NativeConstraints, OpenAIConstraints
from services.gateway.fields import (
    AS_INT,
    FLOAT32_MAX,
    FLOAT32_TINY,
    MAX_N,
    IdsPrompt,
    JsonObject,
    MaxTokens,
    NonEmptyText,
    Prompt,
    Seed,
    StopList,
    StopTokenIds,
    Text,
    TextPrompt,
    TopK,
    check_json_unicode,
)
from services.gateway.tool_choice import TOOL_CHOICE_NEEDS_TOOLS, Tool, ToolChoice


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class ImageURL(_Body):
    """An image_url part's target: a `data:` URL, or an http(s) URL on an allowed domain
    (--allowed-media-domains; services.gateway.images)."""

    url: NonEmptyText
    detail: str | None = None


class TextPart(_Body):
    """A text part of a message's content."""

    type: Literal["text"]
    text: Text


class ImagePart(_Body):
    """An image part of a message's content (a vision-language model's)."""

    type: Literal["image_url"]
    image_url: ImageURL


# One part of a message's content, told apart by `type`: the OpenAPI schema says which fields each
# type needs (a part whose fields do not fit its type is invalid in the schema too, not only here).
ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(BaseModel):
    """One chat message. Extra fields (name, tool_calls, tool_call_id, reasoning_content) are kept
    and passed to the chat template, as transformers passes whole message dicts."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    role: NonEmptyText
    content: Text | list[ContentPart] | None = None

    @model_validator(mode="after")
    def _extras_are_unicode(self) -> ChatMessage:
        check_json_unicode(self.__pydantic_extra__ or {})
        return self

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template sees it: text parts joined into one string, or, when
        it has images, the parts as a list of {"type": "text", "text"} and {"type": "image"} (as
        transformers' processors pass them; the image data travels separately)."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list) and any(isinstance(part, ImagePart) for part in self.content):
            message["content"] = [{"type": "image"} if isinstance(part, ImagePart)
                                  else {"type": "text", "text": part.text} for part in self.content]
        elif isinstance(self.content, list):
            message["content"] = "\n".join(part.text for part in self.content if isinstance(part, TextPart))
        elif self.content is None:
            message["content"] = ""
        return message


class SamplingFields(_Body):
    """The sampling fields every body shares (OpenAI's and SGLang's names agree on these), and the
    one conversion of a body's sampling into the SamplingParams of Worker.Generate.

    A body lists this class first among its bases and declares the fields it puts before these in
    a base listed after it: pydantic orders fields from the base-most class of the MRO on, so each
    body keeps its own field order (the order of its OpenAPI properties and of its errors)."""

    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: TopK | None = None
    min_p: float | None = Field(default=None, ge=0, le=1)
    seed: Seed | None = None
    stop: NonEmptyText | StopList | None = None
    stop_token_ids: StopTokenIds | None = None
    ignore_eos: bool = False
    presence_penalty: float = Field(default=0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float = Field(default=0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def to_proto(self, *, temperature: float | None, max_new_tokens: int | None, logprobs: bool,
                 top_logprobs: int, choice: int = 0) -> common_pb2.SamplingParams:
        """Choice `choice` of the body's generations as the proto carries it. A field not given
        stays unset, so the worker's default applies (temperature 1.0, top_p 1.0, max_new_tokens
        128), as the proto's `optional` fields intend."""
        params = common_pb2.SamplingParams(
            top_k=max(self.top_k or 0, 0), min_p=self.min_p or 0.0, stop=self.stop_list(),
            stop_token_ids=list(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
            logprobs=logprobs or top_logprobs > 0, top_logprobs=top_logprobs,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty)
        if temperature is not None:
            params.temperature = temperature
        if self.top_p is not None:
            # the proto field is float32: a top_p below its smallest positive value would arrive as
            # 0 (refused by the worker); keeping only the most likely token is what it asks for
            params.top_p = max(self.top_p, FLOAT32_TINY)
        if self.seed is not None:
            # n choices with one seed would be n identical samples; seed + i keeps them reproducible
            # and distinct (greedy choices are identical regardless)
            params.seed = self.seed if choice == 0 else _wrap_int64(self.seed + choice)
        if max_new_tokens is not None:
            params.max_new_tokens = max_new_tokens
        return params


def _wrap_int64(value: int) -> int:
    """`value` wrapped into the proto's int64 range (a seed near 2**63 - 1 plus a choice index)."""
    return (value + 2**63) % 2**64 - 2**63


class _OpenAIHead(_Body):
    """The OpenAI bodies' fields that come before the shared sampling ones (see SamplingFields)."""

    model: Text
    n: Annotated[int, Field(ge=1, le=MAX_N), AS_INT] = 1
    max_tokens: MaxTokens | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)


class _OpenAISampling(SamplingFields, OpenAIConstraints, _OpenAIHead):
    """Sampling and streaming fields shared by chat and text completions."""

    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_OpenAISampling):
    """POST /v1/chat/completions."""

    model_config = ConfigDict(json_schema_extra=TOOL_CHOICE_NEEDS_TOOLS)

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS, description=(
        "alternatives per token; they are returned when `logprobs` is true (without it this is "
        "ignored)")), AS_INT] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: JsonObject | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def top_logprobs_wanted(self) -> int:
        # OpenAI returns alternatives only with logprobs on; top_logprobs alone asks for nothing.
        return (self.top_logprobs or 0) if self.logprobs else 0

    def sampling(self, choice: int) -> common_pb2.SamplingParams:
        return self.fill(self.to_proto(temperature=self.temperature, max_new_tokens=self.max_new_tokens,
                                       logprobs=self.logprobs, top_logprobs=self.top_logprobs_wanted,
                                       choice=choice))


class CompletionRequest(_OpenAISampling):
    """POST /v1/completions. `prompt` is a string, a list of strings, token ids or lists of ids."""

    prompt: Prompt
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS), AS_INT] | None = None
    echo: bool = Field(default=False, json_schema_extra={"enum": [False]})
    suffix: Text | None = Field(default=None, json_schema_extra={"maxLength": 0})
    best_of: Annotated[int, Field(ge=1, le=MAX_N, description=(
        "samples generated per prompt; the `n` with the highest mean token logprob are returned (a "
        "value below `n` counts as `n`)")), AS_INT] | None = None

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo is not supported")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported")
        return value

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def candidates(self) -> int:
        """Generations per prompt: best_of when it asks for more than n."""
        return max(self.n, self.best_of or 0)

    def sampling(self, candidate: int) -> common_pb2.SamplingParams:
        """Candidate `candidate` of each prompt; best_of ranks candidates by their logprobs."""
        return self.fill(self.to_proto(temperature=self.temperature, max_new_tokens=self.max_new_tokens,
                                       logprobs=self.logprobs is not None or self.candidates > self.n,
                                       top_logprobs=self.logprobs or 0, choice=candidate))

    def prompt_count(self) -> int:
        """How many prompts the body holds (a flat id list or a string is one)."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return 1
        return len(self.prompt)


class _NativeHead(_Body):
    """The native sampling_params' fields that come before the shared ones (see SamplingFields)."""

    temperature: float | None = Field(default=None, ge=0, le=FLOAT32_MAX)
    max_new_tokens: MaxTokens | None = None


class NativeSamplingParams(SamplingFields, NativeConstraints, _NativeHead):
    """`sampling_params` of the native /generate body (SGLang's names)."""

    # SGLang takes n here; one sample per prompt is supported
    n: Annotated[int, Field(ge=1, le=1), AS_INT] = 1


# A client's own request id: shown back in meta_info.id and in logs, so keep it printable.
RequestId = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:@-]+$")]


class NativeGenerateRequest(_Body):
    """POST /generate: `text` (a string or a batch) or `input_ids` (ids or a batch of ids)."""

    text: TextPrompt | None = None
    input_ids: IdsPrompt | None = None
    sampling_params: NativeSamplingParams = Field(default_factory=NativeSamplingParams)
    stream: bool = False
    rid: RequestId | None = None
    return_logprob: bool = False
    top_logprobs_num: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS), AS_INT] = 0
    model: Text | None = None
    lora_path: Text | None = None  # SGLang's: the LoRA adapter to run under, by its name
    # SGLang's: one prompt's image (a string) or images (a list); for a batch, a list with one
    # entry per prompt (null, a string or a list). Each: a data: URL, base64, or an allowed http(s) URL.
    image_data: NonEmptyText | list[NonEmptyText | list[NonEmptyText] | None] | None = None

    @model_validator(mode="after")
    def _one_prompt_kind(self) -> NativeGenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text or input_ids")
        return self

    def images_per_prompt(self) -> list[list[str]]:
        """image_data as one list of images per prompt; ValueError when a batch's list does not
        have one entry per prompt, or a single prompt's list nests lists."""
        data = self.image_data
        if data is None:
            return [[] for _ in range(self.prompt_count())]
        if isinstance(data, str):
            data = [data]
        if not self.batched:
            images = [item for item in data if isinstance(item, str)]
            if len(images) != len(data):
                raise ValueError("image_data for one prompt is a string or a list of strings")
            return [images]
        if len(data) != self.prompt_count():
            raise ValueError(f"image_data for a batch has one entry per prompt: {len(data)} entries for "
                             f"{self.prompt_count()} prompts")
        return [[] if item is None else [item] if isinstance(item, str) else list(item) for item in data]

    def sampling(self) -> common_pb2.SamplingParams:
        """Every prompt's sampling (one sample per prompt: no per-choice seeds)."""
        params = self.sampling_params
        return params.fill(params.to_proto(temperature=params.temperature,
                                           max_new_tokens=params.max_new_tokens,
                                           logprobs=self.return_logprob, top_logprobs=self.top_logprobs_num))

    @property
    def batched(self) -> bool:
        ids = self.input_ids
        return isinstance(self.text, list) or (ids is not None and len(ids) > 0 and isinstance(ids[0], list))

    def prompt(self) -> str | list[str] | list[int] | list[list[int]]:
        """`text` or `input_ids`, whichever the body gives."""
        prompt = self.text if self.text is not None else self.input_ids
        if prompt is None:  # _one_prompt_kind refused such a body
            raise ValueError("give exactly one of text or input_ids")
        return prompt

    def prompt_count(self) -> int:
        return len(self.prompt()) if self.batched else 1
