"""A follower rank's process: `python -m engine.tp.follower`, its spec (JSON) on stdin (started by
engine.tp.ranks).

The spec is JSON: the engine config, this rank, rank 0's rendezvous port and rank 0's pid. The
follower loads its shard of the weights, makes its KV pool the size rank 0 chose (same page ids
on every rank), then runs the steps rank 0 broadcasts until told to stop. It exits when its
parent goes away, so a killed worker never leaves ranks behind.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time

import torch

from engine.config import EngineConfig
from engine.models.config import ModelConfig
from engine.speculative.nextn_ranks import follower_runner
from engine.tp.control import connect_to_rank0, serve
from engine.tp.group import TPGroup
from engine.tp.load import load_rank
from engine.tp.rendezvous import NODE_LOST_AFTER_S, HeartbeatWatch, RendezvousError, open_store
from engine.tp.runner import follow
from engine.tp.shard import TPShard
from libkv.transfer import exit_process
from libkv.transfer.tensor_parallel import RankTransfer

log = logging.getLogger("pdserve.tp")


def _exit_with_parent(parent: int) -> None:
    """os._exit as soon as rank 0's process is gone (we are re-parented): nobody drives us any more."""
    def run() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        log.error("tp follower: rank 0's process %d is gone; exiting", parent)
        os._exit(1)

    threading.Thread(target=run, name="pdserve-tp-parent", daemon=True).start()


_leaving = threading.Event()


def _rank0_lost(why: str) -> None:
    if _leaving.is_set():
        return
    log.error("tp follower: %s; exiting", why)
    logging.shutdown()
    os._exit(1)


def _serve_then_exit(control, transfer: RankTransfer) -> None:
    """Answer rank 0's control calls; once rank 0's end of the channel is gone (its process died,
    maybe on another node, where no parent watch sees it), nobody drives this rank: leave."""
    serve(control, transfer)
    if _leaving.is_set():  # rank 0 closed the group first: the orderly way out is under way
        return
    log.error("tp follower: rank 0's control channel closed; exiting")
    logging.shutdown()
    os._exit(1)


def main() -> int:
    spec = json.loads(sys.stdin.read())
    rank = spec["rank"]
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format=f"[%(asctime)s] tp rank {rank}: %(message)s", datefmt="%Y-%m-%d %H:%M:%S")
    _exit_with_parent(spec["parent"])
    config = EngineConfig(**spec["config"])
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    device = torch.device(config.device)
    if device.type == "cuda":
        device = torch.device("cuda", (device.index or 0) + rank)
        torch.cuda.set_device(device)
    topology = config.topology()
    store_host, store_port = spec["store"]
    try:
        store = open_store(store_host, store_port, topology.world_size, False, config.dist_timeout,
                           topology.node_of(rank))
        group = TPGroup(rank, topology, store, device, config.dist_timeout)
        # This rank's heartbeat, on its own store connection with a short timeout (engine.tp.rendezvous):
        # rank 0 notices this rank freezing; this rank notices rank 0's process (the store's) freezing.
        beat_store = open_store(store_host, store_port, topology.world_size, False, NODE_LOST_AFTER_S,
                                topology.node_of(rank))
        HeartbeatWatch(beat_store, f"tp rank {rank}", [], NODE_LOST_AFTER_S, _rank0_lost)
    except (RendezvousError, RuntimeError) as exc:
        log.error("cannot join the rank group: %s", exc)
        return 1
    host, port, authkey = spec["control"]
    control = connect_to_rank0((host, port), bytes.fromhex(authkey), rank)
    transfer = None
    try:
        rank_engine = load_rank(config, device, group)
        log.info("loaded shard %d/%d: %d KV pages of %s", rank, config.tp_size, rank_engine.pool.num_pages,
                 rank_engine.pool.layout.describe())
        # World rank of world size (under DP attention: rank in its attention group, whose pages it
        # holds a share of); ranks on another node bind their transfer engines to that node's
        # address, not rank 0's.
        if topology.dp_size > 1:
            transfer = RankTransfer(rank_engine.pool, topology.attn_tp_rank(rank), topology.attn_tp_size,
                                    bind_host=spec.get("transfer_host"))
        else:
            transfer = RankTransfer(rank_engine.pool, rank, config.world_size, config.pp_size,
                                    bind_host=spec.get("transfer_host"))
        threading.Thread(target=_serve_then_exit, args=(control, transfer), name="pdserve-tp-control",
                         daemon=True).start()
        shard = TPShard(group.tp_rank, group.tp_size)
        follow(group, follower_runner(config, ModelConfig.from_dir(config.model_path), rank_engine.model,
                                      rank_engine.pool, rank_engine.runner, shard))  # type: ignore[arg-type]
    except RuntimeError as exc:  # a collective failed: rank 0 went away or broke the group
        log.error("stopping: %s", exc)
        return 1
    _leaving.set()
    group.close()
    if transfer is not None and transfer.backend is not None:
        transfer.close()
        logging.shutdown()
        exit_process(0)  # NIXL agents crash at interpreter exit: leave without the teardown
    return 0


if __name__ == "__main__":
    sys.exit(main())
