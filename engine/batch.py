"""SchedulerOutput: the whole contract between the scheduler and the model runner for one step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ScheduledChunk:
    """New tokens of one sequence to run this step.

    `token_ids` start at position `start_pos` (the number of tokens whose K/V is already in the
    sequence's pages); `page_ids` are all of the sequence's pages in order and cover
    start_pos + len(token_ids) tokens. `sample` asks for the logits of the chunk's last token
    (true when the chunk reaches the end of the known tokens).
    """

    room: str
    token_ids: list[int]
    start_pos: int
    page_ids: list[int]
    sample: bool

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass
class SchedulerOutput:
    """One forward pass: decode tokens (one per sequence, prefix cached) and extend chunks.

    The runner returns logits for every decode, then for every extend with `sample`, in this order.
    """

    decodes: list[ScheduledChunk] = field(default_factory=list)
    extends: list[ScheduledChunk] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.extends

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(len(c.token_ids) for c in self.extends)

    def sampled_chunks(self) -> list[ScheduledChunk]:
        """The chunks whose logits the runner returns, in the order of its logits rows."""
        return self.decodes + [c for c in self.extends if c.sample]
