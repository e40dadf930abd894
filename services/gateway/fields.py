"""The field types of the gateway's request bodies (protocol.py): each JSON value is checked as the
protobuf field it ends up in will hold it. Numbers stay inside the range of their protobuf field
(protos/v1/common.proto SamplingParams), strings must be valid Unicode (a lone UTF-16 surrogate
cannot be encoded into a protobuf string or an HTTP body), JSON's 921.0 is the integer 921, and a
prompt is validated only in the one form its first element names.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Discriminator, Field, Tag

MAX_N = 128
MAX_STOP_STRINGS = 32
MAX_STOP_TOKEN_IDS = 256
# Ranges of the protobuf fields the values are copied into.
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.401298464324817e-45  # the smallest positive float32


def _valid_unicode(value: str) -> str:
    # JSON may carry "\ud800" escapes that decode to lone surrogates: such a string has no UTF-8
    # form, so protobuf, the tokenizer and the response encoder would all fail on it later.
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"contains a lone UTF-16 surrogate ({value[exc.start]!r} at {exc.start}), "
                         "which is not valid Unicode") from None
    return value


def check_json_unicode(value: Any, where: str = "") -> Any:
    """Raise ValueError if any string (key or value) inside a JSON value is not valid Unicode."""
    if isinstance(value, str):
        try:
            _valid_unicode(value)
        except ValueError as exc:
            raise ValueError(f"{where or 'value'} {exc}") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            check_json_unicode(key, f"{where}.{key!r}" if where else repr(key))
            check_json_unicode(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            check_json_unicode(item, f"{where}[{index}]")
    return value


def _json_integer(value: Any) -> Any:
    # JSON has one number type: 921.0 is the integer 921 (and JSON Schema agrees), while strict
    # mode would refuse it. Strings and booleans still are not integers.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# An int field is written `Annotated[int, Field(ge=..., le=...), AS_INT]`: in [ge, le], and JSON's
# 921.0 taken as 921. (The bounds go before the validator so that they stay `minimum`/`maximum` in
# the JSON schema.) Spelled out at each field rather than built by a function, so that type
# checkers see an int.
AS_INT = BeforeValidator(_json_integer)


Text = Annotated[str, AfterValidator(_valid_unicode)]
NonEmptyText = Annotated[str, Field(min_length=1), AfterValidator(_valid_unicode)]
JsonObject = Annotated[dict[str, Any], AfterValidator(check_json_unicode)]
def _json_integers(value: Any) -> Any:
    # The list-level form of _json_integer: one C-speed scan instead of a Python call per id
    # (4M ids in an 8 MB body: 0.05 s instead of 1.8 s on the event loop).
    if isinstance(value, list) and float in set(map(type, value)):
        return [_json_integer(item) for item in value]
    return value


TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]


# A list of token ids (its length bounds go before the validator, as for ints): `_json_integers`
# takes JSON's 921.0 as 921 for the whole list at once.
AS_INTS = BeforeValidator(_json_integers)
TokenIds = Annotated[list[TokenId], Field(min_length=1), AS_INTS]


def _prompt_kind(value: Any) -> str | None:
    """Which form a prompt takes, from its first element, so that only that form is validated
    (trying each form of the union on a 4M-id list would build millions of errors first). The tags
    start with `form:` so that error locations can leave them out (errors.py)."""
    if isinstance(value, str):
        return "form:text"
    if isinstance(value, list) and value:
        first = value[0]
        if isinstance(first, str):
            return "form:texts"
        if isinstance(first, list):
            return "form:id_lists"
        if isinstance(first, (int, float)) and not isinstance(first, bool):
            return "form:ids"
    return None


Texts = Annotated[list[NonEmptyText], Field(min_length=1)]
IdLists = Annotated[list[TokenIds], Field(min_length=1)]
Prompt = Annotated[Annotated[NonEmptyText, Tag("form:text")] | Annotated[Texts, Tag("form:texts")]
                   | Annotated[TokenIds, Tag("form:ids")] | Annotated[IdLists, Tag("form:id_lists")],
                   Discriminator(_prompt_kind, custom_error_type="prompt_form", custom_error_message=(
                       "Input should be a non-empty string, list of strings, list of token ids or list of "
                       "lists of token ids"))]
TextPrompt = Annotated[Annotated[NonEmptyText, Tag("form:text")] | Annotated[Texts, Tag("form:texts")],
                       Discriminator(_prompt_kind, custom_error_type="prompt_form", custom_error_message=(
                           "Input should be a non-empty string or list of strings"))]
IdsPrompt = Annotated[Annotated[TokenIds, Tag("form:ids")] | Annotated[IdLists, Tag("form:id_lists")],
                      Discriminator(_prompt_kind, custom_error_type="prompt_form", custom_error_message=(
                          "Input should be a non-empty list of token ids or list of lists of token ids"))]
StopList = Annotated[list[NonEmptyText], Field(max_length=MAX_STOP_STRINGS)]
StopTokenIds = Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS), AS_INTS]
Seed = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX), AS_INT]
TopK = Annotated[int, Field(ge=-1, le=INT32_MAX, description="-1 or 0: off"), AS_INT]
MaxTokens = Annotated[int, Field(ge=1, le=INT32_MAX), AS_INT]
