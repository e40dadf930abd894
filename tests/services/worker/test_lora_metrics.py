"""Per-adapter counters keep a bounded label set: the first names get their own label, the rest
share "other"."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from services.worker.lora_metrics import OTHER, LoraMetrics


def test_adapter_labels_are_bounded():
    registry = CollectorRegistry()
    metrics = LoraMetrics(registry, {"role": "colocated", "model": "m"}, max_labels=2)
    for name, prompt, generated in (("a", 5, 3), ("b", 7, 2), ("c", 1, 1), ("a", 2, 2), ("d", 1, 4)):
        metrics.finished(name, prompt, generated)

    def value(metric: str, adapter: str) -> float | None:
        return registry.get_sample_value(metric, {"role": "colocated", "model": "m", "adapter": adapter})

    assert value("pdserve:lora_requests_total", "a") == 2
    assert value("pdserve:lora_generation_tokens_total", "a") == 5
    assert value("pdserve:lora_prompt_tokens_total", "b") == 7
    assert value("pdserve:lora_requests_total", OTHER) == 2  # c and d
    assert value("pdserve:lora_generation_tokens_total", OTHER) == 5
    assert value("pdserve:lora_requests_total", "c") is None
