"""--stream-interval: the worker's relay packs N tokens per GenerateResponse after the first one,
sends the first at once and the finish with whatever is held."""

from __future__ import annotations

import asyncio

import pytest

from engine.config import EngineConfig
from engine.outputs import TokenOutput
from services.common.generate_response import response_token_ids
from services.worker.config import WorkerConfig
from services.worker.metrics import WorkerMetrics
from services.worker.wire import relay


def out(token: int, reason: str | None = None) -> TokenOutput:
    return TokenOutput(token_id=token, text=f"<{token}>", logprob=None, top_logprobs=[], finish_reason=reason,
                       prompt_tokens=3, completion_tokens=token)


def messages(batches: list[list[TokenOutput]], interval: int) -> list[list[int]]:
    async def run() -> list[list[int]]:
        async def engine():
            for batch in batches:
                yield batch
        return [response_token_ids(response)
                async for response in relay(engine(), WorkerMetrics("colocated", "m"), 0.0, interval)]
    return asyncio.run(run())


def test_one_message_per_engine_batch_by_default():
    assert messages([[out(1)], [out(2)], [out(3), out(4)], [out(5, "length")]], 1) == [[1], [2], [3, 4], [5]]


def test_interval_packs_tokens_after_the_first_and_flushes_at_the_finish():
    batches = [[out(i)] for i in range(1, 11)] + [[out(11, "length")]]
    assert messages(batches, 4) == [[1], [2, 3, 4, 5], [6, 7, 8, 9], [10, 11]]
    # a batch that overshoots the interval goes out whole
    overshoot = [[out(1)], [out(2), out(3), out(4)], [out(5), out(6, "stop")]]
    assert messages(overshoot, 2) == [[1], [2, 3, 4], [5, 6]]


def test_an_abort_with_tokens_held_still_ends_the_stream():
    assert messages([[out(1)], [out(2)], [out(-1, "abort")]], 8) == [[1], [2]]


def test_interval_must_be_positive(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="--stream-interval must be at least 1"):
        WorkerConfig(engine=EngineConfig(model_path=str(tmp_path)), stream_interval=0)


def test_tokens_without_logprobs_travel_as_columns_and_with_logprobs_as_messages():
    async def run(batches):
        async def engine():
            for batch in batches:
                yield batch
        return [response async for response in relay(engine(), WorkerMetrics("colocated", "m"), 0.0, 4)]

    plain = asyncio.run(run([[out(1)], [out(2), out(3, "length")]]))
    assert [(list(r.token_ids), list(r.token_texts), len(r.outputs)) for r in plain] == \
        [([1], ["<1>"], 0), ([2, 3], ["<2>", "<3>"], 0)]
    scored = TokenOutput(token_id=4, text="<4>", logprob=-0.25, top_logprobs=[(4, -0.25)],
                         finish_reason="stop", prompt_tokens=3, completion_tokens=1)
    (message,) = asyncio.run(run([[scored]]))
    assert not message.token_ids and not message.token_texts
    assert [(o.token_id, o.text, o.logprob) for o in message.outputs] == [(4, "<4>", -0.25)]
    assert [(t.token_id, t.logprob) for t in message.outputs[0].top_logprobs] == [(4, -0.25)]
