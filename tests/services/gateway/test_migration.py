"""Request migration (services/gateway/dispatcher.py, migration.py) with fake decode workers: the
continuation request, the limit, the failures that must not migrate, and the text across the
boundary (made by the gateway from the token ids, as the workers make it)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import grpc
import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from pdserve.text import TextStream
from protos.v1 import common_pb2, worker_pb2
from services.gateway.dispatcher import (
    Dispatcher,
    DispatchSettings,
    GeneratedToken,
    GenerationChunk,
    GenerationFailed,
)
from services.gateway.metrics import GatewayMetrics
from services.gateway.migration import ContinuationText, Delivered, continuation_sampling
from services.gateway.policies.base import Policy
from services.gateway.workers import Router, WorkerHandle, WorkerPool

PROMPT = [1, 2, 3]
CUT = "cut"  # a step of a fake stream: the registry cuts the call (the worker's lease expired)


class First(Policy):
    """Always the first candidate: a failed worker would be picked again unless excluded."""

    def choose(self, candidates: Sequence[WorkerHandle], prompt_token_ids: Sequence[int],
               lora: str | None = None) -> WorkerHandle:
        return candidates[0]


def chunk(*ids: int, finish: int = common_pb2.FINISH_REASON_UNSPECIFIED,
          usage: tuple[int, int] = (0, 0)) -> worker_pb2.GenerateResponse:
    response = worker_pb2.GenerateResponse(
        outputs=[common_pb2.TokenOutput(token_id=i, text=f"<{i}>", logprob=-0.5) for i in ids],
        finish_reason=finish)
    if finish:
        response.usage.CopyFrom(worker_pb2.Usage(prompt_tokens=usage[0], completion_tokens=usage[1]))
    return response


def rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                details=f"{code.name} for the test")


class FakeCall:
    def __init__(self, handle: WorkerHandle, steps: list) -> None:
        self.handle, self.steps, self.cancelled = handle, list(steps), False

    async def read(self):
        await asyncio.sleep(0)
        step = self.steps.pop(0) if self.steps else grpc.aio.EOF
        if step == CUT:
            self.handle.cut("lease expired")
            raise asyncio.CancelledError
        if isinstance(step, BaseException):
            raise step
        return step

    def cancel(self) -> bool:
        self.cancelled = True
        return True


class FakeWorker:
    """A decode worker's stub: each Generate call plays the next script."""

    def __init__(self, handle: WorkerHandle, scripts: list[list]) -> None:
        self.handle, self.scripts = handle, list(scripts)
        self.requests: list[worker_pb2.GenerateRequest] = []
        self.aborts: list[str] = []
        handle.worker_stub = lambda: self  # type: ignore[method-assign]

    def Generate(self, request: worker_pb2.GenerateRequest) -> FakeCall:  # noqa: N802 - the gRPC name
        self.requests.append(request)
        return FakeCall(self.handle, self.scripts.pop(0))

    async def Abort(self, request: worker_pb2.AbortRequest, timeout: float | None = None):  # noqa: N802
        self.aborts.append(request.room)
        return worker_pb2.AbortResponse(found=True)


def cluster(*scripts: list[list], limit: int = 3, tokenizer: Tokenizer | None = None):
    """A dispatcher over one prefill and one fake decode per entry of `scripts`."""
    pool = WorkerPool()
    pool.add("127.0.0.1:1", "prefill", "m")
    decodes = [FakeWorker(pool.add(f"127.0.0.1:{2 + i}", "decode", "m"), list(script))
               for i, script in enumerate(scripts)]
    metrics = GatewayMetrics(pool)
    dispatcher = Dispatcher(Router(pool, First(), First()), metrics,
                            DispatchSettings(retry_backoff_s=0, migration_limit=limit), tokenizer=tokenizer)
    return dispatcher, decodes, metrics


def sampling(**fields) -> common_pb2.SamplingParams:
    params = common_pb2.SamplingParams(temperature=0.7, seed=5, max_new_tokens=6, stop=["zz", "\n\n"],
                                       stop_token_ids=[7], ignore_eos=True, logprobs=True, top_logprobs=2)
    for name, value in fields.items():
        if isinstance(value, list):
            getattr(params, name)[:] = value
        else:
            setattr(params, name, value)
    return params


async def run(dispatcher: Dispatcher,
              params: common_pb2.SamplingParams | None = None) -> list[GenerationChunk]:
    return [c async for c in dispatcher.generate("r", "m", PROMPT, params or sampling())]


def migrations(metrics: GatewayMetrics, reason: str) -> float:
    return metrics.registry.get_sample_value("pdserve:gateway_migrations_total", {"reason": reason}) or 0.0


async def test_a_mid_stream_failure_continues_on_another_pair() -> None:
    dispatcher, (first, second), metrics = cluster(
        [[chunk(10, 11), chunk(12), rpc_error(grpc.StatusCode.UNAVAILABLE)]],
        [[chunk(13, 14), chunk(15, finish=common_pb2.FINISH_REASON_LENGTH, usage=(6, 3))]])
    chunks = await run(dispatcher)
    assert [t.token_id for c in chunks for t in c.tokens] == [10, 11, 12, 13, 14, 15]  # no gap, no repeat
    assert "".join(c.text for c in chunks) == "<10><11><12><13><14><15>"  # no tokenizer: the workers' text
    last = chunks[-1]
    assert (last.finish_reason, last.prompt_tokens, last.completion_tokens) == ("length", 3, 6)
    (continuation,) = second.requests
    assert list(continuation.prompt_token_ids) == PROMPT + [10, 11, 12]
    assert continuation.prefill_address == "127.0.0.1:1" and continuation.room == "r.m1"
    expected = sampling(max_new_tokens=3)  # the rest of the budget, every other setting as asked
    assert continuation.sampling == expected
    assert continuation.carried_tokens == 3 and first.requests[0].carried_tokens == 0
    assert len(first.requests) == 1  # the failed worker is not tried again by this request
    assert migrations(metrics, "unavailable") == 1


@pytest.mark.parametrize(("failure", "reason"), [
    (CUT, "worker_lost"),                                  # froze or cut off: its lease expired
    (grpc.aio.EOF, "truncated"),                           # the stream ended without a finish
    (rpc_error(grpc.StatusCode.INTERNAL), "internal"),
    (rpc_error(grpc.StatusCode.UNKNOWN), "unknown"),
])
async def test_every_failure_of_the_worker_migrates(failure, reason: str) -> None:
    dispatcher, (_, second), metrics = cluster(
        [[chunk(10), failure]], [[chunk(11, finish=common_pb2.FINISH_REASON_STOP, usage=(4, 1))]])
    chunks = await run(dispatcher)
    assert [t.token_id for c in chunks for t in c.tokens] == [10, 11]
    assert chunks[-1].completion_tokens == 2 and chunks[-1].prompt_tokens == 3
    assert list(second.requests[0].prompt_token_ids) == PROMPT + [10]
    assert migrations(metrics, reason) == 1


async def test_the_limit_ends_the_stream_with_the_error_of_today() -> None:
    failing = [[chunk(10), rpc_error(grpc.StatusCode.UNAVAILABLE)]]
    dispatcher, decodes, metrics = cluster(failing, [[chunk(11), rpc_error(grpc.StatusCode.UNAVAILABLE)]],
                                           [[chunk(12, finish=common_pb2.FINISH_REASON_STOP, usage=(5, 1))]],
                                           limit=1)
    received = []
    with pytest.raises(GenerationFailed, match="127.0.0.1:3 failed mid-stream: UNAVAILABLE") as info:
        async for item in dispatcher.generate("r", "m", PROMPT, sampling()):
            received.append(item)
    assert info.value.after_first_token and info.value.status == 503
    assert [t.token_id for c in received for t in c.tokens] == [10, 11]
    assert not decodes[2].requests and migrations(metrics, "unavailable") == 1


async def test_migrations_chain_up_to_the_limit() -> None:
    dispatcher, decodes, metrics = cluster(
        [[chunk(10), CUT]], [[chunk(11), rpc_error(grpc.StatusCode.INTERNAL)]],
        [[chunk(12), chunk(13, finish=common_pb2.FINISH_REASON_STOP, usage=(5, 2))]], limit=2)
    chunks = await run(dispatcher)
    assert [t.token_id for c in chunks for t in c.tokens] == [10, 11, 12, 13]
    assert (chunks[-1].finish_reason, chunks[-1].prompt_tokens,
            chunks[-1].completion_tokens) == ("stop", 3, 4)
    second, third = decodes[1].requests[0], decodes[2].requests[0]
    assert (list(second.prompt_token_ids), second.sampling.max_new_tokens,
            second.room) == (PROMPT + [10], 5, "r.m1")
    assert (list(third.prompt_token_ids), third.sampling.max_new_tokens,
            third.room) == (PROMPT + [10, 11], 4, "r.m2")
    assert migrations(metrics, "worker_lost") == migrations(metrics, "internal") == 1


async def test_limit_zero_disables_migration() -> None:
    dispatcher, (_, second), metrics = cluster([[chunk(10), CUT]], [[chunk(11)]], limit=0)
    with pytest.raises(GenerationFailed, match="lease expired mid-stream") as info:
        await run(dispatcher)
    assert info.value.after_first_token and not second.requests
    assert migrations(metrics, "worker_lost") == 0


@pytest.mark.parametrize("code", [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.CANCELLED,
                                  grpc.StatusCode.FAILED_PRECONDITION])
async def test_a_failure_that_is_not_the_workers_does_not_migrate(code: grpc.StatusCode) -> None:
    dispatcher, (_, second), metrics = cluster([[chunk(10), rpc_error(code)]], [[chunk(11)]])
    with pytest.raises(GenerationFailed) as info:
        await run(dispatcher)
    assert info.value.after_first_token and not second.requests
    assert sum(migrations(metrics, reason) for reason in ("unavailable", "internal", "unknown")) == 0


async def test_a_client_that_leaves_is_not_migrated() -> None:
    dispatcher, (first, second), metrics = cluster([[chunk(10), chunk(11), chunk(12)]], [[chunk(13)]])
    stream = dispatcher.generate("r", "m", PROMPT, sampling())
    await anext(stream)
    await stream.aclose()  # the client disconnected
    await dispatcher.drain()
    assert first.aborts == ["r"] and not second.requests
    assert migrations(metrics, "worker_lost") == 0


async def test_a_spent_budget_finishes_without_a_continuation() -> None:
    dispatcher, (_, second), _ = cluster([[chunk(10, 11), CUT]], [[chunk(12)]])
    chunks = await run(dispatcher, sampling(max_new_tokens=2))
    assert (chunks[-1].finish_reason, chunks[-1].completion_tokens) == ("length", 2) and not second.requests


async def test_the_continuation_that_cannot_start_is_an_error_after_the_first_token() -> None:
    dispatcher, _, _ = cluster([[chunk(10), CUT]])  # nobody left to continue on
    with pytest.raises(GenerationFailed, match="lease expired mid-stream; no other worker") as info:
        await run(dispatcher)
    assert info.value.after_first_token


def test_continuation_sampling() -> None:
    assert continuation_sampling(sampling(max_new_tokens=6), 4).max_new_tokens == 2
    assert continuation_sampling(sampling(max_new_tokens=6), 6) is None
    assert continuation_sampling(sampling(max_new_tokens=6, min_tokens=5), 4).min_tokens == 1
    assert continuation_sampling(sampling(max_new_tokens=6, min_tokens=3), 4).min_tokens == 0
    unset = common_pb2.SamplingParams(temperature=0.0)
    rest = continuation_sampling(unset, 100)
    assert rest.max_new_tokens == 28 and rest.temperature == 0.0  # the worker's default budget, 128


# -- text across the boundary --------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_model / "tokenizer.json"))


def worker_text(model: Path, prompt: Sequence[int], ids: Sequence[int]) -> list[str]:
    """Each token's text as one worker, unmigrated, makes it (no stop strings): with the
    transformers tokenizer a worker loads, the last token ending the output ("length")."""
    stream = TextStream(AutoTokenizer.from_pretrained(model), prompt_ids=prompt)
    return [stream.apply(token_id, "length" if i == len(ids) - 1 else None)[0]
            for i, token_id in enumerate(ids)]


def tokens(ids: Sequence[int], texts: Sequence[str] | None = None) -> tuple[GeneratedToken, ...]:
    return tuple(GeneratedToken(i, "" if texts is None else t)
                 for i, t in zip(ids, texts or ids, strict=True))


@pytest.mark.parametrize("text", ["Hello world, migrating text.", "héllo wörld ✓ 日本語のテキスト 🙂🙂"])
def test_the_continuation_text_joins_the_delivered_text(tokenizer: Tokenizer, tiny_model: Path,
                                                        text: str) -> None:
    prompt = tokenizer.encode("The prompt:").ids
    ids = tokenizer.encode(text).ids
    whole = worker_text(tiny_model, prompt, ids)
    assert "".join(whole) == text
    for cut in range(1, len(ids)):  # every boundary, inside multi-byte characters too
        delivered = Delivered(token_ids=list(ids[:cut]))
        text_maker = ContinuationText(tokenizer, sampling(stop=[]), prompt, delivered)
        rest = text_maker.apply(GenerationChunk(tokens(ids[cut:]), finish_reason="length"))
        assert "".join(whole[:cut]) + rest.text == text, cut
        assert rest.finish_reason == "length"


def test_a_stop_string_across_the_boundary_is_honoured(tokenizer: Tokenizer) -> None:
    first, second = tokenizer.encode("hello wo").ids, tokenizer.encode("rld and more").ids
    # the failed worker held back "wo" (it may start the stop string "world") and sent the rest
    delivered = Delivered(token_ids=first)
    maker = ContinuationText(tokenizer, sampling(stop=["world"]), [], delivered)
    rest = maker.apply(GenerationChunk(tokens(second)))
    assert rest.finish_reason == "stop" and rest.text == ""
    assert len(rest.tokens) < len(second)  # cut at the token that completed it
    # no stop string: the held-back text is shown before the new text
    maker = ContinuationText(tokenizer, sampling(stop=["wonder"]), [], Delivered(token_ids=first))
    rest = maker.apply(GenerationChunk(tokens(second), finish_reason="length"))
    assert rest.text == "world and more" and rest.finish_reason == "length"


def test_a_stop_token_adds_no_text(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("abc def").ids
    maker = ContinuationText(tokenizer, sampling(stop=[], stop_token_ids=[ids[-1]]), [],
                             Delivered(token_ids=[]))
    rest = maker.apply(GenerationChunk(tokens(ids), finish_reason="stop"))
    assert rest.text == tokenizer.decode(ids[:-1]) and rest.finish_reason == "stop"


async def test_the_gateway_text_and_stop_strings_after_a_migration(tokenizer: Tokenizer) -> None:
    """End to end through the dispatcher: the worker after the migration does not see the held
    text; the gateway ends the stream at the stop string that spans the boundary and aborts it."""
    first_ids, second_ids = tokenizer.encode("hello wo").ids, tokenizer.encode("rld and more").ids
    assert [tokenizer.decode([i]) for i in first_ids] == ["h", "ello", " w", "o"]
    sent = ["h", "ello", " ", ""]  # "wo" could begin "world": the failed worker held it back
    first_chunk = worker_pb2.GenerateResponse(outputs=[common_pb2.TokenOutput(token_id=i, text=t)
                                                       for i, t in zip(first_ids, sent, strict=True)])
    dispatcher, (_, second), _ = cluster([[first_chunk, CUT]], [[chunk(*second_ids)]], tokenizer=tokenizer)
    chunks = await run(dispatcher, sampling(stop=["world"], max_new_tokens=50))
    assert chunks[-1].finish_reason == "stop" and chunks[-1].completion_tokens == 7  # 4 + "r", "l", "d"
    assert "".join(c.text for c in chunks) == "hello "
    await dispatcher.drain()
    assert second.aborts == ["r.m1"]  # the continuation's worker is told to stop
