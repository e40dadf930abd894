"""The streamed chat chunk that carries only content text, written from a template.

Nearly every event of a streamed chat is one choice's next text with no role, logprobs or finish
reason. Building a ChatCompletionChunk (three pydantic models) and serializing it for each one was a
large share of the gateway's CPU per relayed token, so a request serializes one such chunk once,
with a marker where the content goes, and each token's event is the text before the marker, the
content as JSON (pydantic_core.to_json: the encoder model_dump_json uses) and the text after it:
byte for byte what the models would write. Every other chunk is still built from the models.
"""

from __future__ import annotations

from pydantic_core import to_json

from services.gateway.responses import ChatChunkChoice, ChatCompletionChunk, ChatDelta, event

_MARKER = "pdserve-content-goes-here"


class ContentChunks:
    """The SSE events of one choice's content-only chunks (routes.chat_completions, per choice)."""

    def __init__(self, request_id: str, created: int, model: str, index: int) -> None:
        whole = event(ChatCompletionChunk(id=request_id, created=created, model=model, choices=[
            ChatChunkChoice(index=index, delta=ChatDelta(content=_MARKER))]))
        marker = to_json(_MARKER).decode()
        head, found, tail = whole.partition(marker)
        if not found or marker in tail:  # cannot happen: the marker is no id, model or number
            raise ValueError("content marker not found once in the chunk template")
        self._head, self._tail = head, tail

    def event(self, content: str) -> str:
        return self._head + to_json(content).decode() + self._tail
