"""The next step's masks, prefetched in a worker thread: equal to masks computed on the spot, for a
batch that keeps its rows, one that changes order or gains a request, and a grammar that moved on
after its prefetch started."""

from __future__ import annotations

import json

import torch
from transformers import AutoTokenizer

from engine.grammar import GrammarCompiler, apply_masks, fill_masks
from engine.next_masks import NextMasks
from pdserve.sampling_params import StructuredOutput

SCHEMA = {"type": "object", "properties": {"rows": {"type": "array", "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "integer"}},
    "required": ["name", "n"]}}}, "required": ["rows"]}
VOCAB, EOS = 4096, 2


def test_prefetched_masks_equal_masks_computed_on_the_spot(qwen3_ckpt) -> None:
    compiler = GrammarCompiler(AutoTokenizer.from_pretrained(qwen3_ckpt), VOCAB, EOS)
    compiled = compiler.compile(StructuredOutput("json_schema", json.dumps(SCHEMA)))
    grammars = [compiled.new_request() for _ in range(3)]
    outputs: list[list[int]] = [[] for _ in grammars]
    generator = torch.Generator().manual_seed(0)
    masks = NextMasks(VOCAB)
    late = compiled.new_request()
    try:
        for step in range(24):
            batch = list(range(len(grammars)))
            if step % 5 == 4:
                batch.reverse()  # rows in another order than prefetched
            if step == 10:
                grammars.append(late)  # a request joins: its mask is computed on the spot
                outputs.append([])
                batch.append(3)
            chosen = [grammars[i] for i in batch]
            for i in batch:
                grammars[i].sync(outputs[i])
            bitmask = masks.take(chosen)
            assert torch.equal(bitmask, fill_masks(chosen, VOCAB)), step
            logits = apply_masks(torch.randn(len(batch), VOCAB, generator=generator),
                                 torch.arange(len(batch)), bitmask)
            for row, i in enumerate(batch):
                outputs[i].append(int(logits[row].argmax()))
                grammars[i].accept(outputs[i][-1])
            masks.start(chosen)
            if step == 15:
                # a grammar that moves on after its prefetch started gets a fresh mask
                masks.wait()
                token = int(apply_masks(torch.zeros(1, VOCAB), torch.tensor([0]),
                                        fill_masks([grammars[0]], VOCAB)).argmax())
                outputs[0].append(token)
                grammars[0].accept(token)
        assert masks.prefetched >= 3 * 20  # all but the first step, the joining row, the moved one
    finally:
        masks.close()
