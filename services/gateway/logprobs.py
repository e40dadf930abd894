"""Token logprobs from the workers in the OpenAI shapes: chat's `logprobs.content` list and the
text completions' parallel `tokens` / `token_logprobs` / `top_logprobs` / `text_offset` lists."""

from __future__ import annotations

from collections.abc import Sequence

from services.gateway.dispatcher import GeneratedToken
from services.gateway.model_files import ModelFiles
from services.gateway.responses import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob


def chat_logprobs(tokens: Sequence[GeneratedToken], model_files: ModelFiles, top_n: int) -> ChatLogprobs:
    content = []
    for token in tokens:
        shown = model_files.token_text(token.token_id)
        top = []
        for token_id, logprob in token.top_logprobs[:top_n]:
            alternative = model_files.token_text(token_id)
            top.append(TopLogprob(token=alternative.text, logprob=logprob, bytes=alternative.bytes))
        content.append(ChatTokenLogprob(token=shown.text, logprob=token.logprob if token.logprob is not None else 0.0,
                                        bytes=shown.bytes, top_logprobs=top))
    return ChatLogprobs(content=content)


def completion_logprobs(tokens: Sequence[GeneratedToken], model_files: ModelFiles, top_n: int,
                        text_offset: int = 0) -> CompletionLogprobs:
    """`text_offset` is where the first token's text starts in the choice's text (streaming: the
    length already sent)."""
    result = CompletionLogprobs(top_logprobs=[] if top_n > 0 else None)
    offset = text_offset
    for token in tokens:
        result.tokens.append(model_files.token_text(token.token_id).text)
        result.token_logprobs.append(token.logprob)
        result.text_offset.append(offset)
        offset += len(token.text)
        if result.top_logprobs is not None:
            result.top_logprobs.append({model_files.token_text(token_id).text: logprob
                                        for token_id, logprob in token.top_logprobs[:top_n]})
    return result
