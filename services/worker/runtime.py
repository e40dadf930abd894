"""WorkerRuntime: what one worker process owns besides its servicer.

The engine (model, KV pool, scheduler thread), the transfer backend registered on the engine's
pool (prefill and decode only), the metrics endpoint, the room table and the registry lease.
`services.launch_server` builds one, hands it to the role's servicer, and closes it on shutdown.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, field, replace

from engine.api import EngineAPI
from engine.dp_engine import DPEngine, load_engine
from engine.engine import Engine
from engine.outputs import EngineStats
from engine.step_clock import KINDS as STEP_KINDS
from engine.step_clock import StepClock
from libkv.embedding_pool import EmbeddingPool
from libkv.layout import KVLayout
from libkv.transfer import TransferBackend, create_backend
from libkv.transfer.dp_groups import DPGroupsBackend
from libkv.transfer.head_map import whole_model
from libkv.transfer.tensor_parallel import TensorParallelBackend
from pdserve import envs
from protos.v1 import bootstrap_pb2, common_pb2
from services.common.image_drop import ImageDrop
from services.common.keepalive import MAX_MESSAGE_BYTES
from services.common.metrics import MetricsServer, start_metrics_server
from services.common.registry_client import RegistryClient
from services.worker import lora_admin
from services.worker.config import WorkerConfig
from services.worker.encoders import EncoderClient, add_embedding_metrics
from services.worker.metrics import HANDSHAKE, WorkerMetrics
from services.worker.rooms import Room, RoomTable, RoomView
from services.worker.wire import endpoint_to_proto, layout_to_proto

log = logging.getLogger("pdserve.worker")

_ROLES = {"prefill": common_pb2.WORKER_ROLE_PREFILL, "decode": common_pb2.WORKER_ROLE_DECODE,
          "colocated": common_pb2.WORKER_ROLE_COLOCATED}


def backend_options(config: WorkerConfig, name: str) -> dict:
    """Constructor options of backend `name` (the KV backend, or EPD's embedding one) for this worker."""
    options: dict = {"timeout_s": config.transfer_timeout, "host": config.server.host}
    if name == "mooncake":
        options["ib_device"] = config.disaggregation_ib_device or ""
        options["max_queued_per_peer"] = envs.MOONCAKE_MAX_QUEUED_PER_PEER.get()
    elif name == "nixl":
        options["nixl_backend"] = envs.NIXL_BACKEND.get()
    return options


def _exit_worker(engine: EngineAPI, config: WorkerConfig, why: str) -> None:
    """A rank died (or another node's ranks are lost): this worker cannot run a step any more. Exit
    at once (the other ranks are killed, the registry lease expires, callers' RPCs fail and the
    gateway retries elsewhere) rather than serve errors or hang in a collective."""
    log.error("%s worker: %s (of %d ranks); exiting", config.role, why, config.engine.world_size)
    if engine.tp_followers is not None:
        engine.tp_followers.kill()
    logging.shutdown()
    os._exit(1)


def _transfer_backend(config: WorkerConfig, engine: EngineAPI) -> TransferBackend:
    """The worker's backend, registered: every rank moves its own KV heads, to peers of any TP size.
    Under DP attention each group is a worker of attn_tp_size ranks of its own (dp_groups)."""
    name = config.disaggregation_transfer_backend
    options = backend_options(config, name)
    if isinstance(engine, DPEngine):
        size = config.engine.topology().attn_tp_size
        if engine.tp_followers is None:
            raise ValueError("DP attention runs over tensor-parallel ranks: the engine has none")
        controls = engine.tp_followers.controls
        groups: list[TransferBackend] = []
        for g, pool in enumerate(engine.group_pools):
            group: TransferBackend
            if g > 0:
                group = TensorParallelBackend.over_ranks(name, controls[g * size - 1:(g + 1) * size - 1],
                                                         options)
            elif size > 1:
                group = TensorParallelBackend(create_backend(name, **options), controls[:size - 1], options)
            else:
                group = create_backend(name, **options)
            group.register(pool)
            groups.append(group)
        return DPGroupsBackend(groups, engine.group_of)
    rank0 = create_backend(name, **options)
    backend: TransferBackend = rank0 if engine.tp_followers is None else \
        TensorParallelBackend(rank0, engine.tp_followers.controls, options, config.engine.pp_size)
    backend.register(engine.pool)
    return backend


def _encoder_client(config: WorkerConfig, engine: EngineAPI) -> EncoderClient:
    """A language-only worker's embedding pool, registered with its own backend instance
    (--encoder-transfer-backend), and the client that fills it from encoders."""
    name = config.epd.encoder_transfer_backend
    pool = EmbeddingPool(engine.model_config.hidden_size, engine.kv_layout.dtype, config.epd.embedding_pages)
    backend = create_backend(name, **backend_options(config, name))
    backend.register(pool)
    return EncoderClient(config.epd, model_name=config.model_name, pool=pool, backend=backend,
                         security=config.security)


def _rank_bytes(backend: TransferBackend, rank: int) -> int:
    return backend.rank_bytes()[rank]


def _add_step_metrics(metrics: WorkerMetrics, clock: StepClock) -> None:
    """The serving-cost account's engine side (engine/step_clock.py, `pdserve bench serving-vs-vllm`)."""
    for kind in STEP_KINDS:
        metrics.counter_from("engine_step_seconds_total", "Seconds the engine thread spent in steps, by kind "
                             "(decode rows only, mixed with prompt chunks, prompt chunks only)",
                             functools.partial(clock.seconds.__getitem__, kind), kind=kind)
        metrics.counter_from("engine_steps_total", "Engine steps, by kind (see engine_step_seconds_total)",
                             functools.partial(clock.steps.__getitem__, kind), kind=kind)
    metrics.counter_from("engine_decode_tokens_total", "Tokens decoded by the engine's steps (decode rows)",
                         lambda: clock.decode_tokens)
    metrics.counter_from("engine_decode_token_seconds_total", "Each decode row's step seconds, summed: over "
                         "engine_decode_tokens_total, the mean step a decoded token waited for",
                         lambda: clock.decode_token_seconds)


def _add_grammar_metrics(metrics: WorkerMetrics, engine: EngineAPI) -> None:
    """Structured outputs (engine/grammar.py): compile cost, cache reuse, refusals, masked steps."""
    for name, stat, doc in (
            ("grammar_compiles_total", "grammar_compiles",
             "Structured-output grammars compiled (cache misses)"),
            ("grammar_compile_seconds_total", "grammar_compile_seconds",
             "Seconds spent compiling structured-output grammars (off the engine thread)"),
            ("grammar_cache_hits_total", "grammar_cache_hits",
             "Structured outputs served by a cached grammar"),
            ("grammar_refused_total", "grammar_refused",
             "Structured outputs refused: they did not compile, or not in time"),
            ("grammar_constrained_steps_total", "constrained_steps",
             "Tokens sampled under a structured-output mask")):
        metrics.counter_from(name, doc, functools.partial(_stat, engine, stat))


def _stat(engine: EngineAPI, name: str) -> float:
    return getattr(engine.stats(), name)


def _add_dp_metrics(metrics: WorkerMetrics, engine: DPEngine) -> None:
    for g, member in enumerate(engine.members):
        metrics.counter_from("dp_rank_requests_total", "Requests placed on each DP attention group "
                             "(prefilled ones on decode by their reservation)",
                             functools.partial(engine.placed.__getitem__, g), dp_rank=str(g))
        metrics.gauge("dp_rank_kv_pages_used", "KV pages in use on each DP attention group",
                      functools.partial(_used_pages, member), dp_rank=str(g))


def _used_pages(member: Engine) -> int:
    return member.pages.used_pages


@dataclass
class WorkerRuntime:
    """The parts of a running worker; build with `WorkerRuntime.create(config)` (blocking: loads weights)."""

    config: WorkerConfig
    engine: EngineAPI
    backend: TransferBackend | None
    metrics: WorkerMetrics
    # The role's room table, as the runtime reads it; the role's servicer sets its own (RoleServicer).
    rooms: RoomView = field(init=False)
    metrics_server: MetricsServer | None = None
    registry: RegistryClient | None = None
    encoders: EncoderClient | None = None  # --language-only: where image embeddings come from (EPD)
    image_drop: ImageDrop | None = None  # where gateways upload large images (open_image_drop)

    def __post_init__(self) -> None:
        self.rooms = RoomTable(self.config.role, Room)  # empty until the servicer brings its own

    def open_image_drop(self) -> ImageDrop | None:
        """Start the image drop on the gRPC host (Worker service roles, --image-drop-port not -1, no
        TLS: the drop speaks plain TCP, so under TLS the images stay inside the encrypted call)."""
        config = self.config
        if config.role == "prefill" or config.image_drop_port < 0 or config.security.tls:
            return None
        drop = self.image_drop = ImageDrop(config.server.host, config.image_drop_port,
                                           secret=config.security.secret,
                                           max_upload_bytes=MAX_MESSAGE_BYTES).start()
        self.metrics.gauge("image_drop_uploads", "Image uploads the image drop stored since start",
                           lambda: drop.stats.stored)
        self.metrics.gauge("image_drop_pending_bytes", "Image bytes the image drop holds or is receiving",
                           lambda: drop.pending_bytes)
        return drop

    @classmethod
    def create(cls, config: WorkerConfig) -> WorkerRuntime:
        engine_config = config.engine
        if engine_config.enable_hierarchical_cache:  # other store clients read this worker's segment there
            engine_config = replace(engine_config, hicache_local_host=config.server.host)
        engine = load_engine(engine_config)  # a DPEngine under --enable-dp-attention
        if engine.tp_followers is not None:
            engine.tp_followers.watch(lambda why: _exit_worker(engine, config, why))
        backend = None if config.role == "colocated" else _transfer_backend(config, engine)
        runtime = cls(config=config, engine=engine, backend=backend,
                      metrics=WorkerMetrics(config.role, config.model_name),
                      encoders=_encoder_client(config, engine) if config.engine.language_only else None)
        runtime._add_gauges()
        return runtime

    def _add_gauges(self) -> None:
        engine, metrics = self.engine, self.metrics
        metrics.gauge("kv_pages_used", "KV pages in use (held by requests or reserved); idle pages of the "
                      "prefix cache count as free",
                      lambda: engine.stats().used_pages)
        metrics.gauge("kv_pages_total", "KV pages in the pool", lambda: engine.stats().total_pages)
        metrics.gauge("num_running_reqs", "Requests in the decode batch", lambda: engine.stats().running)
        metrics.counter_from("retractions_total", "Requests retracted under memory pressure",
                             lambda: engine.stats().total_retractions)
        # The prefix cache's totals (hit / query is the hit rate); on decode, "hit" tokens are
        # prompt tokens whose pages were reused instead of transferred.
        metrics.counter_from("prefix_cache_query_tokens_total", "Prompt tokens looked up in the prefix cache",
                             lambda: engine.stats().prefix_query_tokens)
        metrics.counter_from("prefix_cache_hit_tokens_total", "Prompt tokens found in the prefix cache "
                             "(not computed; on decode: not transferred)",
                             lambda: engine.stats().prefix_hit_tokens)
        metrics.counter_from("prefix_cache_evicted_pages_total", "Idle cached KV pages evicted to make room",
                             lambda: engine.stats().prefix_evicted_pages)
        metrics.counter_from("spec_drafted_tokens_total", "Tokens drafted by speculative decoding",
                             lambda: engine.stats().spec_drafted_tokens)
        metrics.counter_from("spec_accepted_tokens_total", "Drafted tokens the target model accepted",
                             lambda: engine.stats().spec_accepted_tokens)
        metrics.counter_from("spec_verify_rows_total", "Verifies run (one per speculating request per step); "
                             "accept length = 1 + accepted / verifies",
                             lambda: engine.stats().spec_verify_rows)
        metrics.gauge("prefix_cache_pages", "KV pages indexed by the prefix cache (in use or idle)",
                      lambda: engine.stats().cached_pages)
        _add_grammar_metrics(metrics, engine)
        if engine.model_config.moe is not None:
            metrics.expert_load(engine.expert_load)
        if engine.hicache is not None:
            metrics.store_tier(engine.hicache)
        if engine.step_clock is not None:  # a DP attention engine's members step jointly: none
            _add_step_metrics(metrics, engine.step_clock)
        if isinstance(engine, DPEngine):  # where the requests went, and what each group holds
            _add_dp_metrics(metrics, engine)
        if self.encoders is not None:
            add_embedding_metrics(metrics, self.encoders.cache, self.encoders.pages)
        if self.backend is not None:
            backend = self.backend
            for rank in range(len(backend.rank_bytes())):
                metrics.gauge("kv_transfer_rank_bytes",
                              "KV bytes written by each tensor-parallel rank since start",
                              functools.partial(_rank_bytes, backend, rank), rank=str(rank))
        for stage in self.rooms.stages:
            metrics.gauge("queue_requests", "Requests in each PD queue",
                          functools.partial(self._queue_count, stage.value), queue=stage.value)

    def _queue_count(self, queue: str) -> int:
        return self.queue_counts()[queue]

    def queue_counts(self, stats: EngineStats | None = None) -> dict[str, int]:
        """Requests in each of the role's PD queues (by queue label): the room table's stages, but a
        decode or colocated worker's `waiting` and `running` are its engine's own queues (requests
        waiting for admission, retracted ones included, and the running batch)."""
        counts = self.rooms.counts()
        if self.config.role != "prefill":
            stats = stats or self.engine.stats()
            counts.update(waiting=stats.waiting, running=stats.running)
        return counts

    def load(self) -> common_pb2.WorkerLoad:
        stats = self.engine.stats()
        counts = self.queue_counts(stats)
        return common_pb2.WorkerLoad(
            bootstrap=counts.get(HANDSHAKE, 0), inflight=counts.get("inflight", 0),
            prealloc=counts.get("prealloc", 0), transfer=counts.get("transfer", 0),
            waiting=counts["waiting"], running=stats.running, retracted=stats.retracted,
            free_pages=stats.total_pages - stats.used_pages, total_pages=stats.total_pages)

    def start_metrics(self) -> MetricsServer:
        self.metrics_server = start_metrics_server(self.metrics.registry, self.config.server.metrics_port,
                                                   self.config.server.host)
        return self.metrics_server

    def model_layout(self) -> KVLayout:
        """The KV page of the whole model (all KV heads), whatever the TP size: what the registry
        compares between the workers of one model (a TP rank's own pages hold 1/tp_size of it; an
        MLA rank's the whole latent; under DP attention a rank holds 1/attn_tp_size of its group's;
        under pipeline parallelism rank 0's only its stage's layers)."""
        layout = whole_model(self.engine.kv_layout, self.config.engine.topology().attn_tp_size)
        if self.config.engine.pp_size > 1:
            layout = replace(layout, num_layers=self.engine.model_config.num_layers)
        return layout

    async def register(self, grpc_address: str) -> None:
        """Register with the bootstrap registry (if configured) and keep the lease alive."""
        if not self.config.bootstrap:
            return
        worker = bootstrap_pb2.WorkerInfo(
            role=_ROLES[self.config.role], model=self.config.model_name,
            kv_layout=layout_to_proto(self.model_layout()), grpc_address=grpc_address,
            metrics_address=self.metrics_server.address if self.metrics_server else "",
            load=self.load(), local_prefill=self.config.local_prefill_rule().enabled,
            lora_adapters=lora_admin.adapter_refs(self.engine))
        if self.backend is not None:
            worker.transfer_endpoint.CopyFrom(endpoint_to_proto(self.backend.endpoint()))
        self.registry = RegistryClient(self.config.bootstrap, security=self.config.security)
        await self.registry.register(worker)  # logs the worker id and lease
        if self.encoders is not None:
            self.encoders.registry = self.registry
        self.registry.start_heartbeat(load=self.load,
                                      lora_adapters=functools.partial(lora_admin.adapter_refs, self.engine))

    def report_adapters(self) -> None:
        """The worker's LoRA adapters changed: tell the registry now, not at the next heartbeat."""
        if self.registry is not None:
            self.registry.report_now()

    async def close(self, *, exiting: bool = False) -> None:
        """Deregister, stop the engine, then close the transfer backends, the encoder client and the
        metrics endpoint. `exiting`: the process ends right after (launch_server ends every worker
        with exit_process, skipping interpreter teardown: NIXL/UCX agents crash in their destructors
        there, and torch's teardown alone took most of a second), so what the exit frees anyway is
        left to it: the backends (unregistering mooncake's memory took 0.5 s; a peer learns that
        the process is gone as it learns of one that was killed), the encoder client, the metrics
        endpoint (0.5 s to stop its server) and a hierarchical-cache store client (its teardown can
        hold the process for ever)."""
        if self.registry is not None:
            await self.registry.close()
        if self.image_drop is not None:
            self.image_drop.close()
        self.engine.shutdown(exiting=exiting)
        if self.backend is not None and len(self.backend.rank_bytes()) > 1:
            log.info("KV bytes written per tp rank: %s", ", ".join(
                f"rank {rank} {sent}" for rank, sent in enumerate(self.backend.rank_bytes())))
        if exiting:
            return
        if self.backend is not None:
            self.backend.close()
        if self.encoders is not None:
            await self.encoders.close()
        if self.metrics_server is not None:
            self.metrics_server.stop()
