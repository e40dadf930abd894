"""Rejection sampling keeps the target's distribution: many draws on a small vocabulary at
temperature 1, with a draft distribution far from the target's, give the target's frequencies for
the first token and for the second (a kept draft followed by its successor)."""

from __future__ import annotations

import torch

from engine.speculative.rejection import rejection_sample

VOCAB = 6
DRAWS = 20000


def _frequencies(tokens: list[int]) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=VOCAB).double() / len(tokens)


def test_emitted_tokens_follow_the_target_not_the_draft() -> None:
    generator = torch.Generator().manual_seed(0)
    target = torch.tensor([[0.05, 0.4, 0.25, 0.2, 0.1, 0.0], [0.3, 0.1, 0.1, 0.1, 0.1, 0.3]])
    draft = torch.tensor([[0.5, 0.05, 0.05, 0.1, 0.1, 0.2]])
    first: list[int] = []
    second_after_kept: list[int] = []
    for _ in range(DRAWS):
        drafted = int(torch.multinomial(draft[0], 1, generator=generator))
        tokens = rejection_sample(target, draft, [drafted], generator)
        first.append(tokens[0])
        if len(tokens) == 2:
            second_after_kept.append(tokens[1])
    # 20000 draws: a frequency's standard error is at most 0.0036, so 0.015 is over 4 of them
    assert torch.allclose(_frequencies(first), target[0].double(), atol=0.015), _frequencies(first)
    assert torch.allclose(_frequencies(second_after_kept), target[1].double(), atol=0.02)
    assert _frequencies(first)[5] == 0  # the draft proposes token 5, the target never takes it


def test_deterministic_drafts_and_seeded_reproducibility() -> None:
    target = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    one_hot = torch.nn.functional.one_hot(torch.tensor([1, 0]), 3).float()
    # the first draft certain under the target, the second impossible: kept, then replaced by token 2
    assert rejection_sample(target, one_hot, [1, 0]) == [1, 2]
    probs = torch.softmax(torch.randn(4, 50, generator=torch.Generator().manual_seed(1)), dim=-1)
    runs = [rejection_sample(probs, probs[:3], [3, 4, 5], torch.Generator().manual_seed(9)) for _ in range(2)]
    assert runs[0] == runs[1]
