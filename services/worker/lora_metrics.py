"""Per-adapter request and token counters of a worker serving LoRA adapters, with a bounded label
set: the first MAX_ADAPTER_LABELS adapter names seen get a label of their own, later ones share
"other" (names are chosen by whoever loads adapters at run time: an unbounded label set would grow
the scrape and the time series without end)."""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter

from services.common.metrics import metric_name as m

MAX_ADAPTER_LABELS = 32
OTHER = "other"


class LoraMetrics:
    """pdserve:lora_requests_total, pdserve:lora_prompt_tokens_total and
    pdserve:lora_generation_tokens_total, by `adapter` (requests of the base model are not counted)."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str],
                 max_labels: int = MAX_ADAPTER_LABELS) -> None:
        names = [*labels, "adapter"]
        self.labels = labels
        self.max_labels = max_labels
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        self.requests = Counter(m("lora_requests_total"), "Finished requests per LoRA adapter",
                                labelnames=names, registry=registry)
        self.prompt_tokens = Counter(m("lora_prompt_tokens_total"), "Prompt tokens per LoRA adapter",
                                     labelnames=names, registry=registry)
        self.generation_tokens = Counter(m("lora_generation_tokens_total"),
                                         "Generated tokens per LoRA adapter", labelnames=names,
                                         registry=registry)

    def label(self, adapter: str) -> str:
        """The adapter's own label while fewer than max_labels names have one, else "other"."""
        with self._lock:
            if adapter in self._seen:
                return adapter
            if len(self._seen) < self.max_labels:
                self._seen.add(adapter)
                return adapter
            return OTHER

    def finished(self, adapter: str, prompt_tokens: int, generated_tokens: int) -> None:
        label = {**self.labels, "adapter": self.label(adapter)}
        self.requests.labels(**label).inc()
        self.prompt_tokens.labels(**label).inc(prompt_tokens)
        self.generation_tokens.labels(**label).inc(generated_tokens)
