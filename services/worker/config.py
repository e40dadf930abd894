"""WorkerConfig: everything a prefill, decode or colocated worker is started with.

Flags are generated from these fields (pdserve.config_flags), spelled as in SGLang's
`launch_server` wherever they mean the same thing (`--model-path`, `--disaggregation-mode`,
`--disaggregation-transfer-backend`, `--mem-fraction-static`, ...). The engine's settings are an
EngineConfig nested here (`config.engine.page_size`), so each has its default and help in one place;
likewise the gRPC server's (`config.server.port`), the conditional-disaggregation rule's
(`config.local_prefill`) and the security flags. PD timeouts default from the
PDSERVE_DISAGGREGATION_* environment knobs (pdserve.envs), read once when the parser is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from engine.config import EngineConfig
from engine.models.config import ModelConfig
from engine.tp.pipeline import check_pp_size
from engine.tp.shard import check_tp_size
from libkv.transfer import BACKEND_NAMES as BACKENDS
from pdserve import envs
from services.common.security import GrpcSecurity
from services.common.server_config import ServerConfig
from services.common.text_parsers import TextParsers
from services.worker.epd_config import EpdConfig

MODES = ("prefill", "decode", "null")
# EngineConfig settings `pdserve launch-server` has no flag for (they keep the engine's defaults).
_ENGINE_ONLY = ("max_total_tokens", "cpu_kv_cap_gib", "cpu_kernels", "hicache_local_host")


def _help(text: str) -> dict:
    return {"help": text}


# Why a decode worker runs a prompt itself (LocalPrefillRule.reason), in the order they are checked.
NO_PREFILL = "no_prefill"  # the request names no prefill worker (none was healthy at the gateway)
SHORT_PROMPT = "short_prompt"  # at most --local-prefill-max-tokens prompt tokens
PREFILL_QUEUE = "prefill_queue"  # --local-prefill-max-prefill-queue calls already open on that prefill
REASONS = (NO_PREFILL, SHORT_PROMPT, PREFILL_QUEUE)


@dataclass(frozen=True)
class LocalPrefillRule:
    """Conditional disaggregation: when a decode worker runs a prompt itself instead of shipping it
    to a prefill worker (`reason`). `enabled=False` always ships the prompt (the plain PD
    behaviour). Its fields are flags of WorkerConfig; the worker's rule is enabled on a decode
    worker only (WorkerConfig.local_prefill_rule).

    Why: shipping a prompt to a prefill worker costs a Prefill round trip, a handshake, page
    reservations and a KV transfer; for a short prompt that costs more than the forward pass it
    saves the decode batch, and when no prefill worker can take it the request would otherwise
    fail. The local run batches the prompt's chunks with the running decode batch like a colocated
    worker, with the same output: both paths run the same chunked prefill over the same weights,
    and sampling is seeded per token, not per worker. `pdserve:local_prefill_requests_total{reason}`
    counts each of REASONS."""

    enabled: bool = field(default=False, metadata={"flags": ("--conditional-disaggregation",), "help": (
        "decode: run a prompt on this worker instead of a prefill worker when that is cheaper: no prefill "
        "worker given, a prompt of at most --local-prefill-max-tokens, or the prefill's queue at "
        "--local-prefill-max-prefill-queue")})
    max_tokens: int = field(default=256, metadata={"flags": ("--local-prefill-max-tokens",), "help": (
        "decode, with --conditional-disaggregation: prompts of at most this many tokens run locally")})
    max_prefill_queue: int = field(default=0, metadata={
        "flags": ("--local-prefill-max-prefill-queue",), "help": (
            "decode, with --conditional-disaggregation: run locally when this worker already has this "
            "many Prefill calls open on the chosen prefill worker (0 = never)")})

    def reason(self, prompt_tokens: int, prefill_address: str, open_on_prefill: int) -> str | None:
        """Why this request runs here (the first of REASONS that applies, in that order), or None:
        ship it to `prefill_address`. `open_on_prefill`: Prefill calls this worker has open on that
        prefill."""
        if not self.enabled:
            return None
        if not prefill_address:
            return NO_PREFILL
        if prompt_tokens <= self.max_tokens:
            return SHORT_PROMPT
        if self.max_prefill_queue and open_on_prefill >= self.max_prefill_queue:
            return PREFILL_QUEUE
        return None

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise ValueError(f"--local-prefill-max-tokens must be >= 0, got {self.max_tokens}")
        if self.max_prefill_queue < 0:
            raise ValueError(f"--local-prefill-max-prefill-queue must be >= 0, got {self.max_prefill_queue}")


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    """Flags of `pdserve launch-server`. `engine` is what the worker's engine is loaded with; its
    `device` may be "auto" on the command line (the default there), resolved here with base_gpu_id."""

    engine: EngineConfig = field(metadata={"defaults": {"device": "auto"}, "omit": _ENGINE_ONLY})
    served_model_name: str | None = field(default=None, metadata={
        "help": "model name clients use; default: the checkpoint folder's name",
        "flags": ("--served-model-name", "--model-name")})
    disaggregation_mode: str = field(default="null", metadata=_help(
        "prefill | decode | null (null = colocated: one worker runs both phases)"))
    disaggregation_transfer_backend: str = field(default="mooncake", metadata=_help(
        "KV transfer engine: mooncake | nixl | ucx | fake (fake moves nothing: control-plane tests)"))
    disaggregation_ib_device: str | None = field(default=None, metadata=_help(
        "RDMA device(s) for mooncake, comma-separated; unset = TCP"))
    server: ServerConfig = field(default_factory=lambda: ServerConfig(port=30000))
    bootstrap: str | None = field(default=None, metadata=_help(
        "HOST:PORT of the bootstrap registry; unset = do not register"))
    base_gpu_id: int = field(default=0, metadata=_help(
        "first GPU index this worker uses (--device auto on CUDA)"))
    bootstrap_timeout: float = field(default_factory=envs.BOOTSTRAP_TIMEOUT.get, metadata=_help(
        "prefill: seconds a request may wait for its decode-side handshake"))
    waiting_timeout: float = field(default_factory=envs.WAITING_TIMEOUT.get, metadata=_help(
        "decode: seconds a request may wait for free pages and then for its KV"))
    transfer_timeout: float = field(default_factory=envs.TRANSFER_TIMEOUT.get, metadata=_help(
        "seconds one KV write may take before the peer is declared dead"))
    transfer_thread_pool_size: int = field(default_factory=envs.THREAD_POOL_SIZE.get, metadata=_help(
        "prefill: threads issuing KV writes, shared by the transfer queues"))
    transfer_queue_size: int = field(default_factory=envs.QUEUE_SIZE.get, metadata=_help(
        "prefill: transfer queues; requests are sharded over them by room"))
    kv_checksum: bool = field(default=True, metadata=_help(
        "decode: ask prefill for a checksum of every KV page it writes and check the pages that "
        "arrived before the request joins the batch (a mismatch fails the request, retryable); "
        "always on for one-sided backends (mooncake, nixl), where the checksums also tell when a "
        "write has landed"))
    quarantine_timeout: float = field(default=900.0, metadata=_help(
        "decode: seconds the pages of a failed request wait for its prefill to confirm that no KV "
        "write can still land (a one-sided engine cannot recall a write) before they are freed anyway"))
    local_prefill: LocalPrefillRule = field(default_factory=LocalPrefillRule)
    stream_interval: int = field(default=1, metadata=_help(
        "tokens per streamed message after the first one (SGLang's flag): N > 1 sends N tokens per gRPC "
        "message and so per SSE chunk of the gateway, cutting their per-token cost; 1 = each step's tokens "
        "as soon as they are made"))
    image_drop_port: int = field(default=0, metadata=_help(
        "port of the image drop, where gateways upload a large request's images beside gRPC so the "
        "worker reads them without holding the GIL (services/common/image_drop.py); 0 = any free port, "
        "-1 = none (images travel inside Generate). Off under TLS: the images then travel in gRPC"))
    decode_log_interval: float = field(default=5.0, metadata=_help(
        "seconds between 'Decode batch' log lines while the worker is busy (0 = off)"))
    security: GrpcSecurity = field(default_factory=GrpcSecurity)
    epd: EpdConfig = field(default_factory=EpdConfig)
    text_parsers: TextParsers = field(default_factory=TextParsers)  # reported to gateways, not used here

    def __post_init__(self) -> None:
        if not Path(self.engine.model_path, "config.json").is_file():
            raise ValueError(f"--model-path {self.engine.model_path!r} has no config.json")
        if self.disaggregation_mode not in MODES:
            raise ValueError(f"--disaggregation-mode must be one of {MODES}, "
                             f"got {self.disaggregation_mode!r}")
        if self.disaggregation_transfer_backend not in BACKENDS:
            raise ValueError(f"--disaggregation-transfer-backend must be one of {BACKENDS}, "
                             f"got {self.disaggregation_transfer_backend!r}")
        if self.stream_interval < 1:
            raise ValueError(f"--stream-interval must be at least 1, got {self.stream_interval}")
        self._check_epd()
        if self.engine.tp_size > 1:
            check_tp_size(self.engine.tp_size, ModelConfig.from_dir(self.engine.model_path),
                          self.engine.topology().ep_size, self.engine.topology().attn_tp_size)
        if self.engine.pp_size > 1:
            check_pp_size(self.engine.topology(), ModelConfig.from_dir(self.engine.model_path).num_layers)
        if self.engine.device == "auto":
            object.__setattr__(self, "engine", replace(self.engine, device=self._auto_device()))

    def _check_epd(self) -> None:
        if not (self.epd.encoder_only or self.engine.language_only):
            return
        flag = "--encoder-only" if self.epd.encoder_only else "--language-only"
        if self.epd.encoder_only and self.engine.language_only:
            raise ValueError("--encoder-only and --language-only exclude each other")
        if not ModelConfig.from_dir(self.engine.model_path).is_multimodal:
            raise ValueError(f"{flag} needs a vision-language model; {self.engine.model_path} is text-only")
        if self.epd.encoder_only and self.disaggregation_mode != "null":
            raise ValueError("--encoder-only runs no prefill or decode: leave --disaggregation-mode unset")
        if self.engine.language_only and self.disaggregation_mode == "decode":
            raise ValueError("--language-only is for a worker that runs prompts (colocated or prefill), "
                             "not decode")

    def _auto_device(self) -> str:
        import torch

        return f"cuda:{self.base_gpu_id}" if torch.cuda.is_available() else "cpu"

    @property
    def role(self) -> str:
        if self.epd.encoder_only:
            return "encoder"
        return {"prefill": "prefill", "decode": "decode", "null": "colocated"}[self.disaggregation_mode]

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.engine.model_path).resolve().name

    def local_prefill_rule(self) -> LocalPrefillRule:
        """When a prompt runs here instead of on a prefill worker: never but on a decode worker."""
        return replace(self.local_prefill,
                       enabled=self.local_prefill.enabled and self.disaggregation_mode == "decode")
