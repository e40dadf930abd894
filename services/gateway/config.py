"""GatewayConfig: everything `pdserve launch-router` is started with, defaults in one place.

Scalar flags are generated from GatewayConfig's fields (pdserve.config_flags). The worker
lists of the seeds' router (`--prefill URL [BOOTSTRAP_PORT]`, `--decode URL`, `--worker URL`,
repeatable) are parsed into StaticWorker entries by `static_workers_from_args`.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from pdserve import envs
from services.common.keepalive import MAX_MESSAGE_BYTES, MESSAGE_ROOM_BYTES
from services.common.security import GrpcSecurity
from services.common.text_parsers import TextParsers
from services.gateway.addresses import grpc_address
from services.gateway.media_limits import parse_domains, parse_limit_mm_per_prompt

POLICIES = ("round_robin", "random", "power_of_two", "cache_aware")
ROLES = ("prefill", "decode", "colocated")


def _help(text: str) -> dict:
    return {"help": text}


@dataclass(frozen=True)
class StaticWorker:
    """A worker named on the command line (not discovered): its role and gRPC `host:port`."""

    role: str
    address: str

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"worker role must be one of {ROLES}, got {self.role!r}")


@dataclass(frozen=True)
class GatewayConfig:
    """Flags of `pdserve launch-router` (the scalar ones; worker lists are StaticWorker)."""

    model_path: str = field(default="", metadata=_help(
        "checkpoint folder the workers serve: the gateway reads its tokenizer.json, chat template and "
        "config.json (context length) from it; unset: the gateway takes these files and the served "
        "name from the workers (GetModelInfo) and routes only to workers that report the same"))
    model_name: str | None = field(default=None, metadata={
        "help": "served model name; default: the checkpoint folder's name (what workers default to), or "
                "without --model-path the name the workers report",
        "flags": ("--served-model-name", "--model-name")})
    model_info_timeout: float = field(default=600.0, metadata=_help(
        "without --model-path: seconds to wait at start-up for a worker to report its model"))
    host: str = field(default="127.0.0.1", metadata=_help("HTTP address to bind"))
    port: int = field(default=8000, metadata=_help("HTTP port; 0 picks a free port"))
    bootstrap: str | None = field(default=None, metadata=_help(
        "HOST:PORT of the bootstrap registry to discover workers from (joins and leaves apply live); "
        "several comma-separated for registries sharing an etcd store (fails over between them)"))
    pd_disaggregation: bool = field(default=False, metadata=_help(
        "accepted for compatibility with the seeds' router; PD routing is on whenever prefill and "
        "decode workers are known"))
    policy: str = field(default="cache_aware", metadata=_help(f"routing policy: {' | '.join(POLICIES)}"))
    prefill_policy: str | None = field(default=None, metadata=_help(
        "policy for prefill workers; default --policy"))
    decode_policy: str | None = field(default=None, metadata=_help(
        "policy for decode and colocated workers; default --policy"))
    max_attempts: int = field(default=3, metadata=_help(
        "tries per request on retryable failures before any token reached the client"))
    retry_backoff: float = field(default=0.05, metadata=_help(
        "seconds before the first retry; doubles each time"))
    first_token_timeout: float = field(default=300.0, metadata=_help(
        "seconds to wait for a request's first token before trying another pair"))
    migration_limit: int = field(default_factory=envs.MIGRATION_LIMIT.get, metadata=_help(
        "times one generation may move to another (prefill, decode) pair when its decode worker dies, "
        "freezes or is cut off after the first token: it continues from the tokens already sent, the "
        "client sees no error; 0: no migration (the stream ends with an error event); default: "
        "$PDSERVE_MIGRATION_LIMIT, else 3"))
    breaker_failures: int = field(default=3, metadata=_help(
        "consecutive failures that open a worker's circuit (it gets no traffic)"))
    breaker_cooldown: float = field(default=5.0, metadata=_help(
        "seconds an open circuit waits before a health probe or trial request may close it"))
    cache_threshold: float = field(default=0.5, metadata=_help(
        "cache_aware: least fraction of the prompt cached on the best worker for prefix routing"))
    balance_abs_threshold: int = field(default=32, metadata=_help(
        "cache_aware: in-flight spread (max - min) above which load wins over cache"))
    balance_rel_threshold: float = field(default=1.5, metadata=_help(
        "cache_aware: and max > this x min, for load to win over cache"))
    max_tree_tokens: int = field(default=1 << 20, metadata=_help(
        "cache_aware: prefix-tree nodes (tokens) kept per worker; least recently used prompts go first"))
    abort_timeout: float = field(default=2.0, metadata=_help("seconds an explicit Worker.Abort may take"))
    graceful_shutdown: float = field(default=5.0, metadata=_help(
        "seconds open requests get on SIGINT/SIGTERM"))
    # -- security and limits (docs/security.md)
    api_key: str | None = field(default=None, repr=False, metadata=_help(
        "API key clients must send as `Authorization: Bearer KEY` on every route but /health (and /metrics, "
        "see --metrics-require-api-key); default: $PDSERVE_API_KEY, which keeps the key out of `ps`; unset: "
        "no key"))
    metrics_require_api_key: bool = field(default=False, metadata=_help(
        "with an API key set, /metrics asks for it too"))
    max_request_body_bytes: int = field(default=2 << 20, metadata=_help(
        "largest request body accepted; a larger one is refused with 413 before it is read (parsing and "
        "checking a body holds the event loop: about 0.25 s for 2 MiB of token ids)"))
    body_read_timeout: float = field(default=30.0, metadata=_help(
        "seconds a client may take to send a request body; a slower one is refused with 408"))
    max_generations_per_request: int = field(default=256, metadata=_help(
        "most generations one request may start (prompts x n, or x best_of); more is refused with 400"))
    max_concurrent_requests: int = field(default=256, metadata=_help(
        "admission control, per model: generations running through the gateway at once (a request holds "
        "one slot per generation); more wait in a queue"))
    queue_size: int = field(default=128, metadata=_help(
        "admission control, per model: requests that may wait for a slot; beyond that 429"))
    queue_timeout: float = field(default=60.0, metadata=_help(
        "admission control: seconds a request may wait for a slot before it is refused with 429"))
    retry_after: int = field(default=1, metadata=_help(
        "seconds a 429 answer asks the client to wait (Retry-After)"))
    # -- images (services/gateway/images.py; vLLM's flag names where it has one)
    allowed_media_domains: str = field(default="", metadata=_help(
        "hosts whose http(s) image URLs the gateway fetches (exact host names, several as separate values or "
        "comma-separated; each redirect's host must be one too); none: remote image URLs are "
        "refused with 400"))
    allow_private_media_addresses: bool = field(default=False, metadata=_help(
        "fetch media URLs of --allowed-media-domains also when their host resolves to a loopback, private, "
        "link-local or other non-public address (off: such a URL is a 400, checked at the address "
        "connected to)"))
    media_fetch_timeout: float = field(default=10.0, metadata=_help(
        "seconds all of one request's remote image fetches may take together; a slower one is "
        "refused with 400"))
    limit_mm_per_prompt: str = field(default='{"image": 16}', metadata=_help(
        'images per request, as vLLM\'s JSON {"image": N} or N; more is refused with 400 (the worker '
        "takes 16 at most)"))
    max_image_bytes: int = field(default=20 << 20, metadata=_help(
        "largest image (its encoded bytes, after base64 decoding or fetching); a larger one is "
        "refused with 413"))
    max_request_image_bytes: int = field(default=32 << 20, metadata=_help(
        "most image bytes in one request, all images together; more is refused with 413. A vision-language "
        "model's request body limit is --max-request-body-bytes plus these bytes as base64 (a body of 1 MiB "
        "or more is parsed and its images decoded off the event loop: --body-parse-processes)"))
    workers: int = field(default=1, metadata=_help(
        "gateway processes serving this port (services/gateway/processes.py): each a whole gateway with its "
        "own view of the registry, KV events and routing state; the kernel spreads connections over them"))
    tokenizer_threads: int = field(default=2, metadata=_help(
        "threads that render chat templates and tokenize prompts, off the event loop"))
    body_parse_processes: int = field(default=2, metadata=_help(
        "processes that parse request bodies of 1 MiB or more and decode their base64 images, off the "
        "event loop (services/gateway/large_bodies.py); 0 parses every body on the event loop"))
    registry_rejoin_grace: float = field(default_factory=lambda: envs.HEARTBEAT_INTERVAL.get() * (
        envs.HEARTBEAT_MAX_FAILURE.get() + 1), metadata=_help(
        "seconds a worker stays routable after a restarted registry came back without it (workers "
        "register again within one heartbeat interval); default: heartbeat interval x (max failures + 1)"))
    enable_lora: bool = field(default=False, metadata=_help(
        "the workers serve LoRA adapters (--enable-lora): a `model` other than the base's names an adapter "
        "(as in vLLM), and /generate takes SGLang's `lora_path`; such a request goes only to workers and "
        "pairs the registry lists as holding the adapter (404 when none does)"))
    security: GrpcSecurity = field(default_factory=GrpcSecurity)
    # over the names the workers report (services.common.text_parsers)
    text_parsers: TextParsers = field(default_factory=TextParsers)

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"--workers must be at least 1, got {self.workers}")
        if self.model_path and not Path(self.model_path, "tokenizer.json").is_file():
            raise ValueError(f"--model-path {self.model_path!r} has no tokenizer.json")
        for flag, value in (("--policy", self.policy), ("--prefill-policy", self.prefill_policy),
                            ("--decode-policy", self.decode_policy)):
            if value is not None and value not in POLICIES:
                raise ValueError(f"{flag} must be one of {POLICIES}, got {value!r}")
        if self.max_attempts < 1:
            raise ValueError(f"--max-attempts must be >= 1, got {self.max_attempts}")
        if self.migration_limit < 0:
            raise ValueError(f"--migration-limit must be >= 0, got {self.migration_limit}")
        if self.breaker_failures < 1:
            raise ValueError(f"--breaker-failures must be >= 1, got {self.breaker_failures}")
        if self.api_key is not None and (not self.api_key.strip() or not self.api_key.isprintable()):
            raise ValueError("--api-key must be a non-empty printable string")
        for flag, number in (("--max-request-body-bytes", self.max_request_body_bytes),
                             ("--max-generations-per-request", self.max_generations_per_request),
                             ("--max-concurrent-requests", self.max_concurrent_requests),
                             ("--tokenizer-threads", self.tokenizer_threads),
                             ("--body-read-timeout", self.body_read_timeout),
                             ("--queue-timeout", self.queue_timeout),
                             ("--model-info-timeout", self.model_info_timeout)):
            if not number > 0:
                raise ValueError(f"{flag} must be > 0, got {number}")
        for flag, number in (("--max-image-bytes", self.max_image_bytes),
                             ("--max-request-image-bytes", self.max_request_image_bytes),
                             ("--media-fetch-timeout", self.media_fetch_timeout)):
            if not number > 0:
                raise ValueError(f"{flag} must be > 0, got {number}")
        if self.max_request_image_bytes > MAX_MESSAGE_BYTES - MESSAGE_ROOM_BYTES:
            raise ValueError("--max-request-image-bytes must be at most "
                             f"{MAX_MESSAGE_BYTES - MESSAGE_ROOM_BYTES} (a request's images travel to the "
                             f"workers in one gRPC message of at most {MAX_MESSAGE_BYTES} bytes), got "
                             f"{self.max_request_image_bytes}")
        parse_limit_mm_per_prompt(self.limit_mm_per_prompt)  # ValueError saying what is wrong
        parse_domains(self.allowed_media_domains)
        if self.queue_size < 0 or self.retry_after < 0:
            raise ValueError("--queue-size and --retry-after must be >= 0")
        if self.body_parse_processes < 0:
            raise ValueError(f"--body-parse-processes must be >= 0, got {self.body_parse_processes}")

    @property
    def served_model_name(self) -> str | None:
        """The name clients use; None until the workers tell it (no --model-path, no --served-model-name)."""
        if self.model_name:
            return self.model_name
        return Path(self.model_path).resolve().name if self.model_path else None

    @property
    def prefill_policy_name(self) -> str:
        return self.prefill_policy or self.policy

    @property
    def decode_policy_name(self) -> str:
        return self.decode_policy or self.policy


def with_env_api_key(config: GatewayConfig) -> GatewayConfig:
    """`config` with the API key from $PDSERVE_API_KEY when --api-key was not given (read once, at
    start-up; the flag's help never shows the variable's value)."""
    if config.api_key is None and envs.API_KEY.get():
        return dataclasses.replace(config, api_key=envs.API_KEY.get())
    return config


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """The seeds' repeatable worker flags."""
    parser.add_argument("--prefill", action="append", nargs="+", default=[], metavar="URL [BOOTSTRAP_PORT]",
                        help="a prefill worker's address (http://H:P, grpc://H:P or H:P); the optional "
                             "bootstrap port of the seeds' router is accepted and ignored (decode reaches "
                             "prefill at its gRPC address)")
    parser.add_argument("--decode", action="append", default=[], metavar="URL",
                        help="a decode worker's address")
    parser.add_argument("--worker", action="append", default=[], metavar="URL",
                        help="a colocated worker's address (it runs both phases)")


def take_list_forms(parser: argparse.ArgumentParser) -> None:
    """Let --allowed-media-domains (a generated string flag) take several values, as vLLM's does
    (`--allowed-media-domains a.com b.com`); `joined_list_flags` joins them into the field's string."""
    for action in parser._actions:
        if action.dest == "allowed_media_domains":
            action.nargs = "*"


def joined_list_flags(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with the values of a several-values flag joined by commas (what the field holds)."""
    if isinstance(args.allowed_media_domains, list):
        args.allowed_media_domains = ",".join(args.allowed_media_domains)
    return args


def static_workers_from_args(args: argparse.Namespace) -> tuple[StaticWorker, ...]:
    """StaticWorker entries from --prefill/--decode/--worker. Raises ValueError on a bad address."""
    workers = []
    for values in args.prefill:
        if len(values) > 2:
            raise ValueError(f"--prefill takes URL [BOOTSTRAP_PORT], got {values}")
        if len(values) == 2 and not values[1].isdigit() and values[1].lower() != "none":
            raise ValueError(f"--prefill {values[0]}: bootstrap port must be a number, got {values[1]!r}")
        workers.append(StaticWorker("prefill", grpc_address(values[0])))
    workers += [StaticWorker("decode", grpc_address(url)) for url in args.decode]
    workers += [StaticWorker("colocated", grpc_address(url)) for url in args.worker]
    return tuple(workers)
