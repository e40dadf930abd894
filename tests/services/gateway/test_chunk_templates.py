"""A content-only chat chunk written from its template equals, byte for byte, the one the response
models serialize (services/gateway/chunk_templates.py)."""

from __future__ import annotations

import pytest

from services.gateway.chunk_templates import ContentChunks
from services.gateway.responses import ChatChunkChoice, ChatCompletionChunk, ChatDelta, event


@pytest.mark.parametrize("content", [
    "hello", " world", 'quote " and \\ backslash', "line\nbreak\ttab", "\x00\x1f\x7f control",
    "héllo wörld", "日本語", "emoji 🚀", "\u2028\u2029", "</script>", "{\"json\": 1}",
])
@pytest.mark.parametrize(("request_id", "model", "index"), [
    ("chatcmpl-abc", "tiny", 0), ("chatcmpl-\"quoted\"", "org/model-名前", 7)])
def test_template_event_equals_the_models(content, request_id, model, index):
    built = event(ChatCompletionChunk(id=request_id, created=1_700_000_000, model=model, choices=[
        ChatChunkChoice(index=index, delta=ChatDelta(content=content))]))
    assert ContentChunks(request_id, 1_700_000_000, model, index).event(content) == built
