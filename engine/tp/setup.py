"""Rank 0's side of starting a tensor-parallel engine: spawn the followers, form the group."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import TypeVar

import torch

from engine.config import EngineConfig
from engine.models.config import ModelConfig
from engine.tp.control import ControlListener
from engine.tp.group import TPGroup, free_port
from engine.tp.ranks import FollowerRanks, default_threads
from engine.tp.rendezvous import (
    NODE_LOST_AFTER_S,
    HeartbeatWatch,
    model_identity,
    open_store,
    parse_init_addr,
    publish_control,
    publish_topology,
    use_interface_of,
    warn_if_exposed,
)
from engine.tp.shard import check_tp_size
from engine.tp.topology import Topology

T = TypeVar("T")

log = logging.getLogger(__name__)

# Ranks on one machine rendezvous over loopback, whatever address the worker serves on.
RENDEZVOUS_HOST = "127.0.0.1"


def start_tensor_parallel(config: EngineConfig, device: torch.device) -> tuple[TPGroup, FollowerRanks]:
    """Start this node's other ranks, serve the rendezvous store, join the group as rank 0 and accept
    every follower's control connection (other nodes' too: engine.tp.node starts theirs); raise
    (with the local followers killed) if one of them exits first, or a node does not join in time."""
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL binds rank 0's communicator to the current device
    topology = config.topology()
    if topology.nnodes > 1:
        host, port = parse_init_addr(config.dist_init_addr)
        warn_if_exposed(host)
        use_interface_of(host)  # node 0's ranks (and their children, which inherit it) talk over it
    else:
        host, port = RENDEZVOUS_HOST, free_port(RENDEZVOUS_HOST)
    store = open_store(host, port, topology.world_size, True, config.dist_timeout)
    control = ControlListener(host)
    if topology.nnodes > 1:
        publish_topology(store, topology, model_identity(config.model_path))
        publish_control(store, control.address, control.authkey)
    followers = FollowerRanks.start(config, list(topology.node_ranks(0))[1:], (host, port), control.address,
                                    control.authkey)
    try:
        group = _while_followers_run(followers,
                                     lambda: TPGroup(0, topology, store, device, config.dist_timeout),
                                     _join_what(topology, config))
        controls = _while_followers_run(followers, lambda: control.accept(topology.world_size - 1),
                                        "connect its control channel")
    except BaseException:
        followers.kill()
        raise
    followers.controls = [controls[rank] for rank in range(1, topology.world_size)]
    watched = [f"tp rank {rank}" for rank in range(1, topology.world_size)]
    watched += [f"node {node}" for node in range(1, topology.nnodes)]
    followers.heartbeat = HeartbeatWatch(store, "tp rank 0", watched, NODE_LOST_AFTER_S, followers.lost)
    if topology.nnodes > 1:
        log.info("rank group of %s joined at --dist-init-addr %s:%d", topology.describe(), host, port)
    return group, followers


def _join_what(topology: Topology, config: EngineConfig) -> str:
    if topology.nnodes == 1:
        return "join the group"
    return (f"join the group (ranks {topology.ranks_per_node}..{topology.world_size - 1} on nodes "
            f"1..{topology.nnodes - 1} join at --dist-init-addr {config.dist_init_addr} within "
            f"--dist-timeout {config.dist_timeout:.0f}s)")


def _while_followers_run(followers: FollowerRanks, function: Callable[[], T], what: str) -> T:
    """`function()` in a thread, failing fast if a follower exits while it waits for them."""
    values: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            values.append(function())
        except BaseException as exc:  # re-raised below
            errors.append(exc)

    thread = threading.Thread(target=run, name="pdserve-tp-rendezvous", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.2)
        exited = followers.exited()
        if exited is not None and thread.is_alive():
            raise RuntimeError(f"tp rank {exited[0]} exited with code {exited[1]} before it could {what}")
    if errors:
        raise RuntimeError(f"tp ranks could not {what}: {errors[0]}")
    return values[0]


def prepare_config(config: EngineConfig, model_config: ModelConfig) -> EngineConfig:
    """Refuse a model that does not split `tp_size` ways; give each rank its share of the CPUs
    when no thread count is set (N ranks each using every core would fight over them)."""
    topology = config.topology()
    check_tp_size(config.tp_size, model_config, topology.ep_size, topology.attn_tp_size)
    if config.num_threads:
        return config
    return replace(config, num_threads=default_threads(config.topology().ranks_per_node))
