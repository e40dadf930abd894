"""`pdserve bootstrap`: run the worker registry until SIGINT/SIGTERM.

Logs `[time] bootstrap registry listening on HOST:PORT (metrics :MPORT), ...` once it accepts
RPCs (launchers and tests read the bound ports from it when started with --port 0).
"""

from __future__ import annotations

import argparse
import asyncio
import logging

from grpc_health.v1 import health_pb2

from pdserve.config_flags import add_config_arguments, config_from_args
from protos.v1 import bootstrap_pb2, bootstrap_pb2_grpc
from services.bootstrap.config import BootstrapConfig
from services.bootstrap.etcd_client import EtcdClient, parse_endpoints
from services.bootstrap.etcd_store import EtcdStore
from services.bootstrap.metrics import registry_metrics
from services.bootstrap.registry import Registry
from services.bootstrap.servicer import BootstrapServicer
from services.bootstrap.store import MemoryStore, RegistryStore
from services.common.grpc_server import (
    GrpcServer,
    ServiceBinding,
    ShutdownSignals,
    service_name,
    start_grpc_server,
)
from services.common.logging import setup_logging
from services.common.metrics import start_metrics_server

log = logging.getLogger("pdserve.bootstrap")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, BootstrapConfig)


def main(args: argparse.Namespace) -> int:
    config = config_from_args(BootstrapConfig, args)
    setup_logging("bootstrap")
    try:
        asyncio.run(serve(config))
    except OSError as exc:  # port in use, bad host, etcd unreachable
        log.error("bootstrap registry failed to start: %s", exc)
        return 1
    return 0


def make_store(config: BootstrapConfig) -> RegistryStore:
    if config.registry_store == "etcd":
        return EtcdStore(EtcdClient(parse_endpoints(config.etcd_endpoints)), cluster=config.etcd_cluster,
                         heartbeat_interval_s=config.heartbeat_interval,
                         heartbeat_max_failure=config.heartbeat_max_failure)
    return MemoryStore(Registry(config.heartbeat_interval, config.heartbeat_max_failure))


def follow_store_health(store: RegistryStore, server: GrpcServer) -> None:
    """The gRPC health status says NOT_SERVING while an etcd store's view may be stale (its etcd
    watch is down), so health-checking clients and load balancers go to another registry."""
    if not isinstance(store, EtcdStore):
        return
    updates: set[asyncio.Task] = set()  # referenced until done

    def on_change(healthy: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if healthy
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("", *server.service_names):
            task = asyncio.get_running_loop().create_task(server.health.set(name, status))
            updates.add(task)
            task.add_done_callback(updates.discard)

    store.on_health_change = on_change
    if not store.healthy:
        on_change(False)


async def serve(config: BootstrapConfig) -> None:
    registry = make_store(config)
    await registry.start()
    shutdown = ShutdownSignals()  # before the ready line: a signal right after it is graceful
    metrics = None
    try:
        metrics = start_metrics_server(registry_metrics(registry), config.server.metrics_port,
                                       config.server.host)
        server = await start_grpc_server(
            [ServiceBinding(service_name(bootstrap_pb2, "Bootstrap"), BootstrapServicer(registry),
                            bootstrap_pb2_grpc.add_BootstrapServicer_to_server)],
            config.server.host, config.server.port, security=config.security)
        follow_store_health(registry, server)
        log.info("bootstrap registry listening on %s (metrics :%d), lease ttl %.1fs, %s, %s", server.address,
                 metrics.port, registry.ttl_s, config.security.describe(), registry.describe())
        config.security.warn_if_open(config.server.host, "the bootstrap registry")
        received = await shutdown.wait()
        log.info("bootstrap registry got %s: shutting down", received.name)
        await registry.close()  # ends the Watch streams, which would otherwise hold the grace period
        await server.stop(config.server.grace_period)
    finally:
        shutdown.remove()
        await registry.close()
        if metrics is not None:
            metrics.stop()
