"""Start a gRPC service the standard way: health checking, reflection, port 0, graceful stop.

A service main is then short (see services/bootstrap/main.py):

    shutdown = ShutdownSignals()
    server = await start_grpc_server([ServiceBinding(name, servicer, add_fn)], host, port)
    log.info("... listening on %s", server.address)
    await shutdown.wait()
    await server.stop(grace_s)

Every server answers `grpc.health.v1.Health/Check` ("" and each service name: SERVING until
shutdown begins) and server reflection, so `grpcurl -plaintext HOST:PORT list` works without the
.proto files.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.keepalive import server_options
from services.common.security import GrpcSecurity

# SO_REUSEPORT (gRPC's default) would let a second server bind a port that is in use and silently
# share its traffic; a port conflict must fail loudly instead.
_NO_REUSEPORT: tuple[tuple[str, Any], ...] = (("grpc.so_reuseport", 0),)


@dataclass(frozen=True)
class ServiceBinding:
    """One servicer for the server: its full service name and the generated `add_*_to_server`."""

    name: str  # full name, e.g. "pdserve.v1.Bootstrap"
    servicer: object
    add_to_server: Callable[[Any, grpc.aio.Server], None]


_HANDLER_KINDS = {  # (client streams, server streams) -> the handler gRPC makes for such a method
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def adder_with_deserializers(service: ServiceDescriptor, deserializers: Mapping[str, Callable[[bytes], Any]]
                             ) -> Callable[[Any, grpc.aio.Server], None]:
    """An `add_*_to_server` for `service` that registers what the generated one does, except that
    the methods named in `deserializers` read their requests with the function given (the generated
    one always parses with the request type's FromString)."""
    unknown = set(deserializers) - {method.name for method in service.methods}
    if unknown:
        raise ValueError(f"{service.full_name} has no method {sorted(unknown)}")

    def add(servicer: Any, server: grpc.aio.Server) -> None:
        handlers = {}
        for method in service.methods:
            request_type = message_factory.GetMessageClass(method.input_type)
            response_type = message_factory.GetMessageClass(method.output_type)
            make = _HANDLER_KINDS[(method.client_streaming, method.server_streaming)]
            deserializer = deserializers.get(method.name, request_type.FromString)
            handlers[method.name] = make(getattr(servicer, method.name), request_deserializer=deserializer,
                                         response_serializer=response_type.SerializeToString)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
        server.add_registered_method_handlers(service.full_name, handlers)

    return add


def service_name(pb2_module: ModuleType, short_name: str) -> str:
    """Full name of a service declared in a generated *_pb2 module: (bootstrap_pb2, "Bootstrap")
    -> "pdserve.v1.Bootstrap"."""
    return pb2_module.DESCRIPTOR.services_by_name[short_name].full_name


@dataclass
class GrpcServer:
    """A started `grpc.aio` server. `port` is the bound port (the real one when asked for 0)."""

    server: grpc.aio.Server
    host: str
    port: int
    service_names: tuple[str, ...]
    health: health.aio.HealthServicer = field(repr=False)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def stop(self, grace_s: float = 5.0) -> None:
        """Report NOT_SERVING (so balancers stop sending), then let in-flight RPCs finish for up to
        `grace_s` seconds before cancelling them."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()


async def start_grpc_server(services: Sequence[ServiceBinding], host: str, port: int, *,
                            security: GrpcSecurity | None = None,
                            options: Sequence[tuple[str, Any]] = ()) -> GrpcServer:
    """Build a `grpc.aio.server()` with `services`, health and reflection; bind host:port; start.

    The server follows the deployment's keepalive policy (services.common.keepalive), checks the
    cluster secret on every call but health checks, and serves TLS when `security` has a
    certificate. `options` add to or override the defaults. Raises OSError if the address cannot
    be bound.
    """
    security = security or GrpcSecurity()
    merged = dict(server_options())
    merged.update(_NO_REUSEPORT)
    merged.update(options)
    server = grpc.aio.server(options=list(merged.items()), interceptors=security.server_interceptors())
    for binding in services:
        binding.add_to_server(binding.servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = tuple(binding.name for binding in services)
    reflection.enable_server_reflection(
        (*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server)
    credentials = security.server_credentials()
    try:
        if credentials is None:
            bound_port = server.add_insecure_port(f"{host}:{port}")
        else:
            bound_port = server.add_secure_port(f"{host}:{port}", credentials)
    except RuntimeError as exc:  # grpc raises RuntimeError when binding fails
        raise OSError(f"cannot bind gRPC server to {host}:{port}: {exc}") from exc
    if bound_port == 0:
        raise OSError(f"cannot bind gRPC server to {host}:{port}")
    await server.start()
    for name in ("", *names):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return GrpcServer(server=server, host=host, port=bound_port, service_names=names, health=health_servicer)


class ShutdownSignals:
    """Catches SIGINT/SIGTERM from the moment it is created (inside the running loop): create it
    BEFORE announcing readiness, so a launcher that signals right after the ready line is handled
    gracefully instead of killing the process. `await wait()` returns the signal received; the
    handlers are then removed, so a second Ctrl-C kills the process the usual way (what an
    operator expects when a graceful shutdown hangs)."""

    def __init__(self, signals: Sequence[signal.Signals] = (signal.SIGINT, signal.SIGTERM)) -> None:
        self._loop = asyncio.get_running_loop()
        self._signals = tuple(signals)
        self._received: asyncio.Future[signal.Signals] = self._loop.create_future()
        for sig in self._signals:
            self._loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        if not self._received.done():
            self._received.set_result(sig)

    async def wait(self) -> signal.Signals:
        try:
            return await self._received
        finally:
            self.remove()

    def remove(self) -> None:
        for sig in self._signals:
            self._loop.remove_signal_handler(sig)
