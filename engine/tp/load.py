"""Loading one rank: its shard of the weights and its KV pool (its KV heads, rank 0's page count).

Under pipeline parallelism a rank holds only its stage's layers (Topology.stage_layers), and its
pool only those layers' K/V: layer i of the stage is layer i of the pool.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from engine.config import EngineConfig
from engine.lora.setup import attach_lora
from engine.lora.slots import LoraSlots
from engine.memory import kv_pages
from engine.model_runner import ModelRunner
from engine.models.config import ModelConfig, resolve_dtype
from engine.models.decoder import DecoderModel
from engine.models.layer_ops import select_layer_ops
from engine.tp.control import RankControl
from engine.tp.dp_attention import DPAttentionComm, DPRankRunner
from engine.tp.expert_parallel import ExpertParallel
from engine.tp.group import TPGroup
from engine.tp.pipeline import PipelineStage
from engine.tp.shard import TPShard
from libkv.landing import TPKVPool
from libkv.layout import KVLayout
from libkv.pool import KVPool


@dataclass
class RankParts:
    model: DecoderModel
    pool: KVPool
    runner: ModelRunner
    lora: LoraSlots | None = None  # --enable-lora: this rank's shard of the adapters' slots


def rank_layout(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype,
                layers: range | None = None) -> KVLayout:
    """The KV page of one rank: its num_kv_heads / tp_size heads (the whole model's at TP 1) of the
    `layers` its stage holds (default: all); under DP attention its share of its group's heads
    (num_kv_heads / attn_tp_size)."""
    layout = model_config.kv_layout(config.page_size, dtype, config.topology().attn_tp_size)
    num_layers = layout.num_layers if layers is None else len(layers)
    if config.speculative.speculative_algorithm == "NEXTN":  # the MTP layer's K/V (pipeline stages refused)
        num_layers += 1
    return replace(layout, num_layers=num_layers)


def load_rank(config: EngineConfig, device: torch.device, group: TPGroup,
              controls: list[RankControl] | None = None) -> RankParts:
    """Every rank calls this together: rank 0 sizes the pool and the others take its page count.
    Rank 0 passes the followers' `controls`: its pool's checksums then cover every rank's heads
    (and, under pipeline parallelism, every stage's layers; under DP attention, its group's ranks')."""
    model_config = ModelConfig.from_dir(config.model_path)
    dtype = resolve_dtype(config.dtype, model_config)
    topology = group.topology
    layers = topology.stage_layers(model_config.num_layers, group.pp_rank)
    layout = rank_layout(config, model_config, dtype, layers)
    dp_attention = topology.dp_size > 1
    attn_shard = TPShard(topology.attn_tp_rank(group.rank), topology.attn_tp_size) if dp_attention else None
    expert_parallel = None
    if topology.ep_size > 1:
        if model_config.moe is None:  # check_tp_size refuses it before any rank starts
            raise ValueError(f"--ep-size {topology.ep_size} needs a mixture-of-experts model")
        expert_parallel = ExpertParallel.for_rank(group, model_config.moe.num_experts)
    model = DecoderModel.load(config.model_path, model_config, dtype, device,
                              select_layer_ops(config.cpu_kernels, device),
                              shard=TPShard(group.tp_rank, group.tp_size),
                              # a stage of one rank has nothing to sum
                              all_reduce=group.all_reduce if group.tp_size > 1 else None,
                              attn_shard=attn_shard, expert_parallel=expert_parallel, layers=layers)
    # Rank 0 sizes the pool for its own stage; a stage with fewer layers could hold more pages,
    # but every rank must have the same page ids.
    num_pages = group.broadcast(kv_pages(config, layout, device) if group.rank == 0 else None)
    if not isinstance(num_pages, int):
        raise RuntimeError(f"rank 0 sent {num_pages!r} as the pool's page count")
    if controls is not None and dp_attention:
        # Rank 0's pool is its DP group's (the first attn_tp_size ranks); the other groups' pools
        # are views over their ranks (engine.dp_engine)
        controls = controls[:topology.attn_tp_size - 1] or None
    if controls is not None:
        # TPKVPool takes a list[RankChannel], and a list of RankControls is not one (list is invariant):
        # libkv's signature should take a Sequence
        pool: KVPool = TPKVPool(layout, num_pages, device, controls)  # type: ignore[arg-type]
    else:
        pool = KVPool(layout, num_pages, device)
    if dp_attention:  # (not with pipeline stages: EngineConfig refuses the two together)
        model.dp = DPAttentionComm(group.rank, topology, group.tp_group, group.attn_group, device,
                                   group.traffic)
        # RankParts.runner is a ModelRunner to its callers; under DP attention it is this DPRankRunner,
        # which runs the DPSteps rank 0 broadcasts (engine.dp_engine)
        dp_runner = DPRankRunner(ModelRunner(model, pool), model.dp)
        return RankParts(model, pool, dp_runner)  # type: ignore[arg-type]
    stage = None
    if topology.pp_size > 1:
        stage = PipelineStage(group, model_config.hidden_size, model_config.vocab_size, dtype, device)
    lora = (attach_lora(config, model_config, model, dtype, device, TPShard(group.tp_rank, group.tp_size))
            if config.enable_lora else None)
    return RankParts(model, pool, ModelRunner(model, pool, stage, lora=lora), lora)
