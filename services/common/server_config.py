"""ServerConfig: where a gRPC service listens and how long it takes to stop.

The registry and every worker take the same four flags; each nests this config with its own
default port (`field(default_factory=lambda: ServerConfig(port=N))`), which is then the flag's
default too (pdserve.config_flags).
"""

from __future__ import annotations

from dataclasses import dataclass, field


def _help(text: str) -> dict:
    return {"help": text}


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """`--host`, `--port`, `--metrics-port`, `--grace-period` of a gRPC service."""

    host: str = field(default="127.0.0.1", metadata=_help(
        "address the gRPC server binds (a worker's transfer engine binds it too)"))
    port: int = field(metadata=_help("gRPC port; 0 picks a free port"))
    metrics_port: int = field(default=0, metadata=_help(
        "Prometheus /metrics port on the same host; 0 picks a free port"))
    grace_period: float = field(default=5.0, metadata=_help(
        "seconds in-flight RPCs get to finish on SIGINT/SIGTERM"))
