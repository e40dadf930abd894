"""Topology: how one worker's ranks are laid out over nodes, pipeline stages, TP, DP attention and EP.

SGLang's arithmetic, so that its command lines mean the same here:
- world = tp_size * pp_size ranks; rank r is in pipeline stage r // tp_size at TP rank r % tp_size.
  Each stage holds a consecutive block of layers (`stage_layers`).
- nnodes nodes each run world / nnodes consecutive ranks; node 0 runs rank 0 (the scheduler, and a
  worker's gRPC endpoint).
- DP attention (`--enable-dp-attention --dp-size D`): inside a stage, the tp_size ranks form D
  attention groups of tp_size / D ranks each (attention TP size), each with its own requests and
  KV pool; the MLP/MoE layers still run over all tp_size ranks.
- Expert parallelism (`--ep-size E`): inside a stage, experts are split into E blocks; the ranks
  sharing a block (tp_size / E of them, the MoE TP size) split each of its experts' columns.

Every check raises `TopologyError` naming the flags and values that do not fit.
"""

from __future__ import annotations

from dataclasses import dataclass


class TopologyError(ValueError):
    """A layout that does not fit: the message names the flags and their values."""


@dataclass(frozen=True)
class Topology:
    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1  # attention DP groups (1 unless --enable-dp-attention)
    ep_size: int = 1
    nnodes: int = 1
    node_rank: int = 0

    def __post_init__(self) -> None:
        for name in ("tp_size", "pp_size", "dp_size", "ep_size", "nnodes"):
            if getattr(self, name) < 1:
                raise TopologyError(f"--{name.replace('_', '-')} must be at least 1, got "
                                    f"{getattr(self, name)}")
        if not 0 <= self.node_rank < self.nnodes:
            raise TopologyError(f"--node-rank {self.node_rank} is outside 0..{self.nnodes - 1} (--nnodes "
                                f"{self.nnodes})")
        if self.world_size % self.nnodes:
            raise TopologyError(f"--nnodes {self.nnodes} does not divide the {self.world_size} ranks "
                                f"(--tp-size {self.tp_size} x --pp-size {self.pp_size}): every node runs as "
                                "many ranks")
        if self.tp_size % self.dp_size:
            raise TopologyError(f"--dp-size {self.dp_size} does not divide --tp-size {self.tp_size} "
                                "(each DP attention group takes tp_size / dp_size ranks)")
        if self.tp_size % self.ep_size:
            raise TopologyError(f"--ep-size {self.ep_size} does not divide --tp-size {self.tp_size} "
                                "(each expert block takes tp_size / ep_size ranks)")

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    def node_ranks(self, node: int | None = None) -> range:
        """The world ranks node `node` (default: this one) runs."""
        node = self.node_rank if node is None else node
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def pp_rank(self, rank: int) -> int:
        return rank // self.tp_size

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp_size

    def stage_ranks(self, pp_rank: int) -> list[int]:
        """The world ranks of pipeline stage `pp_rank` (its TP group)."""
        return list(range(pp_rank * self.tp_size, (pp_rank + 1) * self.tp_size))

    @property
    def attn_tp_size(self) -> int:
        return self.tp_size // self.dp_size

    def attn_dp_rank(self, rank: int) -> int:
        return self.tp_rank(rank) // self.attn_tp_size

    def attn_tp_rank(self, rank: int) -> int:
        return self.tp_rank(rank) % self.attn_tp_size

    @property
    def moe_tp_size(self) -> int:
        return self.tp_size // self.ep_size

    def ep_rank(self, rank: int) -> int:
        return self.tp_rank(rank) // self.moe_tp_size

    def moe_tp_rank(self, rank: int) -> int:
        return self.tp_rank(rank) % self.moe_tp_size

    def stage_layers(self, num_layers: int, pp_rank: int) -> range:
        """The layers stage `pp_rank` holds: consecutive blocks, the first num_layers % pp_size stages
        one layer longer."""
        if num_layers < self.pp_size:
            raise TopologyError(f"--pp-size {self.pp_size} is more than the model's {num_layers} layers")
        base, extra = divmod(num_layers, self.pp_size)
        start = pp_rank * base + min(pp_rank, extra)
        return range(start, start + base + (1 if pp_rank < extra else 0))

    def describe(self) -> str:
        parts = [f"tp {self.tp_size}"]
        if self.pp_size > 1:
            parts.append(f"pp {self.pp_size}")
        if self.dp_size > 1:
            parts.append(f"dp-attention {self.dp_size}")
        if self.ep_size > 1:
            parts.append(f"ep {self.ep_size}")
        if self.nnodes > 1:
            parts.append(f"{self.nnodes} nodes ({self.ranks_per_node} ranks each)")
        return ", ".join(parts)
