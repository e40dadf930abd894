"""Prometheus metrics of an encoder service and of the embedding side of a language-only worker."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

from services.common.metrics import metric_name as m


class EncoderMetrics:
    """An encoder service's metrics, in its own CollectorRegistry (labels: role, model)."""

    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"role": "encoder", "model": model}
        r = self.registry

        def counter(name: str, text: str) -> Counter:
            return Counter(m(name), text, labelnames=list(labels), registry=r).labels(**labels)

        self.images = counter("encoder_images_total", "Images encoded")
        self.encode_seconds = counter("encoder_encode_seconds_total", "Seconds the vision tower ran")
        self.bytes_sent = counter("encoder_embedding_bytes_total", "Embedding bytes written into callers' memory")
        self.refused = counter("encoder_refused_total", "Encode calls refused (bad input, grant, layout, no pages)")
        self._labels = labels

    def gauge(self, name: str, text: str, read: Callable[[], float]) -> None:
        Gauge(m(name), text, labelnames=list(self._labels), registry=self.registry).labels(
            **self._labels).set_function(read)


def add_embedding_metrics(metrics, cache, pages) -> None:
    """A language-only worker's embedding side, on its WorkerMetrics: cache hits and misses, pages in
    use (all read at scrape time)."""
    metrics.counter_from("embedding_cache_hits_total", "Images whose embeddings came from the worker's "
                         "embedding cache", lambda: cache.hits)
    metrics.counter_from("embedding_cache_misses_total", "Images sent to an encoder (not in the embedding cache)",
                         lambda: cache.misses)
    metrics.gauge("embedding_cache_images", "Images in the embedding cache", lambda: len(cache))
    metrics.gauge("embedding_pages_used", "Embedding pages reserved for encoders' writes", lambda: pages.used)
