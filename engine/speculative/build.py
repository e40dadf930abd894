"""The engine's speculator for its config (None when speculation is off), draft model loaded."""

from __future__ import annotations

from engine.loading import LoadedModel
from engine.models.mtp import MTPLayer
from engine.scheduler import Scheduler
from engine.speculative.draft_model import DraftModel, check_vocabulary
from engine.speculative.nextn import NextNDrafter
from engine.speculative.speculator import Speculator


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
        if loaded.config.world_size > 1:
            raise ValueError("--speculative-algorithm NEXTN runs with one rank for now (--tp-size 1, "
                             "--pp-size 1)")
        mtp = MTPLayer.load(loaded.config.model_path, loaded.model_config, loaded.model)
        nextn = NextNDrafter(loaded.model, mtp, loaded.pool, loaded.pages)
    return Speculator(spec, scheduler, loaded.pages, draft_model=draft_model, nextn=nextn)
