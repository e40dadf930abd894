"""A prefill worker's runtime in-process, over a transfer backend the test chooses (one whose
engine misbehaves in a given way), for tests that drive the real Prefill gRPC service."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from engine.config import EngineConfig
from engine.engine import Engine
from libkv.transfer import TransferBackend
from services.worker.config import WorkerConfig
from services.worker.metrics import WorkerMetrics
from services.worker.runtime import WorkerRuntime
from tools.models.tiny_model import write_tiny_model


@contextmanager
def prefill_runtime(folder: Path, backend: TransferBackend) -> Iterator[WorkerRuntime]:
    """A started tiny-model prefill engine of 64 pages whose KV moves through `backend`; both are
    shut down on exit."""
    model = write_tiny_model(folder / "tiny", preset="tiny", seed=0)
    config = WorkerConfig(engine=EngineConfig(model_path=str(model), num_pages=64, num_threads=1),
                          disaggregation_mode="prefill", disaggregation_transfer_backend="fake")
    engine = Engine.load(config.engine)
    backend.register(engine.pool)
    engine.start()
    try:
        yield WorkerRuntime(config=config, engine=engine, backend=backend,
                            metrics=WorkerMetrics("prefill", config.model_name))
    finally:
        engine.shutdown()
        backend.close()
