"""The request fields that constrain tokens beyond plain sampling, and their one conversion into the
proto SamplingParams (`fill`): penalties' extensions, logit_bias, min_tokens and structured outputs.

Names are each API's own: OpenAI's `logit_bias` (string token ids, values -100..100) and
`response_format` (json_object, json_schema strict or not), vLLM's `repetition_penalty`,
`min_tokens` and `structured_outputs` {json, regex, choice, grammar}, and SGLang's /generate
sampling params `repetition_penalty`, `min_new_tokens`, `logit_bias`, `json_schema`, `regex`,
`ebnf`. Everything that needs the model (a logit_bias id against the vocabulary, a schema or
grammar that must compile against the tokenizer) is checked by the worker, whose refusal is the
client's 400.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pdserve.sampling_params import MAX_LOGIT_BIAS
from protos.v1 import common_pb2
from services.gateway.fields import (
    AS_INT,
    FLOAT32_TINY,
    INT32_MAX,
    JsonObject,
    NonEmptyText,
    Text,
)

MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_CHOICES = 256

RepetitionPenalty = Annotated[float, Field(gt=0, le=1e4)]  # the worker's bound (pdserve.sampling_params)
MinTokens = Annotated[int, Field(ge=0, le=INT32_MAX), AS_INT]


class _Part(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class JsonSchemaFormat(_Part):
    """response_format.json_schema: `schema` is the JSON Schema the output must follow."""

    name: Text | None = None
    description: Text | None = None
    schema_: JsonObject = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Part):
    # the document says what _schema_given checks
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False, json_schema_extra={
        "if": {"properties": {"type": {"const": "json_schema"}}},
        "then": {"required": ["json_schema"], "properties": {"json_schema": {"not": {"type": "null"}}}}})

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema")
        return self


_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar")


def _exactly_one_kind(schema: dict) -> None:
    """The OpenAPI document says what the validator checks: one kind given (not null), the others
    absent or null."""
    given, absent = {"not": {"type": "null"}}, {"type": "null"}
    kinds = _STRUCTURED_KINDS
    schema["anyOf"] = [{"required": [kind], "properties": {
        other: given if other == kind else absent for other in kinds}} for kind in kinds]


class StructuredOutputs(_Part):
    """vLLM's `structured_outputs`: exactly one of json (a schema, as an object or JSON text), regex,
    choice or grammar (EBNF)."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False,
                              json_schema_extra=_exactly_one_kind)
    json_: JsonObject | NonEmptyText | None = Field(default=None, alias="json")
    regex: NonEmptyText | None = None
    choice: list[NonEmptyText] | None = Field(default=None, min_length=1, max_length=MAX_CHOICES)
    grammar: NonEmptyText | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [name for name in ("json_", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, regex, choice, grammar")
        return self

    def proto(self) -> common_pb2.StructuredOutput:
        if self.json_ is not None:
            text = self.json_ if isinstance(self.json_, str) else json.dumps(self.json_)
            return common_pb2.StructuredOutput(json_schema=text)
        if self.regex is not None:
            return common_pb2.StructuredOutput(regex=self.regex)
        if self.choice is not None:
            return common_pb2.StructuredOutput(choice=common_pb2.ChoiceList(choices=self.choice))
        return common_pb2.StructuredOutput(ebnf=self.grammar or "")


def _logit_bias(value: dict[str, float]) -> dict[str, float]:
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValueError(f"logit_bias has {len(value)} entries; at most {MAX_LOGIT_BIAS_ENTRIES}")
    for key, bias in value.items():
        if not key.isdigit() or int(key) > INT32_MAX:
            raise ValueError(f"logit_bias keys are token ids (non-negative integers), got {key!r}")
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {key}")
    return value


# OpenAI's logit_bias, which SGLang's /generate sampling params take too: token ids as text -> bias
LogitBias = Annotated[dict[str, float] | None, Field(json_schema_extra={
    "propertyNames": {"pattern": "^[0-9]+$"}, "additionalProperties": {"minimum": -100, "maximum": 100}})]


def _fill_logit_bias(params: common_pb2.SamplingParams, logit_bias: dict[str, float] | None) -> None:
    for key, bias in (logit_bias or {}).items():
        params.logit_bias[int(key)] = bias


class OpenAIConstraints(_Part):
    """OpenAI's and vLLM's fields of the chat and text completion bodies."""

    logit_bias: LogitBias = None
    repetition_penalty: RepetitionPenalty | None = None
    min_tokens: MinTokens = 0
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        return None if value is None else _logit_bias(value)

    @model_validator(mode="after")
    def _one_structure(self) -> OpenAIConstraints:
        if self.structured_outputs is not None and self.response_format is not None \
                and self.response_format.type != "text":
            raise ValueError("give response_format or structured_outputs, not both")
        return self

    def structured(self) -> common_pb2.StructuredOutput | None:
        if self.structured_outputs is not None:
            return self.structured_outputs.proto()
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return common_pb2.StructuredOutput(json_object=True)
        spec = fmt.json_schema
        if spec is None:  # _schema_given refused it
            raise ValueError("response_format of type json_schema needs a json_schema")
        return common_pb2.StructuredOutput(json_schema=json.dumps(spec.schema_), strict=bool(spec.strict))

    def fill(self, params: common_pb2.SamplingParams) -> common_pb2.SamplingParams:
        _fill_logit_bias(params, self.logit_bias)
        if self.repetition_penalty is not None:
            # float32 on the wire: a value below its smallest positive one would arrive as 0
            params.repetition_penalty = max(self.repetition_penalty, FLOAT32_TINY)
        params.min_tokens = self.min_tokens
        structured = self.structured()
        if structured is not None:
            params.structured.CopyFrom(structured)
        return params


class NativeConstraints(_Part):
    """SGLang's /generate sampling params: at most one of json_schema (JSON text), regex, ebnf."""

    repetition_penalty: RepetitionPenalty | None = None
    min_new_tokens: MinTokens = 0
    logit_bias: LogitBias = None
    json_schema: NonEmptyText | None = None
    regex: NonEmptyText | None = None
    ebnf: NonEmptyText | None = None

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        return None if value is None else _logit_bias(value)

    @model_validator(mode="after")
    def _one_structure(self) -> NativeConstraints:
        if sum(value is not None for value in (self.json_schema, self.regex, self.ebnf)) > 1:
            raise ValueError("give at most one of json_schema, regex, ebnf")
        return self

    def fill(self, params: common_pb2.SamplingParams) -> common_pb2.SamplingParams:
        if self.repetition_penalty is not None:
            # float32 on the wire: a value below its smallest positive one would arrive as 0
            params.repetition_penalty = max(self.repetition_penalty, FLOAT32_TINY)
        params.min_tokens = self.min_new_tokens
        _fill_logit_bias(params, self.logit_bias)
        kind: dict[str, Any] = {}
        if self.json_schema is not None:
            kind["json_schema"] = self.json_schema
        elif self.regex is not None:
            kind["regex"] = self.regex
        elif self.ebnf is not None:
            kind["ebnf"] = self.ebnf
        if kind:
            params.structured.CopyFrom(common_pb2.StructuredOutput(**kind))
        return params
