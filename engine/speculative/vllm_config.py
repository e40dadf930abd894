"""vLLM's `--speculative-config` JSON, mapped onto SGLang's flags (SpeculativeConfig's fields).

Accepted keys: `method` (ngram -> NGRAM, draft_model -> STANDALONE, deepseek_mtp or mtp -> NEXTN),
`num_speculative_tokens` (the drafts per step: --speculative-num-draft-tokens is one more, the
verified token), `model` (draft_model's checkpoint), and n-gram's `prompt_lookup_min` /
`prompt_lookup_max`. Any other key, or a method this engine cannot run, is refused naming it.
"""

from __future__ import annotations

import json

METHODS = {"ngram": "NGRAM", "draft_model": "STANDALONE", "deepseek_mtp": "NEXTN", "mtp": "NEXTN"}
_KEYS = ("method", "num_speculative_tokens", "model", "prompt_lookup_min", "prompt_lookup_max")


def _refuse(message: str) -> ValueError:
    return ValueError(f"--speculative-config: {message}")


def fields_from_vllm_json(text: str) -> dict[str, object]:
    """SpeculativeConfig field values for vLLM's JSON; ValueError naming the key it cannot map."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _refuse(f"not JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise _refuse("must be a JSON object")
    for key in raw:
        if key not in _KEYS:
            raise _refuse(f"key {key!r} has no counterpart here; accepted: {', '.join(_KEYS)}")
    method = raw.get("method")
    if method not in METHODS:
        raise _refuse(f"method {method!r} is not supported; choose one of {', '.join(METHODS)}")
    algorithm = METHODS[method]
    fields: dict[str, object] = {"speculative_algorithm": algorithm}
    if "num_speculative_tokens" in raw:
        tokens = raw["num_speculative_tokens"]
        if not isinstance(tokens, int) or isinstance(tokens, bool):
            raise _refuse(f"num_speculative_tokens must be an integer, got {tokens!r}")
        fields["speculative_num_draft_tokens"] = tokens + 1
    if "model" in raw:
        if algorithm != "STANDALONE":
            raise _refuse(f"key 'model' goes with method draft_model (method {method!r} needs no second "
                          "checkpoint)")
        fields["speculative_draft_model_path"] = str(raw["model"])
    for key, name in (("prompt_lookup_min", "speculative_ngram_min_match"),
                      ("prompt_lookup_max", "speculative_ngram_max_match")):
        if key in raw:
            if algorithm != "NGRAM":
                raise _refuse(f"key {key!r} goes with method ngram")
            fields[name] = raw[key]
    return fields
