"""Relaying an engine's token stream to a gRPC Generate stream, with the latency metrics."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from engine.outputs import TokenOutput
from protos.v1 import common_pb2, worker_pb2
from services.common.convert import finish_reason_to_proto, token_to_proto
from services.worker.metrics import WorkerMetrics


async def relay_tokens(outputs: AsyncIterator[TokenOutput], metrics: WorkerMetrics,
                       arrival: float) -> AsyncIterator[worker_pb2.GenerateResponse]:
    """One GenerateResponse per engine output; the last carries finish_reason and usage.

    An abort output (token_id -1) carries no token, only the finish reason.
    """
    async for out in outputs:
        async for response in relay_token_batches(_one(out), metrics, arrival):
            yield response


async def relay_token_batches(batches: AsyncIterator[list[TokenOutput]], metrics: WorkerMetrics,
                              arrival: float) -> AsyncIterator[worker_pb2.GenerateResponse]:
    """One GenerateResponse per batch of engine outputs (Engine.generate_batches): the tokens that
    were ready together travel in one message. The last response carries finish_reason and usage;
    an abort output (token_id -1) adds no token, only the finish reason. Tokens after the first
    of a batch arrive with it, so their inter-token latency is observed as 0."""
    last = None
    async for batch in batches:
        now = time.perf_counter()
        response = worker_pb2.GenerateResponse()
        for out in batch:
            if out.token_id >= 0:
                if last is None:
                    metrics.ttft.observe(now - arrival)
                else:
                    metrics.itl.observe(now - last)
                last = now
                metrics.generation_tokens.inc()
                response.outputs.append(token_to_proto(out.token_id, out.text, out.logprob, out.top_logprobs))
            if out.finish_reason is not None:
                response.finish_reason = finish_reason_to_proto(out.finish_reason)
                response.usage.CopyFrom(worker_pb2.Usage(prompt_tokens=out.prompt_tokens,
                                                         completion_tokens=out.completion_tokens))
                metrics.prompt_tokens.inc(out.prompt_tokens)
                metrics.finished(out.finish_reason)
                metrics.e2e.observe(now - arrival)
        yield response


async def _one(out: TokenOutput) -> AsyncIterator[list[TokenOutput]]:
    yield [out]


def is_abort(response: worker_pb2.GenerateResponse) -> bool:
    return response.finish_reason == common_pb2.FINISH_REASON_ABORT
