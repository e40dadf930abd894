"""Every environment knob pdserve reads, declared once.

Names mirror SGLang's `SGLANG_DISAGGREGATION_*` knobs with a `PDSERVE_` prefix where they mean
the same thing. Code never calls `os.environ` for a PDSERVE_ variable anywhere else: it asks the
declared `EnvVar` here (`envs.WAITING_TIMEOUT.get()`), and services copy the values into their
frozen configs once at start-up. docs/configuration.md lists them (generated from `ALL`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T", int, float, str, bool)


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    name: str
    default: T
    doc: str

    def get(self) -> T:
        raw = os.environ.get(self.name)
        if raw is None or raw == "":
            return self.default
        kind = type(self.default)
        try:
            if kind is bool:
                return raw.strip().lower() in ("1", "true", "yes", "on")
            return kind(raw)
        except ValueError as exc:
            raise ValueError(f"{self.name}={raw!r} is not a valid {kind.__name__}") from exc

    def is_set(self) -> bool:
        return bool(os.environ.get(self.name))


def _default_thread_pool_size() -> int:
    # Same rule as SGLang's default: 3/4 of the cores divided by 8, kept within 4..12.
    return min(max(int(0.75 * (os.cpu_count() or 1)) // 8, 4), 12)


BOOTSTRAP_TIMEOUT = EnvVar(
    "PDSERVE_DISAGGREGATION_BOOTSTRAP_TIMEOUT", 300.0,
    "Prefill: seconds a request may wait for its decode-side handshake (bootstrap queue).")
WAITING_TIMEOUT = EnvVar(
    "PDSERVE_DISAGGREGATION_WAITING_TIMEOUT", 300.0,
    "Decode: seconds a request may wait for its KV cache after pre-allocation (transfer queue).")
HEARTBEAT_INTERVAL = EnvVar(
    "PDSERVE_DISAGGREGATION_HEARTBEAT_INTERVAL", 5.0,
    "Seconds between a worker's heartbeats to the bootstrap registry.")
HEARTBEAT_MAX_FAILURE = EnvVar(
    "PDSERVE_DISAGGREGATION_HEARTBEAT_MAX_FAILURE", 2,
    "Missed heartbeats after which the registry expires a worker's lease.")
THREAD_POOL_SIZE = EnvVar(
    "PDSERVE_DISAGGREGATION_THREAD_POOL_SIZE", _default_thread_pool_size(),
    "Prefill: threads that issue KV transfers.")
QUEUE_SIZE = EnvVar(
    "PDSERVE_DISAGGREGATION_QUEUE_SIZE", 4,
    "Prefill: parallel transfer queues; requests are sharded over them by room.")
TRANSFER_TIMEOUT = EnvVar(
    "PDSERVE_DISAGGREGATION_TRANSFER_TIMEOUT", 30.0,
    "Seconds one KV write may take before its peer is declared dead.")
NIXL_BACKEND = EnvVar(
    "PDSERVE_DISAGGREGATION_NIXL_BACKEND", "UCX",
    "NIXL plugin used by the nixl transfer backend.")
MOONCAKE_MAX_QUEUED_PER_PEER = EnvVar(
    "PDSERVE_MOONCAKE_MAX_QUEUED_TRANSFERS_PER_PEER", 32768,
    "Mooncake TCP transport's per-peer queue limit (its default, 1024, rejects large batches; it "
    "ignores values above 65535 and falls back to 1024).")
CLUSTER_SECRET = EnvVar(
    "PDSERVE_CLUSTER_SECRET", "",
    "The deployment's shared secret: every gRPC call carries it and every server checks it "
    "(or `--cluster-secret-file`). Empty = no authentication.")
GRPC_TLS_CERT = EnvVar(
    "PDSERVE_GRPC_TLS_CERT", "",
    "PEM certificate this process presents (what `--grpc-tls-cert` sets; the flag wins). The container "
    "health check reads it too, so it can probe a server that speaks TLS.")
GRPC_TLS_KEY = EnvVar(
    "PDSERVE_GRPC_TLS_KEY", "",
    "PEM private key of PDSERVE_GRPC_TLS_CERT (what `--grpc-tls-key` sets; the flag wins).")
GRPC_TLS_CA = EnvVar(
    "PDSERVE_GRPC_TLS_CA", "",
    "PEM CA bundle for mutual TLS (what `--grpc-tls-ca` sets; the flag wins).")
GRPC_KEEPALIVE_TIME = EnvVar(
    "PDSERVE_GRPC_KEEPALIVE_TIME", 10.0,
    "Seconds between keepalive pings on every gRPC connection; a peer that does not answer within "
    "half of it is cut off (its calls fail at once). Servers accept pings at twice this rate.")
API_KEY = EnvVar(
    "PDSERVE_API_KEY", "",
    "Gateway: the API key clients must send as `Authorization: Bearer KEY` (what --api-key sets; the "
    "flag wins). Empty: no key is asked for.")
MIGRATION_LIMIT = EnvVar(
    "PDSERVE_MIGRATION_LIMIT", 3,
    "Gateway: times one generation may move to another (prefill, decode) pair when its decode worker "
    "fails after the first token (what --migration-limit sets; the flag wins). 0: no migration, the "
    "stream ends with an error event.")
PROFILE_PREFILL = EnvVar(
    "PDSERVE_PROFILE_PREFILL", False,
    "Record a torch profiler trace of the first prefill steps (SGLang's SGLANG_PROFILE_PREFILL).")
PROFILE_DECODE = EnvVar(
    "PDSERVE_PROFILE_DECODE", False,
    "Record a torch profiler trace of the first decode steps (SGLang's SGLANG_PROFILE_DECODE).")
PROFILE_STEPS = EnvVar("PDSERVE_PROFILE_STEPS", 5, "Steps of the profiled kind one trace records.")
PROFILE_DIR = EnvVar("PDSERVE_PROFILE_DIR", "pdserve-profile", "Folder profiler traces are written to.")
HICACHE_MOONCAKE_MASTER = EnvVar(
    "PDSERVE_HICACHE_MOONCAKE_MASTER", "",
    "Workers with --enable-hierarchical-cache: the Mooncake Store master, HOST:PORT (what "
    "--hicache-mooncake-master sets; the flag wins).")
MOONCAKE_MASTER = EnvVar(
    "MOONCAKE_MASTER", "",
    "SGLang's name for the Mooncake Store master (HOST:PORT), read when PDSERVE_HICACHE_MOONCAKE_MASTER "
    "and --hicache-mooncake-master are unset.")
LOG_LEVEL = EnvVar("PDSERVE_LOG_LEVEL", "INFO", "Log level of every pdserve process.")
GATEWAY_REUSE_PORT = EnvVar(
    "PDSERVE_GATEWAY_REUSE_PORT", False,
    "Set by `launch-router --workers N` for its gateway processes: bind the port with SO_REUSEPORT, "
    "beside the others; not for operators.")

CPU_ISA = EnvVar(
    "PDSERVE_CPU_ISA", "auto",
    "Instruction set of the C++ CPU kernels a process loads: auto (the best this CPU runs), avx512, avx2 or "
    "portable. A set the CPU lacks is refused; each is built once by `make setup`.")

GC_GEN0_THRESHOLD = EnvVar(
    "PDSERVE_GC_GEN0_THRESHOLD", 50_000,
    "Gateway: the garbage collector's first threshold once it is up (net new container objects "
    "between young collections; Python's default is 700). 0 keeps Python's default.")
ALL: tuple[EnvVar, ...] = tuple(v for v in globals().values() if isinstance(v, EnvVar))


def describe() -> str:
    """A Markdown table of every knob."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    rows += [f"| `{v.name}` | `{v.default}` | {v.doc} |" for v in ALL]
    return "\n".join(rows)
