"""SimRunner: an engine step without a model. It stands where engine.model_runner.ModelRunner
stands (engine.loading.StepRunner) and keeps the engine's contract: one logits row per sampled
chunk, rows in `SchedulerOutput.sampled_chunks()` order.

Tokens. Each position's K slot (layer 0, head 0, value 0 of the page) holds a running hash of the
context up to and including that position; the token sampled after a position is picked by that
hash. So the output is a deterministic function of the whole context, and it comes out the same
colocated and through PD only if the transfer really carried the prompt's pages: a decode worker
reads the hashes prefill wrote. The hash stays below 2**24, which float32 holds exactly.

Time. The step lasts as long as the profile (engine.sim.profile) says: the runner sleeps out what
its own work left of it. Back-to-back steps are paced from the previous step's end, so the time the
engine thread spends outside the forward (scheduling, sampling, emitting) is absorbed rather than
added, as long as it is shorter than the modeled step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from engine.scheduler import ScheduledChunk, SchedulerOutput
from engine.sim.profile import SimProfile
from libkv.pool import KVPool

HASH_MODULUS = 16_777_213  # the largest prime below 2**24: every hash is exact in float32
HASH_SEED = 12_345  # the hash "before" position 0
_MULTIPLIER = 1_000_003
UNPICKED_LOGIT = -30.0  # every token but the picked one: any sampling settings pick the same token


def mix(previous: int, token: int) -> int:
    """The running hash after `token`, from the hash before it."""
    return (previous * _MULTIPLIER + token + 1) % HASH_MODULUS


def context_hash(token_ids: Sequence[int]) -> int:
    """The running hash of a whole context (what the pool holds at its last position)."""
    value = HASH_SEED
    for token in token_ids:
        value = mix(value, token)
    return value


class SimRunner:
    """See the module docstring. `vocabulary`: the token ids it may emit (no special tokens);
    `vocab_size`: the logits' width. `clock` and `sleep` are a test's seams."""

    def __init__(self, pool: KVPool, profile: SimProfile, vocabulary: Sequence[int], vocab_size: int,
                 clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if not vocabulary:
            raise ValueError("the simulated engine needs at least one token it may emit")
        self.pool = pool
        self.profile = profile
        self.vocabulary = list(vocabulary)
        self.vocab_size = vocab_size
        self.page_size = pool.layout.page_size
        # [page, slot]: the K slot's first value on layer 0, head 0 (a view: writes land in the pool)
        self.hashes = pool.buffer[:, 0, 0, :, 0, 0]
        self.clock = clock
        self.sleep = sleep
        self._last_end = float("-inf")
        self.modeled_seconds = 0.0  # every step's modeled time, summed (for a bench to compare)

    def pick(self, context: int) -> int:
        """The token sampled after a context whose running hash is `context`."""
        return self.vocabulary[context % len(self.vocabulary)]

    def forward(self, batch: SchedulerOutput) -> torch.Tensor:
        began = self.clock()
        chunks = batch.decodes + batch.extends
        before = self._read([c for c in chunks if c.start_pos > 0])
        pages: list[int] = []
        slots: list[int] = []
        values: list[int] = []
        picked: list[int] = []
        sampled_extends: list[int] = []
        for index, chunk in enumerate(chunks):
            value = before.pop(chunk.room) if chunk.start_pos > 0 else HASH_SEED
            for offset, token in enumerate(chunk.token_ids):
                position = chunk.start_pos + offset
                value = mix(value, token)
                pages.append(chunk.page_ids[position // self.page_size])
                slots.append(position % self.page_size)
                values.append(value)
            if index < len(batch.decodes):
                picked.append(self.pick(value))
            elif chunk.sample:
                sampled_extends.append(self.pick(value))
        if pages:
            written = torch.tensor(values, dtype=self.hashes.dtype)
            self.hashes[torch.tensor(pages), torch.tensor(slots)] = written
        picked += sampled_extends
        logits = torch.full((len(picked), self.vocab_size), UNPICKED_LOGIT)
        if picked:
            logits[torch.arange(len(picked)), torch.tensor(picked)] = 0.0
        self._pace(began, self.profile.step_seconds(len(batch.decodes),
                                                    sum(len(c.token_ids) for c in batch.extends)))
        return logits

    def _read(self, chunks: list[ScheduledChunk]) -> dict[str, int]:
        """Each chunk's running hash at the position before its first token, by room."""
        if not chunks:
            return {}
        pages = [c.page_ids[(c.start_pos - 1) // self.page_size] for c in chunks]
        slots = [(c.start_pos - 1) % self.page_size for c in chunks]
        read = self.hashes[torch.tensor(pages), torch.tensor(slots)].tolist()
        return {c.room: int(v) for c, v in zip(chunks, read, strict=True)}

    def _pace(self, began: float, modeled: float) -> None:
        """Return `modeled` seconds after the step began, or after the previous step's end when this
        step follows it closely (see the module docstring)."""
        self.modeled_seconds += modeled
        start = self._last_end if 0.0 <= began - self._last_end < modeled else began
        end = start + modeled
        left = end - self.clock()
        if left > 0:
            self.sleep(left)
        self._last_end = end

    def close(self) -> None:
        """Nothing to release."""
