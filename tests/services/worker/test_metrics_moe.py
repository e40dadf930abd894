"""The expert-load metrics of a mixture-of-experts worker: one counter series per expert, and the
imbalance gauge; nothing for a dense model."""

from __future__ import annotations

from prometheus_client import generate_latest

from engine.models.moe import ExpertLoad
from services.worker.metrics import WorkerMetrics


def test_expert_load_is_exported_per_expert():
    metrics = WorkerMetrics("colocated", "m")
    loads = [ExpertLoad((3, 0, 5), 1.875)]
    metrics.expert_load(lambda: loads[-1])
    text = generate_latest(metrics.registry).decode()
    assert 'pdserve:moe_expert_tokens_total{expert="0",model="m",role="colocated"} 3.0' in text
    assert 'pdserve:moe_expert_tokens_total{expert="1",model="m",role="colocated"} 0.0' in text
    assert 'pdserve:moe_expert_imbalance{model="m",role="colocated"} 1.875' in text
    loads.append(ExpertLoad((4, 2, 5), 1.0))  # read at scrape time
    assert 'expert="1",model="m",role="colocated"} 2.0' in generate_latest(metrics.registry).decode()


def test_expert_parallel_load_and_traffic_are_exported():
    metrics = WorkerMetrics("decode", "m")
    metrics.expert_load(lambda: ExpertLoad((3, 0, 5, 1), 1.5, tokens_per_ep_rank=(3, 6), a2a_sent_bytes=4096,
                                           a2a_received_bytes=4096))
    text = generate_latest(metrics.registry).decode()
    assert 'pdserve:moe_ep_rank_tokens_total{ep_rank="1",model="m",role="decode"} 6.0' in text
    assert 'pdserve:moe_a2a_bytes_total{direction="sent",model="m",role="decode"} 4096.0' in text
    assert 'pdserve:moe_a2a_bytes_total{direction="received",model="m",role="decode"} 4096.0' in text


def test_without_expert_parallelism_no_ep_series():
    metrics = WorkerMetrics("decode", "m")
    metrics.expert_load(lambda: ExpertLoad((3, 0), 2.0))
    text = generate_latest(metrics.registry).decode()
    assert "moe_ep_rank_tokens" not in text and "moe_a2a_bytes" not in text


def test_dense_model_exports_no_expert_metrics():
    metrics = WorkerMetrics("decode", "m")
    metrics.expert_load(lambda: None)
    assert "moe_expert" not in generate_latest(metrics.registry).decode()
