"""Prometheus metrics of the registry, read from its state at scrape time (nothing to keep in sync).

    pdserve:bootstrap_workers{role}                       workers registered now
    pdserve:bootstrap_watchers                            open Watch streams
    pdserve:bootstrap_lease_expiries_total                leases that ran out
    pdserve:bootstrap_registrations_refused_total{reason} invalid | layout_mismatch | backend_mismatch
    pdserve:bootstrap_watchers_dropped_total              watchers dropped for falling behind
    pdserve:bootstrap_store_up                            1 while the store's view is current (etcd: watch up)
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.bootstrap.registry import REFUSED_BACKEND, REFUSED_INVALID, REFUSED_LAYOUT
from services.bootstrap.store import RegistryStore
from services.common.metrics import metric_name


class RegistryCollector(Collector):
    """Exposes a registry store's counts. Called on the metrics server's thread: it only reads
    snapshots (list copies) of the registry's containers."""

    def __init__(self, registry: RegistryStore) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        workers = GaugeMetricFamily(metric_name("bootstrap_workers"), "Workers registered now, by role.",
                                    labels=["role"])
        for role, count in self._registry.count_by_role().items():
            workers.add_metric([role], count)
        yield workers
        yield GaugeMetricFamily(metric_name("bootstrap_watchers"), "Open Watch streams.",
                                value=self._registry.num_watchers)
        stats = self._registry.stats
        yield CounterMetricFamily(metric_name("bootstrap_lease_expiries"),
                                  "Worker leases that expired for missed heartbeats.",
                                  value=stats.lease_expiries)
        refused = CounterMetricFamily(metric_name("bootstrap_registrations_refused"),
                                      "Registrations refused, by reason.", labels=["reason"])
        for reason in (REFUSED_INVALID, REFUSED_LAYOUT, REFUSED_BACKEND):
            refused.add_metric([reason], stats.registrations_refused[reason])
        yield refused
        yield CounterMetricFamily(metric_name("bootstrap_watchers_dropped"),
                                  "Watch streams dropped for falling behind.", value=stats.watchers_dropped)
        yield GaugeMetricFamily(metric_name("bootstrap_store_up"),
                                "1 while the registry's view of its store is current "
                                "(etcd: its watch is up).",
                                value=1 if self._registry.healthy else 0)


def registry_metrics(registry: RegistryStore) -> CollectorRegistry:
    """A fresh CollectorRegistry holding the registry's metrics (served by services.common.metrics)."""
    collectors = CollectorRegistry()
    collectors.register(RegistryCollector(registry))
    return collectors
