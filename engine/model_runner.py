"""ModelRunner: turns a SchedulerOutput (engine.scheduler) into input tensors, runs the decoder,
returns logits."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.graph_runner import DecodeGraphRunner
from engine.models.attention import AttentionMetadata, ExtendSpan
from engine.models.decoder import DecoderModel
from engine.multimodal.state import MultimodalState, text_positions
from engine.scheduler import ScheduledChunk, SchedulerOutput
from libkv.pool import KVPool

if TYPE_CHECKING:
    from engine.lora.slots import LoraSlots
    from engine.tp.pipeline import PipelineStage


class ModelRunner:
    """Runs one step of the model over the KV pool; knows nothing about requests or sampling.

    With a `stage` (pipeline parallelism) the model is one stage's layers and the stage passes the
    residual stream on (engine.tp.pipeline). Every rank runs `step`, which returns None on ranks that
    get no logits (a pipeline stage, or under DP attention a rank other than 0); the engine, on rank
    0, runs `forward`, which always has them.
    """

    def __init__(self, model: DecoderModel, pool: KVPool, stage: PipelineStage | None = None,
                 graphs: DecodeGraphRunner | None = None, lora: LoraSlots | None = None) -> None:
        self.model = model
        self.lora = lora  # --enable-lora: told each step's rows' adapter slots
        self.pool = pool
        self.stage = stage
        self.graphs = graphs  # runs the decode-only steps it takes (engine.graph_runner)
        self.device = pool.device
        self.page_size = pool.layout.page_size

    def _tensor(self, values: list[int] | list[list[int]], dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def _slots(self, chunk: ScheduledChunk) -> list[int]:
        size = self.page_size
        pages = chunk.page_ids
        return [pages[pos // size] * size + pos % size for pos in range(chunk.start_pos, chunk.end_pos)]

    def forward(self, batch: SchedulerOutput) -> torch.Tensor:
        """fp32 logits [rows, vocab]: one row per chunk of batch.sampled_chunks(), in that order (a
        verify chunk's num_drafts + 1 rows); rank 0's `step`."""
        logits = self.step(batch)
        if logits is None:
            raise RuntimeError("this rank gets no logits (a pipeline stage or a DP attention rank other "
                               "than 0): it runs step(), not forward()")
        return logits

    def close(self) -> None:
        """Nothing to release: one rank, no group (DriverRunner closes a group's)."""

    @torch.inference_mode()
    def step(self, batch: SchedulerOutput) -> torch.Tensor | None:
        """This rank's part of the step: `forward`'s logits, or None on a rank that gets none."""
        if self.graphs is not None:
            if self.graphs.takes(batch):
                return self.graphs.run(batch)
            self.graphs.forget_rows()
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for chunk in batch.decodes:
            input_ids.append(chunk.token_ids[0])
            positions.append(chunk.start_pos)
            slots.extend(self._slots(chunk))
        page_table = seq_lens = None
        if batch.decodes:
            width = max(len(c.page_ids) for c in batch.decodes)
            page_table = self._tensor([c.page_ids + [0] * (width - len(c.page_ids)) for c in batch.decodes],
                                      torch.int32)
            seq_lens = self._tensor([c.end_pos for c in batch.decodes], torch.int32)

        spans: list[ExtendSpan] = []
        logit_rows = list(range(len(batch.decodes)))
        for chunk in batch.extends:
            start = len(input_ids)
            input_ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start_pos, chunk.end_pos))
            slots.extend(self._slots(chunk))
            num_pages = -(-chunk.end_pos // self.page_size)
            spans.append(ExtendSpan(start=start, length=len(chunk.token_ids), prefix_len=chunk.start_pos,
                                    page_ids=self._tensor(chunk.page_ids[:num_pages])))
            if chunk.sample:  # a verify chunk: its last token's and every draft's
                logit_rows.extend(range(len(input_ids) - chunk.num_drafts - 1, len(input_ids)))

        if self.lora is not None:
            self.lora.apply_loads(batch.lora_loads)
            self.lora.set_rows([c.lora_slot for c in batch.decodes]
                               + [c.lora_slot for c in batch.extends for _ in c.token_ids])
        meta = AttentionMetadata(slots=self._tensor(slots), num_decode=len(batch.decodes),
                                 decode_page_table=page_table, decode_seq_lens=seq_lens, extends=spans)
        every_row = len(logit_rows) == len(input_ids)
        # M-RoPE models take this path for every step (3-D positions); plain-RoPE ones (LLaVA)
        # only for steps holding an image request
        if self.model.mrotary is not None or any(c.multimodal is not None for c in batch.extends):
            return self._forward_multimodal(batch, input_ids, meta, None if every_row else logit_rows)
        args = (self._tensor(input_ids), self._tensor(positions), max(positions), meta, self.pool.buffer,
                None if every_row else self._tensor(logit_rows))
        if self.stage is not None:
            return self.stage.run(self.model, *args, len(logit_rows))
        return self.model.forward(*args)

    def _forward_multimodal(self, batch: SchedulerOutput, input_ids: list[int], meta: AttentionMetadata,
                            logit_rows: list[int] | None) -> torch.Tensor | None:
        """A VL model's step: positions per token (M-RoPE's 3-D ones, or plain), and the image
        tokens' embeddings from the vision tower (run once per request, at its first prefill chunk
        holding image tokens)."""
        axes = 3 if self.model.mrotary is not None else 1
        positions = [_positions(c, axes) for c in batch.decodes + batch.extends]
        rows: list[torch.Tensor] = []
        embeds: list[torch.Tensor] = []
        offset = len(batch.decodes)
        for chunk in batch.extends:
            state = chunk.multimodal
            if state is not None and chunk.start_pos < state.positions.shape[1]:
                in_chunk, values = self._image_rows(state, chunk)
                rows.append(in_chunk + offset)
                embeds.append(values)
            offset += len(chunk.token_ids)
        stacked = torch.cat(positions, dim=1).to(self.device)
        if axes == 1:
            stacked = stacked[0]
        image_embeds = (torch.cat(rows).to(self.device), torch.cat(embeds)) if rows else None
        return self.model.forward(self._tensor(input_ids), stacked, int(stacked.max()), meta,
                                  self.pool.buffer, None if logit_rows is None else self._tensor(logit_rows),
                                  image_embeds)

    def _image_rows(self, state: MultimodalState, chunk: ScheduledChunk) -> tuple[torch.Tensor, torch.Tensor]:
        if state.embeddings is None:
            if self.model.vision is None:
                raise ValueError("an image request without its embeddings on a model loaded without its "
                                 "vision tower (--language-only)")
            state.embeddings = self.model.vision.encode(state.images)
        return state.embedding_rows(chunk.start_pos, chunk.end_pos)


def _positions(chunk: ScheduledChunk, axes: int) -> torch.Tensor:
    """[axes, len(chunk.token_ids)]: the request's positions (M-RoPE's, or plain), or a text
    request's plain ones."""
    if chunk.multimodal is None:
        return text_positions(chunk.start_pos, chunk.end_pos, axes)
    return chunk.multimodal.position_rows(chunk.start_pos, chunk.end_pos)
