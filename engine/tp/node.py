"""A node other than node 0 (`launch-server --nnodes N --node-rank R>0`): it only runs ranks.

As SGLang's: the same command line on every node, only --node-rank (and --host, this node's
address) differ. This process serves no RPC and registers nowhere; it checks that node 0 was
started with the same layout and model, starts its world / nnodes ranks (engine.tp.follower,
each joining node 0's rank group and control listener, loading its shard and binding its transfer
engine to this node's --host), and supervises them:

- a rank exits with an error -> the others are killed and this process exits 1 (node 0 sees the
  node's heartbeat stop and its collectives fail, and its worker exits: the gateway routes around it);
- rank 0 closes the group (node 0's worker shut down) -> the ranks leave and this process exits 0;
- node 0 is gone or frozen (its heartbeat stops, or its store stops answering) -> same;
- SIGTERM / SIGINT -> the ranks are killed and this process exits 0.
Killed with -9, its ranks notice their parent is gone and exit too.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

from engine.config import EngineConfig
from engine.models.config import ModelConfig
from engine.tp.ranks import FollowerRanks
from engine.tp.rendezvous import (
    NODE_LOST_AFTER_S,
    HeartbeatWatch,
    RendezvousError,
    check_topology,
    is_loopback,
    lookup_control,
    model_identity,
    open_store,
    parse_init_addr,
    use_interface_of,
)
from engine.tp.setup import prepare_config
from engine.tp.topology import TopologyError

log = logging.getLogger("pdserve.node")


def _left_cleanly(followers: FollowerRanks, grace_s: float = 3.0) -> bool:
    """Whether every rank leaves with code 0 within `grace_s` (they were told to by rank 0)."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        codes = [proc.poll() for proc in followers.procs]
        if all(code is not None for code in codes):
            return all(code == 0 for code in codes)
        time.sleep(0.1)
    return False


def run_node(config: EngineConfig, host: str) -> int:
    """Run node `config.node_rank`'s ranks until one exits, node 0 is lost or a signal comes."""
    topology = config.topology()
    init_host, port = parse_init_addr(config.dist_init_addr)
    try:
        if is_loopback(host) and not is_loopback(init_host):
            raise RendezvousError(f"node {topology.node_rank}: --host {host} is a loopback address, which "
                                  "node 0's ranks cannot reach: pass this node's address (as in the seeds' "
                                  "commands)")
        use_interface_of(host)  # this node's ranks (our children) talk over it
        store = open_store(init_host, port, topology.world_size, False, config.dist_timeout,
                           topology.node_rank)
        check_topology(store, topology, model_identity(config.model_path))
        control, authkey = lookup_control(store)
        # The heartbeat gets its own connection with a short timeout: a frozen node 0 must not hold
        # this node for --dist-timeout.
        beat_store = open_store(init_host, port, topology.world_size, False, NODE_LOST_AFTER_S,
                                topology.node_rank)
    except (RendezvousError, TopologyError) as exc:
        log.error("%s", exc)
        return 2
    config = prepare_config(config, ModelConfig.from_dir(config.model_path))
    ranks = list(topology.node_ranks())
    followers = FollowerRanks.start(config, ranks, (init_host, port), control, authkey, transfer_host=host)
    done = threading.Event()
    outcome: dict[str, tuple[int, str]] = {}  # "result": (exit code, why)

    def finish(code: int, why: str) -> None:
        outcome.setdefault("result", (code, why))
        done.set()

    # Rank 0 beats once the group has joined, which it gives --dist-timeout.
    heartbeat = HeartbeatWatch(beat_store, f"node {topology.node_rank}", ["tp rank 0"], NODE_LOST_AFTER_S,
                               lambda why: finish(1, f"node 0 is lost: {why}"),
                               first_beat_timeout_s=config.dist_timeout)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda received, _frame: finish(0, f"got {signal.Signals(received).name}"))
    log.info("node %d of %d: ranks %d..%d of %s started, joining --dist-init-addr %s:%d, transfer engines "
             "on %s", topology.node_rank, topology.nnodes, ranks[0], ranks[-1], topology.describe(),
             init_host, port, host)
    while not done.wait(0.2):
        exited = followers.exited()
        if exited is not None:
            rank, code = exited
            # Code 0: rank 0 closed the group (its worker shut down); anything else is a failure.
            if code == 0:
                finish(0, "rank 0 closed the group")
            else:
                finish(1, f"tp rank {rank} exited with code {code}")
    code, why = outcome["result"]
    if code and _left_cleanly(followers):  # node 0 shut down first, then its store went away
        code, why = 0, "rank 0 closed the group"
    heartbeat.stop()
    (log.info if code == 0 else log.error)("node %d: %s; stopping its ranks", topology.node_rank, why)
    followers.kill()
    return code
