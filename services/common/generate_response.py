"""Reading a Worker.Generate message's tokens, whichever of its two forms carries them."""

from __future__ import annotations

from protos.v1 import worker_pb2


def response_token_ids(response: worker_pb2.GenerateResponse) -> list[int]:
    """The token ids of one Generate message: its token_ids column, or its TokenOutput messages
    (the form of tokens with logprobs; services.worker.wire.with_tokens writes either)."""
    return list(response.token_ids) or [out.token_id for out in response.outputs]
