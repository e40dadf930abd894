"""The prompts the load sends: chat messages of varied length, the same for every run with one seed.

Lengths run from a few words to a few hundred, so some requests finish before a fault lands and
others are still in prefill chunks or KV transfer when it does.
"""

from __future__ import annotations

import random

# Words per prompt: short, medium and long prompts (the longest are several prefill chunks).
WORD_COUNTS = (3, 8, 15, 30, 50, 80, 120, 170, 230, 300)
_SYLLABLES = ("ka", "ro", "mi", "ten", "sul", "va", "de", "lor", "pi", "nex", "tau", "bri", "os", "ul", "gan")


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3)))


def make_prompts(seed: int = 0, word_counts: tuple[int, ...] = WORD_COUNTS) -> list[str]:
    """One user message per entry of `word_counts`, each starting with its index so no two share a prefix
    (routing and prefix caching then see distinct prompts)."""
    rng = random.Random(seed)
    return [f"Prompt {i}: " + " ".join(_word(rng) for _ in range(count))
            for i, count in enumerate(word_counts)]
