"""A gateway started with --model-path learns its workers' --tool-call-parser and
--reasoning-parser.

A gateway without --model-path learns the model and the parser names together from a worker's
ModelInfo (services.gateway.model_source). One given the model's files reads them itself, but
the parsers are typed on launch-server as SGLang's users do, so it still asks: `ParserLearner`
asks the static workers (none given: the registry's) for their ModelInfo, once a second until
one that serves this gateway's model answers, and reads chat output with the names it reports
from then on. The gateway's own flags win; with both set nothing is asked.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import grpc

from services.common.model_info import reported_text_parsers
from services.common.registry_client import RegistryClient
from services.common.security import GrpcSecurity
from services.gateway.config import StaticWorker
from services.gateway.discovery import stop_task
from services.gateway.model_source import fetch_model_info
from services.gateway.state import GatewayState
from services.gateway.workers import ROLE_FROM_PROTO

log = logging.getLogger("pdserve.gateway")

_RETRY_S = 1.0


class ParserLearner:
    """Sets `state.text_parsers` from the first worker of the served model that reports its own."""

    def __init__(self, state: GatewayState, workers: Sequence[StaticWorker], registry: str | None,
                 security: GrpcSecurity, retry_s: float = _RETRY_S) -> None:
        self.state = state
        self.workers = list(workers)
        self.registry = registry
        self.security = security
        self.retry_s = retry_s
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        flags = self.state.config.text_parsers
        if flags.tool_call_parser and flags.reasoning_parser:
            return  # the flags name both: nothing a worker says would change them
        self._task = asyncio.get_running_loop().create_task(self._run(), name="parser-learner")

    async def _run(self) -> None:
        while True:
            for worker in await self._candidates():
                try:
                    info = await fetch_model_info(worker.address, worker.role, self.security)
                except grpc.aio.AioRpcError:
                    continue
                if info.served_model_name and info.served_model_name != self.state.model_name:
                    continue
                reported = reported_text_parsers(info)
                self.state.text_parsers = self.state.config.text_parsers.over(reported)
                log.info("reading chat output with tool call parser %s and reasoning parser %s "
                         "(%s %s reports %s and %s)", self.state.text_parsers.tool_call_parser,
                         self.state.text_parsers.reasoning_parser, worker.role, worker.address,
                         reported.tool_call_parser, reported.reasoning_parser)
                return
            await asyncio.sleep(self.retry_s)

    async def _candidates(self) -> list[StaticWorker]:
        if self.workers or not self.registry:
            return self.workers
        try:
            async with RegistryClient(self.registry, security=self.security) as client:
                listed = await client.list()
        except grpc.aio.AioRpcError:
            return []
        return [StaticWorker(ROLE_FROM_PROTO[info.role], info.grpc_address) for info in listed
                if info.role in ROLE_FROM_PROTO and info.grpc_address]

    async def close(self) -> None:
        await stop_task(self._task)
