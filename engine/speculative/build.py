"""The engine's speculator for its config (None when speculation is off), draft model loaded."""

from __future__ import annotations

from engine.loading import LoadedModel
from engine.models.mtp import MTPLayer
from engine.scheduler import Scheduler
from engine.speculative.draft_model import DraftModel, check_vocabulary
from engine.speculative.nextn import NextNDrafter
from engine.speculative.nextn_ranks import check_nextn_topology
from engine.speculative.speculator import Speculator
from engine.tp.runner import DriverRunner
from engine.tp.shard import TPShard


def build_speculator(loaded: LoadedModel, scheduler: Scheduler) -> Speculator | None:
    """ValueError (naming why) for a draft model this target cannot use."""
    spec = loaded.config.speculative
    if not spec.enabled:
        return None
    draft_model = None
    nextn = None
    if spec.speculative_algorithm == "STANDALONE":
        if loaded.model_config.is_multimodal:
            raise ValueError(f"--speculative-algorithm STANDALONE: {loaded.model_config.architecture} is a "
                             "vision-language model; its image requests would need the draft to see images")
        draft_model = DraftModel.load(loaded.config, loaded.pages.num_pages)
        try:
            check_vocabulary(loaded.model_config, draft_model.loaded.model_config, loaded.tokenizer,
                             draft_model.loaded.tokenizer)
        except ValueError:
            draft_model.loaded.runner.close()
            raise
    elif spec.speculative_algorithm == "NEXTN":
        check_nextn_topology(loaded.config)
        # tensor-parallel: rank 0's shard here, each follower loads its own (engine.speculative.nextn_ranks)
        group = loaded.runner.group if isinstance(loaded.runner, DriverRunner) else None
        shard = TPShard(group.tp_rank, group.tp_size) if group is not None else None
        mtp = MTPLayer.load(loaded.config.model_path, loaded.model_config, loaded.model, shard)
        nextn = NextNDrafter(loaded.model, mtp, loaded.pool, loaded.pages, group)
    return Speculator(spec, scheduler, loaded.pages, draft_model=draft_model, nextn=nextn)
