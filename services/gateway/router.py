"""Pick where one attempt of a request runs: a (prefill, decode) pair or a colocated worker.

The decode policy chooses among decode and colocated workers (a decode worker only while some
prefill worker is available to pair it with, or if it runs prompts itself when none is:
conditional disaggregation); if it chose a decode worker, the prefill policy chooses its prefill
worker, if there is one. Workers whose circuit is open, or that this request already failed
on (`exclude`), are not candidates. The returned Route holds both workers' in-flight slots and
breaker trial slots until `finish` says how the attempt went.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from services.gateway.errors import GatewayError
from services.gateway.policies.base import Policy
from services.gateway.workers import COLOCATED, DECODE, PREFILL, WorkerHandle, WorkerPool


class NoWorkersError(GatewayError):
    """No worker can take the request now (503)."""

    def __init__(self, message: str) -> None:
        super().__init__(503, message, code="no_healthy_workers")


@dataclass
class Route:
    """One attempt's workers. `finish(failed=...)` must be called exactly once."""

    decode: WorkerHandle
    prefill: WorkerHandle | None
    _finished: bool = False

    @property
    def workers(self) -> tuple[WorkerHandle, ...]:
        return (self.decode,) if self.prefill is None else (self.prefill, self.decode)

    def describe(self) -> str:
        if self.prefill is None:
            return f"{self.decode.role} {self.decode.address}"
        return f"prefill {self.prefill.address} -> decode {self.decode.address}"

    def finish(self, *, succeeded: bool = False, failed: Iterable[WorkerHandle] = ()) -> None:
        """Release the slots. `succeeded`: every worker of the route did its part (closes a
        half-open breaker). `failed`: workers to charge a failure to; the others are released
        without a verdict (client abort, bad request)."""
        if self._finished:
            return
        self._finished = True
        failed = set(failed)
        for worker in self.workers:
            worker.end()
            if worker in failed:
                worker.breaker.record_failure()
            elif succeeded:
                worker.breaker.record_success()
            else:
                worker.breaker.release()


class Router:
    """Chooses routes from a WorkerPool with one policy for prefill and one for decode."""

    def __init__(self, pool: WorkerPool, prefill_policy: Policy, decode_policy: Policy) -> None:
        self.pool = pool
        self.prefill_policy = prefill_policy
        self.decode_policy = decode_policy
        pool.on_removed(self._forget)

    def _forget(self, worker: WorkerHandle) -> None:
        self.prefill_policy.forget(worker)
        if self.decode_policy is not self.prefill_policy:
            self.decode_policy.forget(worker)

    def candidates(self, model: str, exclude: Iterable[str] = ()) -> tuple[list[WorkerHandle], list[WorkerHandle]]:
        """(prefill candidates, decode-or-colocated candidates) available for `model` now."""
        excluded = set(exclude)
        usable = [w for w in self.pool.routable(model) if w.key not in excluded and w.breaker.available()]
        prefills = [w for w in usable if w.role == PREFILL]
        decodes = [w for w in usable if w.role == COLOCATED or (w.role == DECODE and (prefills or w.local_prefill))]
        return prefills, decodes

    def pick(self, model: str, prompt_token_ids: Sequence[int], exclude: Iterable[str] = ()) -> Route:
        """A route for one attempt; raises NoWorkersError (503) when nothing can serve `model`."""
        prefills, decodes = self.candidates(model, exclude)
        if not decodes:
            raise NoWorkersError(self._why_none(model, exclude))
        decode = self.decode_policy.choose(decodes, prompt_token_ids)
        prefill = (self.prefill_policy.choose(prefills, prompt_token_ids)
                   if decode.role == DECODE and prefills else None)
        route = Route(decode=decode, prefill=prefill)
        for worker in route.workers:
            worker.breaker.acquire()
            worker.begin()
        return route

    def _why_none(self, model: str, exclude: Iterable[str]) -> str:
        known = self.pool.routable(model)
        if not known:
            return f"no workers serve model {model!r}"
        roles = sorted({w.role for w in known})
        if roles == [PREFILL]:
            return f"model {model!r} has prefill workers but no decode or colocated worker"
        if roles == [DECODE] or (set(roles) == {DECODE, PREFILL}
                                 and not any(w.breaker.available() for w in known if w.role == PREFILL)):
            return f"model {model!r} has no healthy prefill worker for its decode workers"
        tried = set(exclude)
        if tried:
            return f"every worker for model {model!r} failed this request or is unhealthy (tried {len(tried)})"
        return f"every worker for model {model!r} is unhealthy (circuit open)"
