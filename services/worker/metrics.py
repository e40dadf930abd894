"""Prometheus metrics of a prefill, decode or colocated worker (names in the `pdserve:` style).

Counters and histograms are updated by the servicers; gauges (queues, pages, running requests)
are read from the engine and the room table at scrape time, so they are never stale.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from services.common.metrics import metric_name as m
from services.worker.lora_metrics import LoraMetrics

if TYPE_CHECKING:  # the engine's dataclass only; this module must not import torch
    from engine.models.moe import ExpertLoad
    from libkv.store import StoreTier

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
# The label value of the prefill's handshake with decode's transfer endpoint, as a queue
# (`queue_requests{queue}`) and as a failure stage (`pd_failures_total{stage}`). SGLang calls that
# step "bootstrap" (its prefill meets decode through a bootstrap server), and dashboards and alerts
# written for SGLang read that word, so the value keeps it; in code "bootstrap" is the registry.
HANDSHAKE = "bootstrap"
# The PD failure stages each role counts (services/prefill/servicer.py, services/decode/servicer.py
# and prefill_client.py), exported at 0 until they first happen.
FAILURE_STAGES = {"prefill": (HANDSHAKE, "grant", "transfer"),
                  "decode": ("prealloc", HANDSHAKE, "prefill", "checksum")}


class WorkerMetrics:
    """Every metric of one worker, in its own CollectorRegistry."""

    def __init__(self, role: str, model: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"role": role, "model": model}
        self.labels = labels
        r = self.registry
        self.ttft = self._histogram("time_to_first_token_seconds",
                                    "Time from request arrival to its first token", _LATENCY_BUCKETS)
        self.itl = self._histogram("inter_token_latency_seconds",
                                   "Time between consecutive tokens of a request", _ITL_BUCKETS)
        self.e2e = self._histogram("e2e_request_latency_seconds",
                                   "Time from request arrival to its end", _LATENCY_BUCKETS)
        # by finish reason: request_success.labels(**labels, finish_reason=...)
        self.request_success = Counter(m("request_success_total"), "Finished requests by finish reason",
                                       labelnames=[*labels, "finish_reason"], registry=r)
        self.prompt_tokens = Counter(m("prompt_tokens_total"), "Prompt tokens processed",
                                     labelnames=list(labels), registry=r).labels(**labels)
        self.generation_tokens = Counter(m("generation_tokens_total"), "Tokens generated",
                                         labelnames=list(labels), registry=r).labels(**labels)
        self.transfer_latency = self._histogram(
            "kv_transfer_latency_seconds", "Time from a request's first KV write to its last completing",
            _LATENCY_BUCKETS)
        self.transfer_bytes = Counter(m("kv_transfer_bytes_total"), "KV bytes written to decode workers",
                                      labelnames=list(labels), registry=r).labels(**labels)
        self.transfer_bytes_saved = Counter(
            m("kv_transfer_bytes_saved_total"), "Decode: KV bytes not transferred because the prompt's "
            "leading pages were already in this worker's prefix cache", labelnames=list(labels),
            registry=r).labels(**labels)
        self.transfer_speed = self._histogram(
            "kv_transfer_speed_gb_s", "KV transfer speed per request (GB/s)",
            (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32))
        self._failures = Counter(m("pd_failures_total"),
                                 "PD failures by stage (bootstrap, transfer, prefill)",
                                 labelnames=[*labels, "stage"], registry=r)
        self.leak_detections = Counter(m("kv_leak_detections_total"),
                                       "KV page leaks found by the leak detector (pages held with no "
                                       "live room)", labelnames=list(labels), registry=r).labels(**labels)
        self._local_prefills = Counter(m("local_prefill_requests_total"),
                                       "Decode: requests whose prompt ran on this decode worker instead of a "
                                       "prefill worker (conditional disaggregation), by rule",
                                       labelnames=[*labels, "reason"], registry=r)
        self.lora = LoraMetrics(r, labels)  # per adapter, --enable-lora
        self._gauges: dict[str, Gauge] = {}
        self._read_counters: dict[str, _ReadCounter] = {}
        # at 0 from the start: a rate over a series that does not exist yet is no data, not 0
        for stage in FAILURE_STAGES.get(role, ()):
            self._failures.labels(**labels, stage=stage)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]):
        return Histogram(m(name), doc, labelnames=list(self.labels), buckets=buckets,
                         registry=self.registry).labels(**self.labels)

    def local_prefill(self, reason: str) -> None:
        self._local_prefills.labels(**self.labels, reason=reason).inc()

    def failure(self, stage: str) -> None:
        self._failures.labels(**self.labels, stage=stage).inc()

    def counter_from(self, name: str, doc: str, read: Callable[[], float], **extra_labels: str) -> None:
        """A counter whose running total is kept elsewhere (the engine) and read at scrape time;
        one call per series when `extra_labels` tell series apart."""
        collector = self._read_counters.get(name)
        if collector is None:
            collector = self._read_counters[name] = _ReadCounter(m(name), doc, [*self.labels, *extra_labels])
            self.registry.register(collector)
        collector.series.append(([*self.labels.values(), *extra_labels.values()], read))

    def gauge(self, name: str, doc: str, read: Callable[[], float], **extra_labels: str) -> None:
        """A gauge whose value is read at scrape time."""
        if name not in self._gauges:
            self._gauges[name] = Gauge(m(name), doc, labelnames=[*self.labels, *extra_labels],
                                       registry=self.registry)
        self._gauges[name].labels(**self.labels, **extra_labels).set_function(read)

    def expert_load(self, read: Callable[[], ExpertLoad | None]) -> None:
        """A mixture-of-experts model's expert load (Engine.expert_load), read at scrape time:
        `moe_expert_tokens_total{expert}`, tokens routed to each expert summed over the MoE layers
        (one series per expert, however many layers), and `moe_expert_imbalance`, max / mean tokens
        per expert in the last step's most unevenly loaded layer. Under expert parallelism also
        `moe_ep_rank_tokens_total{ep_rank}`, the same tokens per EP rank's block of experts (rank 0
        routes every token, so it counts for all ranks), and `moe_a2a_bytes_total{direction}`, the
        bytes rank 0's dispatch/combine sent to and received from the other ranks."""
        self.registry.register(_ExpertLoadCollector(self.labels, read))


    def store_tier(self, tier: StoreTier) -> None:
        """The store tier of --enable-hierarchical-cache (libkv/store/), read at scrape time:
        `hicache_store_up` (1 while the store answers), `hicache_hit_pages_total` (pages fetched
        from the store instead of computed), `hicache_read_bytes_total`, `hicache_written_bytes_total`,
        `hicache_written_pages_total`, `hicache_dropped_pages_total` (offered, not written: the
        write queue full or the store down), `hicache_store_errors_total` (failed or timed-out
        calls, probes included), `hicache_corrupt_entries_total` (fetched entries that failed their
        check: used as misses) and the `hicache_fetch_latency_seconds` histogram (one per fetch
        that found pages)."""
        self.gauge("hicache_store_up", "1 while the hierarchical cache's store answers, 0 while it is down "
                   "(requests are computed without it)", lambda: 1 if tier.up else 0)
        stats = tier.stats
        for name, doc, read in (
                ("hicache_hit_pages_total", "KV pages fetched from the store instead of computed",
                 lambda: stats.hit_pages),
                ("hicache_read_bytes_total", "KV bytes fetched from the store", lambda: stats.bytes_read),
                ("hicache_written_bytes_total", "KV bytes written to the store", lambda: stats.bytes_written),
                ("hicache_written_pages_total", "KV pages written to the store", lambda: stats.pages_written),
                ("hicache_dropped_pages_total", "KV pages offered to the store but not written (write queue "
                 "full, or the store down)", lambda: stats.dropped_pages),
                ("hicache_store_errors_total", "Store calls that failed or timed out (probes included)",
                 lambda: stats.errors),
                ("hicache_corrupt_entries_total", "Fetched store entries that failed their check "
                 "(token hash, byte checksum): used as misses", lambda: stats.corrupt)):
            self.counter_from(name, doc, read)
        self.registry.register(_FetchLatencyCollector(self.labels, tier))


class _FetchLatencyCollector(Collector):
    def __init__(self, labels: dict[str, str], tier: StoreTier) -> None:
        self._labels, self._tier = labels, tier

    def collect(self):
        stats = self._tier.stats
        family = HistogramMetricFamily(m("hicache_fetch_latency_seconds"), "Time of one store fetch (exists "
                                       "check, get, checks, copy into the pool) that found pages",
                                       labels=list(self._labels))
        cumulative, buckets = 0, []
        for bound, count in zip((*stats.BOUNDS, float("inf")), stats.fetch_buckets, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else str(bound), cumulative))
        family.add_metric(list(self._labels.values()), buckets, stats.fetch_seconds)
        yield family


class _ExpertLoadCollector(Collector):
    def __init__(self, labels: dict[str, str], read: Callable[[], ExpertLoad | None]) -> None:
        self._labels, self._read = labels, read

    def collect(self):
        load = self._read()
        if load is None:
            return
        names, values = [*self._labels, "expert"], list(self._labels.values())
        tokens = CounterMetricFamily(m("moe_expert_tokens"), "Tokens routed to each expert, summed over "
                                     "the MoE layers (each token counts once per layer and per expert it "
                                     "goes to)", labels=names)
        for expert, count in enumerate(load.tokens_per_expert):
            tokens.add_metric([*values, str(expert)], count)
        yield tokens
        imbalance = GaugeMetricFamily(m("moe_expert_imbalance"), "Max / mean tokens per expert in the last "
                                      "step's most unevenly loaded MoE layer (1 is even)",
                                      labels=list(self._labels))
        imbalance.add_metric(values, load.last_step_imbalance)
        yield imbalance
        if not load.tokens_per_ep_rank:
            return
        per_rank = CounterMetricFamily(m("moe_ep_rank_tokens"), "Tokens routed to each expert-parallel "
                                       "rank's experts, summed over the MoE layers",
                                       labels=[*self._labels, "ep_rank"])
        for ep_rank, count in enumerate(load.tokens_per_ep_rank):
            per_rank.add_metric([*values, str(ep_rank)], count)
        yield per_rank
        moved = CounterMetricFamily(m("moe_a2a_bytes"), "Bytes rank 0's expert-parallel all-to-alls sent "
                                    "to and received from the other ranks",
                                    labels=[*self._labels, "direction"])
        moved.add_metric([*values, "sent"], load.a2a_sent_bytes)
        moved.add_metric([*values, "received"], load.a2a_received_bytes)
        yield moved


class _ReadCounter(Collector):
    def __init__(self, name: str, doc: str, label_names: list[str]) -> None:
        self._name, self._doc, self._label_names = name.removesuffix("_total"), doc, label_names
        self.series: list[tuple[list[str], Callable[[], float]]] = []

    def collect(self):
        family = CounterMetricFamily(self._name, self._doc, labels=self._label_names)
        for values, read in self.series:
            family.add_metric(values, read())
        yield family
