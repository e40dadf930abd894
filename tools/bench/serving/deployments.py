"""The deployments `bench pd-vs-colocated` compares, started as real processes on this machine.

Same model, same dtype, same KV pages per worker and the same cores for each:
- `colocated`: one colocated worker with one torch thread per core, on all the cores;
- `pd`: one prefill worker on the first half of the cores and one decode worker on the other half
  (threads = cores each), the KV moving over a real transfer engine;
- `pd+conditional`: `pd` with the decode worker running short prompts itself
  (`--conditional-disaggregation`, services/decode/servicer.py).
Each has its own gateway (static worker lists, round robin). Workers are pinned with `taskset`;
the gateways and the load generator are not pinned (they share every core, alike for all).
Processes come from tools/launch.py (the launcher of every tool and of the e2e tests): ports are
picked free, logs go to files, and everything is killed when the ProcessGroup closes.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

from engine.config import EngineConfig
from services.worker.config import LocalPrefillRule
from tools.launch import ProcessGroup, Service

KINDS = ("colocated", "pd", "pd+conditional")


@dataclass(frozen=True)
class WorkerSettings:
    """What every worker of every deployment gets alike."""

    model_path: str
    backend: str = "nixl"
    dtype: str = "bfloat16"
    num_pages: int = 2048
    chunked_prefill_size: int = EngineConfig.chunked_prefill_size  # the worker defaults
    local_prefill_max_tokens: int = LocalPrefillRule.max_tokens
    ready_timeout_s: float = 300.0
    # Added to every worker's launch-server line, e.g. the speculative flags (prefill and decode must
    # agree on them: the handshake refuses a pair whose draft configs differ).
    worker_flags: tuple[str, ...] = ()


def split_cores(cores: list[int]) -> tuple[list[int], list[int]]:
    """(prefill cores, decode cores): the first half and the rest; one core is shared by both."""
    if len(cores) < 2:
        return cores, cores
    half = len(cores) // 2
    return cores[:half], cores[half:]


def available_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def _pinned(cores: list[int]) -> tuple[str, ...]:
    return ("taskset", "-c", ",".join(map(str, cores))) if shutil.which("taskset") else ()


@dataclass
class Deployment:
    """One started deployment: its gateway URL and how its cores were split (for the report)."""

    kind: str
    gateway: Service
    workers: dict[str, Service]
    cores: dict[str, list[int]]

    @property
    def url(self) -> str:
        return f"http://{self.gateway.address}"

    def describe(self) -> str:
        return ", ".join(f"{name} on cores {','.join(map(str, cores))}" for name, cores in self.cores.items())


def _worker_args(settings: WorkerSettings, mode: str, threads: int, extra: tuple[str, ...] = ()) -> list[str]:
    return ["launch-server", "--model-path", settings.model_path, "--disaggregation-mode", mode,
            "--disaggregation-transfer-backend", settings.backend, "--host", "127.0.0.1", "--port", "0",
            "--metrics-port", "0", "--num-threads", str(threads), "--dtype", settings.dtype,
            "--num-pages", str(settings.num_pages),
            "--chunked-prefill-size", str(settings.chunked_prefill_size),
            "--decode-log-interval", "0", *extra, *settings.worker_flags]


def _gateway_args(settings: WorkerSettings, workers: list[str]) -> list[str]:
    return ["launch-router", "--model-path", settings.model_path, "--host", "127.0.0.1", "--port", "0",
            "--policy", "round_robin", *workers]


def start(group: ProcessGroup, kind: str, settings: WorkerSettings, cores: list[int]) -> Deployment:
    """Start deployment `kind` (one of KINDS) in `group`, on `cores`; returns once its gateway serves."""
    if kind not in KINDS:
        raise ValueError(f"unknown deployment {kind!r}; expected one of {KINDS}")
    tag = kind.replace("+", "-")
    if kind == "colocated":
        worker = group.spawn(f"{tag}-worker", _worker_args(settings, "null", len(cores)),
                             wrapper=_pinned(cores))
        workers, placement = {"worker": worker}, {"colocated worker": cores}
        routes = ["--worker", "WORKER"]
    else:
        prefill_cores, decode_cores = split_cores(cores)
        extra = (("--conditional-disaggregation",
                  "--local-prefill-max-tokens", str(settings.local_prefill_max_tokens))
                 if kind == "pd+conditional" else ())
        workers = {
            "prefill": group.spawn(f"{tag}-prefill", _worker_args(settings, "prefill", len(prefill_cores)),
                                   wrapper=_pinned(prefill_cores)),
            "decode": group.spawn(f"{tag}-decode", _worker_args(settings, "decode", len(decode_cores), extra),
                                  wrapper=_pinned(decode_cores))}
        placement = {"prefill": prefill_cores, "decode": decode_cores}
        routes = ["--prefill", "PREFILL", "--decode", "DECODE"]
    for worker in workers.values():
        worker.wait_ready(settings.ready_timeout_s)
    addresses = {"WORKER": "worker", "PREFILL": "prefill", "DECODE": "decode"}
    routes = [workers[addresses[r]].address if r in addresses else r for r in routes]
    gateway = group.start(f"{tag}-gateway", _gateway_args(settings, routes),
                          timeout_s=settings.ready_timeout_s)
    return Deployment(kind, gateway, workers, placement)
