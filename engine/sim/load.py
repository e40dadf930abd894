"""Building a simulated engine's parts (engine.loading.load hands `--engine sim` here): the model's
config.json and tokenizer from --model-path (no weights), a small KV layout of the simulator's own, a
real KV pool and page manager, and the SimRunner in the model's place."""

from __future__ import annotations

from collections.abc import Sized
from typing import cast

import torch

from engine.config import EngineConfig
from engine.loading import LoadedModel, _page_manager, _tokenizer
from engine.models.config import ModelConfig
from engine.models.decoder import DecoderModel
from engine.sim.profile import SimProfile
from engine.sim.runner import SimRunner
from libkv.layout import KVLayout
from libkv.pool import KVPool
from pdserve.text import Decoder

# A simulated page carries the running hashes (engine.sim.runner) and little else: one layer, one
# head of 2 float32 values, so a page of 16 tokens is 256 bytes and 64 workers' pools stay small.
SIM_LAYERS = 1
SIM_HEAD_DIM = 2
# Unset --num-pages / --max-total-tokens: about what an 80 GB GPU holds of a 4B model's KV (512k tokens),
# 8 MiB here at 16 tokens a page.
SIM_DEFAULT_TOKENS = 1 << 19


class SimModel:
    """What the engine reads of a model beside its forward: no MoE layers, no vision tower."""

    layers: list = []
    vision = None


def sim_layout(page_size: int) -> KVLayout:
    return KVLayout(num_layers=SIM_LAYERS, num_kv_heads=1, head_dim=SIM_HEAD_DIM, page_size=page_size,
                    dtype="float32")


def sim_vocabulary(model_config: ModelConfig, decoder: Decoder) -> list[int]:
    """The ids a simulated engine emits: every id the tokenizer knows but the special ones (eos
    among them), so a simulated request runs to its length like a benchmark's."""
    special = set(getattr(decoder, "all_special_ids", ())) | set(model_config.eos_token_ids)
    size = model_config.vocab_size
    if isinstance(decoder, Sized):  # a checkpoint's embedding rows may outnumber its tokenizer's ids
        size = min(size, len(decoder))
    return [i for i in range(size) if i not in special]


def load_sim(config: EngineConfig) -> LoadedModel:
    """The parts of a simulated engine for `config` (see the module docstring)."""
    torch.set_num_threads(config.num_threads or 1)  # its tensors are tiny: one thread is plenty
    model_config = ModelConfig.from_dir(config.model_path)
    layout = sim_layout(config.page_size)
    tokens = config.max_total_tokens or SIM_DEFAULT_TOKENS
    pool = KVPool(layout, config.num_pages or max(layout.pages_for(tokens), 1), "cpu")
    decoder = _tokenizer(config)
    runner = SimRunner(pool, SimProfile.load(config.sim_profile), sim_vocabulary(model_config, decoder),
                       model_config.vocab_size)
    # The engine reads only `layers` and `vision` of its model (expert load, image checks).
    return LoadedModel(config, model_config, cast(DecoderModel, SimModel()), decoder, pool,
                       _page_manager(config, pool), runner)
