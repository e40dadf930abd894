"""Rejection sampling of drafted tokens (Leviathan et al. / Chen et al., 2023): the tokens it emits
are distributed exactly as sampling the target alone would be, whatever the draft distribution.

Draft i (drawn from the draft's distribution q_i) is kept with probability min(1, p_i(d) / q_i(d))
under the target's p_i; at the first rejection the token is drawn from the residual
max(p_i - q_i, 0), normalised, and the rest is dropped; when every draft is kept, one more token is
drawn from p_k. A deterministic drafter (n-gram) is the case q_i = one-hot(d_i).
"""

from __future__ import annotations

import torch


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor, drafts: list[int],
                     generator: torch.Generator | None = None) -> list[int]:
    """The tokens one verify yields: the kept drafts, then one drawn token.

    `target_probs` [k + 1, V]: the target's sampling distribution at each draft's position and after
    the last; `draft_probs` [k, V]: the distribution each draft was drawn from. Every draw comes from
    `generator` (a seeded request's own), so a seeded request yields the same tokens run after run.
    """
    k = len(drafts)
    if target_probs.shape[0] != k + 1 or draft_probs.shape[0] != k:
        raise ValueError(f"{k} drafts need {k + 1} target rows and {k} draft rows, got "
                         f"{target_probs.shape[0]} and {draft_probs.shape[0]}")
    uniforms = torch.rand(k, generator=generator, device=target_probs.device).tolist() if k else []
    kept: list[int] = []
    for i, token in enumerate(drafts):
        p, q = float(target_probs[i, token]), float(draft_probs[i, token])
        if q > 0 and uniforms[i] * q <= p:  # kept with probability min(1, p / q)
            kept.append(token)
            continue
        residual = (target_probs[i] - draft_probs[i]).clamp_min(0)
        total = float(residual.sum())
        # residual mass 0 only when p == q (nothing can be rejected then), kept for rounding's sake
        return kept + [_draw(residual / total if total > 0 else target_probs[i], generator)]
    return kept + [_draw(target_probs[k], generator)]
