"""The caller's side of a request: its stream of outputs, and that stream's text.

The engine thread emits token ids and ends a request on token-level conditions (a stop token,
eos, length); everything about text happens here, on the caller's loop: `OutputStream` receives
what the engine delivered, gives each token its text (pdserve.text.TextStream, the module the
gateway's migration makes text with too) and tells the engine to finish a request whose stop
string it found. A prefill-only request has no text and builds none of this but the stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import replace

from engine.outputs import TokenOutput
from pdserve.sampling_params import SamplingParams
from pdserve.text import Decoder, TextStream


def text_stream(tokenizer: Decoder, params: SamplingParams, prompt_ids: Sequence[int] = (),
                eos_token_ids: Sequence[int] = ()) -> TextStream:
    """The text of a request with `params`: its stop strings, its stop token ids and, unless it
    ignores eos, the model's eos ids."""
    stop_ids = frozenset(params.stop_token_ids) | (
        frozenset() if params.ignore_eos else frozenset(eos_token_ids))
    return TextStream(tokenizer, params.stop, stop_ids, prompt_ids, params.kept_special_token_ids)


def with_text(text: TextStream, output: TokenOutput) -> tuple[TokenOutput, bool]:
    """The output with its token's text; True when a stop string ends the output at this token
    although the engine did not end it (so the engine must be told)."""
    delta, reason, stopped_here = text.apply(output.token_id, output.finish_reason)
    return replace(output, text=delta, finish_reason=reason), stopped_here


class OutputStream:
    """The caller's end of one request (the threading protocol in engine.engine).

    The engine thread hands each output to `put` on the caller's loop (`loop.call_soon_threadsafe`,
    once per step); `batches` yields them, everything queued when the caller looks as one list, so
    a caller that fell behind gets what piled up as one item (one message for a server to send).
    With a `text`, each token gets its text here, and a stop string found here is reported through
    `on_stop_string` so the engine finishes the request. An exception put here (the engine refused
    the request) is raised. `done`: the last output or the refusal came through, so a caller that
    leaves now leaves nothing running.
    """

    def __init__(self, text: TextStream | None) -> None:
        self.loop = asyncio.get_running_loop()
        self._outputs: asyncio.Queue[TokenOutput | Exception] = asyncio.Queue()
        self.put: Callable[[TokenOutput | Exception], None] = self._outputs.put_nowait
        self.text = text
        self.done = False

    async def batches(self, on_stop_string: Callable[[], None]) -> AsyncGenerator[list[TokenOutput], None]:
        while not self.done:
            batch = []
            item = await self._outputs.get()
            while True:
                if isinstance(item, Exception):
                    self.done = True
                    raise item
                if self.text is not None and item.token_id >= 0:
                    item, stopped_here = with_text(self.text, item)
                    if stopped_here:  # a stop string: the engine does not know yet
                        on_stop_string()
                batch.append(item)
                self.done = item.finish_reason is not None
                if self.done or self._outputs.empty():
                    break
                item = self._outputs.get_nowait()
            yield batch
