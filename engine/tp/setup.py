"""Rank 0's side of starting a tensor-parallel engine: spawn the followers, form the group."""

from __future__ import annotations

import threading
from dataclasses import replace

import torch

from engine.config import EngineConfig
from engine.models.config import ModelConfig
from engine.tp.group import TPGroup, free_port
from engine.tp.ranks import FollowerRanks, default_threads
from engine.tp.shard import check_divisible

# Ranks on one machine rendezvous over loopback, whatever address the worker serves on.
RENDEZVOUS_HOST = "127.0.0.1"


def start_tensor_parallel(config: EngineConfig, device: torch.device) -> tuple[TPGroup, FollowerRanks]:
    """Start ranks 1..tp_size-1 and join them as rank 0; raise (with the followers killed) if one
    of them exits before the group is formed, instead of waiting for the rendezvous timeout."""
    port = free_port(RENDEZVOUS_HOST)
    followers = FollowerRanks.start(config, port)
    outcome: dict[str, object] = {}

    def join() -> None:
        try:
            outcome["group"] = TPGroup(0, config.tp_size, RENDEZVOUS_HOST, port, device)
        except BaseException as exc:  # re-raised below
            outcome["error"] = exc

    thread = threading.Thread(target=join, name="pdserve-tp-rendezvous", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.2)
        exited = followers.exited()
        if exited is not None and thread.is_alive():
            followers.kill()
            raise RuntimeError(f"tp rank {exited[0]} exited with code {exited[1]} before joining the group")
    if "error" in outcome:
        followers.kill()
        raise RuntimeError(f"tp group of {config.tp_size} ranks did not form: {outcome['error']}")
    return outcome["group"], followers  # type: ignore[return-value]


def prepare_config(config: EngineConfig, model_config: ModelConfig) -> EngineConfig:
    """Refuse a model that does not split `tp_size` ways; give each rank its share of the CPUs
    when no thread count is set (N ranks each using every core would fight over them)."""
    check_divisible(config.tp_size, model_config.num_heads, model_config.num_kv_heads,
                    model_config.intermediate_size)
    if config.num_threads:
        return config
    return replace(config, num_threads=default_threads(config.tp_size))
