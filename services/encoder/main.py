"""`pdserve launch-server --encoder-only`: the encoder service of EPD, until SIGINT/SIGTERM.

Loads only the vision tower of a vision-language checkpoint, registers a staging pool of
embedding pages with its transfer backend (--encoder-transfer-backend), serves pdserve.v1.Encoder
(services/encoder/servicer.py) with health and reflection, and registers in the registry with
role `encoder` (its kv_layout is its embedding page). Logs the ready line every launcher reads:
`encoder listening on HOST:PORT (metrics :MPORT), ...`.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from engine.models.config import ModelConfig, resolve_dtype
from engine.models.vision import VisionTower
from libkv.embedding_pool import EmbeddingPool
from libkv.transfer import create_backend, exit_process
from protos.v1 import bootstrap_pb2, common_pb2, encoder_pb2, encoder_pb2_grpc
from services.common.grpc_server import ServiceBinding, ShutdownSignals, service_name, start_grpc_server
from services.common.metrics import start_metrics_server
from services.common.registry_client import RegistryClient
from services.encoder.metrics import EncoderMetrics
from services.encoder.servicer import EncoderServicer
from services.worker.config import WorkerConfig
from services.worker.runtime import backend_options
from services.worker.wire import endpoint_to_proto, layout_to_proto

log = logging.getLogger("pdserve.encoder")


def build_servicer(config: WorkerConfig) -> EncoderServicer:
    """Load the tower (on --device: a GPU when there is one) and register the staging pool, in host
    memory where every transfer engine reaches it (blocking)."""
    import torch

    if config.engine.num_threads:
        torch.set_num_threads(config.engine.num_threads)
    model_config = ModelConfig.from_dir(config.engine.model_path)
    dtype = resolve_dtype(config.engine.dtype, model_config)
    tower = VisionTower.load(config.engine.model_path, model_config, dtype,
                             torch.device(config.engine.device))
    pool = EmbeddingPool(model_config.hidden_size, str(dtype).removeprefix("torch."),
                         config.epd.embedding_pages)
    name = config.epd.encoder_transfer_backend
    backend = create_backend(name, **backend_options(config, name))
    backend.register(pool)
    return EncoderServicer(model_name=config.model_name, model_path=config.engine.model_path, tower=tower,
                           pool=pool, backend=backend, metrics=EncoderMetrics(config.model_name),
                           transfer_timeout_s=config.transfer_timeout)


def run(config: WorkerConfig) -> int:
    servicer = build_servicer(config)
    code = 0
    try:
        asyncio.run(serve(config, servicer))
    except OSError as exc:
        log.error("encoder failed to start: %s", exc)
        code = 1
    except grpc.aio.AioRpcError as exc:
        log.error("encoder: registry %s refused it: %s %s", config.bootstrap, exc.code().name, exc.details())
        code = 1
    finally:
        servicer.backend.close()
        logging.shutdown()
        exit_process(code)  # NIXL agents crash at interpreter exit: leave without the teardown
    return code


async def serve(config: WorkerConfig, servicer: EncoderServicer) -> None:
    shutdown = ShutdownSignals()
    metrics_server = start_metrics_server(servicer.metrics.registry, config.server.metrics_port,
                                          config.server.host)
    servicer.metrics.gauge("encoder_staging_pages_used", "Staging embedding pages in use",
                           lambda: servicer.pages.used)
    registry = None
    try:
        server = await start_grpc_server(
            [ServiceBinding(service_name(encoder_pb2, "Encoder"), servicer,
                            encoder_pb2_grpc.add_EncoderServicer_to_server)],
            config.server.host, config.server.port, security=config.security)
        if config.bootstrap:
            registry = RegistryClient(config.bootstrap, security=config.security)
            await registry.register(bootstrap_pb2.WorkerInfo(
                role=common_pb2.WORKER_ROLE_ENCODER, model=config.model_name,
                kv_layout=layout_to_proto(servicer.pool.layout), grpc_address=server.address,
                metrics_address=metrics_server.address,
                transfer_endpoint=endpoint_to_proto(servicer.backend.endpoint())))
            registry.start_heartbeat()
        log.info("encoder listening on %s (metrics :%d), model %s, vision tower only, %d staging embedding "
                 "pages of %d rows, transfer backend %s, %s", server.address, metrics_server.port,
                 config.model_name, servicer.pool.num_pages, servicer.pool.rows_per_page,
                 config.epd.encoder_transfer_backend, config.security.describe())
        config.security.warn_if_open(config.server.host, "this encoder")
        received = await shutdown.wait()
        log.info("encoder got %s: shutting down", received.name)
        await server.stop(config.server.grace_period)
    finally:
        shutdown.remove()
        if registry is not None:
            await registry.close()
        metrics_server.stop()
