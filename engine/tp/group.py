"""TPGroup: the torch.distributed process group of one worker's tensor-parallel ranks.

gloo on CPU, NCCL where the ranks run on CUDA. Rank 0 listens on a free TCP port of the worker's
host (the rendezvous store); followers connect to it. Collectives time out after `timeout_s`, so a
rank that stops answering fails the step instead of hanging it (a rank that dies closes its
sockets and fails it at once).
"""

from __future__ import annotations

import datetime
import pickle
import socket

import torch
import torch.distributed as dist

# How long one collective may wait for the slowest rank. A step of a big prompt can take seconds
# on CPU; a rank that takes minutes is broken.
DEFAULT_TIMEOUT_S = 300.0


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


class TPGroup:
    """One rank's view of the group: all-reduce for the model, object broadcast for the step plan.

    Every method is a collective: all ranks call it in the same order (rank 0's engine thread
    drives; followers mirror it in engine.tp.runner.follow).
    """

    def __init__(self, rank: int, size: int, host: str, port: int, device: torch.device,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.rank = rank
        self.size = size
        self.device = device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        store = dist.TCPStore(host, port, size, is_master=rank == 0,
                              timeout=datetime.timedelta(seconds=timeout_s))
        dist.init_process_group(self.backend, store=store, rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        self._store = store

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` over the ranks, in place. Half-precision partial sums are added in fp32 and
        rounded once, as the unsplit matmul's fp32 accumulator would (bf16 sums round at each add)."""
        if tensor.dtype == torch.float32:
            dist.all_reduce(tensor)
            return
        wide = tensor.float()
        dist.all_reduce(wide)
        tensor.copy_(wide)

    def broadcast(self, obj: object) -> object:
        """Rank 0 sends `obj`, every other rank returns rank 0's. One size message plus one payload."""
        if self.rank == 0:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)),
                                       dtype=torch.uint8)
            size = torch.tensor([payload.numel()], dtype=torch.long)
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
