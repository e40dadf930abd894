"""SpeculativeConfig: the speculative-decoding settings of an engine (SGLang's flag names)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.speculative.vllm_config import fields_from_vllm_json

# A verify chunk's positions all go through one forward: past this many drafts a CPU step stops being
# memory-bound, and a long rejected draft wastes more than an accepted one saves.
MAX_DRAFT_TOKENS = 16
ALGORITHMS = ("NGRAM", "STANDALONE", "NEXTN")


def _help(text: str) -> dict:
    return {"help": text}


@dataclass(frozen=True)
class SpeculativeConfig:
    """Which drafter runs and how many tokens it proposes per step (nested in EngineConfig)."""

    speculative_algorithm: str | None = field(default=None, metadata=_help(
        "speculative decoding: NGRAM (prompt lookup: drafts copied from the request's own earlier tokens; "
        "greedy requests speculate, sampled ones decode a token per step), STANDALONE (a draft model, "
        "--speculative-draft-model-path; sampled requests too, by rejection sampling) or NEXTN "
        "(DeepSeek-V3's MTP layer, stored in the checkpoint after its last layer, run once per draft; "
        "sampled requests too, by rejection sampling); unset = off"))
    speculative_draft_model_path: str | None = field(default=None, metadata=_help(
        "STANDALONE: the draft model's HF checkpoint folder (the target's vocabulary; its own KV pages)"))
    speculative_num_steps: int | None = field(default=None, metadata=_help(
        "drafting steps per verify (NGRAM: the drafts per step, at most --speculative-num-draft-tokens "
        "- 1; unset = that)"))
    speculative_num_draft_tokens: int = field(default=5, metadata=_help(
        f"positions one verify covers per request: its last token and up to this many - 1 drafts (at most "
        f"{MAX_DRAFT_TOKENS})"))
    speculative_eagle_topk: int = field(default=1, metadata=_help(
        "drafts per position (SGLang's flag; only 1, a chain, is supported)"))
    speculative_ngram_min_match: int = field(default=1, metadata=_help(
        "NGRAM: shortest suffix of the request's tokens looked up in its earlier tokens"))
    speculative_ngram_max_match: int = field(default=4, metadata=_help(
        "NGRAM: longest suffix looked up (the longest one found wins)"))
    speculative_config: str | None = field(default=None, metadata=_help(
        "vLLM's speculative config JSON, where it maps onto the flags above: method (ngram, draft_model, "
        "deepseek_mtp), num_speculative_tokens (drafts per step), model (draft_model's checkpoint), "
        "prompt_lookup_min/max; its values replace those flags'"))

    def __post_init__(self) -> None:
        if self.speculative_config is not None:
            mapped = fields_from_vllm_json(self.speculative_config)
            algorithm = mapped["speculative_algorithm"]
            if self.speculative_algorithm not in (None, algorithm):
                raise ValueError(f"--speculative-config's method means --speculative-algorithm {algorithm}, "
                                 f"but --speculative-algorithm {self.speculative_algorithm} was given")
            for name, value in mapped.items():
                object.__setattr__(self, name, value)
        if self.speculative_algorithm is None:
            return
        if self.speculative_algorithm not in ALGORITHMS:
            raise ValueError(f"--speculative-algorithm {self.speculative_algorithm!r} is not supported; "
                             f"choose one of {', '.join(ALGORITHMS)}")
        if not 2 <= self.speculative_num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"--speculative-num-draft-tokens must be 2..{MAX_DRAFT_TOKENS}, got "
                             f"{self.speculative_num_draft_tokens}: it counts the verified token plus its "
                             f"drafts, and more than {MAX_DRAFT_TOKENS} per request makes a verify "
                             "compute-bound, so rejected drafts cost more than accepted ones save")
        if self.speculative_num_steps is not None and not \
                1 <= self.speculative_num_steps <= self.speculative_num_draft_tokens - 1:
            raise ValueError(f"--speculative-num-steps must be 1..--speculative-num-draft-tokens - 1 "
                             f"({self.speculative_num_draft_tokens - 1}), got {self.speculative_num_steps}")
        if (self.speculative_algorithm == "STANDALONE") != (self.speculative_draft_model_path is not None):
            raise ValueError("--speculative-draft-model-path goes with --speculative-algorithm STANDALONE, "
                             "and STANDALONE needs it")
        if self.speculative_eagle_topk != 1:
            raise ValueError(f"--speculative-eagle-topk {self.speculative_eagle_topk}: only 1 (a chain of "
                             "drafts) is supported")
        if not 1 <= self.speculative_ngram_min_match <= self.speculative_ngram_max_match:
            raise ValueError("--speculative-ngram-min-match must be 1..--speculative-ngram-max-match, got "
                             f"{self.speculative_ngram_min_match} and {self.speculative_ngram_max_match}")

    def agreed(self) -> dict[str, object]:
        """The settings prefill and decode must share (the PD handshake compares them): a drafter
        may need the prefill side's help (a draft model's prompt K/V), so both run the same one."""
        if self.speculative_algorithm is None:
            return {"speculative_algorithm": None}
        return {"speculative_algorithm": self.speculative_algorithm,
                "speculative_num_draft_tokens": self.speculative_num_draft_tokens,
                "speculative_num_steps": self.max_drafts,
                "speculative_eagle_topk": self.speculative_eagle_topk}

    def differences(self, other: SpeculativeConfig) -> list[str]:
        """`field: mine vs theirs` for each agreed setting that differs."""
        mine, theirs = self.agreed(), other.agreed()
        return [f"{name}: {mine.get(name)!r} vs {theirs.get(name)!r}"
                for name in dict.fromkeys([*mine, *theirs]) if mine.get(name) != theirs.get(name)]

    @property
    def enabled(self) -> bool:
        return self.speculative_algorithm is not None

    @property
    def max_drafts(self) -> int:
        """Drafted tokens per request per step, at most."""
        steps = self.speculative_num_steps
        return self.speculative_num_draft_tokens - 1 if steps is None else steps
