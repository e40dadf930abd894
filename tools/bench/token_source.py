"""The far side of `pdserve bench gateway-relay`: gRPC servers speaking the Worker service whose
Generate streams a fixed schedule of tokens, so the bench loads one gateway at fleet rates.

This is load generation, not a worker: no engine, no KV pool, no prefix cache. The simulated engine
(`launch-server --engine sim`) runs the whole real worker and costs about 0.25 ms of CPU per token
on this 2-core machine, so feeding one gateway 20,000 tokens per second would take five cores of
simulated workers; this server costs a few microseconds per message. Every source steps on one
clock, as an engine does: every `--tpot-ms` all of its streams gain a token, and a stream sends a
message when `--stream-interval` tokens are ready (the first token at once, the last with the
finish reason and usage), exactly the messages a worker with that --stream-interval sends. Tokens
are the model's own token ids with their text, cycled from a fixed passage, so the gateway's text
path sees real text.

`python -m tools.bench.token_source --model-path DIR --sources N ...` serves N such servers on free
ports of 127.0.0.1 (one process, one event loop) and logs the launcher's ready line with the first
port; the others are the following lines `source listening on HOST:PORT`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import uvloop
from transformers import AutoTokenizer

from protos.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.common.grpc_server import ServiceBinding, ShutdownSignals, service_name, start_grpc_server
from services.common.model_info import read_model_info

log = logging.getLogger("pdserve.bench.token_source")

PASSAGE = ("The printing press changed how ideas travelled: a page set once in movable type could be "
           "pressed hundreds of times a day, books grew cheap enough for students and merchants, and "
           "within fifty years presses worked in more than two hundred cities across Europe. ")
DEFAULT_MAX_TOKENS = 128


class StepClock:
    """One engine-like clock: step k ends at start + k * step_s. Streams wait for a step number; a
    single task wakes every waiter of a step at once, as a batched decode step would."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.step = 0
        self._waiters: dict[int, list[asyncio.Future[None]]] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        began = time.perf_counter()
        while True:
            self.step += 1
            await asyncio.sleep(max(0.0, began + self.step * self.step_s - time.perf_counter()))
            for waiter in self._waiters.pop(self.step, ()):
                if not waiter.done():
                    waiter.set_result(None)

    async def wait_until(self, step: int) -> None:
        if step <= self.step - 1:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(step, []).append(waiter)
        await waiter


class TokenSourceServicer(worker_pb2_grpc.WorkerServicer):
    """Generate on a StepClock; GetModelInfo from the checkpoint folder; GetLoad and Abort trivially."""

    def __init__(self, clock: StepClock, stream_interval: int, model_info: worker_pb2.ModelInfo,
                 tokens: list[tuple[int, str]]) -> None:
        self.clock = clock
        self.stream_interval = stream_interval
        self.model_info = model_info
        self.tokens = tokens
        self.running = 0

    async def Generate(self, request: worker_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.GenerateResponse]:
        wanted = (request.sampling.max_new_tokens if request.sampling.HasField("max_new_tokens")
                  else DEFAULT_MAX_TOKENS)
        if wanted < 1:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens must be at least 1")
        self.running += 1
        try:
            start = self.clock.step
            sent = 0
            while sent < wanted:
                count = 1 if sent == 0 else min(self.stream_interval, wanted - sent)
                await self.clock.wait_until(start + sent + count)
                response = worker_pb2.GenerateResponse()
                for position in range(sent, sent + count):
                    token_id, text = self.tokens[position % len(self.tokens)]
                    response.token_ids.append(token_id)
                    response.token_texts.append(text)
                sent += count
                if sent == wanted:
                    response.finish_reason = common_pb2.FINISH_REASON_LENGTH
                    response.usage.prompt_tokens = len(request.prompt_token_ids)
                    response.usage.completion_tokens = sent
                yield response
        finally:
            self.running -= 1

    async def Abort(self, request: worker_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> worker_pb2.AbortResponse:
        return worker_pb2.AbortResponse(found=False)  # a cancelled Generate call has stopped already

    async def GetLoad(self, request: worker_pb2.GetLoadRequest,
                      context: grpc.aio.ServicerContext) -> common_pb2.WorkerLoad:
        return common_pb2.WorkerLoad(running=self.running)

    async def GetModelInfo(self, request: worker_pb2.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> worker_pb2.ModelInfo:
        return self.model_info


def passage_tokens(model_path: str) -> list[tuple[int, str]]:
    """The passage's token ids with each one's text (as a worker's detokenizer would send them)."""
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    ids = tokenizer.encode(PASSAGE, add_special_tokens=False)
    return [(token_id, tokenizer.decode([token_id])) for token_id in ids]


async def serve(args: argparse.Namespace) -> None:
    name = args.served_model_name or Path(args.model_path).resolve().name
    model_info = read_model_info(args.model_path, name)
    tokens = passage_tokens(args.model_path)
    shutdown = ShutdownSignals()
    clock = StepClock(args.tpot_ms / 1000.0)
    clock.start()
    servers = []
    for _ in range(args.sources):
        servicer = TokenSourceServicer(clock, args.stream_interval, model_info, tokens)
        servers.append(await start_grpc_server(
            [ServiceBinding(service_name(worker_pb2, "Worker"), servicer,
                            worker_pb2_grpc.add_WorkerServicer_to_server)], "127.0.0.1", 0))
    log.info("token source listening on %s (metrics :0), %d sources, one token per %.1f ms, "
             "stream interval %d", servers[0].address, len(servers), args.tpot_ms, args.stream_interval)
    for server in servers[1:]:
        log.info("source listening on %s", server.address)
    await shutdown.wait()
    for server in servers:
        await server.stop(1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", required=True, help="checkpoint folder (tokenizer and config only)")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--sources", type=int, default=2,
                        help="servers (each a colocated worker to the gateway)")
    parser.add_argument("--tpot-ms", type=float, default=10.0,
                        help="one token per stream every this many ms")
    parser.add_argument("--stream-interval", type=int, default=8, help="tokens per message after the first")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s")
    uvloop.run(serve(args))


if __name__ == "__main__":
    main()
