"""schemathesis hooks for tests/e2e/test_gateway_schema.py (loaded through SCHEMATHESIS_HOOKS).

Bodies are made cheap before they are sent, without changing whether they are valid: a valid body
gets at most 4 new tokens and at most 64 prompt token ids (the schema's minimums are 1 and 1); an
invalid one only gets `max_tokens: 4` where it names no token budget at all (shrinking a field a
negative case broke could make it valid). That keeps the run within its time budget on a CPU.
"""

from __future__ import annotations

from typing import Any

import schemathesis

MAX_NEW_TOKENS = 4
MAX_PROMPT_IDS = 64


def _small(body: dict[str, Any]) -> None:
    for field in ("max_tokens", "max_completion_tokens"):
        value = body.get(field)
        # JSON integers may come as 1601.0 (the server accepts integral floats): clamp those too
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            body[field] = min(int(value), MAX_NEW_TOKENS) if float(value).is_integer() else value
    if "messages" in body and body.get("max_completion_tokens") is None:
        body["max_tokens"] = min(body.get("max_tokens") or MAX_NEW_TOKENS, MAX_NEW_TOKENS)
    if "prompt" in body:
        body["max_tokens"] = min(body.get("max_tokens") or MAX_NEW_TOKENS, MAX_NEW_TOKENS)
    params = body.get("sampling_params")
    if isinstance(params, dict):
        params["max_new_tokens"] = min(params.get("max_new_tokens") or MAX_NEW_TOKENS, MAX_NEW_TOKENS)
    elif "text" in body or "input_ids" in body:
        body["sampling_params"] = {"max_new_tokens": MAX_NEW_TOKENS}
    # a minimum stays within the budget it was under
    for holder, field in ((body, "min_tokens"), (params, "min_new_tokens"), (params, "min_tokens")):
        value = holder.get(field) if isinstance(holder, dict) else None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > MAX_NEW_TOKENS:
            holder[field] = MAX_NEW_TOKENS  # type: ignore[index]
    for field in ("prompt", "input_ids"):
        ids = body.get(field)
        if isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids):
            body[field] = ids[:MAX_PROMPT_IDS]
        elif isinstance(ids, list) and ids and all(isinstance(i, list) for i in ids):
            body[field] = [inner[:MAX_PROMPT_IDS] for inner in ids]


# A grammar, a regex or a JSON schema written as text is a language of its own that the OpenAPI
# document can only call a string: a valid body keeps each such field, with a text that parses.
_VALID_TEXT = {"grammar": 'root ::= "yes" | "no"', "ebnf": 'root ::= "yes" | "no"', "regex": "[a-z]{1,4}",
               "json": '{"type": "object"}', "json_schema": '{"type": "object"}'}


def _parsable_constraints(body: dict[str, Any]) -> None:
    for holder in (body.get("structured_outputs"), body.get("sampling_params")):
        if isinstance(holder, dict):
            for field, text in _VALID_TEXT.items():
                if isinstance(holder.get(field), str):
                    holder[field] = text


def _budget_if_absent(body: dict[str, Any]) -> None:
    if "messages" in body or "prompt" in body:
        if "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = MAX_NEW_TOKENS
    elif ("text" in body or "input_ids" in body) and "sampling_params" not in body:
        body["sampling_params"] = {"max_new_tokens": MAX_NEW_TOKENS}


@schemathesis.hook
def map_case(context: schemathesis.HookContext, case: schemathesis.Case) -> schemathesis.Case:
    meta = case.meta
    if not isinstance(case.body, dict) or meta is None:
        return case
    if meta.generation.mode.is_positive:
        _small(case.body)
        _parsable_constraints(case.body)
    else:
        _budget_if_absent(case.body)
    return case
