"""Turn request bodies into prompt token ids, and check them against the model's context."""

from __future__ import annotations

from collections.abc import Sequence

from services.gateway.chat_template import ChatTemplateError
from services.gateway.errors import bad_request
from services.gateway.model_files import ModelFiles
from services.gateway.protocol import ChatCompletionRequest


def chat_prompt_ids(body: ChatCompletionRequest, model_files: ModelFiles) -> list[int]:
    """Render the checkpoint's chat template over the messages and tokenize (no special tokens
    added: the template wrote them)."""
    if model_files.chat_template is None:
        raise bad_request("this model has no chat template; use /v1/completions", param="messages")
    try:
        text = model_files.chat_template.render(
            [message.template_dict() for message in body.messages],
            add_generation_prompt=body.add_generation_prompt, tools=body.tools, extra=body.chat_template_kwargs)
    except ChatTemplateError as exc:
        raise bad_request(str(exc), param="messages") from None
    return model_files.encode(text, add_special_tokens=False)


def completion_prompts(prompt: str | list[str] | list[int] | list[list[int]],
                       model_files: ModelFiles) -> list[list[int]]:
    """The prompts of a /v1/completions (or /generate) body as token id lists."""
    if isinstance(prompt, str):
        return [model_files.encode(prompt, add_special_tokens=True)]
    if all(isinstance(item, str) for item in prompt):
        return [model_files.encode(item, add_special_tokens=True) for item in prompt]  # type: ignore[arg-type]
    if all(isinstance(item, int) for item in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return [list(item) for item in prompt]  # type: ignore[arg-type]


def check_prompt(prompt_ids: Sequence[int], max_new_tokens: int | None, model_files: ModelFiles,
                 param: str) -> None:
    """400 for an empty prompt, token ids outside the vocabulary, or a prompt (plus the tokens
    asked for) longer than the model's context, naming both lengths."""
    if not prompt_ids:
        raise bad_request("the prompt is empty (no tokens)", param=param)
    vocab_size = model_files.vocab_size
    bad = next((token for token in prompt_ids if not 0 <= token < vocab_size), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})", param=param)
    context = model_files.context_length
    if context is None:
        return
    if len(prompt_ids) >= context:
        raise bad_request(
            f"This model's maximum context length is {context} tokens. However, your prompt has "
            f"{len(prompt_ids)} tokens. Please reduce the length of the prompt.",
            param=param, code="context_length_exceeded")
    if max_new_tokens is not None and len(prompt_ids) + max_new_tokens > context:
        raise bad_request(
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{len(prompt_ids) + max_new_tokens} tokens ({len(prompt_ids)} in the prompt, {max_new_tokens} "
            f"for the completion). Please reduce the length of the prompt or the completion.",
            param="max_tokens", code="context_length_exceeded")
