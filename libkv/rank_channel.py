"""How rank 0 of a tensor-parallel worker reaches its follower ranks' processes.

libkv drives every rank's pool and transfer engine from rank 0 (libkv.landing.TPKVPool,
libkv.transfer.tensor_parallel), but does not own the processes: whoever starts the ranks
(engine.tp) hands rank 0 one RankChannel per follower, served there by a
libkv.transfer.tensor_parallel.RankTransfer.
"""

from __future__ import annotations

from typing import Any, Protocol


class RankCallFailed(RuntimeError):
    """A follower raised something that cannot be carried back as itself (or is gone); the message
    names it. `type_name` and `detail` (e.g. a GrantRefused's refusal) let the caller rebuild it."""

    def __init__(self, message: str, type_name: str = "", detail: object = None) -> None:
        super().__init__(message)
        self.type_name = type_name
        self.detail = detail


class RankChannel(Protocol):
    """One rank's handler, as rank 0 sees it: `call(method, *args)` runs `handler.method(*args)`
    in that rank's process and returns its result, or raises its exception (RankCallFailed when
    the exception cannot travel, or the rank is gone). Calls are short and may come from any
    thread."""

    def call(self, method: str, *args: object) -> Any: ...


class InProcessRank:
    """A RankChannel to a handler in this process (rank 0's own, and tests' followers)."""

    def __init__(self, handler: object) -> None:
        self.handler = handler

    def call(self, method: str, *args: object) -> Any:
        return getattr(self.handler, method)(*args)
