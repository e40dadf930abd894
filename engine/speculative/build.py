"""The engine's speculator for its config (None when speculation is off), draft model loaded."""

from __future__ import annotations

from engine.loading import LoadedModel
from engine.scheduler import Scheduler
from engine.speculative.draft_model import DraftModel, check_vocabulary
from engine.speculative.speculator import Speculator


def build_speculator(loaded: LoadedModel, scheduler: Scheduler) -> Speculator | None:
    """ValueError (naming why) for a draft model this target cannot use."""
    spec = loaded.config.speculative
    if not spec.enabled:
        return None
    draft_model = None
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
    return Speculator(spec, scheduler, loaded.pages, draft_model=draft_model)


