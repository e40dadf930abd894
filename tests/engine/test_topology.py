"""Topology: SGLang's rank arithmetic (world, stages, DP attention groups, expert blocks, nodes) and
the refusals that name the flags and values that do not fit."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.tp.topology import Topology, TopologyError
from pdserve.config_flags import add_config_arguments, config_from_args


def test_the_seeds_layouts() -> None:
    # Two nodes of 8 GPUs: --tp-size 16 --dp-size 8 --enable-dp-attention --moe-a2a-backend deepep
    seeds = EngineConfig(model_path="m", tp_size=16, dp_size=8, enable_dp_attention=True,
                         moe_a2a_backend="deepep",
                         nnodes=2, node_rank=1, dist_init_addr="192.168.1.10:5000").topology()
    assert (seeds.world_size, seeds.ranks_per_node, list(seeds.node_ranks())) == (16, 8, list(range(8, 16)))
    assert (seeds.attn_tp_size, seeds.attn_dp_rank(11), seeds.attn_tp_rank(11)) == (2, 5, 1)
    assert (seeds.ep_size, seeds.moe_tp_size, seeds.ep_rank(11)) == (16, 1, 11)  # deepep implies EP over TP
    # DeepSeek-V3.1 over four nodes: --tp 8 --pp-size 4 --nnodes 4
    pp = EngineConfig(model_path="m", tp_size=8, pp_size=4, nnodes=4, dist_init_addr="h:1").topology()
    assert (pp.world_size, pp.pp_rank(17), pp.tp_rank(17), pp.node_of(17)) == (32, 2, 1, 2)
    assert pp.stage_ranks(3) == list(range(24, 32))
    assert [list(pp.stage_layers(61, s)) for s in range(4)] == [
        list(range(0, 16)), list(range(16, 31)), list(range(31, 46)), list(range(46, 61))]


def test_ep_blocks_and_moe_tp() -> None:
    t = Topology(tp_size=4, ep_size=2)
    assert [(t.ep_rank(r), t.moe_tp_rank(r)) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]


@pytest.mark.parametrize("kwargs, message", [
    (dict(tp_size=2, nnodes=3, dist_init_addr="h:1"),
     "--nnodes 3 does not divide the 2 ranks (--tp-size 2 x --pp-size 1)"),
    (dict(tp_size=4, dp_size=3, enable_dp_attention=True), "--dp-size 3 does not divide --tp-size 4"),
    (dict(tp_size=4, ep_size=3), "--ep-size 3 does not divide --tp-size 4"),
    (dict(tp_size=2, nnodes=2, node_rank=2, dist_init_addr="h:1"),
     "--node-rank 2 is outside 0..1 (--nnodes 2)"),
    (dict(tp_size=2, dp_size=2), "--dp-size 2 needs --enable-dp-attention"),
    (dict(tp_size=2, nnodes=2), "--nnodes 2 needs --dist-init-addr HOST:PORT"),
    (dict(moe_a2a_backend="nccl"), "--moe-a2a-backend must be none, deepep or mooncake"),
])
def test_layouts_that_do_not_fit_are_refused(kwargs, message) -> None:
    with pytest.raises(ValueError) as refused:
        EngineConfig(model_path="m", **kwargs)
    assert message in str(refused.value)


def test_more_stages_than_layers() -> None:
    with pytest.raises(TopologyError, match="--pp-size 4 is more than the model's 2 layers"):
        Topology(pp_size=4).stage_layers(2, 0)


def test_sglang_spellings() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_config_arguments(parser, EngineConfig)
    config = config_from_args(EngineConfig, parser.parse_args(
        ["--model-path", "m", "--tp", "4", "--ep", "2", "--pp-size", "2", "--nnodes", "2", "--node-rank", "1",
         "--dist-init-addr", "10.0.0.1:5000", "--trust-remote-code"]))
    assert (config.tp_size, config.ep_size, config.pp_size, config.world_size) == (4, 2, 2, 8)
