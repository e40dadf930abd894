"""A gateway given --model-path reads chat output with the parsers its workers report: the first
worker of its model that answers GetModelInfo names them, a worker of another model or one that
does not answer is passed over, and the gateway's own flags win."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import grpc
import pytest

from protos.v1 import worker_pb2, worker_pb2_grpc
from services.common.text_parsers import TextParsers
from services.gateway.config import GatewayConfig, StaticWorker
from services.gateway.parser_source import ParserLearner
from services.gateway.state import build_state


class ReportingWorker(worker_pb2_grpc.WorkerServicer):
    def __init__(self, info: worker_pb2.ModelInfo) -> None:
        self.info = info
        self.asked = 0

    async def GetModelInfo(self, request, context) -> worker_pb2.ModelInfo:
        self.asked += 1
        return self.info


async def start_worker(servicer: ReportingWorker) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def closed_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.parametrize(("flags", "expected"), [
    (TextParsers(), TextParsers("qwen25", "qwen3")),
    (TextParsers(tool_call_parser="mistral"), TextParsers("mistral", "qwen3")),
])
async def test_model_path_gateway_learns_the_reported_parsers(tiny_model: Path, flags: TextParsers,
                                                              expected: TextParsers) -> None:
    config = GatewayConfig(model_path=str(tiny_model), text_parsers=flags)
    state = build_state(config)
    other = ReportingWorker(worker_pb2.ModelInfo(served_model_name="another-model",
                                                 tool_call_parser="llama3", reasoning_parser="deepseek-r1"))
    own = ReportingWorker(worker_pb2.ModelInfo(served_model_name=state.model_name,
                                               tool_call_parser="qwen25", reasoning_parser="qwen3"))
    servers = [await start_worker(other), await start_worker(own)]
    workers = [StaticWorker("colocated", closed_port())] + [StaticWorker("colocated", a) for _, a in servers]
    learner = ParserLearner(state, workers, None, config.security, retry_s=0.05)
    try:
        assert state.text_parsers == flags  # until a worker answers
        learner.start()
        for _ in range(200):
            if state.text_parsers != flags:
                break
            await asyncio.sleep(0.05)
        assert state.text_parsers == expected
        assert other.asked >= 1 and own.asked == 1  # asked until one answered, then no more
    finally:
        await learner.close()
        for server, _ in servers:
            await server.stop(None)


async def test_flags_naming_both_parsers_ask_nothing(tiny_model: Path) -> None:
    flags = TextParsers("llama3", "deepseek-r1")
    config = GatewayConfig(model_path=str(tiny_model), text_parsers=flags)
    state = build_state(config)
    own = ReportingWorker(worker_pb2.ModelInfo(served_model_name=state.model_name, tool_call_parser="qwen25"))
    server, address = await start_worker(own)
    learner = ParserLearner(state, [StaticWorker("colocated", address)], None, config.security, retry_s=0.05)
    try:
        learner.start()
        await asyncio.sleep(0.3)
        assert own.asked == 0 and state.text_parsers == flags
    finally:
        await learner.close()
        await server.stop(None)
