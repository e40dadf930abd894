"""The routing-policy interface: choose one worker out of the candidates for one request.

The router calls `choose` with the workers it may use right now (right role and model, circuit
not open, not already tried by this request): never an empty list. A policy may keep per-worker
state (cache_aware's prefix tree); the router calls `forget` when a worker leaves the pool.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

from services.gateway.workers import WorkerHandle


class Policy(abc.ABC):
    """Picks a worker for a request; one instance per role (prefill, decode) per gateway."""

    name: str = ""

    @abc.abstractmethod
    def choose(self, candidates: Sequence[WorkerHandle], prompt_token_ids: Sequence[int],
               lora: str | None = None) -> WorkerHandle:
        """One of `candidates` (non-empty) for a request with this prompt, run under LoRA adapter
        `lora` (None: the base model; every candidate serves it)."""

    def forget(self, worker: WorkerHandle) -> None:  # noqa: B027 - optional hook, most policies keep no state
        """`worker` left the pool: drop any state kept for it."""


def least_loaded(candidates: Sequence[WorkerHandle]) -> WorkerHandle:
    """The candidate with the smallest load; ties go to the earliest in the list (stable)."""
    return min(candidates, key=lambda worker: worker.load)
