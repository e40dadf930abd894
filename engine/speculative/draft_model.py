"""STANDALONE drafting: a small draft model with the target's vocabulary proposes the drafts.

The draft model has its own KV pool and pages (engine.loading loads it like a target, with the
prefix cache off). Per request it keeps the tokens whose K/V it holds; before drafting it runs the
tokens it has not seen (the prompt the first time, then what the last verify accepted) as one
chunk, then one step per further draft. After a verify, only the leading tokens the request still
has count as computed (a rejected draft's slots are overwritten later), so nothing is recomputed
that is still right. The request's own pages and the target's pool are never touched.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from engine.config import EngineConfig
from engine.loading import LoadedModel, load
from engine.models.config import ModelConfig
from engine.sampling import SamplingParams, sampling_probs
from engine.scheduler import Request, ScheduledChunk, SchedulerOutput
from engine.speculative.config import SpeculativeConfig


@dataclass
class _DraftSequence:
    page_ids: list[int] = field(default_factory=list)
    fed: list[int] = field(default_factory=list)  # tokens whose K/V is in page_ids, in order


@dataclass(frozen=True)
class Drafts:
    """A request's drafts, and (sampled requests) the distribution each was drawn from [k, V]."""

    tokens: list[int]
    probs: torch.Tensor | None = None


def check_vocabulary(target: ModelConfig, draft: ModelConfig, target_tokenizer, draft_tokenizer) -> None:
    """ValueError unless the draft model speaks the target's vocabulary (ids mean the same tokens)."""
    if target.vocab_size != draft.vocab_size:
        raise ValueError(f"--speculative-draft-model-path: the draft model's vocabulary has "
                         f"{draft.vocab_size} ids, the target's {target.vocab_size}: drafts must use the "
                         "target's token ids")
    if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        raise ValueError("--speculative-draft-model-path: the draft model's tokenizer maps tokens to other "
                         "ids than the target's: drafts must use the target's token ids")


class DraftModel:
    """Runs the draft model for one request at a time (the engine thread is its only caller)."""

    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        self.pages = loaded.pages
        self.vocab_size = loaded.model_config.vocab_size
        self._sequences: dict[str, _DraftSequence] = {}

    @classmethod
    def load(cls, config: EngineConfig, num_pages: int) -> DraftModel:
        spec = config.speculative
        assert spec.speculative_draft_model_path is not None
        # On a tensor- or pipeline-parallel target the draft model runs whole, on rank 0 only: it is
        # small, and only rank 0 drafts (the followers run the verify chunks rank 0's plan carries).
        draft_config = replace(config, model_path=spec.speculative_draft_model_path, num_pages=num_pages,
                               max_total_tokens=None, disable_radix_cache=True,
                               enable_hierarchical_cache=False, speculative=SpeculativeConfig(),
                               tp_size=1, pp_size=1, dp_size=1, ep_size=1, enable_dp_attention=False,
                               moe_a2a_backend="none", elastic_ep_backend="none", nnodes=1, node_rank=0,
                               dist_init_addr=None)
        return cls(load(draft_config))

    def propose(self, request: Request, max_drafts: int, params: SamplingParams,
                generator: torch.Generator | None) -> Drafts:
        """Up to `max_drafts` drafts after the request's tokens ([] when the draft pool is full):
        argmax for a greedy request, else drawn from the draft's distribution under `params`."""
        tokens = request.token_ids
        sequence = self._sequences.setdefault(request.room, _DraftSequence())
        common = min(len(sequence.fed), len(tokens) - 1)
        while common > 0 and sequence.fed[common - 1] != tokens[common - 1]:
            common -= 1
        del sequence.fed[common:]
        # Pages for every token fed: the request's unseen tokens, then max_drafts - 1 drafts.
        if not self.pages.grow(sequence.page_ids, len(tokens) + max_drafts - 1):
            return Drafts([])
        chunk = tokens[common:]
        drafts: list[int] = []
        rows: list[torch.Tensor] = []
        for _ in range(max_drafts):
            batch = SchedulerOutput(extends=[ScheduledChunk(
                room=request.room, token_ids=chunk, start_pos=len(sequence.fed), page_ids=sequence.page_ids,
                sample=True)])
            logits = self.loaded.runner.forward(batch)[-1:]
            sequence.fed.extend(chunk)
            if params.greedy:
                token = int(logits.argmax(dim=-1))
            else:
                probs = sampling_probs(logits.float(), [params])
                token = int(torch.multinomial(probs[0], 1, generator=generator))
                rows.append(probs[0])
            drafts.append(token)
            chunk = [token]
        return Drafts(drafts, torch.stack(rows) if rows else None)

    def forget(self, room: str) -> None:
        sequence = self._sequences.pop(room, None)
        if sequence is not None:
            self.pages.free(sequence.page_ids)
