"""A follower rank's process: `python -m engine.tp.follower`, its spec (JSON) on stdin (started by engine.tp.ranks).

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
from engine.tp.control import connect_to_rank0, serve
from engine.tp.group import TPGroup, open_store
from engine.tp.load import load_rank
from engine.tp.runner import follow
from engine.tp.setup import RENDEZVOUS_HOST
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
    store = open_store(RENDEZVOUS_HOST, spec["port"], topology.world_size, False, config.dist_timeout)
    group = TPGroup(rank, topology, store, device, config.dist_timeout)
    host, port, authkey = spec["control"]
    control = connect_to_rank0((host, port), bytes.fromhex(authkey), rank)
    transfer = None
    try:
        rank_engine = load_rank(config, device, group)
        log.info("loaded shard %d/%d: %d KV pages of %s", rank, config.tp_size, rank_engine.pool.num_pages,
                 rank_engine.pool.layout.describe())
        transfer = RankTransfer(rank_engine.pool, rank, config.world_size, config.pp_size)  # world rank of world size
        threading.Thread(target=serve, args=(control, transfer), name="pdserve-tp-control", daemon=True).start()
        follow(group, rank_engine.runner)
    except RuntimeError as exc:  # a collective failed: rank 0 went away or broke the group
        log.error("stopping: %s", exc)
        return 1
    group.close()
    if transfer is not None and transfer.backend is not None:
        transfer.close()
        logging.shutdown()
        exit_process(0)  # NIXL agents crash at interpreter exit: leave without the teardown
    return 0


if __name__ == "__main__":
    sys.exit(main())
