"""WorkerConfig: everything a prefill, decode or colocated worker is started with.

Flags are generated from these fields (services.common.config_flags), spelled as in SGLang's
`launch_server` wherever they mean the same thing (`--model-path`, `--disaggregation-mode`,
`--disaggregation-transfer-backend`, `--mem-fraction-static`, ...). PD timeouts default from the
PDSERVE_DISAGGREGATION_* environment knobs (pdserve.envs), read once when the parser is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from engine.config import EngineConfig
from engine.models.config import ModelConfig
from engine.tp.shard import check_tp_size
from pdserve import envs
from services.common.security import GrpcSecurity
from services.decode.local_prefill import LocalPrefillRule

MODES = ("prefill", "decode", "null")
BACKENDS = ("mooncake", "nixl", "ucx", "fake")


def _help(text: str) -> dict:
    return {"help": text}


@dataclass(frozen=True)
class WorkerConfig:
    """Flags of `pdserve launch-server`. `engine_config()` derives the engine's own config."""

    model_path: str = field(default="", metadata=_help("HF-format checkpoint folder (local path)"))
    served_model_name: str | None = field(default=None, metadata={
        "help": "model name clients use; default: the checkpoint folder's name",
        "flags": ("--served-model-name", "--model-name")})
    disaggregation_mode: str = field(default="null", metadata=_help(
        "prefill | decode | null (null = colocated: one worker runs both phases)"))
    disaggregation_transfer_backend: str = field(default="mooncake", metadata=_help(
        "KV transfer engine: mooncake | nixl | ucx | fake (fake moves nothing: control-plane tests)"))
    disaggregation_ib_device: str | None = field(default=None, metadata=_help(
        "RDMA device(s) for mooncake, comma-separated; unset = TCP"))
    host: str = field(default="127.0.0.1", metadata=_help("address the gRPC server and transfer engine bind"))
    port: int = field(default=30000, metadata=_help("gRPC port; 0 picks a free port"))
    metrics_port: int = field(default=0, metadata=_help("Prometheus /metrics port; 0 picks a free port"))
    bootstrap: str | None = field(default=None, metadata=_help(
        "HOST:PORT of the bootstrap registry; unset = do not register"))
    tp_size: int = field(default=1, metadata=_help(
        "tensor-parallel ranks: this process (rank 0: gRPC, scheduler) starts tp_size - 1 more, each "
        "holding 1/tp_size of the attention heads, KV heads and MLP columns (must divide them)"))
    base_gpu_id: int = field(default=0, metadata=_help("first GPU index this worker uses (CUDA only)"))
    device: str = field(default="auto", metadata=_help("auto | cpu | cuda"))
    dtype: str = field(default="auto", metadata=_help("auto | float32 | bfloat16 | float16"))
    page_size: int = field(default=16, metadata=_help("tokens per KV page"))
    num_pages: int | None = field(default=None, metadata=_help("KV pages; unset = --mem-fraction-static"))
    mem_fraction_static: float = field(default=0.8, metadata=_help(
        "fraction of free memory given to the KV pool when --num-pages is unset"))
    max_running_requests: int = field(default=64, metadata=_help("largest decode batch"))
    chunked_prefill_size: int = field(default=512, metadata=_help("prompt tokens per forward pass"))
    num_threads: int | None = field(default=None, metadata=_help("torch CPU threads; unset = torch default"))
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
    conditional_disaggregation: bool = field(default=False, metadata=_help(
        "decode: run a prompt on this worker instead of a prefill worker when that is cheaper: no "
        "prefill worker given, a prompt of at most --local-prefill-max-tokens, or the prefill's queue "
        "at --local-prefill-max-prefill-queue (services/decode/local_prefill.py)"))
    local_prefill_max_tokens: int = field(default=256, metadata=_help(
        "decode, with --conditional-disaggregation: prompts of at most this many tokens run locally"))
    local_prefill_max_prefill_queue: int = field(default=0, metadata=_help(
        "decode, with --conditional-disaggregation: run locally when this worker already has this many "
        "Prefill calls open on the chosen prefill worker (0 = never)"))
    disable_radix_cache: bool = field(default=False, metadata=_help(
        "turn the prefix cache off (SGLang's flag name): every prompt is computed in full, a decode "
        "worker reuses none of its cached pages, and no KV events are published"))
    decode_log_interval: float = field(default=5.0, metadata=_help(
        "seconds between 'Decode batch' log lines while the worker is busy (0 = off)"))
    grace_period: float = field(default=5.0, metadata=_help("seconds in-flight RPCs get on SIGTERM"))
    security: GrpcSecurity = field(default_factory=GrpcSecurity)

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("--model-path is required")
        if not Path(self.model_path, "config.json").is_file():
            raise ValueError(f"--model-path {self.model_path!r} has no config.json")
        if self.disaggregation_mode not in MODES:
            raise ValueError(f"--disaggregation-mode must be one of {MODES}, got {self.disaggregation_mode!r}")
        if self.disaggregation_transfer_backend not in BACKENDS:
            raise ValueError(f"--disaggregation-transfer-backend must be one of {BACKENDS}, "
                             f"got {self.disaggregation_transfer_backend!r}")
        self.local_prefill_rule()  # refuses negative thresholds
        if self.tp_size < 1:
            raise ValueError(f"--tp-size must be at least 1, got {self.tp_size}")
        if self.tp_size > 1:
            check_tp_size(self.tp_size, ModelConfig.from_dir(self.model_path))

    @property
    def role(self) -> str:
        return {"prefill": "prefill", "decode": "decode", "null": "colocated"}[self.disaggregation_mode]

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_path).resolve().name

    def local_prefill_rule(self) -> LocalPrefillRule:
        """Decode only: when a prompt runs here instead of on a prefill worker."""
        return LocalPrefillRule(enabled=self.conditional_disaggregation and self.disaggregation_mode == "decode",
                                max_tokens=self.local_prefill_max_tokens,
                                max_prefill_queue=self.local_prefill_max_prefill_queue)

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return f"cuda:{self.base_gpu_id}" if torch.cuda.is_available() else "cpu"

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model_path=self.model_path, dtype=self.dtype, device=self.resolved_device(),
            page_size=self.page_size, num_pages=self.num_pages,
            mem_fraction_static=self.mem_fraction_static,
            max_running_requests=self.max_running_requests,
            chunked_prefill_size=self.chunked_prefill_size, num_threads=self.num_threads, tp_size=self.tp_size,
            disable_radix_cache=self.disable_radix_cache)
