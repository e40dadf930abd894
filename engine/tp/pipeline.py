"""PipelineStage: one rank's part of a pipeline-parallel step (`--pp-size P`, engine.tp.topology).

Each stage holds a consecutive block of layers (DecoderModel loaded with `layers`). Every rank
gets rank 0's plan (engine.tp.runner), builds the same step tensors from it, and then:
  stage 0       embeds the tokens, runs its layers, sends the residual stream [T, hidden] on;
  stage s > 0   receives it from stage s-1, runs its layers, sends it on (the last stage does not);
  last stage    computes the fp32 logits of the sampled rows; its TP rank 0 sends them to world
                rank 0, which samples (rank 0 is stage 0's TP rank 0).
Each rank talks to the rank of the neighbouring stage with the same TP rank: under TP every rank
of a stage holds the whole residual stream (o_proj/down are all-reduced), so the pairs move
identical copies and no rank gathers anything.

Stages run one after the other inside a step (no micro-batches): while one stage computes, the
others wait. That is the known cost of this simple schedule; it buys a model that does not fit
one device's memory, not speed.

Point-to-point sends go through torch.distributed (gloo on CPU, NCCL on CUDA: tensors are made on
the rank's device, so both backends see the memory they move). Every rank of every stage calls
`run` for every step in the same order, so each send meets its receive.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.models.attention import AttentionMetadata
from engine.models.decoder import DecoderModel
from engine.tp.group import TPGroup
from engine.tp.topology import Topology


def check_pp_size(topology: Topology, num_layers: int) -> None:
    """Refuse more stages than layers (every stage holds at least one), naming both, before any
    rank starts (raises engine.tp.topology.TopologyError)."""
    topology.stage_layers(num_layers, 0)


class PipelineStage:
    """This rank's stage: which neighbours it receives from and sends to, and the bytes it sent
    (`bytes_sent` since start and `step_bytes` in the last step: the residual streams and logits
    this rank handed to another rank, so a benchmark can print what the pipeline moves)."""

    def __init__(self, group: TPGroup, hidden_size: int, vocab_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        topology = group.topology
        self.rank = group.rank
        self.pp_rank, self.pp_size = group.pp_rank, topology.pp_size
        self.tp_rank = group.tp_rank
        self.is_first, self.is_last = self.pp_rank == 0, self.pp_rank == self.pp_size - 1
        # The same TP rank of the neighbouring stages (world rank = stage * tp_size + tp_rank).
        self.prev_rank = self.rank - topology.tp_size if not self.is_first else None
        self.next_rank = self.rank + topology.tp_size if not self.is_last else None
        # The rank that sends rank 0 the logits: the last stage's TP rank 0.
        self.last_stage_driver = topology.stage_ranks(self.pp_size - 1)[0]
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.dtype, self.device = dtype, device
        self.bytes_sent = 0
        self.step_bytes = 0
        self.steps = 0
        self.traffic = group.traffic  # `pdserve bench parallel` reads rank 0's: what it sent and received

    def run(self, model: DecoderModel, input_ids: torch.Tensor, positions: torch.Tensor, max_position: int,
            meta: AttentionMetadata, kv_buffer: torch.Tensor, logit_rows: torch.Tensor | None,
            num_logit_rows: int) -> torch.Tensor | None:
        """One step on this stage. Returns the fp32 logits [num_logit_rows, vocab] on world rank 0
        (received from the last stage unless it is the last stage itself), on the last stage's ranks
        their own logits, elsewhere None."""
        self.steps += 1
        self.step_bytes = 0
        if self.prev_rank is None:  # the first stage
            tokens = input_ids
        else:
            tokens = self._receive((input_ids.shape[0], self.hidden_size), self.dtype, self.prev_rank)
        hidden = model.forward_layers(tokens, positions, max_position, meta, kv_buffer)
        if self.next_rank is not None:  # not the last stage
            self._send(hidden, self.next_rank)
            if self.rank == 0:
                return self._receive((num_logit_rows, self.vocab_size), torch.float32, self.last_stage_driver)
            return None
        logits = model.final_logits(hidden, logit_rows)
        # only DP attention leaves a rank without logits, and EngineConfig refuses it with PP
        if logits is None:
            raise RuntimeError("the last pipeline stage computed no logits")
        if self.tp_rank == 0 and self.rank != 0:
            self._send(logits, 0)
        return logits

    def _send(self, tensor: torch.Tensor, dst: int) -> None:
        tensor = tensor.contiguous()
        dist.send(tensor, dst)
        nbytes = tensor.numel() * tensor.element_size()
        self.bytes_sent += nbytes
        self.step_bytes += nbytes
        self.traffic["stage"] += nbytes

    def _receive(self, shape: tuple[int, int], dtype: torch.dtype, src: int) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(tensor, src)
        self.traffic["stage"] += tensor.numel() * tensor.element_size()
        return tensor
