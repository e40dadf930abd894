"""GatewayState: the objects one gateway is made of, built once from its config."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.common.text_parsers import TextParsers
from services.gateway.config import GatewayConfig, StaticWorker
from services.gateway.discovery import HealthProber, RegistryDiscovery, WorkerCheck, add_static_workers
from services.gateway.dispatcher import Dispatcher, DispatchSettings
from services.gateway.kv_events import KvEventSubscriptions
from services.gateway.lora_on_demand import OnDemandAdapters
from services.gateway.metrics import GatewayMetrics
from services.gateway.policies import make_policy
from services.gateway.prompts import ModelFiles
from services.gateway.workers import CircuitBreaker, Router, WorkerPool


@dataclass
class GatewayState:
    """Everything a request handler needs; `start()`/`close()` run discovery and probes."""

    config: GatewayConfig
    model_name: str
    model_files: ModelFiles
    pool: WorkerPool
    router: Router
    dispatcher: Dispatcher
    metrics: GatewayMetrics
    discovery: RegistryDiscovery | None = None
    prober: HealthProber | None = None
    kv_events: KvEventSubscriptions | None = None
    text_parsers: TextParsers = field(default_factory=TextParsers)  # how chat output is read
    created: int = field(default_factory=lambda: int(time.time()))

    async def start(self) -> None:
        if self.discovery is not None:
            self.discovery.start()
        if self.prober is not None:
            self.prober.start()
        if self.kv_events is not None:
            self.kv_events.start()

    async def close(self) -> None:
        if self.kv_events is not None:
            await self.kv_events.close()
        if self.prober is not None:
            await self.prober.close()
        if self.discovery is not None:
            await self.discovery.close()
        await self.dispatcher.drain()
        self.pool.close()

    def readiness(self) -> str | None:
        """None when the gateway can serve now; else why not. Ready means: the registry view is
        synced (when a registry is used) and some route's workers have answered (a health probe or
        a request) and are not failing."""
        if self.discovery is not None and not self.discovery.synced.is_set():
            return f"registry {self.discovery.registry_address} not synced yet"
        prefills, decodes = self.router.candidates(self.model_name)
        reachable_prefill = any(w.reachable for w in prefills)
        if any(w.reachable and (w.role == "colocated" or reachable_prefill) for w in decodes):
            return None
        if not decodes:
            return f"no healthy workers for model {self.model_name!r}"
        return f"no worker for model {self.model_name!r} has answered a health check yet"


def build_state(config: GatewayConfig, static_workers: Sequence[StaticWorker] = (), *,
                model_files: ModelFiles | None = None, model_name: str | None = None,
                worker_check: WorkerCheck | None = None,
                reported_parsers: TextParsers = TextParsers()) -> GatewayState:
    """The gateway's objects. `model_files`/`model_name`: the model learned from the workers when
    there is no --model-path (services.gateway.model_source), and `worker_check` admits registry
    workers only once they report that model; default: read from --model-path. `reported_parsers`:
    the parser names that model's worker reported (the gateway's flags win)."""
    model_name = model_name or config.served_model_name
    if model_name is None or (model_files is None and not config.model_path):
        raise ValueError("the gateway needs --model-path, or a model learned from its workers")
    pool = WorkerPool(lambda: CircuitBreaker(config.breaker_failures, config.breaker_cooldown),
                      security=config.security)
    add_static_workers(pool, static_workers, model_name)
    router = Router(pool, make_policy(config.prefill_policy_name, config),
                    make_policy(config.decode_policy_name, config))
    metrics = GatewayMetrics(pool)
    metrics.start_at_zero(model_name)
    discovery = RegistryDiscovery(pool, config.bootstrap, model_name, security=config.security,
                                  rejoin_grace_s=config.registry_rejoin_grace,
                                  check=worker_check) if config.bootstrap else None
    model_files = model_files or ModelFiles(config.model_path)
    dispatcher = Dispatcher(router, metrics, DispatchSettings(
        max_attempts=config.max_attempts, retry_backoff_s=config.retry_backoff,
        first_token_timeout_s=config.first_token_timeout, abort_timeout_s=config.abort_timeout,
        migration_limit=config.migration_limit),
        synced=discovery.synced if discovery is not None else None, tokenizer=model_files.tokenizer)
    if config.enable_lora:
        dispatcher.adapter_loader = OnDemandAdapters(pool, model_name).load
    prober = HealthProber(pool, interval_s=max(0.05, min(1.0, config.breaker_cooldown)))
    # Only cache_aware reads the workers' KV events: other policies need no subscription.
    cache_aware = "cache_aware" in (config.prefill_policy_name, config.decode_policy_name)
    kv_events = KvEventSubscriptions(pool, on_lag=metrics.kv_event_lag.observe) if cache_aware else None
    return GatewayState(config=config, model_name=model_name, model_files=model_files,
                        pool=pool, router=router, dispatcher=dispatcher, metrics=metrics, discovery=discovery,
                        prober=prober, kv_events=kv_events,
                        text_parsers=config.text_parsers.over(reported_parsers))
