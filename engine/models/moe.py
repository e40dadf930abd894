"""Routed experts: a layer's MLP as a router plus expert SwiGLU MLPs (and shared experts).

The decoder loads a `MoEBlock` for each layer in `MoEConfig.sparse_layers` and calls it on the
post-attention-normed hidden states [T, hidden] of a whole flattened batch.

Forward: the router (`Router`, exactly transformers' recipe per architecture, engine.models.
moe_config) gives each token `top_k` expert ids and weights; the T * top_k (token, expert) pairs
are sorted by expert (argsort + bincount), each expert that received tokens runs once on all of
its rows (a Python loop over experts, never over tokens), and the weighted outputs are summed into
their tokens by one `index_add_`, in increasing expert id, the order in which transformers adds
them. Shared experts (DeepSeek) are one dense SwiGLU MLP added to that. The gate is a prepacked
Linear and no sum depends on the other tokens of the step, so a request's output is the same
alone or in any batch (tests/engine/test_moe.py).

With the C++ CPU kernels (engine.models.layer_ops.CpuKernelLayerOps, `fused_moe_experts`) the
routed experts instead run as one op per layer, kernels.cpu_kernels.moe_experts over every
expert's weights stacked ([E, 2I, H] and [E, H, I], no Linears kept): in a decode step most
experts get a few rows, and two oneDNN calls per expert cost ~50 us each in overhead (small-moe
bf16 decode, batch 16: 418 of them per step). The op rounds where this torch path does and sums
each output element in an order fixed by its own token, so it is used for every batch size: a
row-count switch to oneDNN would make a token's result depend on the batch it ran in.

Weights. Each expert's gate/up is fused into one `Linear` and its down into another, both
prepacked for oneDNN (engine.models.linear); the packed copy replaces the checkpoint tensor, so
per-expert Linears cost no memory beyond the weights. Two checkpoint layouts load:
- published (what model hubs ship, and what transformers 5 `save_pretrained` writes, converting
  back from its in-memory layout): one tensor per expert, `mlp.experts.E.{gate,up,down}_proj.weight`
  (Mixtral: `block_sparse_moe.experts.E.{w1,w3,w2}.weight`, gate `block_sparse_moe.gate.weight`);
- fused (transformers 5's in-memory state dict, written by saving `state_dict()` directly):
  `mlp.experts.gate_up_proj` [E, 2 * I, hidden] and `mlp.experts.down_proj` [E, hidden, I].
The router is `mlp.gate.weight` [E, hidden] (DeepSeek V3 adds `mlp.gate.e_score_correction_bias`),
the shared experts `mlp.shared_experts.{gate,up,down}_proj.weight`.

Tensor parallelism: every rank keeps every expert and holds its 1/N slice of each expert's
intermediate dimension (gate/up rows, down columns), exactly like the dense MLP; the router is
replicated, so every rank routes identically and needs no exchange, and the decoder's one
all-reduce after the MLP sums the partial outputs. Split by intermediate columns, every rank does
1/N of every expert's work, balanced by construction.

Expert parallelism (`--ep-size`, engine.tp.expert_parallel): loaded with an `ExpertParallel`, a
block holds only its EP rank's experts (each still split by columns over the moe_tp ranks that
share them). Every rank still routes every token (the router is cheap, and so the expert-load
counts stay whole on rank 0), then sends the pairs of its slice of the rows to the experts' owners
and sums what comes back; the result is this rank's partial output like any other, zero outside
its slice, and the decoder's all-reduce completes it. Shared experts stay column-split over TP.

LoRA (engine.lora.experts): a block may carry `adapters`, which add each row's adapter delta to
every expert's gate_up and down outputs; with adapter rows in the step the experts run on the torch
path above, the adapter's rows grouped with their expert's like any other.

Expert load: each block counts its (token, expert) pairs per expert with one `bincount` on the
ids it computes anyway; `expert_load` sums them over layers for the worker's metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from engine.models.linear import Linear
from engine.models.moe_config import GROUP_LIMITED_GREEDY, NOAUX_TC, SIGMOID, MoEConfig
from engine.models.weights import ShardedReader
from engine.tp.expert_parallel import ExpertParallel
from kernels import cpu_kernels


class Router:
    """Top-k expert choice for each token: `__call__(x [T, hidden])` -> (ids [T, k] int64,
    weights [T, k]); fp32 weights, or the model dtype where transformers casts them (Qwen3-MoE)."""

    def __init__(self, config: MoEConfig, weight: torch.Tensor,
                 correction_bias: torch.Tensor | None = None) -> None:
        self.config = config
        # DeepSeek multiplies in fp32; Qwen3-MoE and Mixtral in the model dtype (then softmax in fp32).
        # A prepacked Linear rather than F.linear: MKL's sums for one row differ from those for
        # several, which would make a token's experts depend on the batch it ran in.
        self.gate = Linear(weight.float() if config.router_fp32 else weight)
        self.correction_bias = correction_bias.float() if correction_bias is not None else None
        if config.topk_method == NOAUX_TC and correction_bias is None:
            raise ValueError("noaux_tc routing needs e_score_correction_bias")

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.config
        logits = self.gate(x.float() if cfg.router_fp32 else x)
        if cfg.scoring == SIGMOID:
            scores = _sigmoid_rows(logits)
        else:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
        if cfg.topk_method == NOAUX_TC:
            if self.correction_bias is None:  # __init__ refuses this
                raise ValueError("noaux_tc routing needs e_score_correction_bias")
            choice = scores + self.correction_bias
            per_group = cfg.num_experts // cfg.num_groups
            groups = choice.view(-1, cfg.num_groups, per_group).topk(2, dim=-1)[0].sum(-1)
            choice = choice.masked_fill(~self._group_mask(groups), float("-inf"))
            ids = torch.topk(choice, cfg.top_k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, ids)
        elif cfg.topk_method == GROUP_LIMITED_GREEDY:
            groups = scores.view(-1, cfg.num_groups, cfg.num_experts // cfg.num_groups).amax(dim=-1)
            weights, ids = torch.topk(scores.masked_fill(~self._group_mask(groups), 0.0), cfg.top_k, dim=-1,
                                      sorted=False)
        else:
            weights, ids = torch.topk(scores, cfg.top_k, dim=-1)
        if cfg.normalize:
            total = weights.sum(dim=-1, keepdim=True)
            weights = weights / (total + 1e-20 if cfg.scoring == SIGMOID else total)  # V3 adds 1e-20
        if cfg.scaling_factor != 1.0:
            weights = weights * cfg.scaling_factor
        if cfg.weights_in_model_dtype:
            weights = weights.to(x.dtype)
        return ids, weights

    def _group_mask(self, group_scores: torch.Tensor) -> torch.Tensor:
        """[T, experts] True for the experts of each token's `topk_groups` best groups."""
        cfg = self.config
        best = torch.topk(group_scores, cfg.topk_groups, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return keep.repeat_interleave(cfg.num_experts // cfg.num_groups, dim=1)


# Elements torch's vectorized elementwise loops take per iteration at most (two AVX-512 vectors of
# fp32, and then some): a tensor whose size is a multiple of it has no tail.
_VECTOR_SPAN = 64


def _sigmoid_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits.sigmoid() whose rows do not depend on how many rows there are. torch computes the
    tail of a tensor past its last whole vector with another routine whose last bit can differ, so
    with 8 experts a token's scores changed with the number of tokens in its step (7 against 8
    rows); each row padded to a multiple of the vector span leaves no tail."""
    width = logits.shape[-1]
    padded = -(-width // _VECTOR_SPAN) * _VECTOR_SPAN
    if padded == width:
        return logits.sigmoid()
    return torch.nn.functional.pad(logits, (0, padded - width)).sigmoid()[..., :width]


@dataclass(frozen=True)
class ExpertLoad:
    """Tokens routed to each expert since load, summed over the MoE layers, and the last step's
    imbalance: max / mean tokens per expert in its most unevenly loaded layer (1.0 is even).
    Under expert parallelism also the same tokens summed per EP rank's block of experts, and the
    bytes rank 0's all-to-alls sent to and received from the other ranks (rank 0's only: the
    other ranks' depend on where their slices' tokens went)."""

    tokens_per_expert: tuple[int, ...]
    last_step_imbalance: float
    tokens_per_ep_rank: tuple[int, ...] = ()  # empty without expert parallelism
    a2a_sent_bytes: int = 0
    a2a_received_bytes: int = 0


# Adds LoRA deltas in place: (expert, "gate_up" or "down", first row of the expert's run among the
# pairs, the projection's input rows, its output rows).
ExpertDelta = Callable[[int, str, int, torch.Tensor, torch.Tensor], None]


class ExpertAdapters(Protocol):
    """Per-row LoRA on a block's routed experts (engine.lora.experts.ExpertLoraHook)."""

    def bind(self, pair_rows: torch.Tensor) -> ExpertDelta | None:
        """The delta for this step's (token, expert) pairs, `pair_rows` [P] the token row of each pair
        in expert-sorted order; None when no row of the step has an adapter."""
        ...


class MoEBlock:
    """One layer's mixture-of-experts MLP; __call__ returns this rank's partial output [T, hidden]."""

    def __init__(self, config: MoEConfig, router: Router, experts: list[tuple[Linear, Linear]] | None,
                 shared: tuple[Linear, Linear] | None = None,
                 stacked: tuple[torch.Tensor, torch.Tensor] | None = None,
                 ep: ExpertParallel | None = None) -> None:
        self.config = config
        self.router = router
        self.experts = experts  # per expert: gate_up [2 * I / tp, hidden], down [hidden, I / tp]
        # Or, for the fused C++ op (kernels.cpu_kernels.moe_experts), every expert's weights stacked:
        # gate_up [E, 2 * I / tp, hidden], down [E, hidden, I / tp] (exactly one of the two is set).
        # Under expert parallelism only this EP rank's experts, split over the moe_tp ranks instead.
        self.stacked = stacked
        if (experts is None) == (stacked is None):
            raise ValueError("MoEBlock needs either per-expert Linears or stacked expert weights")
        self.shared = shared
        self.ep = ep
        self.adapters: ExpertAdapters | None = None  # LoRA on the routed experts (per-expert Linears only)
        self.routed_tokens = torch.zeros(config.num_experts, dtype=torch.int64)  # since load
        self.last_routed = torch.zeros(config.num_experts, dtype=torch.int64)  # in the last call

    @classmethod
    def load(cls, weights: ShardedReader, layer_prefix: str, config, fused: bool = False,
             ep: ExpertParallel | None = None) -> MoEBlock:
        """Layer `layer_prefix`'s router, experts and shared experts, in either checkpoint layout.
        `fused`: keep the experts stacked for the C++ op (CPU) instead of as per-expert Linears.
        `ep`: load only this EP rank's experts, split over its moe_tp ranks (the shared experts and
        router as without it)."""
        moe: MoEConfig = config.moe
        hidden, width = config.hidden_size, moe.intermediate_size
        mlp = layer_prefix + "mlp."
        experts, expert_weights = range(moe.num_experts), weights
        if ep is not None:
            experts = ep.local_experts
            expert_weights = ShardedReader(weights.reader, weights.device, weights.dtype, ep.expert_shard)
        if mlp + "experts.gate_up_proj" in weights:
            gate_up, down = _fused_experts(expert_weights, mlp + "experts.", moe.num_experts, hidden,
                                           width, experts)
        else:
            names = ("gate_proj", "up_proj", "down_proj")
            if config.architecture == "MixtralForCausalLM":
                mlp, names = layer_prefix + "block_sparse_moe.", ("w1", "w3", "w2")
            per_expert = [_swiglu_weights(expert_weights, mlp + f"experts.{e}.", names, hidden, width)
                          for e in experts]
            gate_up = torch.stack([g for g, _ in per_expert])
            down = torch.stack([d for _, d in per_expert])
            del per_expert
        # In fp32 whatever the model dtype: transformers keeps V3's correction bias in fp32
        # (`_keep_in_fp32_modules_strict`); in bf16 its small differences between experts round away.
        bias = (weights.get(mlp + "gate.e_score_correction_bias", (moe.num_experts,), torch.float32)
                if moe.topk_method == NOAUX_TC else None)
        router = Router(moe, weights.get(mlp + "gate.weight", (moe.num_experts, hidden)), bias)
        shared = None
        if moe.shared_intermediate_size:
            shared = _swiglu(weights, mlp + "shared_experts.", ("gate_proj", "up_proj", "down_proj"), hidden,
                             moe.shared_intermediate_size)
        if fused:
            return cls(moe, router, None, shared, stacked=(gate_up.contiguous(), down.contiguous()), ep=ep)
        linears = [(Linear(gate_up[e]), Linear(down[e])) for e in range(len(experts))]
        return cls(moe, router, linears, shared, ep=ep)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.router(x)
        counts = torch.bincount(ids.view(-1), minlength=self.config.num_experts)
        if self.routed_tokens.device != counts.device:  # on a GPU the counters live beside the routing
            self.routed_tokens = self.routed_tokens.to(counts.device)
        self.routed_tokens += counts
        self.last_routed = counts
        if self.ep is not None:
            out = self.ep.replicated(x, ids, weights, self._run_local_experts)
        elif self.stacked is not None:
            out = cpu_kernels.moe_experts(x.contiguous(), ids, weights, *self.stacked)
        else:
            out = routed_experts_torch(x, ids, weights, self._expert_linears(), counts, self.adapters)
        if self.shared is not None:
            gate_up, down = self.shared
            out += down(_silu_mul(gate_up(x)))
        return out

    def _run_local_experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Expert parallelism's owner side: this rank's experts on `rows` grouped by local expert
        (`counts` [E_local] rows each), unweighted (the origin rank applies the routing weights)."""
        if self.stacked is not None:
            # The fused op with one pair per row of weight 1: its output is the expert's rounded
            # output (x 1.0 rounds to itself), what the torch path below gives.
            ids = torch.repeat_interleave(torch.arange(len(counts)), counts).unsqueeze(1)
            return cpu_kernels.moe_experts(rows.contiguous(), ids, torch.ones(ids.shape), *self.stacked)
        return run_grouped_experts(self._expert_linears(), rows, counts)

    def _expert_linears(self) -> list[tuple[Linear, Linear]]:
        """The per-expert Linears (set whenever `stacked` is not: __init__ checks exactly one is)."""
        if self.experts is None:
            raise ValueError("MoEBlock needs either per-expert Linears or stacked expert weights")
        return self.experts


def routed_experts_torch(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                         experts: list[tuple[Linear, Linear]], counts: torch.Tensor,
                         adapters: ExpertAdapters | None = None) -> torch.Tensor:
    """The routed experts' summed output [T, hidden] in torch ops (the reference of the C++ op);
    `counts` [E] is the bincount of `ids`."""
    top_k = ids.shape[1]
    order = torch.argsort(ids.reshape(-1), stable=True)  # (token, expert) pairs grouped by expert
    rows_of_pairs = order // top_k
    inputs = x[rows_of_pairs]  # one gather; each expert's rows are a slice of it
    delta = adapters.bind(rows_of_pairs) if adapters is not None else None
    grouped = run_grouped_experts(experts, inputs, counts, delta)
    weighted = (grouped * weights.reshape(-1, 1)[order]).to(x.dtype)
    # One index_add_ adds a token's pairs in their (expert-sorted) order: in fp32 bit for bit what
    # transformers' loop of one index_add_ per expert gives (in bf16 equal to rounding), and
    # at 16 decode tokens 1.7x faster than that loop (small-moe, one layer: 1.46 against 2.45 ms).
    return torch.zeros_like(x).index_add_(0, rows_of_pairs, weighted)


def run_grouped_experts(experts: list[tuple[Linear, Linear]], rows: torch.Tensor,
                        counts: torch.Tensor, delta: ExpertDelta | None = None) -> torch.Tensor:
    """Each expert once on its run of `rows` (grouped by expert: `counts[e]` rows for expert e, in
    order), unweighted outputs in the same row order (a Python loop over experts, never tokens);
    `delta` adds the rows' LoRA deltas to each projection."""
    outputs, start = [], 0
    for expert, n in enumerate(counts.tolist()):
        if n:
            gate_up, down = experts[expert]
            if delta is None:
                outputs.append(down(_silu_mul(gate_up(rows[start:start + n]))))
            else:
                run = rows[start:start + n]
                projected = gate_up(run)
                delta(expert, "gate_up", start, run, projected)
                hidden = _silu_mul(projected)
                out = down(hidden)
                delta(expert, "down", start, hidden, out)
                outputs.append(out)
            start += n
    return torch.cat(outputs) if outputs else rows.new_empty(rows.shape)


def expert_load(blocks: list[MoEBlock]) -> ExpertLoad | None:
    """The load of `blocks` (one model's MoE layers); None when it has none."""
    if not blocks:
        return None
    total = torch.stack([b.routed_tokens for b in blocks]).sum(0)
    ratios = [float(b.last_routed.max()) / mean for b in blocks
              if (mean := float(b.last_routed.sum()) / b.config.num_experts) > 0]
    ep = blocks[0].ep
    if ep is None:
        return ExpertLoad(tuple(total.tolist()), max(ratios, default=0.0))
    per_rank = total.view(ep.ep_size, ep.num_local).sum(1)
    return ExpertLoad(tuple(total.tolist()), max(ratios, default=0.0), tuple(per_rank.tolist()),
                      ep.sent_bytes, ep.received_bytes)


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _swiglu_weights(weights: ShardedReader, prefix: str, names: tuple[str, str, str], hidden: int,
                    width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One published-layout SwiGLU MLP's gate_up [2 * I / tp, hidden] and down [hidden, I / tp]."""
    shapes = ((width, hidden), (width, hidden), (hidden, width))
    gate, up, down = (weights.get(prefix + f"{n}.weight", shape)
                      for n, shape in zip(names, shapes, strict=True))
    return torch.cat([weights.rows(gate), weights.rows(up)]), weights.columns(down).contiguous()


def _swiglu(weights: ShardedReader, prefix: str, names: tuple[str, str, str], hidden: int,
            width: int) -> tuple[Linear, Linear]:
    """One published-layout SwiGLU MLP: (gate_up, down) with this rank's intermediate columns."""
    gate_up, down = _swiglu_weights(weights, prefix, names, hidden, width)
    return Linear(gate_up), Linear(down)


def _fused_experts(weights: ShardedReader, prefix: str, num_experts: int, hidden: int,
                   width: int, experts: range) -> tuple[torch.Tensor, torch.Tensor]:
    """A fused-layout checkpoint's `experts` with this rank's columns: gate_up [e, 2 * I / tp, hidden],
    down [e, hidden, I / tp]."""
    gate_up = weights.get(prefix + "gate_up_proj", (num_experts, 2 * width, hidden))
    down = weights.get(prefix + "down_proj", (num_experts, hidden, width))
    return (torch.stack([torch.cat([weights.rows(gate_up[e, :width]), weights.rows(gate_up[e, width:])])
                         for e in experts]),
            torch.stack([weights.columns(down[e]) for e in experts]))
