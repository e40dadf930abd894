"""Control-plane security: the deployment secret every gRPC call carries, and optional (m)TLS.

Only the gateway faces clients; everything behind it is one deployment that shares a secret. With
a secret configured, every pdserve gRPC server refuses calls that do not carry it
(UNAUTHENTICATED), and every pdserve channel attaches it to each call as
`authorization: Bearer SECRET`. The standard health service stays open, so container and
Kubernetes probes work without it; it reveals nothing but SERVING or not.

TLS: a server with a certificate and key serves TLS; with a CA bundle as well it requires client
certificates signed by that CA (mTLS). A channel verifies servers with the CA bundle and presents
its own certificate when it has one. Give every process of a deployment the same flags.

The secret comes from `--cluster-secret-file` or PDSERVE_CLUSTER_SECRET (pdserve.envs); it is
read once when the config is built and never printed (repr=False).
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from pdserve import envs
from pdserve.netaddr import is_loopback

log = logging.getLogger("pdserve.security")

METADATA_KEY = "authorization"
_OPEN_PREFIXES = ("/grpc.health.v1.Health/",)  # probes carry no secret


def _help(text: str) -> dict:
    return {"help": text}


@dataclass(frozen=True)
class GrpcSecurity:
    """Security flags shared by every service (nested in each service's config)."""

    cluster_secret_file: str | None = field(default=None, metadata=_help(
        "file holding the deployment's shared secret: every gRPC call carries it and every server "
        "checks it (UNAUTHENTICATED otherwise); or set PDSERVE_CLUSTER_SECRET. Unset = no authentication"))
    grpc_tls_cert: str | None = field(default=None, metadata=_help(
        "PEM certificate this process presents (gRPC servers serve TLS with it; clients use it for mTLS)"))
    grpc_tls_key: str | None = field(default=None, metadata=_help("PEM private key of --grpc-tls-cert"))
    grpc_tls_ca: str | None = field(default=None, metadata=_help(
        "PEM CA bundle: channels verify servers with it, and servers then require client "
        "certificates it signed (mTLS)"))
    secret: bytes = field(default=b"", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        secret = envs.CLUSTER_SECRET.get()
        if self.cluster_secret_file:
            try:
                secret = Path(self.cluster_secret_file).read_text().strip()
            except OSError as exc:
                raise ValueError(f"--cluster-secret-file: cannot read {self.cluster_secret_file!r}: "
                                 f"{exc}") from None
            if not secret:
                raise ValueError(f"--cluster-secret-file {self.cluster_secret_file!r} is empty")
        object.__setattr__(self, "secret", secret.encode())
        # The TLS files may come from the environment (compose passes PDSERVE_GRPC_TLS_*; the
        # container health check reads the same variables); a flag wins.
        for name, env in (("grpc_tls_cert", envs.GRPC_TLS_CERT), ("grpc_tls_key", envs.GRPC_TLS_KEY),
                          ("grpc_tls_ca", envs.GRPC_TLS_CA)):
            if getattr(self, name) is None and env.get():
                object.__setattr__(self, name, env.get())
        if bool(self.grpc_tls_cert) != bool(self.grpc_tls_key):
            raise ValueError("--grpc-tls-cert and --grpc-tls-key go together")
        for flag, path in (("--grpc-tls-cert", self.grpc_tls_cert), ("--grpc-tls-key", self.grpc_tls_key),
                           ("--grpc-tls-ca", self.grpc_tls_ca)):
            if path and not Path(path).is_file():
                raise ValueError(f"{flag} {path!r} is not a file")

    @property
    def tls(self) -> bool:
        return bool(self.grpc_tls_ca or self.grpc_tls_cert)

    def warn_if_open(self, host: str, what: str) -> None:
        """Say loudly at start when `what` (the registry, a worker) binds an address other hosts can
        reach with no cluster secret: anyone there can then register workers, send prompts to
        workers and read their outputs, or drive KV transfers."""
        if self.secret or is_loopback(host):
            return
        log.warning("%s listens on %s without a cluster secret: anyone who can reach this address can "
                    "register workers, send prompts and read the answers. Set one for every process of the "
                    "deployment: --cluster-secret-file FILE or PDSERVE_CLUSTER_SECRET (and TLS: "
                    "--grpc-tls-cert/--grpc-tls-key/--grpc-tls-ca).", what, host)

    def describe(self) -> str:
        """For the ready line: what protects this process's gRPC, never the secret itself."""
        auth = "cluster secret" if self.secret else "no authentication"
        tls = "mTLS" if self.grpc_tls_ca and self.grpc_tls_cert else ("TLS" if self.tls else "plaintext")
        return f"{tls}, {auth}"

    # ---- server side -----------------------------------------------------------------------

    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [RequireSecret(self.secret)] if self.secret else []

    def server_credentials(self) -> grpc.ServerCredentials | None:
        if not self.grpc_tls_cert:
            return None
        return grpc.ssl_server_credentials(
            [(_read(self.grpc_tls_key), _read(self.grpc_tls_cert))],
            root_certificates=_read(self.grpc_tls_ca) if self.grpc_tls_ca else None,
            require_client_auth=bool(self.grpc_tls_ca))

    # ---- client side -----------------------------------------------------------------------

    def client_interceptors(self) -> list:
        if not self.secret:
            return []
        metadata = ((METADATA_KEY, f"Bearer {self.secret.decode()}"),)
        return [_UnaryUnary(metadata), _UnaryStream(metadata), _StreamUnary(metadata),
                _StreamStream(metadata)]

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.grpc_tls_ca) if self.grpc_tls_ca else None,
            private_key=_read(self.grpc_tls_key) if self.grpc_tls_key else None,
            certificate_chain=_read(self.grpc_tls_cert) if self.grpc_tls_cert else None)

    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        """The secret as call metadata, for callers that build a channel some other way."""
        return ((METADATA_KEY, f"Bearer {self.secret.decode()}"),) if self.secret else ()


def _read(path: str | None) -> bytes:
    assert path
    return Path(path).read_bytes()


class RequireSecret(grpc.aio.ServerInterceptor):
    """Refuses every call but health checks unless it carries the deployment secret.

    The comparison is constant-time. Refusals are logged, at most once a second, with the peer
    (an operator wants to see a misconfigured worker; an attacker must not flood the log)."""

    def __init__(self, secret: bytes) -> None:
        self._expected = b"Bearer " + secret
        self._last_log = 0.0
        self._refused = 0

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(_OPEN_PREFIXES):
            return handler
        presented = b""
        for key, value in details.invocation_metadata or ():
            if key == METADATA_KEY:
                presented = value.encode() if isinstance(value, str) else value
        if hmac.compare_digest(presented, self._expected):
            return handler
        self._refused += 1
        now = time.monotonic()
        if now - self._last_log >= 1.0:
            self._last_log = now
            log.warning("refused %s without the cluster secret (%d refused so far)", details.method,
                        self._refused)
        return _refusing(handler, details.method)


def _refusing(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that answers UNAUTHENTICATED."""
    message = (f"{method} needs the deployment's cluster secret "
               "(--cluster-secret-file or PDSERVE_CLUSTER_SECRET on the caller)")

    async def refuse(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kwargs = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse, **kwargs)
    return grpc.unary_unary_rpc_method_handler(refuse, **kwargs)


class _AttachSecret:
    """Adds the secret to each call's metadata. grpc.aio files an interceptor under one call kind
    only, so each kind gets its own small subclass."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(tuple(details.metadata or ()) + self._metadata))
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                          details.wait_for_ready)


class _UnaryUnary(_AttachSecret, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _UnaryStream(_AttachSecret, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _StreamUnary(_AttachSecret, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


class _StreamStream(_AttachSecret, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)
