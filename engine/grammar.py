"""Structured outputs: a request's StructuredOutput compiled into a grammar (llguidance), and the
per-request matcher that masks the logits each step and advances with each accepted token.

Why llguidance (measured by `pdserve bench grammar`, docs/architecture.md): it compiles a JSON
schema 10-60x faster than xgrammar (ms instead of 100-300 ms at vocab 150k) because it computes
masks lazily, with a per-step mask cost of the same order; a slow compile is the one cost a request
cannot hide, while a mask is computed on the engine thread next to a forward pass.

Compilation runs off the engine thread (`GrammarCompiler.prepare`, from the worker's request
parsing), cached by the constraint, bounded in time: a constraint that does not compile in time, or
at all, is refused with a message, and the engine thread never waits for one. JSON is compiled with
OpenAI strict mode's fixed separators (no free whitespace), so a weak model cannot loop on
whitespace.

State across processes: a `RequestGrammar` is rebuilt from the tokens a request holds (`sync`), so
the decode side of PD (the first token sampled by prefill under the same grammar), a request
recomputed after retraction, and a migrated continuation all continue from the same grammar state.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import llguidance
import llguidance.hf
import numpy as np
import torch
from llguidance.gbnf_to_lark import any_to_lark

from pdserve.sampling_params import StructuredOutput

log = logging.getLogger("engine.grammar")

# A constraint that takes longer to compile is refused (the compile may finish later, cached).
DEFAULT_COMPILE_TIMEOUT_S = 10.0
CACHE_SIZE = 256
# OpenAI's strict JSON: fixed separators, no other whitespace.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
                 "coerce_one_of": True}


def to_grammar(structured: StructuredOutput) -> str:
    """The llguidance grammar of a constraint; ValueError naming what is wrong with it."""
    structured.validate()
    kind, spec = structured.kind, structured.spec
    if kind in ("json_schema", "json_object"):
        if kind == "json_object":
            schema: Any = {"type": "object"}
        else:
            try:
                schema = json.loads(str(spec))
            except json.JSONDecodeError as exc:
                raise ValueError(f"json_schema is not valid JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("json_schema must be a JSON object")
        # strict: an unsupported keyword is an error; otherwise it is ignored (lenient)
        options = {**_JSON_OPTIONS, "lenient": not structured.strict}
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)  # type: ignore[arg-type]
        except ValueError as exc:
            raise ValueError(f"json_schema: {exc}") from None
    if kind == "regex":
        try:
            re.compile(str(spec))
        except re.error as exc:
            raise ValueError(f"regex does not compile: {exc}") from None
        return llguidance.LLMatcher.grammar_from_regex(str(spec))
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(choice) for choice in spec))
    try:
        lark = any_to_lark(str(spec))  # GBNF (`root ::= ...`, as SGLang and vLLM take it) or Lark
    except Exception as exc:  # the converter raises what its parser meets
        raise ValueError(f"ebnf grammar does not parse: {exc}") from None
    return llguidance.LLMatcher.grammar_from_lark(lark)


@dataclass
class GrammarStats:
    """Counters the worker exports (services/worker/metrics.py)."""

    compiles: int = 0
    compile_seconds: float = 0.0
    cache_hits: int = 0
    refused: int = 0
    constrained_steps: int = 0  # request-steps sampled under a mask


class GrammarCompiler:
    """Compiles constraints for one model's tokenizer; the compiled matchers are cached (LRU) by
    constraint, and each request gets its own copy."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int,
                 timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.timeout_s = timeout_s
        self.stats = GrammarStats()
        self._tokenizer: Any = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, Any] = OrderedDict()

    def llg_tokenizer(self) -> Any:
        """The tokenizer llguidance masks with (built once: about 1 s at vocab 32k)."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size,
                                                               eos_token=self.eos_token_id)
            return self._tokenizer

    def compile(self, structured: StructuredOutput) -> CompiledGrammar:
        """Compile (or take from the cache); ValueError naming what does not compile. Blocking:
        call it off the engine thread."""
        key = structured.cache_key
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self.stats.cache_hits += 1
                return CompiledGrammar(cached, self._start_ids(structured))
        began = time.perf_counter()
        grammar = to_grammar(structured)
        matcher = llguidance.LLMatcher(self.llg_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"{structured.kind} does not compile: {matcher.get_error()}")
        with self._lock:
            self.stats.compiles += 1
            self.stats.compile_seconds += time.perf_counter() - began
            self._cache[key] = matcher
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return CompiledGrammar(matcher, self._start_ids(structured))

    def _start_ids(self, structured: StructuredOutput) -> tuple[int, ...]:
        if not structured.start_after:
            return ()
        return tuple(self._hf_tokenizer.encode(structured.start_after, add_special_tokens=False))

    async def prepare(self, structured: StructuredOutput) -> CompiledGrammar:
        """`compile` in a thread, bounded by `timeout_s`: ValueError when it fails or is too slow
        (the compile then finishes in its thread and fills the cache; nothing waits for it)."""
        try:
            return await asyncio.wait_for(asyncio.to_thread(self.compile, structured), self.timeout_s)
        except TimeoutError:
            self.stats.refused += 1
            raise ValueError(f"{structured.kind} took longer than {self.timeout_s:g} s to compile") from None
        except ValueError:
            self.stats.refused += 1
            raise


@dataclass(frozen=True)
class CompiledGrammar:
    """A compiled constraint (shared, never advanced) and the tokens that start it."""

    template: Any  # llguidance.LLMatcher in its initial state
    start_ids: tuple[int, ...] = ()

    def new_request(self) -> RequestGrammar:
        return RequestGrammar(self.template.deep_copy(), self.start_ids)


@dataclass
class RequestGrammar:
    """One request's grammar state: the matcher and how many output tokens it has seen."""

    matcher: Any
    start_ids: tuple[int, ...]
    seen: int = 0  # output tokens looked at (fed to the matcher once active)
    start: int | None = None  # output index the constraint starts at (None: not yet)
    failed: bool = field(default=False)

    def sync(self, output_ids: Sequence[int]) -> bool:
        """Catch up with the request's output tokens; whether the constraint applies to the next token."""
        if self.start is None and not self.start_ids:
            self.start = 0  # from the first output token (which may be here already: PD decode)
        while self.seen < len(output_ids):
            if self.start is None:
                self.seen += 1
                n = len(self.start_ids)
                if list(output_ids[max(0, self.seen - n):self.seen]) == list(self.start_ids):
                    self.start = self.seen
                continue
            self.accept(output_ids[self.seen])
        return self.start is not None and not self.failed

    def accept(self, token_id: int) -> None:
        self.seen += 1
        if not self.failed and not self.matcher.consume_token(token_id):
            # only a token the mask allowed is sampled; this is a grammar the matcher lost track of
            log.warning("grammar refused token %d: %s", token_id, self.matcher.get_error())
            self.failed = True


_executor: Any = None


def _parallel() -> Any:
    """llguidance's thread pool for a batch's masks, as many threads as the engine's torch pool
    (idle while the masks are computed: they sit between the forward pass and the sampler)."""
    global _executor
    if _executor is None:
        _executor = llguidance.LLExecutor(num_threads=max(1, torch.get_num_threads()))
    return _executor


def fill_masks(grammars: Sequence[RequestGrammar], vocab_size: int) -> torch.Tensor:
    """The allowed-token bitmask [R, ceil(V / 32)] int32 of each grammar's next token, the rows
    computed in parallel."""
    bitmask = torch.zeros((len(grammars), (vocab_size + 31) // 32), dtype=torch.int32)
    fill_rows(grammars, bitmask, range(len(grammars)))
    return bitmask


def fill_rows(grammars: Sequence[RequestGrammar], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Rows `rows` of the contiguous `bitmask` [R, words]: the masks of `grammars`, in parallel."""
    if not grammars:
        return
    words = bitmask.shape[1]
    if len(grammars) == 1:
        grammars[0].matcher.unsafe_compute_mask_ptr(bitmask[rows[0]].data_ptr(), words * 4)
        return
    _parallel().unsafe_compute_mask_ptr([(g.matcher, row) for g, row in zip(grammars, rows, strict=True)],
                                        bitmask.data_ptr(), words * 4, bitmask.shape[0])


# byte value -> what its 8 tokens add to their logits: 0 where the bit is set (allowed), -inf where not
_BYTE_TO_BIAS = torch.where(
    (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1 == 1, 0.0, float("-inf")).numpy()


def apply_masks(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` with the tokens a row's bitmask forbids set to -inf (one op over the masked rows).

    The mask is added as a bias of 0 or -inf, looked up 8 tokens at a time from each byte (bit i of
    word w is token 32 w + i, little-endian bytes): on CPU the lookup and an add cost well under
    half of unpacking the bits and a masked_fill, whose bool-mask kernel is slow. Allowed logits
    keep their value (x + 0 == x; a -0.0 becomes 0.0, which compares and exponentiates the same)."""
    vocab = logits.shape[1]
    bytes_ = bitmask.numpy().view(np.uint8)
    bias = torch.from_numpy(_BYTE_TO_BIAS[bytes_].reshape(bytes_.shape[0], -1)[:, :vocab]).to(logits.device)
    if rows.numel() == logits.shape[0] and bool((rows == torch.arange(len(rows), device=rows.device)).all()):
        return logits.float() + bias  # every row masked: one op
    out = logits.float().clone()
    out[rows] = out[rows] + bias
    return out
