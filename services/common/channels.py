"""Every pdserve gRPC channel is opened here: the keepalive policy, the secret, TLS in one place."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

from services.common.keepalive import client_options
from services.common.security import GrpcSecurity


def open_channel(address: str, security: GrpcSecurity, *,
                 options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """A grpc.aio channel to `address` (host:port) that pings the peer (services.common.keepalive),
    carries the cluster secret on every call and speaks TLS when `security` says so. `options`
    add to or override the defaults."""
    merged = dict(client_options())
    merged.update(options)
    interceptors = security.client_interceptors() or None
    credentials = security.channel_credentials()
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=list(merged.items()), interceptors=interceptors)
    return grpc.aio.secure_channel(address, credentials, options=list(merged.items()),
                                   interceptors=interceptors)
