"""EngineRequest: what a caller asks the engine to run (`Engine.check`, then `Engine.generate`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.grammar import CompiledGrammar
from engine.multimodal.inputs import ImageInput
from engine.outputs import FirstToken
from engine.sampling import SamplingParams

# on_pages_filled(page_ids, num_tokens_done), on the engine thread (see EngineRequest).
PagesFilled = Callable[[list[int], int], None]


@dataclass(frozen=True)
class EngineRequest:
    """One request under `room` (a room names one request at a time on an engine). Three kinds:

    - plain: the engine runs the prompt, then decodes until a stop condition (colocated, and a
      decode worker running a prompt itself);
    - prefilled (`first_token` set; the decode side of PD): the prompt's K/V is already in the
      pages reserved under `room` (`Engine.reserve_prompt`), which become the request's own. The
      first token, sampled by the prefill worker, is emitted first, then decoding continues in the
      running batch;
    - prefill-only (`prefill_only`; the prefill side of PD): the engine runs the prompt and stops
      after its first token, the stream's only output (finish reason "stop"). The prompt's pages
      stay held under `room` until `Engine.release(room)` or `Engine.abort(room)`.
      `on_pages_filled(page_ids, num_tokens_done)` is called from the engine thread after each
      chunk with the pages completely filled so far (in order), and once at the end with all the
      prompt's pages (the last one possibly partial), so a transfer can send them as they are
      computed.

    `images` (a vision-language model; any kind of request: a prefilled one needs them for its
    decode positions and a recompute after retraction): preprocessed images
    (engine.multimodal.image_processor), in prompt order; image i's tokens in `prompt_ids` are one
    run of its num_tokens image-pad ids (engine.multimodal.prompt.expand_image_tokens).

    A caller that stops listening stops the request; with `on_pages_filled` its pages then stay held
    too (writes of them may still be reading them) until that abort or release.
    """

    room: str
    prompt_ids: list[int]
    params: SamplingParams
    first_token: FirstToken | None = None
    prefill_only: bool = False
    on_pages_filled: PagesFilled | None = None
    images: tuple[ImageInput, ...] = ()
    # EPD: the images' embedding rows [sum of their tokens, hidden], in prompt order, made by an
    # encoder service; the engine then runs no vision tower (a --language-only worker has none).
    image_embeddings: torch.Tensor | None = None
    # params.structured compiled off the engine thread (Engine.prepare); compiled on first use if not
    grammar: CompiledGrammar | None = None
    # A migrated continuation: the prompt's last carried_tokens ids are output delivered by an
    # earlier attempt; penalties and the grammar count them as output (engine.constraints).
    carried_tokens: int = 0
