"""`pdserve launch-router`: run the gateway (HTTP on uvicorn + uvloop) until SIGINT/SIGTERM.

Logs `[time] gateway listening on HOST:PORT (metrics :PORT), http://HOST:PORT, model M, ...` once it
accepts requests
(launchers and tests read the bound port from it when started with --port 0). Without --model-path
it first learns the model from its workers (services.gateway.model_source), so the seeds' router
command line (worker addresses only) works as is.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import socket
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import uvicorn
import uvloop

from pdserve import envs
from pdserve.config_flags import add_config_arguments, config_from_args
from services.common.gc_policy import settle_after_startup
from services.common.grpc_server import ShutdownSignals
from services.common.logging import setup_logging
from services.gateway.app import create_app
from services.gateway.config import (
    GatewayConfig,
    StaticWorker,
    add_worker_arguments,
    joined_list_flags,
    static_workers_from_args,
    take_list_forms,
    with_env_api_key,
)
from services.gateway.loop_watch import watch_event_loop
from services.gateway.model_source import ModelUnknown, RegistryWorkerCheck, StaticWorkerCheck, learn_model
from services.gateway.parser_source import ParserLearner
from services.gateway.prompts import ModelFiles
from services.gateway.sse import with_server_send
from services.gateway.state import GatewayState, build_state

log = logging.getLogger("pdserve.gateway")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, GatewayConfig)
    take_list_forms(parser)
    add_worker_arguments(parser)


def main(args: argparse.Namespace) -> int:
    setup_logging("gateway")
    try:
        config = with_env_api_key(config_from_args(GatewayConfig, joined_list_flags(args)))
        workers = static_workers_from_args(args)
        if not config.model_path and not workers and not config.bootstrap:
            raise ValueError("give --model-path, or workers (--prefill/--decode/--worker or --bootstrap) to "
                             "learn the model from")
    except ValueError as exc:
        log.error("gateway: %s", exc)
        return 2
    if config.workers > 1:
        from services.gateway.processes import run_processes
        try:
            sock = bind_socket(config.host, config.port, reuse_port=True, listen=False)  # holds the port
        except OSError as exc:
            log.error("gateway failed to start: %s", exc)
            return 1
        with sock:
            port = sock.getsockname()[1]
            return run_processes(config.workers, port, sys.argv[1:], config.graceful_shutdown)
    try:
        uvloop.run(serve(config, workers))
    except OSError as exc:  # port in use, bad host
        log.error("gateway failed to start: %s", exc)
        return 1
    except ModelUnknown as exc:
        log.error("gateway: %s", exc)
        return 1
    return 0


class _Server(uvicorn.Server):
    """uvicorn's server without its signal handling: ShutdownSignals owns SIGINT/SIGTERM (uvicorn
    would re-raise the signal after a graceful stop, so the process would not exit 0)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def bind_socket(host: str, port: int, *, reuse_port: bool = False, listen: bool = True) -> socket.socket:
    """The listening socket, bound before uvicorn starts so port 0 gives us the real port.
    `reuse_port`: bound with SO_REUSEPORT, so several processes listen on one port (--workers)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot bind HTTP server to {host}:{port}: {exc}") from exc
    if listen:
        sock.listen(2048)
    sock.setblocking(False)
    return sock


async def serve(config: GatewayConfig, workers: Sequence[StaticWorker] = ()) -> None:
    shutdown = ShutdownSignals()  # before the ready line: a signal right after it is graceful
    # one of --workers N processes (services.gateway.processes) binds beside the others
    sock = bind_socket(config.host, config.port, reuse_port=envs.GATEWAY_REUSE_PORT.get())
    signal_task = asyncio.create_task(shutdown.wait())
    try:
        with tempfile.TemporaryDirectory(prefix="pdserve-gateway-model-") as folder:
            if config.model_path:
                state = build_state(config, workers)
                learner = ParserLearner(state, workers, config.bootstrap, config.security)
                learner.start()
                try:
                    await _serve(config, signal_task, sock, state, workers)
                finally:
                    await learner.close()
                return
            learning = asyncio.create_task(learn_model(
                workers, config.bootstrap, config.security, Path(folder), wanted_name=config.model_name,
                timeout_s=config.model_info_timeout))
            await asyncio.wait({learning, signal_task}, return_when=asyncio.FIRST_COMPLETED)
            if not learning.done():  # a signal while waiting for the workers
                learning.cancel()
                log.info("gateway got %s while waiting for its workers' model: exiting",
                         signal_task.result().name)
                return
            model = learning.result()
            state = build_state(config, (), model_files=ModelFiles(folder), model_name=model.name,
                                worker_check=RegistryWorkerCheck(model, config.security),
                                reported_parsers=model.text_parsers)
            check = StaticWorkerCheck(state.pool, workers, model, config.security)
            check.start()
            try:
                await _serve(config, signal_task, sock, state, workers)
            finally:
                await check.close()
    finally:
        signal_task.cancel()
        shutdown.remove()
        sock.close()


async def _serve(config: GatewayConfig, signal_task: asyncio.Task, sock: socket.socket, state: GatewayState,
                 workers: Sequence[StaticWorker]) -> None:
    # uvicorn annotates timeout_graceful_shutdown as an int; it is asyncio.wait_for's timeout, where a
    # float is fine
    uvicorn_config = uvicorn.Config(
        with_server_send(create_app(state)), log_level="warning", access_log=False, lifespan="on",
        timeout_graceful_shutdown=config.graceful_shutdown,  # type: ignore[arg-type]
        loop="none")
    server = _Server(uvicorn_config)
    server_task = asyncio.create_task(server.serve(sockets=[sock]))
    loop_watch = asyncio.create_task(watch_event_loop(state.metrics.loop_busy))
    while not server.started and not server_task.done():
        await asyncio.sleep(0.02)
    if server.started:
        settle_after_startup()
        host, port = sock.getsockname()[:2]
        sources = [f"{len(workers)} static worker(s)"]
        sources += [f"registry {config.bootstrap}"] if config.bootstrap else []
        # same shape as the other services' ready line; /metrics is on the HTTP port itself
        log.info("gateway listening on %s:%d (metrics :%d), http://%s:%d, model %s, %s, policy prefill=%s "
                 "decode=%s", host, port, port, host, port, state.model_name, ", ".join(sources),
                 config.prefill_policy_name, config.decode_policy_name)
    done, _ = await asyncio.wait({server_task, signal_task}, return_when=asyncio.FIRST_COMPLETED)
    if signal_task in done:
        log.info("gateway got %s: shutting down", signal_task.result().name)
        server.should_exit = True
    await server_task
    loop_watch.cancel()
