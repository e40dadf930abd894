"""Routing policies, one per file, one interface (base.Policy). `make_policy` builds one by name."""

from __future__ import annotations

from services.gateway.config import GatewayConfig
from services.gateway.policies.base import Policy
from services.gateway.policies.cache_aware import CacheAwarePolicy
from services.gateway.policies.power_of_two import PowerOfTwoPolicy
from services.gateway.policies.random_pick import RandomPolicy
from services.gateway.policies.round_robin import RoundRobinPolicy

__all__ = ["Policy", "make_policy", "CacheAwarePolicy", "PowerOfTwoPolicy", "RandomPolicy",
           "RoundRobinPolicy"]


def make_policy(name: str, config: GatewayConfig | None = None) -> Policy:
    """A fresh policy instance; cache_aware takes its thresholds from `config` when given."""
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "random":
        return RandomPolicy()
    if name == "power_of_two":
        return PowerOfTwoPolicy()
    if name == "cache_aware":
        if config is None:
            return CacheAwarePolicy()
        return CacheAwarePolicy(config.cache_threshold, config.balance_abs_threshold,
                                config.balance_rel_threshold, config.max_tree_tokens)
    raise ValueError(f"unknown policy {name!r}; expected round_robin | random | power_of_two | cache_aware")
