"""Penalties, biases and min_tokens on a batch's logits, before sampling, as tensor ops over the batch.

Formulas (those of the APIs that name them):
- `repetition_penalty` (HF's RepetitionPenaltyLogitsProcessor, as vLLM applies it): a token seen in
  the prompt or the output has its logit divided by the penalty when positive, multiplied when not.
- `frequency_penalty` / `presence_penalty` (OpenAI's): logit -= count * frequency + (count > 0) *
  presence, with count the token's occurrences in the output.
- `logit_bias`: added to the logit of each listed token id.
- `min_tokens`: the request's stop tokens (eos included) get -inf until that many are generated.
Order: logit_bias, min_tokens, repetition, then frequency/presence (tests/engine/test_penalties.py
checks each against HF transformers' processors in that order).

Token counts live in one table with a row ("slot") per live penalized request: a step gathers the
batch's rows, computes with them, and adds the sampled tokens with one scatter. A request's row is
built from its token ids when it first samples here, so a request that arrives prefilled (PD
decode), is recomputed after retraction, or continues a migrated generation counts exactly the
tokens it holds: nothing needs to travel with it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.sampling import SamplingParams


class PenaltyTable:
    """Output-token counts and prompt-token presence of the live penalized requests."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.counts = torch.zeros((0, vocab_size), dtype=torch.int32, device=device)
        self.in_prompt = torch.zeros((0, vocab_size), dtype=torch.bool, device=device)
        self._free: list[int] = []
        self._slots: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._slots)

    def slot(self, room: str, token_ids: Sequence[int], output_start: int) -> int:
        """The row of `room`, built from its tokens (prompt: [:output_start]) the first time."""
        slot = self._slots.get(room)
        if slot is not None:
            return slot
        if not self._free:
            self._grow()
        slot = self._free.pop()
        self._slots[room] = slot
        ids = torch.tensor(list(token_ids), dtype=torch.int64, device=self.device)
        self.counts[slot].zero_()
        output = ids[output_start:]
        self.counts[slot].scatter_add_(0, output, torch.ones_like(output, dtype=torch.int32))
        self.in_prompt[slot].zero_()
        self.in_prompt[slot][ids[:output_start]] = True
        return slot

    def _grow(self) -> None:
        old = self.counts.shape[0]
        new = max(8, old * 2)
        counts = torch.zeros((new, self.vocab_size), dtype=torch.int32, device=self.device)
        in_prompt = torch.zeros((new, self.vocab_size), dtype=torch.bool, device=self.device)
        counts[:old] = self.counts
        in_prompt[:old] = self.in_prompt
        self.counts, self.in_prompt = counts, in_prompt
        self._free.extend(range(new - 1, old - 1, -1))

    def release(self, room: str) -> None:
        slot = self._slots.pop(room, None)
        if slot is not None:
            self._free.append(slot)

    def add_tokens(self, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Count one sampled token per slot (one scatter for the batch)."""
        self.counts.index_put_((slots, token_ids), torch.ones_like(slots, dtype=torch.int32), accumulate=True)


_LOGIT_BOUND = 1e30


def apply_penalties(logits: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, table: PenaltyTable,
                    params: Sequence[SamplingParams], num_generated: Sequence[int],
                    stop_ids: Sequence[frozenset[int]]) -> torch.Tensor:
    """`logits` [B, V] with rows `rows` (their params, generated counts and stop ids in the same
    order, their table slots in `slots`) penalized; other rows unchanged. Returns a new tensor."""
    device = logits.device
    sub = logits[rows].float()
    vocab = sub.shape[1]
    if vocab > table.vocab_size:  # a padded lm_head: columns past the tokenizer never occur in counts
        raise ValueError(f"logits have {vocab} columns, the penalty table {table.vocab_size}")
    biased = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias if t < vocab]
    if biased:
        index = torch.tensor([(i, t) for i, t, _ in biased], dtype=torch.int64, device=device)
        values = torch.tensor([b for _, _, b in biased], dtype=sub.dtype, device=device)
        sub.index_put_((index[:, 0], index[:, 1]), values, accumulate=True)
    banned = [(i, t) for i, p in enumerate(params) if num_generated[i] < p.min_tokens
              for t in stop_ids[i] if t < vocab]
    if banned:
        index = torch.tensor(banned, dtype=torch.int64, device=device)
        sub[index[:, 0], index[:, 1]] = float("-inf")
    counts = table.counts[slots][:, :vocab]
    repetition = torch.tensor([p.repetition_penalty for p in params], dtype=sub.dtype, device=device)
    if bool((repetition != 1).any()):
        seen = table.in_prompt[slots][:, :vocab] | (counts > 0)
        penalty = repetition.unsqueeze(1)
        penalized = torch.where(sub < 0, sub * penalty, sub / penalty)
        # a penalty near 0 overflows a positive logit to +inf, which makes the softmax NaN: a bound
        # far above any logit (and below float32's largest after a temperature's division) keeps it
        penalized = penalized.clamp(max=_LOGIT_BOUND)
        sub = torch.where(seen, penalized, sub)
    frequency = torch.tensor([p.frequency_penalty for p in params], dtype=sub.dtype, device=device)
    presence = torch.tensor([p.presence_penalty for p in params], dtype=sub.dtype, device=device)
    if bool((frequency != 0).any() or (presence != 0).any()):
        counts_f = counts.to(sub.dtype)
        sub = sub - counts_f * frequency.unsqueeze(1) - (counts_f > 0).to(sub.dtype) * presence.unsqueeze(1)
    out = logits.float().clone()
    out[rows] = sub
    return out
