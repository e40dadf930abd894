"""Rank 0's side of starting a tensor-parallel engine: spawn the followers, form the group."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from typing import TypeVar

import torch

from engine.config import EngineConfig
from engine.models.config import ModelConfig
from engine.tp.control import ControlListener
from engine.tp.group import TPGroup, free_port, open_store
from engine.tp.ranks import FollowerRanks, default_threads
from engine.tp.shard import check_tp_size

T = TypeVar("T")

# Ranks on one machine rendezvous over loopback, whatever address the worker serves on.
RENDEZVOUS_HOST = "127.0.0.1"


def start_tensor_parallel(config: EngineConfig, device: torch.device) -> tuple[TPGroup, FollowerRanks]:
    """Start ranks 1..tp_size-1, join them as rank 0 and accept their control connections; raise
    (with the followers killed) if one of them exits first, instead of waiting for a timeout."""
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL binds rank 0's communicator to the current device
    topology = config.topology()
    port = free_port(RENDEZVOUS_HOST)
    store = open_store(RENDEZVOUS_HOST, port, topology.world_size, True, config.dist_timeout)
    control = ControlListener()
    followers = FollowerRanks.start(config, port, control)
    try:
        group = _while_followers_run(followers, lambda: TPGroup(0, topology, store, device, config.dist_timeout),
                                     "join the group")
        controls = _while_followers_run(followers, lambda: control.accept(topology.world_size - 1),
                                        "connect its control channel")
    except BaseException:
        followers.kill()
        raise
    followers.controls = [controls[rank] for rank in range(1, topology.world_size)]
    return group, followers


def _while_followers_run(followers: FollowerRanks, function: Callable[[], T], what: str) -> T:
    """`function()` in a thread, failing fast if a follower exits while it waits for them."""
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["value"] = function()
        except BaseException as exc:  # re-raised below
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="pdserve-tp-rendezvous", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.2)
        exited = followers.exited()
        if exited is not None and thread.is_alive():
            raise RuntimeError(f"tp rank {exited[0]} exited with code {exited[1]} before it could {what}")
    if "error" in outcome:
        raise RuntimeError(f"tp ranks could not {what}: {outcome['error']}")
    return outcome["value"]  # type: ignore[return-value]


def prepare_config(config: EngineConfig, model_config: ModelConfig) -> EngineConfig:
    """Refuse a model that does not split `tp_size` ways; give each rank its share of the CPUs
    when no thread count is set (N ranks each using every core would fight over them)."""
    check_tp_size(config.tp_size, model_config)
    if config.num_threads:
        return config
    return replace(config, num_threads=default_threads(config.topology().ranks_per_node))
