"""`pdserve up`: the whole system on this machine, no Docker: registry, prefill and decode workers
and the gateway as local child processes.

    pdserve up --model-path .cache/models/tiny --num-prefill 1 --num-decode 1 --port 8000

Order: the bootstrap registry first (its port is read from its ready line), then every worker at
once (they register with it), then the gateway (discovers them through it). Progress is shown
while they come up; it is ready once the gateway's /health says a (prefill, decode) pair can
serve. Then it prints the URL and a curl command, and waits. Ctrl-C (or SIGTERM) stops the
gateway, the workers and the registry in that order; a child that does not stop within the grace
period is killed. The built-in tiny model is written first if the default path is missing.
Logs: one file per process in --log-dir. The control plane is authenticated: unless
PDSERVE_CLUSTER_SECRET is set, a random cluster secret is made for this run and given to every
child only (nothing else on the machine can call their gRPC APIs).

`--hicache mooncake` adds the cluster-wide KV store (libkv/store/): Mooncake Store's master
(`mooncake_master` from the venv, on a free port or --hicache-master-port) starts first, every
worker gets `--enable-hierarchical-cache --hicache-storage-backend mooncake
--hicache-mooncake-master` with its address, and it stops last (after the workers it serves); its
log is LOG_DIR/mooncake-master.log.
"""

from __future__ import annotations

import argparse
import json
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from pdserve import envs
from pdserve.transfer_backends import BACKEND_NAMES
from tools import mooncake_master
from tools.launch import NotReady, ProcessGroup, Service

DEFAULT_MODEL = Path(".cache/models/tiny")
# From pdserve, not libkv: `pdserve up` pulls no torch (tests/services/gateway/test_no_torch.py).
BACKENDS = BACKEND_NAMES
HICACHE_BACKENDS = ("mooncake",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-path", type=Path, default=DEFAULT_MODEL,
                        help=f"HF checkpoint folder (default {DEFAULT_MODEL}, written if missing)")
    parser.add_argument("--transfer-backend", choices=BACKENDS, default="mooncake",
                        help="KV transfer engine between prefill and decode (default mooncake)")
    parser.add_argument("--num-prefill", type=int, default=1, help="prefill workers (default 1)")
    parser.add_argument("--num-decode", type=int, default=1, help="decode workers (default 1)")
    parser.add_argument("--host", default="127.0.0.1", help="address every process binds (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="gateway HTTP port (default 8000)")
    parser.add_argument("--policy", default="cache_aware",
                        help="gateway routing policy (default cache_aware)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                        help="weights and KV dtype of every worker (default auto: the checkpoint's)")
    parser.add_argument("--worker-threads", type=int, default=None,
                        help="torch CPU threads per worker (default: torch's choice)")
    parser.add_argument("--etcd-endpoints", default=None,
                        help="keep the registry in this etcd (comma-separated http://HOST:PORT; default: "
                             "the registry's own memory)")
    parser.add_argument("--num-registries", type=int, default=1,
                        help="registry processes (default 1; more than 1 needs --etcd-endpoints): workers "
                             "and the gateway get every address and fail over between them")
    parser.add_argument("--hicache", choices=HICACHE_BACKENDS, default=None,
                        help="start this cluster-wide KV store (mooncake: Mooncake Store's master) and run "
                             "every worker with --enable-hierarchical-cache on it (default: none)")
    parser.add_argument("--hicache-master-port", type=int, default=0,
                        help="RPC port of the store's master with --hicache (default 0: a free port)")
    parser.add_argument("--log-dir", type=Path, default=Path(".cache/up-logs"),
                        help="one log file per process")
    parser.add_argument("--ready-timeout", type=float, default=300.0,
                        help="seconds each step may take to come up")
    parser.add_argument("--grace-period", type=float, default=10.0, help="seconds each process gets to stop")


class _Stop:
    """SIGINT/SIGTERM flag: set once, the main loop notices within 0.2 s."""

    def __init__(self) -> None:
        self.signal: int | None = None
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._set)

    def _set(self, sig: int, frame: object) -> None:
        if self.signal is not None and sig == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop waiting for a graceful shutdown
        self.signal = sig

    def __bool__(self) -> bool:
        return self.signal is not None


def say(line: str) -> None:
    print(line, flush=True)


def ensure_model(model_path: Path) -> None:
    if (model_path / "config.json").is_file():
        return
    if model_path.resolve() != DEFAULT_MODEL.resolve():
        raise SystemExit(f"pdserve up: --model-path {model_path} has no config.json")
    say(f"writing the built-in tiny model to {model_path} ...")
    subprocess.run([sys.executable, "-m", "pdserve", "make-tiny-model", "--out", str(model_path)], check=True)


def wait_healthy(url: str, timeout_s: float, children: list[Service], stop: _Stop) -> dict:
    """Poll the gateway's /health until 200; show what it is waiting for."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline and not stop:
        for child in children:
            if not child.alive():
                raise NotReady(f"{child.name} exited with code {child.popen.returncode}:\n"
                               f"{child.log_tail(4000)}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read() or b"{}")
            seen = body.get("workers", {})
            status = ", ".join(f"{count} {role}" for role, count in seen.items())
            if status != last:
                say(f"  gateway sees {status}; waiting for a servable pair ...")
                last = status
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.3)
    raise NotReady("interrupted" if stop else f"gateway not healthy within {timeout_s:.0f}s")


def start_store(args: argparse.Namespace, group: ProcessGroup, stop: _Stop) -> list[str]:
    """Start the store's master (first in the group's start order, so it is stopped last) and return
    the worker flags that use it."""
    say(f"starting {mooncake_master.NAME} ...")
    master = mooncake_master.spawn(args.log_dir, args.host, args.hicache_master_port)
    group.procs.insert(0, master)
    mooncake_master.wait_listening(master, args.ready_timeout, lambda: bool(stop))
    say(f"  {master.name} ready on {master.address}")
    return ["--enable-hierarchical-cache", "--hicache-storage-backend", args.hicache,
            "--hicache-mooncake-master", master.address]


def main(args: argparse.Namespace) -> int:
    if args.num_prefill < 1 or args.num_decode < 1:
        raise SystemExit("pdserve up: --num-prefill and --num-decode must be >= 1")
    if args.num_registries < 1 or (args.num_registries > 1 and not args.etcd_endpoints):
        raise SystemExit("pdserve up: --num-registries must be >= 1, and above 1 needs --etcd-endpoints "
                         "(registries share their workers only through etcd)")
    if args.hicache_master_port and not args.hicache:
        raise SystemExit("pdserve up: --hicache-master-port needs --hicache mooncake")
    if not 0 <= args.hicache_master_port <= 65535:
        raise SystemExit("pdserve up: --hicache-master-port must be a port number, "
                         f"got {args.hicache_master_port}")
    if args.hicache_master_port and not mooncake_master.port_free(args.host, args.hicache_master_port):
        raise SystemExit(f"pdserve up: --hicache-master-port {args.hicache_master_port} is in use on "
                         f"{args.host}")
    stop = _Stop()
    ensure_model(args.model_path)
    model_path = str(args.model_path)
    secret = envs.CLUSTER_SECRET.get() or secrets.token_urlsafe(32)
    group = ProcessGroup(args.log_dir, env={envs.CLUSTER_SECRET.name: secret})
    children = group.procs  # in start order
    started = time.monotonic()
    try:
        store = (["--registry-store", "etcd", "--etcd-endpoints", args.etcd_endpoints]
                 if args.etcd_endpoints else [])
        registries = []
        for index in range(args.num_registries):
            name = "bootstrap" if args.num_registries == 1 else f"bootstrap-{index}"
            say(f"starting {name} registry{' on etcd' if store else ''} (logs in {args.log_dir}/) ...")
            registry = group.spawn(name, ["bootstrap", "--host", args.host, "--port", "0", *store])
            registry.wait_ready(args.ready_timeout, lambda: bool(stop))
            say(f"  {name} ready on {registry.address}")
            registries.append(registry.address)
        registry_addresses = ",".join(registries)

        hicache = start_store(args, group, stop) if args.hicache else []

        workers = []
        threads = ["--num-threads", str(args.worker_threads)] if args.worker_threads else []
        for role, count in (("prefill", args.num_prefill), ("decode", args.num_decode)):
            for index in range(count):
                name = f"{role}-{index}"
                say(f"starting {name} ({args.transfer_backend}) ...")
                worker = group.spawn(name, [
                    "launch-server", "--model-path", model_path, "--disaggregation-mode", role,
                    "--disaggregation-transfer-backend", args.transfer_backend, "--host", args.host,
                    "--port", "0", "--bootstrap", registry_addresses, "--dtype", args.dtype, *threads,
                    *hicache])
                workers.append(worker)
        for worker in workers:
            worker.wait_ready(args.ready_timeout, lambda: bool(stop))
            say(f"  {worker.name} ready on {worker.address} (metrics :{worker.metrics_port})")

        say("starting gateway ...")
        gateway = group.spawn("gateway", [
            "launch-router", "--model-path", model_path, "--bootstrap", registry_addresses,
            "--host", args.host, "--port", str(args.port), "--policy", args.policy])
        gateway.wait_ready(args.ready_timeout, lambda: bool(stop))
        base = f"http://{args.host}:{gateway.port}"
        health = wait_healthy(f"{base}/health", args.ready_timeout, children, stop)
        model = health.get("model", args.model_path.resolve().name)
        request = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}],
                              "max_tokens": 32})
        say(f"\npdserve is up in {time.monotonic() - started:.1f}s: {base}  (model {model}, "
            f"{args.num_prefill} prefill + {args.num_decode} decode, {args.transfer_backend}"
            f"{', KV store ' + hicache[-1] if hicache else ''})\n")
        say(f"  curl {base}/v1/chat/completions -H 'Content-Type: application/json' -d '{request}'\n")
        say(f"  metrics: {base}/metrics   API docs: {base}/docs   logs: {args.log_dir}/")
        say("Press Ctrl-C to stop.")
        while not stop:
            for child in children:
                if not child.alive():
                    say(f"{child.name} exited with code {child.popen.returncode}; last log lines:\n"
                        f"{child.log_tail(2000)}")
                    return 1
            time.sleep(0.2)
        say("\nstopping ...")
        return 0
    except NotReady as exc:
        if stop:
            say("\ninterrupted while starting: stopping ...")
            return 0
        say(f"pdserve up failed: {exc}")
        return 1
    finally:
        # gateway first (stops taking requests), then decode/prefill, the registry, the store's master last
        group.stop_all(args.grace_period, report=lambda line: say(f"  {line}"))
