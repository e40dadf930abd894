"""Turn request bodies into prompt token ids off the event loop, and check them against the model.

Chat templating and tokenization run in a small thread pool (PromptEncoder), so a big prompt never
stalls /health or other clients' streams: jinja2 holds the GIL only for as long as the template
takes over text the body limit bounds, and the tokenizer's batch call releases it. A text that
cannot fit the context whatever its tokens (ModelFiles.min_tokens) is refused before tokenizing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from services.gateway.chat_template import ChatTemplateError
from services.gateway.errors import GatewayError, bad_request
from services.gateway.model_files import ModelFiles
from services.gateway.protocol import ChatCompletionRequest

T = TypeVar("T")

# Text up to this many characters is templated and tokenized on the event loop (a few ms at most).
INLINE_CHARS = 8192


class PromptEncoder:
    """Chat templating and tokenization for request handlers, on `threads` worker threads.
    Created with the app, closed at shutdown."""

    def __init__(self, model_files: ModelFiles, threads: int) -> None:
        self.model_files = model_files
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="gateway-tokenize")

    async def _run(self, work: Callable[[], T], size: int) -> T:
        # Small inputs are done inline: a thread hop costs more than they do, and the tokenizer's
        # batch call wakes its own worker threads, which compete with the workers for the cores.
        if size <= INLINE_CHARS:
            return work()
        return await asyncio.get_running_loop().run_in_executor(self._pool, work)

    async def chat(self, body: ChatCompletionRequest) -> list[int]:
        """Render the checkpoint's chat template over the messages and tokenize (no special tokens
        added: the template wrote them)."""
        template = self.model_files.chat_template
        if template is None:
            raise bad_request("this model has no chat template; use /v1/completions", param="messages")
        messages = [message.template_dict() for message in body.messages]

        def render() -> str:
            return template.render(messages, add_generation_prompt=body.add_generation_prompt, tools=body.tools,
                                   extra=body.chat_template_kwargs)

        size = sum(len(str(message.get("content", ""))) for message in messages) + len(str(body.tools or ""))
        try:
            text = await self._run(render, size)
        except ChatTemplateError as exc:
            raise bad_request(str(exc), param="messages") from None
        return (await self._encode([text], add_special_tokens=False, param="messages"))[0]

    async def prompts(self, prompt: str | list[str] | list[int] | list[list[int]], param: str) -> list[list[int]]:
        """The prompts of a /v1/completions (or /generate) body as token id lists."""
        if isinstance(prompt, str):
            return await self._encode([prompt], add_special_tokens=True, param=param)
        if all(isinstance(item, str) for item in prompt):
            return await self._encode(prompt, add_special_tokens=True, param=param)  # type: ignore[arg-type]
        if isinstance(prompt[0], int):  # validation left only all-int or all-list id prompts
            return [prompt]  # type: ignore[list-item]
        return list(prompt)  # type: ignore[arg-type]

    async def _encode(self, texts: Sequence[str], *, add_special_tokens: bool, param: str) -> list[list[int]]:
        context = self.model_files.context_length
        if context is not None:
            for text in texts:
                at_least = self.model_files.min_tokens(text)
                if at_least >= context:
                    raise context_exceeded(context, f"at least {at_least}", param)
        size = sum(len(text) for text in texts)
        if size <= INLINE_CHARS:
            return [self.model_files.encode(text, add_special_tokens=add_special_tokens) for text in texts]
        return await self._run(lambda: self.model_files.encode_many(texts, add_special_tokens=add_special_tokens), size)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def context_exceeded(context: int, prompt_tokens: int | str, param: str) -> GatewayError:
    return bad_request(
        f"This model's maximum context length is {context} tokens. However, your prompt has "
        f"{prompt_tokens} tokens. Please reduce the length of the prompt.",
        param=param, code="context_length_exceeded")


def check_prompt(prompt_ids: Sequence[int], max_new_tokens: int | None, model_files: ModelFiles,
                 param: str, max_tokens_param: str = "max_tokens") -> None:
    """400 for an empty prompt, token ids outside the vocabulary, or a prompt (plus the tokens
    asked for) longer than the model's context, naming both lengths."""
    if not prompt_ids:
        raise bad_request("the prompt is empty (no tokens)", param=param)
    context = model_files.context_length
    if context is not None and len(prompt_ids) >= context:  # before the id scan: it costs per id
        raise context_exceeded(context, len(prompt_ids), param)
    check_token_ids(prompt_ids, model_files, param)
    if context is None:
        return
    if max_new_tokens is not None and len(prompt_ids) + max_new_tokens > context:
        raise bad_request(
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{len(prompt_ids) + max_new_tokens} tokens ({len(prompt_ids)} in the prompt, {max_new_tokens} "
            f"for the completion). Please reduce the length of the prompt or the completion.",
            param=max_tokens_param, code="context_length_exceeded")


def check_max_tokens(max_new_tokens: int | None, model_files: ModelFiles, param: str) -> None:
    """400 naming `param` for a token budget no prompt leaves room for (the prompt takes at least
    one token of the context), before anything is tokenized."""
    context = model_files.context_length
    if max_new_tokens is not None and context is not None and max_new_tokens >= context:
        raise bad_request(f"{param} is {max_new_tokens}, but this model's maximum context length is {context} "
                          f"tokens, prompt included", param=param, code="context_length_exceeded")


def check_token_ids(token_ids: Sequence[int], model_files: ModelFiles, param: str) -> None:
    """400 naming `param` if a token id is outside the model's vocabulary."""
    vocab_size = model_files.vocab_size
    bad = next((token for token in token_ids if not 0 <= token < vocab_size), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})", param=param)
