"""Where one worker's ranks meet: the rendezvous store, on one node or across nodes.

Rank 0 serves a torch.distributed TCPStore; every other rank connects to it before joining the
process group. On one node it is a free loopback port. Across nodes (`--nnodes N
--dist-init-addr HOST:PORT`, SGLang's flags) node 0 serves it on HOST:PORT and the other nodes'
processes connect there. Besides the group's own rendezvous the store carries:

- `pdserve:topology`: node 0's rank layout, which every other node compares with its own before
  joining, so that a node started with other sizes is refused naming both;
- `pdserve:control`: the address and key of rank 0's control listener (engine.tp.control), for
  ranks that were not started by rank 0's process;
- `pdserve:heartbeat:<name>`: a counter each rank (and each other node's supervising process)
  bumps every second, so that rank 0 notices a rank or node that died or froze, and a node
  notices that rank 0 did (`HeartbeatWatch`).

The store is not authenticated (neither is torch.distributed's group): anyone who can reach the
init address can read it or join. `warn_if_exposed` says so at start when it is not loopback.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch.distributed as dist

from engine.tp.topology import Topology, TopologyError
from pdserve.netaddr import is_loopback

log = logging.getLogger(__name__)

TOPOLOGY_KEY = "pdserve:topology"
CONTROL_KEY = "pdserve:control"
HEARTBEAT_INTERVAL_S = 1.0
# A rank or node whose heartbeat has not moved for this long is lost (dead, frozen or cut off):
# its worker exits rather than wait out a collective's --dist-timeout. Generous against a loaded
# machine starving a heartbeat thread, short against a frozen peer holding every request.
NODE_LOST_AFTER_S = 15.0


class RendezvousError(RuntimeError):
    """This node cannot join (or host) the rank group; the message names the address and the node."""


def parse_init_addr(value: str | None) -> tuple[str, int]:
    if value is None:  # EngineConfig refuses --nnodes above 1 without it
        raise ValueError("--dist-init-addr HOST:PORT is needed across nodes")
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--dist-init-addr must be HOST:PORT, got {value!r}")
    return host.strip("[]"), int(port)


def open_store(host: str, port: int, world_size: int, is_master: bool, timeout_s: float,
               node_rank: int = 0) -> dist.TCPStore:
    """Rank 0's process serves the store on (host, port) (every interface, that port); the others
    connect to it, failing after `timeout_s` with a message naming the address and this node."""
    try:
        return dist.TCPStore(host, port, world_size, is_master=is_master, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, OSError) as exc:  # DistStoreError and DistNetworkError are RuntimeErrors
        if is_master:
            raise RendezvousError(f"node 0 cannot listen on --dist-init-addr {host}:{port}: {exc}") from None
        raise RendezvousError(f"node {node_rank} cannot reach node 0's rank group at --dist-init-addr "
                              f"{host}:{port} within {timeout_s:.0f}s: {exc}") from None


def model_identity(model_path: str) -> str:
    """The checkpoint's config.json digest: nodes must load the same model, wherever it is mounted."""
    return hashlib.sha256((Path(model_path) / "config.json").read_bytes()).hexdigest()[:16]


def publish_topology(store: dist.Store, topology: Topology, model: str) -> None:
    store.set(TOPOLOGY_KEY, json.dumps({**_comparable(topology), "model": model}))


def check_topology(store: dist.Store, topology: Topology, model: str) -> None:
    """Refuse to join a node 0 whose sizes (or model) differ from this node's, naming both."""
    theirs = json.loads(store.get(TOPOLOGY_KEY))
    ours = {**_comparable(topology), "model": model}
    differ = [key for key in ours if ours[key] != theirs.get(key)]
    if differ:
        raise TopologyError("node {} was started with {} but node 0 with {}".format(
            topology.node_rank, ", ".join(f"{_flag(k)} {ours[k]}" for k in differ),
            ", ".join(f"{_flag(k)} {theirs.get(k)}" for k in differ)))


def _comparable(topology: Topology) -> dict:
    fields = asdict(topology)
    fields.pop("node_rank")
    return fields


def _flag(key: str) -> str:
    return "--model-path" if key == "model" else "--" + key.replace("_", "-")


def publish_control(store: dist.Store, address: tuple[str, int], authkey: bytes) -> None:
    store.set(CONTROL_KEY, json.dumps([address[0], address[1], authkey.hex()]))


def lookup_control(store: dist.Store) -> tuple[tuple[str, int], bytes]:
    host, port, key = json.loads(store.get(CONTROL_KEY))
    return (host, port), bytes.fromhex(key)


def use_interface_of(host: str) -> None:
    """Make gloo (and NCCL's bootstrap) talk over the interface holding `host`, this node's address.

    Left to themselves they resolve the machine's hostname, which is often 127.0.0.1 (an /etc/hosts
    line, or a container): the other nodes would then be told to dial their own loopback. An
    interface the operator named in GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME is kept."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(address.address == host for address in addresses):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", name)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", name)
            return
    raise RendezvousError(f"no network interface of this node has the address {host} (--host, or node 0's "
                          "--dist-init-addr host): the other nodes' ranks could not reach this one")


def warn_if_exposed(host: str) -> None:
    if not is_loopback(host):
        log.warning("the rank group at --dist-init-addr %s is not authenticated (torch.distributed's store "
                    "and group are not): anyone who can reach that address can join it or read the steps' "
                    "token ids. Keep it on the cluster's private network.", host)


class HeartbeatWatch:
    """Bumps this process's heartbeat counter in the store every second, and watches others'.

    Every rank's process beats (`tp rank R`), and so does each other node's supervising process
    (`node N`). Rank 0 watches every follower rank and node, so a rank that froze (SIGSTOP, a hung
    host: alive to the OS, silent to the group) takes the worker down within `timeout_s` instead of
    holding a collective until --dist-timeout; a node's supervisor watches rank 0. `on_lost(why)`
    is called once, from the watch thread, when a watched counter has not moved for `timeout_s`, or
    the store cannot be reached (it lives in rank 0's process). Counters, not timestamps: the
    nodes' clocks need not agree.
    """

    def __init__(self, store: dist.Store, me: str, watched: list[str], timeout_s: float,
                 on_lost: Callable[[str], None], first_beat_timeout_s: float | None = None) -> None:
        self.store, self.me, self.watched = store, me, watched
        self.timeout_s, self.on_lost = timeout_s, on_lost
        # A watched process that has never beaten may still be starting: rank 0 beats only once the
        # group has joined, which on a loaded machine can take longer than `timeout_s`.
        self.first_beat_timeout_s = max(timeout_s, first_beat_timeout_s or timeout_s)
        self._stop = threading.Event()
        threading.Thread(target=self._run, name="pdserve-heartbeat", daemon=True).start()

    def _run(self) -> None:
        seen = {name: (-1, time.monotonic()) for name in self.watched}
        while not self._stop.wait(HEARTBEAT_INTERVAL_S):
            try:
                self.store.add(f"pdserve:heartbeat:{self.me}", 1)
                counts = {name: self.store.add(f"pdserve:heartbeat:{name}", 0) for name in self.watched}
            except (RuntimeError, OSError) as exc:
                if not self._stop.is_set():
                    self.on_lost(f"the rank group's store (in rank 0's process) is unreachable: {exc}")
                return
            now = time.monotonic()
            for name, count in counts.items():
                last, since = seen[name]
                limit = self.timeout_s if count > 0 else self.first_beat_timeout_s
                if count != last:
                    seen[name] = (count, now)
                elif now - since > limit and not self._stop.is_set():
                    self.on_lost(f"{name} sent no heartbeat for {limit:.0f}s")
                    return

    def stop(self) -> None:
        self._stop.set()
