"""The gateway's Prometheus metrics (`pdserve:gateway_*`), served at GET /metrics on its HTTP port.

Latencies are measured as the client sees them: from the moment the request arrived at the
gateway (tokenization, routing, retries included) to the moment a token was handed to the HTTP
response. Per-worker in-flight counts and circuit states are read from the WorkerPool at scrape
time, so a worker that left simply disappears from the next scrape.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from services.common.metrics import metric_name
from services.gateway.workers import WorkerPool

if TYPE_CHECKING:  # middleware reaches this module through responses.py
    from services.gateway.middleware import AdmissionControl

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    10.0, 30.0, 60.0, 120.0)
# a policy's pick: tens of microseconds for few workers, a prefix-tree walk over many (the 1 ms mark is
# what fleet-scale routing must stay under)
_KV_LAG_BUCKETS = (1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.05)
# the event loop's stretches of CPU time without a turn at a 5 ms timer (loop_watch.py)
_LOOP_BUSY_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0,
                2.5, 5.0)
# Exported at 0 from the start (see GatewayMetrics.start_at_zero): the dispatcher's retry and
# migration reasons (services/gateway/dispatcher.py) and the admission queue's shed reasons
# (middleware.py).
RETRY_REASONS = ("prefill_failed", "unavailable", "resource_exhausted", "deadline_exceeded", "worker_abort",
                 "truncated", "worker_lost", "first_token_timeout")
MIGRATION_REASONS = ("worker_lost", "truncated", "unavailable", "internal", "unknown", "prefill_failed")
SHED_REASONS = ("queue_full", "queue_timeout")


class _PoolCollector(Collector):
    """Per-worker gauges computed from the pool when Prometheus scrapes."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[GaugeMetricFamily]:
        inflight = GaugeMetricFamily(metric_name("gateway_worker_inflight_requests"),
                                     "Requests this gateway has open on each worker",
                                     labels=["worker", "role"])
        circuit = GaugeMetricFamily(metric_name("gateway_worker_circuit_state"),
                                    "Circuit breaker state per worker: 0 closed, 1 half-open, 2 open",
                                    labels=["worker", "role"])
        cached = GaugeMetricFamily(metric_name("gateway_worker_cached_pages"),
                                   "KV pages each worker's prefix cache holds, as its KV events tell "
                                   "(-1: not known: no event stream)", labels=["worker", "role"])
        workers = GaugeMetricFamily(metric_name("gateway_workers"), "Known workers by role", labels=["role"])
        counts: dict[str, int] = {"prefill": 0, "decode": 0, "colocated": 0}
        for worker in self.pool.all():
            inflight.add_metric([worker.address, worker.role], worker.inflight)
            circuit.add_metric([worker.address, worker.role], worker.breaker.state.gauge_value)
            view = worker.kv_cache
            cached.add_metric([worker.address, worker.role], len(view.hashes) if view.synced else -1)
            counts[worker.role] = counts.get(worker.role, 0) + 1
        for role, count in counts.items():
            workers.add_metric([role], count)
        yield inflight
        yield circuit
        yield cached
        yield workers


class _AdmissionCollector(Collector):
    """Slots held and requests waiting per model, from the admission queues when Prometheus scrapes."""

    def __init__(self, admission: AdmissionControl) -> None:
        self.admission = admission

    def collect(self) -> Iterator[GaugeMetricFamily]:
        running = GaugeMetricFamily(metric_name("gateway_admission_running_slots"),
                                    "Generation slots held by admitted requests", labels=["model"])
        waiting = GaugeMetricFamily(metric_name("gateway_admission_waiting_requests"),
                                    "Requests waiting for admission", labels=["model"])
        for model, queue in list(self.admission.queues.items()):
            running.add_metric([model], queue.running)
            waiting.add_metric([model], queue.waiting)
        yield running
        yield waiting


class GatewayMetrics:
    """All gateway metrics in their own CollectorRegistry (several gateways can share a process)."""

    def __init__(self, pool: WorkerPool) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(metric_name("gateway_requests"), "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=self.registry)
        self.ttft = Histogram(metric_name("gateway_time_to_first_token_seconds"),
                              "Arrival at the gateway to the first token handed to the client",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram(metric_name("gateway_inter_token_latency_seconds"),
                             "Time between tokens handed to the client (per token)",
                             buckets=_ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram(metric_name("gateway_e2e_request_latency_seconds"),
                             "Arrival at the gateway to the last token handed to the client",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.retries = Counter(metric_name("gateway_retries"),
                               "Attempts retried on another worker, by reason",
                               ["reason"], registry=self.registry)
        self.routing_decision = Histogram(metric_name("gateway_routing_decision_seconds"),
                                          "Time the routing policy took to pick a route (per attempt)",
                                          buckets=_DECISION_BUCKETS, registry=self.registry)
        self.kv_event_lag = Histogram(metric_name("gateway_kv_event_lag_seconds"),
                                      "From a worker's KV event to this gateway applying it (clocks synced)",
                                      buckets=_KV_LAG_BUCKETS, registry=self.registry)
        self.loop_busy = Histogram(metric_name("gateway_event_loop_busy_seconds"),
                                   "CPU time the event loop ran between two turns at a 5 ms timer, where "
                                   "over 5 ms: every stream relayed waits that long",
                                   buckets=_LOOP_BUSY_BUCKETS, registry=self.registry)
        self.routed = Counter(metric_name("gateway_worker_requests"),
                              "Attempts routed to each worker (a retried request counts once per attempt)",
                              ["worker", "role"], registry=self.registry)
        self.migrations = Counter(metric_name("gateway_migrations"),
                                  "Generations moved to another worker pair after a mid-stream failure "
                                  "(a continuation of the tokens already sent), by reason",
                                  ["reason"], registry=self.registry)
        self.aborts = Counter(metric_name("gateway_aborts"),
                              "Requests the client left early (Generate cancelled, Worker.Abort sent)",
                              registry=self.registry)
        self.shed = Counter(metric_name("gateway_shed_requests"),
                            "Requests refused with 429 by admission control, by model and reason "
                            "(queue_full, queue_timeout)", ["model", "reason"], registry=self.registry)
        self.registry.register(_PoolCollector(pool))
        for reason in RETRY_REASONS:
            self.retries.labels(reason=reason)
        for reason in MIGRATION_REASONS:
            self.migrations.labels(reason=reason)

    def start_at_zero(self, model: str) -> None:
        """Export the shed counters of `model` at 0 before the first shed: a rate over a series that
        does not exist yet is no data, not 0 (dashboards and alerts would see nothing)."""
        for reason in SHED_REASONS:
            self.shed.labels(model=model, reason=reason)

    def watch_admission(self, admission: AdmissionControl) -> None:
        """Export the admission queues' occupancy (read at scrape time)."""
        self.registry.register(_AdmissionCollector(admission))
