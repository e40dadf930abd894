"""The worker's wire: what a worker reads off gRPC and writes back.

Requests in: `parse` turns a Generate or Prefill request into an EngineRequest the engine has
checked, with gRPC errors for bad input: every check a client can fail is here, so the servicers
abort with INVALID_ARGUMENT and a message instead of letting a bad request reach the engine
thread. Failures out: `Refused` is how the servicers and the PD orchestration behind them end a
call with a status (`abort_with`). Tokens out: `relay` turns an engine's stream of token batches into Generate
responses, one message per batch, for every worker role, with the latency metrics. And the
protobuf <-> engine and libkv dataclass conversions (KV layout, transfer endpoint, sampling params,
finish reasons, token outputs), in one place: libkv and engine never import protos. Imports engine
and libkv (and so torch): the gateway and the registry never import it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import NoReturn

import grpc

from engine.api import EngineAPI
from engine.lora.adapter import UnknownLoraAdapter
from engine.multimodal.decode import prepare as prepare_images
from engine.multimodal.inputs import ImageInput
from engine.outputs import TokenOutput
from engine.request import EngineRequest
from engine.sampling import SamplingParams
from engine.speculative.config import SpeculativeConfig
from libkv.layout import KVLayout
from libkv.transfer import TransferEndpoint
from pdserve.sampling_params import StructuredOutput
from protos.v1 import common_pb2, worker_pb2
from services.common.failed_peer import failed_peer_metadata
from services.worker.images_apart import TicketNotHeld
from services.worker.metrics import WorkerMetrics


class Refused(Exception):
    """A call this worker ends with a gRPC status instead of an answer: `code`, the message, and the
    worker the failure is blamed on (`failed_peer`: trailing metadata the gateway reads). Raised by
    the parse and the PD orchestration (services/decode/remote_prefill.py, services/prefill/job.py);
    the servicer ends the call with it (`abort_with`)."""

    def __init__(self, code: grpc.StatusCode, message: str, failed_peer: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.failed_peer = failed_peer


class BadRequest(Refused, ValueError):
    """A request the client must fix: INVALID_ARGUMENT with this message."""

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, message)


async def abort_with(context: grpc.aio.ServicerContext, refused: Refused) -> NoReturn:
    """End the call with the refusal's status and message (and the peer it blames)."""
    await context.abort(refused.code, str(refused),
                        trailing_metadata=failed_peer_metadata(refused.failed_peer))
    raise AssertionError("context.abort returned")  # it raises: the handler ends here


async def parse(engine: EngineAPI, room: str, prompt_token_ids: Sequence[int],
                sampling: common_pb2.SamplingParams, images: Sequence[bytes | memoryview] = (), *,
                prefill_only: bool = False, lora: str = "", carried_tokens: int = 0) -> EngineRequest:
    """`parse_request` for a handler on the event loop: in a thread when the request carries images
    (decoding and resizing them is CPU work the loop must not wait on)."""
    if isinstance(images, TicketNotHeld):
        raise BadRequest("image_ticket names no images this worker holds (never uploaded to its image "
                         "drop, taken by an earlier call, or expired): upload them again, or send them "
                         "in `images`")
    if images:
        request = await asyncio.to_thread(parse_request, engine, room, prompt_token_ids, sampling,
                                          prefill_only=prefill_only, images=list(images), lora=lora)
    else:
        request = parse_request(engine, room, prompt_token_ids, sampling, prefill_only=prefill_only,
                                lora=lora)
    if carried_tokens:
        if not 0 < carried_tokens < len(request.prompt_ids):
            raise BadRequest(f"carried_tokens {carried_tokens} must be below the prompt's "
                             f"{len(request.prompt_ids)} tokens")
        request = replace(request, carried_tokens=carried_tokens)
    try:  # a structured output compiles off the engine thread, bounded in time
        return await engine.prepare(request)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None


def parse_request(engine: EngineAPI, room: str, prompt_token_ids: Sequence[int],
                  sampling: common_pb2.SamplingParams, *, prefill_only: bool = False,
                  images: Sequence[bytes | memoryview] = (), lora: str = "") -> EngineRequest:
    """The request as `engine` will run it, checked against its model and KV pool (`Engine.check`:
    the one check of a request in this process); BadRequest names what is wrong. A missing room
    gets a fresh id. `prefill_only` (prefill) checks that the prompt fits, not the whole request.
    `images`: encoded images (engine.multimodal.decode; decoding them is CPU work, so a caller on
    the event loop runs this in a thread when there are any). `lora`: the LoRA adapter's name ("" the
    base model); one this worker has not loaded is NOT_FOUND, naming it."""
    model = engine.model_config
    prompt = list(prompt_token_ids)
    if not prompt:
        raise BadRequest("prompt_token_ids is empty: a prompt needs at least one token")
    decoded: tuple[ImageInput, ...] = ()
    if images:
        try:
            prompt, decoded = prepare_images(engine.config.model_path, model, prompt, images)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
    elif model.is_multimodal and model.image_token_id in prompt:
        # An image-pad token stands for an image's embedding: without the image there is nothing
        # to put there (transformers refuses such a prompt too). A forged Prefill call lands here.
        raise BadRequest(f"prompt holds image-pad tokens (id {model.image_token_id}) but no images were sent")
    bad = next((t for t in prompt if not 0 <= t < model.vocab_size), None)
    if bad is not None:
        raise BadRequest(f"prompt token id {bad} is outside the vocabulary [0, {model.vocab_size})")
    if len(prompt) >= model.max_position_embeddings:
        raise BadRequest(f"prompt of {len(prompt)} tokens does not fit the model's context of "
                         f"{model.max_position_embeddings} tokens")
    request = EngineRequest(room=room or uuid.uuid4().hex, prompt_ids=prompt,
                            params=sampling_from_proto(sampling), prefill_only=prefill_only, images=decoded,
                            lora=lora or None)
    try:
        return engine.check(request)
    except UnknownLoraAdapter as exc:
        raise Refused(grpc.StatusCode.NOT_FOUND, f"{exc} (no LoRA adapter of that name is loaded on this "
                      f"{'prefill' if prefill_only else 'worker'})") from None
    except ValueError as exc:
        raise BadRequest(str(exc)) from None


async def relay(batches: AsyncIterator[list[TokenOutput]], metrics: WorkerMetrics,
                arrival: float, stream_interval: int = 1,
                lora: str | None = None) -> AsyncIterator[worker_pb2.GenerateResponse]:
    """GenerateResponses over the batches of engine outputs (Engine.generate): the tokens that were
    ready together travel in one message, and with `stream_interval` N > 1 (SGLang's
    --stream-interval) tokens after the first wait until N of them fill a message, so every hop
    after the engine (this gRPC stream, the gateway, its SSE chunks) handles N times fewer messages.
    The first token goes out at once (time to first token is not traded away). The last response
    carries finish_reason and usage; an abort output (token_id -1) adds no token, only the finish
    reason. Tokens after the first of a batch arrive with it, so their inter-token latency is
    observed as 0. `lora`: the request's adapter, counted per adapter at its end."""
    last = None
    response = worker_pb2.GenerateResponse()
    held: list[TokenOutput] = []  # the tokens of the next message, written into it when it goes
    async for batch in batches:
        now = time.perf_counter()
        first_token = last is None
        for out in batch:
            if out.token_id >= 0:
                if last is None:
                    metrics.ttft.observe(now - arrival)
                else:
                    metrics.itl.observe(now - last)
                last = now
                metrics.generation_tokens.inc()
                held.append(out)
            if out.finish_reason is not None:
                response.finish_reason = finish_reason_to_proto(out.finish_reason)
                response.usage.CopyFrom(worker_pb2.Usage(prompt_tokens=out.prompt_tokens,
                                                         completion_tokens=out.completion_tokens))
                metrics.prompt_tokens.inc(out.prompt_tokens)
                metrics.request_success.labels(**metrics.labels, finish_reason=out.finish_reason).inc()
                metrics.e2e.observe(now - arrival)
                if lora is not None:
                    metrics.lora.finished(lora, out.prompt_tokens, out.completion_tokens)
        if response.finish_reason or len(held) >= stream_interval or (first_token and held):
            yield with_tokens(response, held)
            response = worker_pb2.GenerateResponse()
            held = []
    if held:  # the engine's stream ended without a finish reason: send what is held
        yield with_tokens(response, held)


def with_tokens(response: worker_pb2.GenerateResponse,
                tokens: list[TokenOutput]) -> worker_pb2.GenerateResponse:
    """`response` with `tokens`: in the two columns when none carries logprobs (the usual
    request), else as TokenOutput messages (GenerateResponse's comment says why)."""
    if all(out.logprob is None and not out.top_logprobs for out in tokens):
        response.token_ids.extend([out.token_id for out in tokens])
        response.token_texts.extend([out.text for out in tokens])
    else:
        response.outputs.extend([token_to_proto(out.token_id, out.text, out.logprob, out.top_logprobs)
                                 for out in tokens])
    return response


def layout_to_proto(layout: KVLayout) -> common_pb2.KVLayout:
    return common_pb2.KVLayout(num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
                               head_dim=layout.head_dim, page_size=layout.page_size, dtype=layout.dtype,
                               kv_lora_rank=layout.kv_lora_rank, qk_rope_head_dim=layout.qk_rope_head_dim)


def layout_from_proto(message: common_pb2.KVLayout) -> KVLayout:
    """Raises ValueError (from KVLayout's own checks) for a missing or invalid layout."""
    return KVLayout(num_layers=message.num_layers, num_kv_heads=message.num_kv_heads,
                    head_dim=message.head_dim, page_size=message.page_size, dtype=message.dtype,
                    kv_lora_rank=message.kv_lora_rank, qk_rope_head_dim=message.qk_rope_head_dim)


_FINISH_REASONS = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}


def speculative_to_proto(config: SpeculativeConfig) -> worker_pb2.SpeculativeConfig:
    return worker_pb2.SpeculativeConfig(
        algorithm=config.speculative_algorithm or "", num_draft_tokens=config.speculative_num_draft_tokens,
        num_steps=config.speculative_num_steps or 0, eagle_topk=config.speculative_eagle_topk)


# The draft model's folder is a path on the peer's host: it does not cross the wire (the handshake
# compares SpeculativeConfig.agreed(), which leaves it out), yet a STANDALONE config needs one to be valid.
PEER_DRAFT_MODEL = "(the peer's draft model)"


def speculative_from_proto(message: worker_pb2.SpeculativeConfig) -> SpeculativeConfig:
    """The peer's config (ValueError for one that is invalid here too, e.g. an unknown algorithm);
    a STANDALONE peer's draft model path is PEER_DRAFT_MODEL."""
    if not message.algorithm:
        return SpeculativeConfig()
    return SpeculativeConfig(speculative_algorithm=message.algorithm,
                             speculative_num_draft_tokens=message.num_draft_tokens,
                             speculative_num_steps=message.num_steps or None,
                             speculative_eagle_topk=message.eagle_topk,
                             speculative_draft_model_path=PEER_DRAFT_MODEL
                             if message.algorithm == "STANDALONE" else None)


def finish_reason_to_proto(reason: str | None) -> common_pb2.FinishReason:
    """The engine's "stop" | "length" | "abort" | None (not finished) as the proto enum."""
    if reason is None:
        return common_pb2.FINISH_REASON_UNSPECIFIED
    try:
        return _FINISH_REASONS[reason]
    except KeyError:
        raise ValueError(f"unknown finish reason {reason!r}; "
                         f"expected one of {sorted(_FINISH_REASONS)}") from None


def finish_reason_from_proto(reason: common_pb2.FinishReason) -> str | None:
    for name, value in _FINISH_REASONS.items():
        if value == reason:
            return name
    return None


def token_to_proto(token_id: int, text: str, logprob: float | None,
                   top_logprobs: list[tuple[int, float]]) -> common_pb2.TokenOutput:
    """One sampled token (engine.outputs.TokenOutput / FirstToken fields) as a proto TokenOutput;
    an unrequested logprob (None) is sent as 0 (the caller asked for none, so reads none)."""
    return common_pb2.TokenOutput(
        token_id=token_id, text=text, logprob=logprob if logprob is not None else 0.0,
        top_logprobs=[common_pb2.TokenLogprob(token_id=tid, logprob=lp) for tid, lp in top_logprobs])


def endpoint_to_proto(endpoint: TransferEndpoint) -> common_pb2.TransferEndpoint:
    return common_pb2.TransferEndpoint(backend=endpoint.backend, host=endpoint.host,
                                       layout=layout_to_proto(endpoint.layout), descriptor=endpoint.blob,
                                       num_pages=endpoint.num_pages)


def endpoint_from_proto(message: common_pb2.TransferEndpoint) -> TransferEndpoint:
    """Raises ValueError if the endpoint or its layout is missing."""
    if not message.backend:
        raise ValueError("transfer endpoint has no backend")
    return TransferEndpoint(backend=message.backend, layout=layout_from_proto(message.layout),
                            host=message.host, num_pages=message.num_pages, blob=message.descriptor)


def sampling_from_proto(message: common_pb2.SamplingParams) -> SamplingParams:
    """Fields left unset in the message take engine.sampling.SamplingParams' defaults (so a default
    lives in one place). top_k 0 (proto3's unset) means off, as -1 does. Not validated: that is
    `Engine.check`'s (parse_request)."""
    values: dict = {
        "top_k": message.top_k if message.top_k != 0 else -1,  # other negatives fail validate()
        "min_p": message.min_p,
        "stop": tuple(message.stop),
        "stop_token_ids": tuple(message.stop_token_ids),
        "ignore_eos": message.ignore_eos,
        "logprobs": message.logprobs,
        "top_logprobs": message.top_logprobs,
        "presence_penalty": message.presence_penalty,
        "frequency_penalty": message.frequency_penalty,
        "logit_bias": dict(message.logit_bias),
        "min_tokens": message.min_tokens,
        "structured": structured_from_proto(message.structured) if message.HasField("structured") else None,
        "kept_special_token_ids": tuple(message.kept_special_token_ids),
    }
    for name in ("temperature", "top_p", "seed", "max_new_tokens", "repetition_penalty"):
        if message.HasField(name):
            values[name] = getattr(message, name)
    return SamplingParams(**values)


def structured_from_proto(message: common_pb2.StructuredOutput) -> StructuredOutput:
    """A StructuredOutput with no kind set keeps kind "" (refused by validate())."""
    kind = message.WhichOneof("kind") or ""
    spec: str | tuple[str, ...] = ""
    if kind == "choice":
        spec = tuple(message.choice.choices)
    elif kind in ("json_schema", "regex", "ebnf"):
        spec = getattr(message, kind)
    return StructuredOutput(kind=kind, spec=spec, start_after=message.start_after, strict=message.strict)


def structured_to_proto(structured: StructuredOutput) -> common_pb2.StructuredOutput:
    message = common_pb2.StructuredOutput(start_after=structured.start_after, strict=structured.strict)
    if structured.kind == "choice":
        message.choice.choices.extend(structured.spec)
    elif structured.kind == "json_object":
        message.json_object = True
    else:
        setattr(message, structured.kind, structured.spec)
    return message


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    message = common_pb2.SamplingParams(
        temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, min_p=params.min_p,
        max_new_tokens=params.max_new_tokens, stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos, logprobs=params.logprobs,
        top_logprobs=params.top_logprobs, presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty, logit_bias=dict(params.logit_bias),
        min_tokens=params.min_tokens, kept_special_token_ids=list(params.kept_special_token_ids))
    if params.seed is not None:
        message.seed = params.seed
    if params.repetition_penalty != 1.0:
        message.repetition_penalty = params.repetition_penalty
    if params.structured is not None:
        message.structured.CopyFrom(structured_to_proto(params.structured))
    return message
