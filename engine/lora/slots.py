"""The adapters a worker serves, and the bounded pool of slots they run from.

Registered adapters (--lora-paths, or loaded at run time) stay on the host. A request's adapter is
copied into one of `num_slots` (--max-loras-per-batch) slots of the model's LoRA weights when the
request is admitted; the slot is held while any running request uses it, and a slot no running
request holds is reused for another adapter, least recently used first. So a step never mixes more
than num_slots adapters, and the device keeps only num_slots adapters' weights whatever is registered.

Threads: the engine thread acquires and releases slots between forward passes; register and
unregister come from the serving threads. One lock covers the bookkeeping.

Tensor parallelism: every rank holds its shard of each slot (engine.lora.adapter's
COLUMN_PARALLEL_MODULES split B's rows, the others A's columns). Rank 0 alone schedules, so only its
pool decides which adapter a slot holds: each copy into a slot is recorded as a `SlotLoad`, which the
scheduler puts in the step's plan, and the follower ranks (which run rank 0's plan) copy the same
adapter, read from the same folder, into the same slot before the step runs.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass

import torch

from engine.lora.adapter import (
    COLUMN_PARALLEL_MODULES,
    REPLICATED_MODULES,
    LoraAdapter,
    LoraLoadError,
    dense_mlp_layers,
    load_adapter,
    module_shape,
)
from engine.lora.experts import EXPERT_PROJECTIONS, ExpertProjectionLora, allocate_expert_pools
from engine.lora.ops import lora_delta, slot_mask
from engine.models.config import ModelConfig
from engine.tp.shard import TPShard
from kernels import cpu_kernels, ops

# Each of the decoder's projections and the PEFT modules fused in it, in the order of its rows.
PROJECTIONS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
               "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
# An MLA layer's attention projections (attributes of engine.models.mla.MLAAttention) instead of qkv/o_proj.
MLA_PROJECTIONS = {"q_proj": ("q_proj",), "q_a_proj": ("q_a_proj",), "q_b_proj": ("q_b_proj",),
                   "kv_a_proj": ("kv_a_proj_with_mqa",), "o_proj": ("o_proj",)}


def projections_of(config: ModelConfig) -> dict[str, tuple[str, ...]]:
    """The wrapped projections of a layer of `config` and the PEFT modules fused in each."""
    if config.mla is None:
        return PROJECTIONS
    return {**MLA_PROJECTIONS, "gate_up": PROJECTIONS["gate_up"], "down": PROJECTIONS["down"]}


@dataclass(frozen=True)
class SlotLoad:
    """Rank 0 copied adapter `name` (its files at `path`, of digest `digest`) into `slot`."""

    slot: int
    name: str
    path: str
    digest: str


@dataclass
class ProjectionLora:
    """One projection's LoRA weights over all slots (the layout of engine.lora.ops)."""

    modules: tuple[str, ...]
    a: torch.Tensor  # [num_slots * width, in]
    bt: torch.Tensor  # [num_slots * width, out]: B transposed
    bounds: tuple[int, ...]  # each module's first column of the fused output, then its width
    width: int  # len(modules) * max_rank

    def fill(self, slot: int, adapter: LoraAdapter | None, layer: int, max_rank: int,
             shard: TPShard | None = None) -> None:
        """Copy `adapter`'s matrices of this projection (this rank's `shard` of them) into `slot`
        (zeros where it has none)."""
        rows = slice(slot * self.width, (slot + 1) * self.width)
        self.a[rows].zero_()
        self.bt[rows].zero_()
        if adapter is None:
            return
        for index, module in enumerate(self.modules):
            pair = adapter.weights.get((layer, module))
            if pair is None:
                continue
            a, b = pair
            if shard is not None and module not in REPLICATED_MODULES:
                a, b = (a, shard.rows(b)) if module in COLUMN_PARALLEL_MODULES else (shard.columns(a), b)
            first = slot * self.width + index * max_rank
            self.a[first:first + a.shape[0]] = a.to(self.a.dtype)
            column = self.bounds[index]
            self.bt[first:first + b.shape[1], column:column + b.shape[0]] = b.t().to(self.bt.dtype)


class LoraSlots:
    """Registered adapters, the slot pool, and the current step's rows (see the module docstring)."""

    def __init__(self, config: ModelConfig, num_slots: int, max_rank: int, target_modules: frozenset[str],
                 dtype: torch.dtype, device: torch.device, cpu_kernel: bool = False,
                 shard: TPShard | None = None) -> None:
        if num_slots < 1 or max_rank < 1:
            raise ValueError("--max-loras-per-batch and --max-lora-rank must be positive")
        self.config = config
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.target_modules = target_modules
        self.shard = shard  # this rank's slice under tensor parallelism
        self.follower = shard is not None and shard.rank > 0  # takes rank 0's SlotLoads
        self.dtype = dtype
        self.device = device
        # kernels/csrc/lora.cpp where asked for and built (CPU, fp32 or bf16), else ops.lora_delta
        self.cpu_kernel = (cpu_kernel and device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
                           and cpu_kernels.available())
        self.adapters: dict[str, LoraAdapter] = {}
        self.slot_names: list[str | None] = [None] * num_slots
        self.slot_refs = [0] * num_slots
        self._last_used = [0] * num_slots
        self._clock = 0
        self.live: Counter[str] = Counter()  # requests in the scheduler per adapter
        self._loads: list[SlotLoad] = []  # rank 0's copies since the last step's plan
        self.scales = torch.zeros(num_slots, dtype=torch.float32, device=device)
        self.ranks = torch.zeros(num_slots, dtype=torch.long, device=device)  # 0: an empty slot
        self.projections: dict[tuple[int, str], ProjectionLora] = self._allocate()
        # routed experts (engine.lora.experts): on one rank only for now
        self.expert_pools: dict[tuple[int, str], ExpertProjectionLora] = (
            allocate_expert_pools(self) if shard is None or shard.size == 1 else {})
        self.row_slots: torch.Tensor | None = None  # this step's, None when no row has an adapter
        self._masks: dict[int, torch.Tensor] = {}
        self.lock = threading.Lock()
        self.resolver_dir = ""  # --lora-resolver-dir: where adapters are loaded from on demand

    def _allocate(self) -> dict[tuple[int, str], ProjectionLora]:
        pools = {}
        dense_mlp = dense_mlp_layers(self.config)
        tp_size = self.shard.size if self.shard is not None else 1
        for layer in range(self.config.num_layers):
            for name, modules in projections_of(self.config).items():
                if not self.target_modules.intersection(modules):
                    continue
                if self.config.mla is not None and name in MLA_PROJECTIONS and (
                        (name == "q_proj") != (self.config.mla.q_lora_rank is None)):
                    continue  # q_proj alone, or q_a_proj and q_b_proj
                if modules[0] in ("gate_proj", "down_proj") and layer not in dense_mlp:
                    continue
                shapes = [module_shape(self.config, m, tp_size) for m in modules]
                bounds = tuple(sum(s[0] for s in shapes[:i]) for i in range(len(shapes) + 1))
                width = len(modules) * self.max_rank
                out_features, in_features = bounds[-1], shapes[0][1]
                rows = self.num_slots * width
                pools[(layer, name)] = ProjectionLora(
                    modules, torch.zeros(rows, in_features, dtype=self.dtype, device=self.device),
                    torch.zeros(rows, out_features, dtype=self.dtype, device=self.device), bounds, width)
        return pools

    # ---- registry (serving threads) -------------------------------------------------------------
    def register(self, adapter: LoraAdapter) -> None:
        if adapter.experts and not self.expert_pools:
            raise LoraLoadError(f"LoRA adapter {adapter.name!r} adapts routed experts, which this worker "
                                "serves only without tensor or expert parallelism (--tp-size 1, --ep-size 1)")
        with self.lock:
            if adapter.name in self.adapters:
                raise LoraLoadError(f"a LoRA adapter named {adapter.name!r} is already loaded")
            self.adapters[adapter.name] = adapter

    def unregister(self, name: str) -> None:
        """Forget an adapter; KeyError if unknown, LoraLoadError while a request uses it."""
        with self.lock:
            if name not in self.adapters:
                raise KeyError(name)
            if self.live[name]:
                raise LoraLoadError(f"LoRA adapter {name!r} is in use by {self.live[name]} request(s)")
            del self.adapters[name]
            if name in self.slot_names:
                self.slot_names[self.slot_names.index(name)] = None

    def names(self) -> list[str]:
        with self.lock:
            return sorted(self.adapters)

    def has(self, name: str) -> bool:
        return name in self.adapters

    def cache_key(self, name: str) -> str:
        """The adapter's key in page hashes: its name and its files' digest, so pages computed under
        an unloaded adapter are never reused for another one loaded later under the same name."""
        adapter = self.adapters.get(name)
        return adapter.cache_key if adapter is not None else name

    # ---- requests (engine thread) ---------------------------------------------------------------
    def hold(self, name: str) -> None:
        """A request of `name` entered the scheduler (it cannot be unloaded until `drop`)."""
        with self.lock:
            if name not in self.adapters:
                raise ValueError(f"LoRA adapter {name!r} is not loaded")
            self.live[name] += 1

    def drop(self, name: str) -> None:
        with self.lock:
            self.live[name] -= 1
            if self.live[name] <= 0:
                del self.live[name]

    def acquire(self, name: str) -> int | None:
        """The slot `name` runs from, loading it into a free or idle slot; None when every slot is
        held by running requests of other adapters (the request waits)."""
        with self.lock:
            self._clock += 1
            if name in self.slot_names:
                slot = self.slot_names.index(name)
            else:
                idle = [s for s in range(self.num_slots) if self.slot_refs[s] == 0]
                if not idle:
                    return None
                slot = min(idle, key=lambda s: (self.slot_names[s] is not None, self._last_used[s]))
                self._load(slot, self.adapters[name])
            self.slot_refs[slot] += 1
            self._last_used[slot] = self._clock
            return slot

    def release(self, slot: int) -> None:
        with self.lock:
            self.slot_refs[slot] -= 1

    def _load(self, slot: int, adapter: LoraAdapter) -> None:
        for (layer, _), projection in self.projections.items():
            projection.fill(slot, adapter, layer, self.max_rank, self.shard)
        for (layer, name), experts in self.expert_pools.items():
            experts.fill(slot, adapter, layer, EXPERT_PROJECTIONS[name], self.max_rank)
        self.scales[slot] = adapter.scaling
        self.ranks[slot] = adapter.rank
        self.slot_names[slot] = adapter.name
        self._loads.append(SlotLoad(slot, adapter.name, adapter.path, adapter.digest))

    # ---- tensor parallelism ---------------------------------------------------------------------
    def take_loads(self) -> list[SlotLoad]:
        """Rank 0: the slot copies made since the last call (the scheduler puts them in the step's plan)."""
        with self.lock:
            loads, self._loads = self._loads, []
            return loads

    def apply_loads(self, loads: list[SlotLoad]) -> None:
        """A follower rank: make each slot hold what rank 0's does, in rank 0's order, before the step
        runs (rank 0's own copies are already made: nothing to do there)."""
        if not self.follower:
            return
        for load in loads:
            adapter = self.adapters.get(load.name)
            if adapter is None or adapter.digest != load.digest:
                # loaded at run time on rank 0 (or reloaded under the name): read it from its folder
                adapter = load_adapter(load.name, load.path, self.config, self.max_rank, self.target_modules)
                if adapter.digest != load.digest:
                    raise LoraLoadError(f"LoRA adapter {load.name!r}: {load.path} changed after rank 0 "
                                        "read it")
                self.adapters[load.name] = adapter
            self._load(load.slot, adapter)
        self._loads.clear()  # a follower's copies are rank 0's, sent nowhere

    # ---- one step -------------------------------------------------------------------------------
    def set_rows(self, row_slots: list[int]) -> None:
        """The slot of each row of the next forward pass (-1: the base model)."""
        self._masks = {}
        if all(slot < 0 for slot in row_slots):
            self.row_slots = None
            return
        self.row_slots = torch.tensor(row_slots, dtype=torch.long).to(self.device)

    def add_delta(self, projection: ProjectionLora, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` [T, out] (the base projection of this step's rows `x` [T, in]) plus each row's
        adapter delta, in place."""
        if self.row_slots is None:
            return out
        if self.cpu_kernel:
            return cpu_kernels.lora_delta_add(out, x.contiguous(), projection.a, projection.bt,
                                              self.row_slots, self.scales, self.ranks, projection.bounds)
        if self.device.type == "cuda":
            return ops.lora_delta_add_triton(out, x.contiguous(), projection.a, projection.bt, self.row_slots,
                                             self.scales, projection.bounds)
        mask = self._masks.get(projection.width)
        if mask is None:
            mask = self._masks[projection.width] = slot_mask(self.row_slots, self.scales, projection.width,
                                                             x.dtype)
        return out.add_(lora_delta(x, projection.a, projection.bt, mask))
