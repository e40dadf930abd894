"""Building an engine's parts: weights, tokenizer, KV pool and page manager, and on tensor-parallel
workers the follower ranks (`Engine.load` calls `load`)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol, TypeVar

import torch

from engine.config import EngineConfig
from engine.graph_runner import DecodeGraphRunner, plan_graphs
from engine.lora.setup import attach_lora, check_lora_flags
from engine.lora.slots import LoraSlots
from engine.memory import kv_pages
from engine.model_runner import ModelRunner
from engine.models.config import ModelConfig, resolve_dtype
from engine.models.decoder import DecoderModel
from engine.models.layer_ops import select_layer_ops
from engine.models.vision import load_vision_tower
from engine.page_manager import PageManager
from engine.scheduler import SchedulerOutput
from engine.tp import a2a_backend
from engine.tp.ranks import FollowerRanks
from engine.tp.runner import DriverRunner
from libkv.pool import KVPool
from pdserve.text import Decoder

T = TypeVar("T")
log = logging.getLogger(__name__)


class StepRunner(Protocol):
    """What runs a step's forward pass for an Engine: the model on this rank alone (ModelRunner),
    every rank of a group driven from rank 0 (engine.tp.runner.DriverRunner), or a DP attention
    member's share of a joint step (engine.dp_engine)."""

    def forward(self, batch: SchedulerOutput) -> torch.Tensor: ...

    def close(self) -> None: ...


@dataclass
class LoadedModel:
    """What an Engine runs on. `runner` drives the other ranks too when `followers` is set."""

    config: EngineConfig
    model_config: ModelConfig
    model: DecoderModel
    tokenizer: Decoder
    pool: KVPool
    pages: PageManager
    runner: StepRunner
    followers: FollowerRanks | None = None  # ranks 1..N-1 when tensor-parallel
    graphs: DecodeGraphRunner | None = None  # decode steps at fixed sizes (engine.graph_runner)
    lora: LoraSlots | None = None  # --enable-lora: the adapters and their slots


def load(config: EngineConfig) -> LoadedModel:
    """Load weights and tokenizer from `config.model_path` and size the KV pool."""
    if config.engine_kind == "sim":  # no weights: a timing model in the forward's place
        from engine.sim.load import load_sim
        return load_sim(config)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    device = torch.device(config.device)
    model_config = ModelConfig.from_dir(config.model_path)
    dtype = resolve_dtype(config.dtype, model_config)
    layout = model_config.kv_layout(config.page_size, dtype)
    if config.speculative.speculative_algorithm == "NEXTN":
        # the MTP layer's K/V in the request's own pages (engine.speculative.nextn)
        layout = replace(layout, num_layers=layout.num_layers + 1)
    layer_ops = select_layer_ops(config.cpu_kernels, device)
    a2a_backend.announce(config.moe_a2a_backend, config.elastic_ep_backend,
                         "nccl" if device.type == "cuda" else "gloo")
    check_lora_flags(config)
    if config.world_size > 1:
        if model_config.is_multimodal:
            raise ValueError(f"{model_config.architecture} is served on one rank only so far "
                             "(tp/pp/dp size 1)")
        return _load_tensor_parallel(config, model_config, device)

    # NEXTN reads every row's hidden state after the forward, which the graphs' static buffers do not keep
    nextn = config.speculative.speculative_algorithm == "NEXTN"
    plan = plan_graphs(device=device, disabled=config.disable_cuda_graph or nextn,
                       max_bs=config.cuda_graph_max_bs, sizes=config.cuda_graph_bs,
                       max_running_requests=config.max_running_requests,
                       world_size=config.world_size, multimodal=model_config.is_multimodal,
                       routed_or_latent=model_config.moe is not None or model_config.mla is not None,
                       lora=config.enable_lora)
    log.info("decode steps: %s", plan.reason)
    # The graphs' padded rows write one scratch page past the page manager's pages.
    scratch_pages = 1 if plan.sizes else 0

    def load_tensors() -> tuple[DecoderModel, KVPool, LoraSlots | None]:
        model = DecoderModel.load(config.model_path, model_config, dtype, device, layer_ops)
        if model_config.is_multimodal and not config.language_only:
            model.vision = load_vision_tower(config.model_path, model_config, dtype, device)
        lora = attach_lora(config, model_config, model, dtype, device) if config.enable_lora else None
        pool = KVPool(layout, kv_pages(config, layout, device) + scratch_pages, device)
        return model, pool, lora

    # The copies of loading run as parallel (OpenMP) regions, and the first one in a thread
    # gives that thread a pool of OpenMP workers for as long as it lives. Two such pools (the
    # caller's and the engine thread's) on a small machine make libgomp throttle its spinning:
    # a bf16 decode step of the small preset measured 25.9 ms instead of 21 ms. So the loading
    # happens in a short-lived thread whose workers go away with it.
    model, pool, lora = _in_short_lived_thread(load_tensors)
    graphs = DecodeGraphRunner(model, pool, plan.sizes, model_config.max_position_embeddings,
                               scratch_page=pool.num_pages - 1, capture=plan.capture) if plan.sizes else None
    return LoadedModel(config, model_config, model, _tokenizer(config), pool,
                       _page_manager(config, pool, pool.num_pages - scratch_pages),
                       ModelRunner(model, pool, graphs=graphs, lora=lora), graphs=graphs, lora=lora)


def _load_tensor_parallel(config: EngineConfig, model_config: ModelConfig,
                          device: torch.device) -> LoadedModel:
    """Rank 0 of `config.world_size` (tp_size * pp_size): start the follower ranks, load this rank's
    shard (its stage's layers), drive the group."""
    from engine.tp.load import load_rank
    from engine.tp.pipeline import check_pp_size
    from engine.tp.setup import prepare_config, start_tensor_parallel

    check_pp_size(config.topology(), model_config.num_layers)
    # refuses a layout the model cannot split, before any rank starts
    config = prepare_config(config, model_config)
    if config.num_threads is None:
        raise RuntimeError("prepare_config leaves num_threads set")
    torch.set_num_threads(config.num_threads)
    group, followers = start_tensor_parallel(config, device)
    try:
        parts = _in_short_lived_thread(lambda: load_rank(config, device, group, followers.controls))
        tokenizer = _tokenizer(config)
    except BaseException:
        followers.kill()
        raise
    # The prefix cache lives in rank 0's page manager only: followers run rank 0's plan (page
    # ids and start positions), so a page cached here holds its K/V head slice on every rank.
    return LoadedModel(config, model_config, parts.model, tokenizer, parts.pool,
                       _page_manager(config, parts.pool), DriverRunner(parts.runner, group), followers,
                       lora=parts.lora)


def _tokenizer(config: EngineConfig):
    from transformers import AutoTokenizer

    # Never code from the checkpoint folder (see EngineConfig.trust_remote_code): a tokenizer that
    # needs its own Python class is refused by transformers with an error naming it.
    return AutoTokenizer.from_pretrained(str(Path(config.model_path)), trust_remote_code=False)


def _page_manager(config: EngineConfig, pool: KVPool, num_pages: int | None = None) -> PageManager:
    """The manager of the pool's first `num_pages` pages (default all; the rest are the graph
    runner's scratch)."""
    return PageManager(pool.num_pages if num_pages is None else num_pages, config.page_size,
                       prefix_cache=not config.disable_radix_cache)


def _in_short_lived_thread(function: Callable[[], T]) -> T:
    """Run `function` in a new thread, wait for it, return its result or raise its exception."""
    values: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            values.append(function())
        except BaseException as exc:  # re-raised in the caller
            errors.append(exc)

    thread = threading.Thread(target=run, name="pdserve-engine-load")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return values[0]
