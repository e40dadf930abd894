"""Prometheus metrics of an encoder service (services/encoder/main.py)."""

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
        self.bytes_sent = counter("encoder_embedding_bytes_total",
                                  "Embedding bytes written into callers' memory")
        self.refused = counter("encoder_refused_total",
                               "Encode calls refused (bad input, grant, layout, no pages)")
        self._labels = labels

    def gauge(self, name: str, text: str, read: Callable[[], float]) -> None:
        Gauge(m(name), text, labelnames=list(self._labels), registry=self.registry).labels(
            **self._labels).set_function(read)
