"""Run one generation on the workers: route, call Worker.Generate, relay tokens, retry, abort.

`Dispatcher.generate(...)` is an async iterator of GenerationChunk for ONE choice. Its protocol:

- Each attempt picks a route (workers.Router) and opens decode's (or a colocated worker's)
  Generate stream with the prefill address the router chose.
- A retryable failure before any token was yielded (UNAVAILABLE, RESOURCE_EXHAUSTED,
  DEADLINE_EXCEEDED, a first-token timeout, a stream that ends without a finish) is retried on
  another route, at most `max_attempts` attempts, with doubling backoff. The worker to blame is
  charged on its circuit breaker and not tried again by this request: the prefill worker when
  decode's error names it (decode reports "prefill ADDRESS failed ..."), else the decode worker.
- After the first token, a failure that is the worker's (it died, froze past its lease or was
  cut off, ended the stream without a finish, or failed with UNAVAILABLE, INTERNAL, UNKNOWN,
  ABORTED, DEADLINE_EXCEEDED or RESOURCE_EXHAUSTED) migrates the request (migration.py): it is
  resubmitted to another pair, the failed worker excluded, as a continuation (the prompt plus the
  tokens already yielded, the rest of max_new_tokens), and the chunks go on with no gap and no
  repeat; at most `migration_limit` times per generation. Past the limit, or for a failure that is
  not the worker's (INVALID_ARGUMENT, ...), GenerationFailed(after_first_token=True).
- If the consumer stops early (client disconnected: the task is cancelled or the iterator
  closed), the gRPC call is cancelled at once and Worker.Abort(room) is sent to decode in the
  background, so both workers free the request's pages.
- If the decode (or colocated) worker's registry lease expires while the call is open (it froze
  or was cut off), discovery cuts the call: before the first token that is a retryable failure,
  after it the request migrates (above). Keepalive pings (services.common.keepalive) catch a
  frozen worker the same way when no registry is used.
- Before the gateway's registry view is synced, a request waits (bounded) for it instead of
  failing with "no workers".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc
from tokenizers import Tokenizer

from protos.v1 import common_pb2, worker_pb2
from services.common.failed_peer import failed_peer
from services.gateway.errors import GatewayError, status_for_grpc
from services.gateway.generation_chunk import GeneratedToken, GenerationChunk
from services.gateway.image_wire import generate_call
from services.gateway.metrics import GatewayMetrics
from services.gateway.migration import ContinuationText, Delivered, continuation_sampling
from services.gateway.workers import NoWorkersError, Route, Router, UnknownAdapterError, WorkerHandle

log = logging.getLogger("pdserve.gateway")

_FINISH_REASONS = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
                   common_pb2.FINISH_REASON_ABORT: "abort"}

_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
              grpc.StatusCode.DEADLINE_EXCEEDED)
# Not the worker's fault: retry elsewhere, but do not count against its circuit.
_NOT_A_HEALTH_SIGNAL = (grpc.StatusCode.RESOURCE_EXHAUSTED,)
# After the first token: the worker's failure, so the request migrates (not the client's request,
# which another worker would refuse the same way, nor a cancellation of the gateway's own).
_MIGRATABLE = (*_RETRYABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.ABORTED)


class GenerationFailed(GatewayError):
    """A generation that could not be completed; `after_first_token` says whether the client
    already got part of it (then the stream ends with an error event instead of a status)."""

    def __init__(self, status: int, message: str, code: str, *, after_first_token: bool) -> None:
        super().__init__(status, message, code=code)
        self.after_first_token = after_first_token


@dataclass(frozen=True)
class DispatchSettings:
    max_attempts: int = 3
    retry_backoff_s: float = 0.05
    first_token_timeout_s: float = 300.0
    abort_timeout_s: float = 2.0
    sync_wait_s: float = 10.0  # how long a request waits for the registry view at start-up
    migration_limit: int = 3  # continuations on another pair after a mid-stream failure; 0: none


class _MidStream(Exception):
    """A failure after the first token that is the worker's: the generation may migrate.
    `error` is what the client gets when it does not."""

    def __init__(self, reason: str, worker: WorkerHandle, error: GenerationFailed) -> None:
        super().__init__(error.message)
        self.reason = reason
        self.worker = worker
        self.error = error


class _Retryable(Exception):
    def __init__(self, reason: str, message: str, blame: WorkerHandle | None,
                 status: tuple[int, str]) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.blame = blame
        self.status = status


def chunk_from_proto(response: worker_pb2.GenerateResponse, want_logprobs: bool) -> GenerationChunk:
    finish = _FINISH_REASONS.get(response.finish_reason)
    usage = response.usage
    if response.outputs:  # the tokens carry logprobs (or a worker that sends only this form)
        if want_logprobs:
            tokens = [GeneratedToken(out.token_id, out.text, out.logprob,
                                     tuple([(t.token_id, t.logprob) for t in out.top_logprobs]))
                      for out in response.outputs]
        else:
            tokens = [GeneratedToken(out.token_id, out.text) for out in response.outputs]
        return GenerationChunk(tokens, finish, usage.prompt_tokens, usage.completion_tokens)
    # the relay's usual case, once per streamed message: two columns, no message object per token
    token_ids, texts = tuple(response.token_ids), tuple(response.token_texts)
    if len(token_ids) != len(texts):
        raise ValueError(f"a chunk of {len(token_ids)} token ids and {len(texts)} texts")
    return GenerationChunk(None, finish, usage.prompt_tokens, usage.completion_tokens,
                           token_ids=token_ids, texts=texts)


class Dispatcher:
    """Generations with retries over a Router. One per gateway."""

    def __init__(self, router: Router, metrics: GatewayMetrics, settings: DispatchSettings,
                 synced: asyncio.Event | None = None, tokenizer: Tokenizer | None = None) -> None:
        self.router = router
        self.metrics = metrics
        self.settings = settings
        self.synced = synced  # set once the registry view is complete; None without a registry
        self.tokenizer = tokenizer  # makes a migrated continuation's text (migration.py)
        self._background: set[asyncio.Task] = set()
        # Loads an adapter no route holds (lora_on_demand.py), True once routes hold it; None: never.
        self.adapter_loader: Callable[[str], Awaitable[bool]] | None = None

    async def generate(self, room: str, model: str, prompt_token_ids: Sequence[int],
                       sampling: common_pb2.SamplingParams, images: Sequence[bytes] = (),
                       lora: str | None = None) -> AsyncGenerator[GenerationChunk, None]:
        """`lora`: the LoRA adapter every attempt and migration runs under (None: the base model)."""
        if self.synced is not None and not self.synced.is_set():
            try:
                await asyncio.wait_for(self.synced.wait(), self.settings.sync_wait_s)
            except asyncio.TimeoutError:
                pass  # route on what is known; NoWorkersError says the rest
        exclude: set[str] = set()
        delivered = Delivered(token_ids=[])
        prompt, params, attempt_room = prompt_token_ids, sampling, room
        text: ContinuationText | None = None
        migrations = carried = 0  # carried: tokens generated before the last migration
        lost = ""  # why the last migration happened
        while True:
            try:
                async with contextlib.aclosing(self._attempts(attempt_room, model, prompt, params,
                                                              exclude, images, lora,
                                                              carried)) as chunks:
                    async for chunk in chunks:
                        if migrations:
                            chunk = _continued(chunk, text, len(prompt_token_ids), carried, delivered)
                        delivered.add(chunk)
                        yield chunk
                        if chunk.finish_reason is not None:
                            return  # (a stop string the gateway found: closing `chunks` aborts the worker)
                return
            except NoWorkersError as exc:
                if not migrations:
                    raise
                raise GenerationFailed(exc.status, f"{lost}; no other worker to continue on: {exc.message}",
                                       "worker_error", after_first_token=True) from None
            except GenerationFailed as failure:
                if migrations:  # the continuation could not start: the client has tokens already
                    failure.after_first_token = True
                    failure.message = f"{lost}; the continuation failed: {failure.message}"
                raise
            except _MidStream as failure:
                exclude.add(failure.worker.key)
                rest = continuation_sampling(sampling, len(delivered.token_ids))
                if migrations >= self.settings.migration_limit:
                    if migrations:
                        failure.error.message += f" (after {migrations} migrations)"
                    raise failure.error from None
                migrations += 1
                lost = failure.error.message
                self.metrics.migrations.labels(reason=failure.reason).inc()
                log.warning("room %s: migrating off %s with %d tokens carried "
                            "(migration %d of at most %d): %s",
                            room, failure.worker.address, len(delivered.token_ids), migrations,
                            self.settings.migration_limit, lost)
                if rest is None:  # every token was generated, only the finish was lost
                    yield GenerationChunk(tokens=(), finish_reason="length",
                                          prompt_tokens=len(prompt_token_ids),
                                          completion_tokens=len(delivered.token_ids))
                    return
                params = rest
                carried = len(delivered.token_ids)
                prompt = [*prompt_token_ids, *delivered.token_ids]
                attempt_room = f"{room}.m{migrations}"
                text = (ContinuationText(self.tokenizer, sampling, prompt_token_ids, delivered)
                        if self.tokenizer is not None else None)

    async def _attempts(self, room: str, model: str, prompt_token_ids: Sequence[int],
                        sampling: common_pb2.SamplingParams, exclude: set[str],
                        images: Sequence[bytes] = (),
                        lora: str | None = None, carried: int = 0) -> AsyncGenerator[GenerationChunk, None]:
        """Attempts on routes not in `exclude` until one yields a token (retries, backoff)."""
        backoff_s = self.settings.retry_backoff_s
        last_failure: _Retryable | None = None
        for attempt in range(1, self.settings.max_attempts + 1):
            try:
                began = time.perf_counter()
                route = await self._pick(model, prompt_token_ids, exclude, lora)
                self.metrics.routing_decision.observe(time.perf_counter() - began)
            except NoWorkersError as exc:
                if last_failure is None:
                    raise
                status, code = last_failure.status
                raise GenerationFailed(status, f"{exc.message}; last failure: {last_failure.message}", code,
                                       after_first_token=False) from None
            attempt_room = room if attempt == 1 else f"{room}.{attempt}"
            for worker in route.workers:
                self.metrics.routed.labels(worker=worker.address, role=worker.role).inc()
            try:
                async with contextlib.aclosing(self._attempt(attempt_room, route, prompt_token_ids,
                                                             sampling, images, lora,
                                                             carried)) as chunks:
                    async for chunk in chunks:
                        yield chunk
                return
            except _Retryable as failure:
                last_failure = failure
                log.warning("room %s: attempt %d on %s failed: %s", attempt_room, attempt, route.describe(),
                            failure.message)
                if failure.blame is not None:
                    exclude.add(failure.blame.key)
                else:
                    exclude.update(worker.key for worker in route.workers if worker.role != "prefill")
                if attempt == self.settings.max_attempts:
                    status, code = failure.status
                    raise GenerationFailed(status,
                                           f"request failed after {attempt} attempts: {failure.message}",
                                           code, after_first_token=False) from None
                self.metrics.retries.labels(reason=failure.reason).inc()
                await asyncio.sleep(backoff_s)
                backoff_s *= 2

    async def _pick(self, model: str, prompt_token_ids: Sequence[int], exclude: set[str],
                    lora: str | None) -> Route:
        """Router.pick, loading the adapter on demand when no route holds it (then 404 as before)."""
        try:
            return self.router.pick(model, prompt_token_ids, exclude, lora)
        except UnknownAdapterError:
            if lora is None or self.adapter_loader is None or not await self.adapter_loader(lora):
                raise
            return self.router.pick(model, prompt_token_ids, exclude, lora)

    async def _attempt(self, room: str, route: Route, prompt_token_ids: Sequence[int],
                       sampling: common_pb2.SamplingParams, images: Sequence[bytes] = (),
                       lora: str | None = None, carried: int = 0) -> AsyncGenerator[GenerationChunk, None]:
        """One attempt on `route`. Raises _Retryable for a failure before the first token. `carried`:
        the prompt's last tokens that a migrated generation delivered already (GenerateRequest)."""
        request = worker_pb2.GenerateRequest(room=room, prompt_token_ids=list(prompt_token_ids),
                                             sampling=sampling, lora_adapter=lora or "",
                                             carried_tokens=carried)
        if route.prefill is not None:
            request.prefill_address = route.prefill.address
        want_logprobs = sampling.logprobs
        if images:  # written into the wire bytes as they are: building the message would copy them twice
            call = generate_call(route.decode.channel, request, images, route.decode)
        else:
            call = route.decode.worker_stub().Generate(request)
        route.decode.track(call)
        delivered = finished = client_gone = False
        blame: list[WorkerHandle] = []
        try:
            while True:
                if delivered:
                    response = await call.read()
                else:
                    response = await asyncio.wait_for(call.read(), self.settings.first_token_timeout_s)
                if response is grpc.aio.EOF:
                    break
                route.decode.reachable = True
                try:
                    chunk = chunk_from_proto(response, want_logprobs)
                except ValueError as exc:  # a worker bug or a forged peer: its stream cannot be trusted
                    raise GenerationFailed(502, f"{route.decode.address} sent a malformed chunk: {exc}",
                                           "worker_error", after_first_token=delivered) from None
                if chunk.finish_reason == "abort" and not delivered:
                    # the worker gave up on it before producing anything (draining, shutting down)
                    raise _Retryable("worker_abort", f"{route.decode.address} aborted room {room}", None,
                                     (503, "worker_unavailable"))
                if chunk.token_ids or chunk.finish_reason is not None:
                    delivered = True
                    finished = chunk.finish_reason is not None
                    yield chunk
                if finished:
                    break
            if not finished:
                if delivered:
                    blame = [route.decode]
                    raise _MidStream("truncated", route.decode, GenerationFailed(
                        502, f"{route.decode.address} ended the stream without finishing", "worker_error",
                        after_first_token=True))
                blame = [route.decode]
                raise _Retryable("truncated", f"{route.decode.address} ended the stream without a token",
                                 route.decode, (502, "worker_error"))
            route.finish(succeeded=True)
        except asyncio.CancelledError:
            cut = route.decode.cut_reason(call)
            if cut is None:
                client_gone = True
                raise
            blame = [route.decode]
            message = f"{route.decode.address} {cut}"
            if delivered:
                raise _MidStream("worker_lost", route.decode, GenerationFailed(
                    502, f"{message} mid-stream", "worker_error", after_first_token=True)) from None
            raise _Retryable("worker_lost", message, route.decode, (503, "worker_unavailable")) from None
        except GeneratorExit:
            client_gone = True
            raise
        except asyncio.TimeoutError:
            target = route.prefill or route.decode
            blame = [target]
            raise _Retryable("first_token_timeout",
                             f"no first token within {self.settings.first_token_timeout_s:g}s", target,
                             (504, "timeout")) from None
        except grpc.aio.AioRpcError as exc:
            code, details = exc.code(), exc.details() or ""
            blamed = failed_peer(exc.trailing_metadata())
            target = (route.prefill if route.prefill is not None and blamed == route.prefill.address
                      else route.decode)
            if code not in _NOT_A_HEALTH_SIGNAL and (code in _RETRYABLE or code == grpc.StatusCode.UNKNOWN):
                blame = [target]
            if delivered:
                status, error_code = status_for_grpc(code)
                error = GenerationFailed(status,
                                         f"{route.describe()} failed mid-stream: {code.name}: {details}",
                                         error_code, after_first_token=True)
                if code in _MIGRATABLE:
                    reason = "prefill_failed" if target is route.prefill else code.name.lower()
                    raise _MidStream(reason, target, error) from None
                raise error from None
            if code in _RETRYABLE:
                reason = "prefill_failed" if target is route.prefill else code.name.lower()
                raise _Retryable(reason, f"{code.name}: {details}", target, status_for_grpc(code)) from None
            status, error_code = status_for_grpc(code)
            raise GenerationFailed(status, details or code.name, error_code,
                                   after_first_token=False) from None
        finally:
            route.decode.untrack(call)
            if not finished:
                call.cancel()
                if client_gone:
                    self._abort_in_background(route.decode, room)
            route.finish(failed=blame)

    def _abort_in_background(self, decode: WorkerHandle, room: str) -> None:
        """Tell decode to drop `room` explicitly (the cancelled call already does; this also covers a
        request still queued behind the cancellation). Runs as its own task: the caller may be in a
        cancelled scope where it cannot await."""

        async def abort() -> None:
            try:
                await decode.worker_stub().Abort(worker_pb2.AbortRequest(room=room),
                                                 timeout=self.settings.abort_timeout_s)
            except grpc.aio.AioRpcError as exc:
                log.info("room %s: Abort on %s failed: %s %s", room, decode.address, exc.code().name,
                         exc.details())
            except Exception:  # never let a background abort crash the loop
                log.exception("room %s: Abort on %s failed", room, decode.address)

        try:
            task = asyncio.get_running_loop().create_task(abort())
        except RuntimeError:  # loop closing: nothing left to tell
            return
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        self.metrics.aborts.inc()

    async def drain(self) -> None:
        """Wait for background aborts (shutdown)."""
        if self._background:
            await asyncio.wait(list(self._background), timeout=self.settings.abort_timeout_s)


def _continued(chunk: GenerationChunk, text: ContinuationText | None, prompt_tokens: int, carried: int,
               delivered: Delivered) -> GenerationChunk:
    """A continuation's chunk as the original request's: the gateway's text (when it has the
    tokenizer) and, on the last chunk, the original prompt's length and every generated token."""
    if text is not None:
        chunk = text.apply(chunk)
    if chunk.finish_reason is None:
        return chunk
    if chunk.prompt_tokens:  # the worker's usage: its completion tokens are the continuation's
        completion = carried + chunk.completion_tokens
    else:  # the gateway ended it at a stop string
        completion = len(delivered.token_ids) + len(chunk.token_ids)
    return chunk.with_usage(prompt_tokens, completion)

