"""The one keepalive policy of every pdserve gRPC client and server.

Why clients ping: a peer that freezes (SIGSTOP, a hung host) or sits behind a network cut keeps
its TCP connection open, so a call to it would wait for its deadline. An HTTP/2 PING needs the
peer's process to answer, so every channel here pings every `keepalive_s` and gives up on the
connection when no answer comes within `keepalive_s / 2`: the calls on it fail with UNAVAILABLE.

Why servers must agree: gRPC servers by default accept a ping on a connection without calls at
most every 5 minutes and answer more frequent ones with GOAWAY `too_many_pings`, which tears down
healthy idle channels (and the calls just starting on them). So every server here accepts pings
as often as every `keepalive_s / 2`, with or without calls, and pings its clients on the same
schedule (a frozen decode holding a Prefill call is noticed by the prefill that serves it).

The interval is PDSERVE_GRPC_KEEPALIVE_TIME (pdserve.envs), read when the options are built.

Both sides also take messages of up to MAX_MESSAGE_BYTES (gRPC's default receive limit is 4 MiB):
a vision-language request carries its images in one message, gateway to worker and decode to
prefill, and the gateway refuses more image bytes than that leaves room for (its
--max-request-image-bytes), so a request it accepts is never cut off between two workers.
"""

from __future__ import annotations

from typing import Any

from pdserve import envs

Options = tuple[tuple[str, Any], ...]

MAX_MESSAGE_BYTES = 64 << 20
MESSAGE_ROOM_BYTES = 4 << 20  # the rest of a message beside its images: prompt tokens, sampling, ids


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


def client_options(keepalive_s: float | None = None) -> Options:
    keepalive_s = envs.GRPC_KEEPALIVE_TIME.get() if keepalive_s is None else keepalive_s
    return (
        ("grpc.keepalive_time_ms", _ms(keepalive_s)),
        ("grpc.keepalive_timeout_ms", _ms(keepalive_s / 2)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),  # a long prefill sends no data for seconds
        # Fail fast when a peer is down (callers retry elsewhere) instead of waiting out gRPC's
        # default reconnect backoff of up to two minutes.
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2000),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    )


def server_options(keepalive_s: float | None = None) -> Options:
    keepalive_s = envs.GRPC_KEEPALIVE_TIME.get() if keepalive_s is None else keepalive_s
    return (
        ("grpc.keepalive_time_ms", _ms(keepalive_s)),
        ("grpc.keepalive_timeout_ms", _ms(keepalive_s / 2)),
        ("grpc.keepalive_permit_without_calls", 1),  # else idle pings count as abuse
        ("grpc.http2.min_ping_interval_without_data_ms", _ms(keepalive_s / 2)),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.max_ping_strikes", 2),  # a client pinging faster than that is still cut off
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    )
