"""TPGroup: the torch.distributed process group of one worker's tensor-parallel ranks.

gloo on CPU, NCCL where the ranks run on CUDA. The ranks meet through a store that rank 0 serves
(engine.tp.rendezvous), on one node or across nodes. Collectives time out after `timeout_s`, so a
rank that stops answering fails the step instead of hanging it (a rank that dies closes its
sockets and fails it at once).
"""

from __future__ import annotations

import datetime
import pickle
import socket
from collections import Counter

import torch
import torch.distributed as dist

from engine.tp.topology import Topology

# How long one collective may wait for the slowest rank. A step of a big prompt can take seconds
# on CPU; a rank that takes minutes is broken.
DEFAULT_TIMEOUT_S = 300.0


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


class TPGroup:
    """One rank's view of the worker's ranks: all-reduce over its TP group for the model, object
    broadcast from rank 0 to every rank for the step plan.

    `rank` and `size` are the world's (tp_size * pp_size ranks, engine.tp.topology); `tp_rank` and
    `tp_size` place this rank in its pipeline stage's TP group, over which `all_reduce` sums.
    `tp_group` and `ep_group` are the torch.distributed groups of this rank's stage and of the ranks
    it exchanges tokens with under expert parallelism (None: the whole world is that group).

    Every method is a collective: all ranks call it in the same order (rank 0's engine thread
    drives; followers mirror it in engine.tp.runner.follow).
    """

    def __init__(self, rank: int, topology: Topology, store: dist.Store, device: torch.device,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.rank = rank
        self.size = topology.world_size
        self.topology = topology
        self.tp_rank, self.tp_size = topology.tp_rank(rank), topology.tp_size
        self.pp_rank = topology.pp_rank(rank)
        self.device = device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        # Bytes this rank put into each kind of collective since start (`pdserve bench parallel`).
        self.traffic: Counter[str] = Counter()
        dist.init_process_group(self.backend, store=store, rank=rank, world_size=self.size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        self._store = store
        self.tp_group = self._own_group([topology.stage_ranks(stage) for stage in range(topology.pp_size)])
        self.ep_group = self._own_group([
            [first + moe_tp + block * topology.moe_tp_size for block in range(topology.ep_size)]
            for first in range(0, self.size, topology.tp_size) for moe_tp in range(topology.moe_tp_size)])
        # DP attention: the ranks of one attention group sum attention's outputs among themselves
        # (None when each group is one rank: nothing to sum).
        self.attn_group = None
        if topology.dp_size > 1 and topology.attn_tp_size > 1:
            self.attn_group = self._own_group([
                [first + g * topology.attn_tp_size + i for i in range(topology.attn_tp_size)]
                for first in range(0, self.size, topology.tp_size) for g in range(topology.dp_size)])

    def _own_group(self, partition: list[list[int]]):
        """Make one torch.distributed group per part (every rank must make every group, in the same
        order) and return the one holding this rank; None when that part is the whole world."""
        if len(partition) == 1 and len(partition[0]) == self.size:
            return None
        mine = None
        for ranks in partition:
            group = dist.new_group(ranks)
            if self.rank in ranks:
                mine = group
        return mine

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` over this rank's TP group, in place. Half-precision partial sums are added in
        fp32 and rounded once, as the unsplit matmul's fp32 accumulator would (bf16 sums round at each
        add)."""
        self.traffic["all_reduce"] += tensor.numel() * 4
        if tensor.dtype == torch.float32:
            dist.all_reduce(tensor, group=self.tp_group)
            return
        wide = tensor.float()
        dist.all_reduce(wide, group=self.tp_group)
        tensor.copy_(wide)

    def broadcast(self, obj: object) -> object:
        """Rank 0 sends `obj`, every other rank returns rank 0's. One size message plus one payload."""
        if self.rank == 0:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)),
                                       dtype=torch.uint8)
            size = torch.tensor([payload.numel()], dtype=torch.long)
            self.traffic["plan"] += payload.numel()
            self.traffic["broadcasts"] += 1
        else:
            size = torch.zeros(1, dtype=torch.long)
        self._broadcast_host(size)
        if self.rank != 0:
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
        self._broadcast_host(payload)
        return obj if self.rank == 0 else pickle.loads(payload.numpy().tobytes())

    def _broadcast_host(self, tensor: torch.Tensor) -> None:
        if self.backend == "nccl":  # NCCL moves device memory only
            on_device = tensor.to(self.device)
            dist.broadcast(on_device, src=0)
            tensor.copy_(on_device.cpu())
        else:
            dist.broadcast(tensor, src=0)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
