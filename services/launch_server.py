"""`pdserve launch-server`: one prefill, decode or colocated worker (or, with --encoder-only, an
encoder service: services/encoder/main.py), until SIGINT/SIGTERM.

Logs `[time] <role> worker listening on HOST:PORT (metrics :MPORT), ...` once it serves RPCs
(launchers and tests read the bound ports from it when started with --port 0).
"""

from __future__ import annotations

import argparse
import asyncio
import logging

import grpc

from libkv.transfer import exit_process
from pdserve.config_flags import add_config_arguments, config_from_args
from protos.v1 import worker_pb2, worker_pb2_grpc
from services.common.grpc_server import ServiceBinding, ShutdownSignals, service_name, start_grpc_server
from services.common.logging import setup_logging
from services.worker import images_apart
from services.worker.config import WorkerConfig
from services.worker.hooks import WorkerHooks
from services.worker.kv_events import KvEventsServicer
from services.worker.leak_detector import LeakDetector
from services.worker.runtime import WorkerRuntime

log = logging.getLogger("pdserve.worker")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, WorkerConfig)


def main(args: argparse.Namespace, hooks: WorkerHooks = WorkerHooks()) -> int:
    """Run the worker `args` describe until a signal; its exit code. `hooks`: a test's or a tool's
    seams into it (tools/hooked_worker.py); a deployment passes none."""
    setup_logging("worker")
    try:
        config = config_from_args(WorkerConfig, args)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    if config.epd.encoder_only:  # EPD: the vision tower alone, as its own service
        from services.encoder.main import run
        return run(config)
    if config.engine.node_rank > 0:  # not node 0: this node only runs its ranks of node 0's worker
        from engine.tp.node import run_node
        # Not a return: the heartbeat thread may be inside a call to node 0's store (torch's C++
        # client) as that store closes, and an error raised there during interpreter teardown
        # aborts the process (std::terminate, code 134) after a clean stop.
        exit_process(run_node(config.engine, config.server.host))
    runtime = WorkerRuntime.create(config)  # loads weights, sizes the KV pool, registers its memory
    code = 0
    try:
        asyncio.run(serve(runtime, hooks))
    except OSError as exc:
        log.error("%s worker failed to start: %s", config.role, exc)
        code = 1
    except grpc.aio.AioRpcError as exc:  # the registry refused us (bad secret, layout mismatch, ...)
        log.error("%s worker: registry %s refused it: %s %s", config.role, config.bootstrap,
                  exc.code().name, exc.details())
        code = 1
    except Exception:
        log.exception("%s worker failed", config.role)
        code = 1
    # What is left open is the exit's to free (WorkerRuntime.close): leave without the teardown.
    exit_process(code)


def _binding(runtime: WorkerRuntime, hooks: WorkerHooks) -> ServiceBinding:
    if runtime.config.role == "prefill":
        from services.prefill.servicer import PrefillServicer
        return ServiceBinding(service_name(worker_pb2, "Prefill"), PrefillServicer(runtime),
                              images_apart.adder("Prefill"))
    if runtime.config.role == "decode":
        from services.decode.servicer import DecodeServicer
        servicer: worker_pb2_grpc.WorkerServicer = DecodeServicer(runtime, hooks)
    else:
        from services.worker.colocated import ColocatedServicer
        servicer = ColocatedServicer(runtime)
    return ServiceBinding(service_name(worker_pb2, "Worker"), servicer,
                          images_apart.adder("Worker", runtime.open_image_drop()))


def _background(runtime: WorkerRuntime, servicer: object) -> list[asyncio.Task]:
    """What a worker runs beside its RPCs: the leak detector; on decode the "Decode batch" log line
    and the watch of the prefill workers' leases."""
    detector = LeakDetector(runtime.engine, runtime.rooms.live,
                            lambda leak: runtime.metrics.leak_detections.inc())
    tasks = [asyncio.create_task(detector.run())]
    if runtime.config.role == "decode":
        from services.decode.prefill_leases import watch_prefill_leases
        from services.decode.servicer import DecodeServicer
        tasks.append(asyncio.create_task(_log_loop(runtime)))
        if runtime.registry is not None and isinstance(servicer, DecodeServicer):
            tasks.append(asyncio.create_task(watch_prefill_leases(runtime.registry, servicer.remote)))
    return tasks


async def serve(runtime: WorkerRuntime, hooks: WorkerHooks = WorkerHooks()) -> None:
    config = runtime.config
    shutdown = ShutdownSignals()  # before the ready line: a signal right after it is graceful
    runtime.engine.start()
    try:
        metrics_server = runtime.start_metrics()
        binding = _binding(runtime, hooks)
        kv_events = KvEventsServicer(runtime.engine)
        server = await start_grpc_server(
            [binding, ServiceBinding(service_name(worker_pb2, "KvEvents"), kv_events,
                                     worker_pb2_grpc.add_KvEventsServicer_to_server)],
            config.server.host, config.server.port, security=config.security)
        await runtime.register(server.address)
        background = _background(runtime, binding.servicer)
        layout = runtime.engine.kv_layout
        # The pool's device names the GPU the worker ended up on (--device auto, --base-gpu-id).
        ops = getattr(getattr(runtime.engine, "model", None), "ops", None)  # which kernels (and ISA) run
        log.info("%s worker listening on %s (metrics :%d), model %s, %d KV pages of %d tokens on %s, "
                 "%s, transfer backend %s, %s", config.role, server.address, metrics_server.port,
                 config.model_name, runtime.engine.stats().total_pages, layout.page_size,
                 runtime.engine.pool.device, ops.describe() if ops is not None else "kernels unknown",
                 config.disaggregation_transfer_backend if runtime.backend else "none",
                 config.security.describe())
        config.security.warn_if_open(config.server.host, f"this {config.role} worker")
        received = await shutdown.wait()
        log.info("%s worker got %s: shutting down", config.role, received.name)
        for task in background:
            task.cancel()
        kv_events.close()
        await server.stop(config.server.grace_period)
    finally:
        shutdown.remove()
        await runtime.close(exiting=True)


async def _log_loop(runtime: WorkerRuntime) -> None:
    from services.decode.log_line import DecodeLogLine

    line = DecodeLogLine(runtime)
    interval = runtime.config.decode_log_interval
    if interval <= 0:
        return
    while True:
        await asyncio.sleep(interval)
        text = line.next()
        if text:
            log.info("%s", text)
