"""Conditional disaggregation: when a decode worker runs a prompt itself instead of shipping it.

Shipping a prompt to a prefill worker costs a Prefill round trip, a handshake, page reservations and
a KV transfer; for a short prompt that costs more than the forward pass it saves the decode batch,
and when no prefill worker can take it the request would otherwise fail. With
`--conditional-disaggregation` a decode worker runs the prompt locally (in its own engine, which
batches the prompt's chunks with the running decode batch like a colocated worker) when, in this
order:

1. `no_prefill`: the request names no prefill worker (the gateway routes a request to a decode
   worker that advertises local prefill when no prefill worker is healthy);
2. `short_prompt`: the prompt has at most `--local-prefill-max-tokens` tokens;
3. `prefill_queue`: this decode worker already has `--local-prefill-max-prefill-queue` Prefill calls
   open on the chosen prefill worker (0 = never): its queue is long, so waiting for it costs more.

Otherwise (and always without the flag) the prompt goes to the prefill worker. Either way the output
is the same: both paths run the same chunked prefill over the same weights, and sampling is
seeded per token, not per worker. `pdserve:local_prefill_requests_total{reason}` counts each rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field

NO_PREFILL = "no_prefill"
SHORT_PROMPT = "short_prompt"
PREFILL_QUEUE = "prefill_queue"
REASONS = (NO_PREFILL, SHORT_PROMPT, PREFILL_QUEUE)


@dataclass(frozen=True)
class LocalPrefillRule:
    """The decision above; `enabled=False` always ships the prompt (the plain PD behaviour).

    Nested in WorkerConfig, whose flags these fields are (the worker's rule is enabled on a decode
    worker only: WorkerConfig.local_prefill_rule)."""

    enabled: bool = field(default=False, metadata={"flags": ("--conditional-disaggregation",), "help": (
        "decode: run a prompt on this worker instead of a prefill worker when that is cheaper: no prefill "
        "worker given, a prompt of at most --local-prefill-max-tokens, or the prefill's queue at "
        "--local-prefill-max-prefill-queue (services/worker/local_prefill.py)")})
    max_tokens: int = field(default=256, metadata={"flags": ("--local-prefill-max-tokens",), "help": (
        "decode, with --conditional-disaggregation: prompts of at most this many tokens run locally")})
    max_prefill_queue: int = field(default=0, metadata={"flags": ("--local-prefill-max-prefill-queue",), "help": (
        "decode, with --conditional-disaggregation: run locally when this worker already has this many "
        "Prefill calls open on the chosen prefill worker (0 = never)")})

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise ValueError(f"--local-prefill-max-tokens must be >= 0, got {self.max_tokens}")
        if self.max_prefill_queue < 0:
            raise ValueError(f"--local-prefill-max-prefill-queue must be >= 0, got {self.max_prefill_queue}")

    def reason(self, prompt_tokens: int, prefill_address: str, open_on_prefill: int) -> str | None:
        """Why this request runs here (one of REASONS), or None: ship it to `prefill_address`.
        `open_on_prefill`: Prefill calls this worker has open on that prefill now."""
        if not self.enabled:
            return None
        if not prefill_address:
            return NO_PREFILL
        if prompt_tokens <= self.max_tokens:
            return SHORT_PROMPT
        if self.max_prefill_queue and open_on_prefill >= self.max_prefill_queue:
            return PREFILL_QUEUE
        return None
