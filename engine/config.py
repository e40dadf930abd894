"""EngineConfig: every setting of one in-process engine, in one frozen dataclass.

Each setting, its default and its help text are written here once. Commands turn the fields into
flags with pdserve.config_flags (`pdserve generate` takes them all; a worker nests this config in
its own, so `pdserve launch-server` takes them with the same spelling and defaults).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.speculative.config import SpeculativeConfig
from engine.tp.topology import Topology
from pdserve import envs


def _help(text: str) -> dict:
    return {"help": text}


@dataclass(frozen=True)
class EngineConfig:
    """How to load and run a model. Services compose this into their own configs.

    KV memory: `num_pages` if given; else `max_total_tokens` tokens if given; else
    `mem_fraction_static` of the memory free after loading the weights (on CPU: psutil's
    available memory, capped at `cpu_kv_cap_gib` because the host is shared with everything else;
    on CUDA: torch.cuda.mem_get_info).
    """

    model_path: str = field(metadata=_help("HF checkpoint folder (config.json, *.safetensors, tokenizer)"))
    dtype: str = field(default="auto", metadata=_help(
        "auto | float32 | bfloat16 | float16 (auto: the checkpoint's dtype)"))
    device: str = field(default="cpu", metadata=_help(
        "cpu, cuda or cuda:N; a worker also takes auto (its default): cuda:<--base-gpu-id> when CUDA is "
        "available, else cpu"))
    page_size: int = field(default=16, metadata=_help("tokens per KV page"))
    num_pages: int | None = field(default=None, metadata=_help(
        "KV pages; unset = sized from free memory (--mem-fraction-static)"))
    max_total_tokens: int | None = field(default=None, metadata=_help(
        "KV capacity in tokens (instead of --num-pages)"))
    mem_fraction_static: float = field(default=0.8, metadata=_help(
        "fraction of the memory free after loading the weights given to the KV pool when --num-pages is "
        "unset"))
    cpu_kv_cap_gib: float = field(default=2.0, metadata=_help(
        "upper bound of the CPU KV pool when sized from free memory"))
    max_running_requests: int = field(default=64, metadata=_help(
        "most requests in the running (decode) batch"))
    chunked_prefill_size: int = field(default=512, metadata=_help(
        "prompt tokens per forward pass (a longer prompt spans several steps)"))
    num_threads: int | None = field(default=None, metadata=_help(
        "torch CPU threads; unset = torch's default"))
    cpu_kernels: str = field(default="auto", metadata=_help(
        "fused C++ CPU kernels (engine.models.layer_ops) built by `make setup`: auto (if built), on "
        "(required) or off"))
    tp_size: int = field(default=1, metadata={"flags": ("--tp-size", "--tp"), "help": (
        "tensor-parallel ranks, one process each: rank 0 (this process: scheduler, and a worker's gRPC) "
        "starts tp_size - 1 more, each holding 1/tp_size of the attention heads, KV heads and MLP columns "
        "(must divide them); 1 = no collectives at all")})
    pp_size: int = field(default=1, metadata={"flags": ("--pp-size", "--pipeline-parallel-size"), "help": (
        "pipeline stages: the layers split into pp_size consecutive blocks, each on its own tp_size ranks "
        "(tp_size * pp_size ranks in all), activations passed stage to stage")})
    dp_size: int = field(default=1, metadata={"flags": ("--dp-size", "--data-parallel-size"), "help": (
        "with --enable-dp-attention: attention data-parallel groups inside the tp_size ranks, each with its "
        "own requests, batch and KV pool (must divide --tp-size); the MLP/MoE layers still span all tp_size "
        "ranks")})
    enable_dp_attention: bool = field(default=False, metadata=_help(
        "data-parallel attention over --dp-size groups (SGLang's flag); --dp-size > 1 requires it"))
    ep_size: int = field(default=1, metadata={
        "flags": ("--ep-size", "--ep", "--expert-parallel-size"),
        "help": ("expert parallelism: experts split into ep_size blocks over the tp_size ranks (must divide "
                 "--tp-size), tokens dispatched to their experts' ranks and combined with an all-to-all")})
    moe_a2a_backend: str = field(default="none", metadata=_help(
        "none | deepep | mooncake: the all-to-all library of expert parallelism (deepep and mooncake set "
        "--ep-size to --tp-size, as SGLang); where the library or its hardware is missing, "
        "torch.distributed's all-to-all runs instead and the worker says so at start (identical output, only "
        "speed differs)"))
    elastic_ep_backend: str = field(default="none", metadata=_help(
        "none | mooncake: accepted so the seeds' command lines run; an EP rank that dies takes its worker "
        "down (see docs/parallelism.md, Expert parallelism)"))
    mooncake_ib_device: str | None = field(default=None, metadata=_help(
        "RDMA device(s) of Mooncake's expert-parallel all-to-all (used where that backend runs)"))
    nnodes: int = field(default=1, metadata=_help(
        "nodes this worker's tp_size * pp_size ranks are spread over (each runs as many); node 0 runs the "
        "scheduler and the gRPC endpoint, the others only ranks"))
    node_rank: int = field(default=0, metadata=_help("this node's index, 0..nnodes-1"))
    dist_init_addr: str | None = field(default=None, metadata=_help(
        "HOST:PORT where node 0 listens for the other nodes' ranks to join (required with --nnodes > 1; "
        "unset on one node: a free loopback port)"))
    dist_timeout: float = field(default=300.0, metadata=_help(
        "seconds to wait for every node's ranks to join, and for one collective"))
    trust_remote_code: bool = field(default=False, metadata=_help(
        "accepted so that SGLang command lines run unchanged, and ignored: pdserve never executes code from "
        "a checkpoint folder (it reads config.json, *.safetensors and the tokenizer files as data, and "
        "refuses an architecture it does not implement, naming the supported ones)"))
    disable_radix_cache: bool = field(default=False, metadata=_help(
        "turn the prefix cache off (SGLang's flag name): every prompt is computed in full, a decode worker "
        "reuses none of its cached pages, and no KV events are published"))
    enable_hierarchical_cache: bool = field(default=False, metadata=_help(
        "write full KV pages through to a cluster-wide store and, on a local prefix-cache miss, fetch the "
        "longest run of leading pages it holds (SGLang's flag; libkv/store/). Needs the prefix cache, "
        "--tp-size 1, --pp-size 1 and no DP attention"))
    hicache_storage_backend: str = field(default="mooncake", metadata=_help(
        "the store of --enable-hierarchical-cache: mooncake (Mooncake Store)"))
    hicache_mooncake_master: str = field(
        default_factory=lambda: envs.HICACHE_MOONCAKE_MASTER.get() or envs.MOONCAKE_MASTER.get(),
        metadata=_help("the Mooncake Store master, HOST:PORT (default: PDSERVE_HICACHE_MOONCAKE_MASTER, "
                       "else MOONCAKE_MASTER)"))
    hicache_local_host: str = field(default="127.0.0.1", metadata=_help(
        "the address other Mooncake Store clients reach this process's segment at (a worker sets it from "
        "its --host)"))
    hicache_mooncake_segment_mb: int = field(default=256, metadata=_help(
        "MiB of host memory this worker lends to Mooncake Store (the store is the sum of its clients' "
        "segments; an entry lives in one of them)"))
    hicache_timeout: float = field(default=0.5, metadata=_help(
        "seconds one store call may take; past it the call fails and the store counts as down until a "
        "probe answers (requests are computed without it meanwhile)"))
    hicache_write_queue_pages: int = field(default=256, metadata=_help(
        "pages waiting to be written to the store at most; pages offered beyond it are dropped (counted), "
        "never waited for"))
    disable_cuda_graph: bool = field(default=False, metadata=_help(
        "run every decode step eagerly (SGLang's flag): no CUDA graphs on a GPU, and on CPU no padded "
        "replay"))
    cuda_graph_max_bs: int | None = field(default=None, metadata=_help(
        "the largest decode batch run as a CUDA graph (SGLang's flag); a larger one runs eagerly. Unset: "
        "--max-running-requests. On CPU, setting it (or --cuda-graph-bs) runs decode steps as the same "
        "padded replay over static buffers, without graphs"))
    cuda_graph_bs: tuple[int, ...] = field(default=(), metadata=_help(
        "the decode batch sizes to capture (SGLang's flag); a batch runs as the next size up. Unset: 1, "
        "2, 4, 8 and every multiple of 8 up to --cuda-graph-max-bs"))
    language_only: bool = field(default=False, metadata=_help(
        "a vision-language model without its vision tower (SGLang's flag, EPD): the image embeddings of each "
        "request come from an encoder service (--encoder-only workers, found in the registry or at "
        "--encoder-urls)"))
    engine_kind: str = field(default="model", metadata={"flags": ("--engine",), "help": (
        "model | sim: sim replaces the model's forward pass by a timing model (engine/sim/: step time from "
        "batch size and tokens, tokens a deterministic function of the context, a small KV layout of its "
        "own); everything else (scheduler, KV pool, prefix cache, PD transfer) is the real worker's. Reads "
        "only config.json and the tokenizer from --model-path, never weights")})
    sim_profile: str | None = field(default=None, metadata=_help(
        "with --engine sim: a JSON step-time table ({\"decode_ms\": [[batch, ms], ...], \"prefill_ms\": "
        "[[tokens, ms], ...]}); unset: the built-in one, an H100 serving a 4B model (engine/sim/profile.py)"))
    enable_lora: bool = field(default=False, metadata=_help(
        "serve LoRA adapters over the base model (SGLang's flag; engine.lora): requests pick one by name"))
    lora_paths: tuple[str, ...] = field(default=(), metadata=_help(
        "PEFT adapter folders to load at start, NAME=PATH (or PATH, named by itself)"))
    max_loras_per_batch: int = field(default=8, metadata=_help(
        "LoRA slots: the most adapters one step mixes, and the adapters kept in the model's weights"))
    max_lora_rank: int = field(default=16, metadata=_help("the largest LoRA rank an adapter may have"))
    lora_target_modules: tuple[str, ...] = field(default=(), metadata=_help(
        "the projections adapters may target (q_proj k_proj v_proj o_proj gate_proj up_proj down_proj; "
        "MLA models: q_a_proj q_b_proj kv_a_proj_with_mqa; default all of them): fewer cost less per step"))
    lora_resolver_dir: str = field(default="", metadata=_help(
        "a directory of PEFT adapter folders: an adapter no worker holds is loaded from the folder of its "
        "name when a request asks for it (vLLM's filesystem LoRA resolver); unset: never"))
    profile_prefill: bool = field(default_factory=envs.PROFILE_PREFILL.get, metadata=_help(
        "record a torch profiler trace of the first --profile-steps prefill steps (a step with any prompt "
        "chunk) into --profile-dir, for https://ui.perfetto.dev (SGLang's flag)"))
    profile_decode: bool = field(default_factory=envs.PROFILE_DECODE.get, metadata=_help(
        "the same for decode-only steps (SGLang's flag); with --profile-prefill, steps of both kinds count"))
    profile_steps: int = field(default_factory=envs.PROFILE_STEPS.get, metadata=_help(
        "steps of the profiled kind(s) one trace records; profiling is off afterwards"))
    profile_dir: str = field(default_factory=envs.PROFILE_DIR.get, metadata=_help(
        "folder the trace file (KIND-PID-TIME.trace.json) is written to, created if missing"))
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self) -> None:
        if isinstance(self.speculative, dict):  # sent to a TP rank as JSON (engine.tp.ranks): rebuilt here
            object.__setattr__(self, "speculative", SpeculativeConfig(**self.speculative))
        for name, value in vars(self).items():  # JSON, as above, has no tuples: the list fields are tuples
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        if not 0.0 < self.mem_fraction_static <= 1.0:
            raise ValueError(f"--mem-fraction-static must be in (0, 1], got {self.mem_fraction_static}")
        if self.page_size <= 0:
            raise ValueError(f"--page-size must be positive, got {self.page_size}")
        if self.num_pages is not None and self.num_pages <= 0:
            raise ValueError(f"--num-pages must be positive, got {self.num_pages}")
        if self.profile_steps < 1:
            raise ValueError(f"--profile-steps must be at least 1, got {self.profile_steps}")
        if self.tp_size < 1:
            raise ValueError(f"--tp-size must be at least 1, got {self.tp_size}")
        if self.moe_a2a_backend not in ("none", "deepep", "mooncake"):
            raise ValueError("--moe-a2a-backend must be none, deepep or mooncake, got "
                             f"{self.moe_a2a_backend!r}")
        if self.elastic_ep_backend not in ("none", "mooncake"):
            raise ValueError("--elastic-ep-backend must be none or mooncake, got "
                             f"{self.elastic_ep_backend!r}")
        if self.dp_size > 1 and not self.enable_dp_attention:
            raise ValueError(f"--dp-size {self.dp_size} needs --enable-dp-attention (whole-model data "
                             "parallelism is more workers behind the gateway: start --dp-size of them)")
        if self.enable_dp_attention and self.pp_size > 1:
            raise ValueError("--enable-dp-attention with --pp-size > 1 is not supported: DP attention groups "
                             "split one stage's ranks")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError(f"--nnodes {self.nnodes} needs --dist-init-addr HOST:PORT (node 0's address, "
                             "where the other nodes' ranks join)")
        if self.enable_hierarchical_cache:
            self._check_hicache()
        if self.speculative.enabled and self.enable_dp_attention:
            raise ValueError("--speculative-algorithm with --enable-dp-attention is not supported: a DP "
                             "step gathers one logits row per request")
        self.topology()  # raises TopologyError naming what does not fit
        if self.engine_kind not in ("model", "sim"):
            raise ValueError(f"--engine must be model or sim, got {self.engine_kind!r}")
        if self.sim_profile is not None and self.engine_kind != "sim":
            raise ValueError("--sim-profile is for --engine sim")
        if self.engine_kind == "sim" and (self.world_size > 1 or self.enable_dp_attention
                                          or self.enable_hierarchical_cache or self.nnodes > 1):
            raise ValueError("--engine sim simulates one rank: no --tp-size/--pp-size > 1, "
                             "--enable-dp-attention, --nnodes or --enable-hierarchical-cache")
        if self.cpu_kernels not in ("auto", "on", "off"):
            raise ValueError(f"--cpu-kernels must be auto, on or off, got {self.cpu_kernels!r}")

    def _check_hicache(self) -> None:
        if self.hicache_storage_backend != "mooncake":
            raise ValueError("--hicache-storage-backend must be mooncake, got "
                             f"{self.hicache_storage_backend!r}")
        if not self.hicache_mooncake_master:
            raise ValueError("--enable-hierarchical-cache needs the Mooncake Store master: "
                             "--hicache-mooncake-master HOST:PORT (or PDSERVE_HICACHE_MOONCAKE_MASTER, "
                             "MOONCAKE_MASTER)")
        if self.disable_radix_cache:
            raise ValueError("--enable-hierarchical-cache needs the prefix cache: drop --disable-radix-cache")
        if self.tp_size > 1 or self.pp_size > 1 or self.enable_dp_attention or self.nnodes > 1:
            raise ValueError("--enable-hierarchical-cache runs with one rank for now (--tp-size 1, --pp-size "
                             "1, no --enable-dp-attention): each rank's pages would need a store entry of "
                             "their own")
        if (self.hicache_timeout <= 0 or self.hicache_write_queue_pages < 1
                or self.hicache_mooncake_segment_mb < 1):
            raise ValueError("--hicache-timeout, --hicache-write-queue-pages and "
                             "--hicache-mooncake-segment-mb must be positive")

    def topology(self) -> Topology:
        """The rank layout these flags ask for. `--moe-a2a-backend deepep|mooncake` implies expert
        parallelism over all TP ranks, as in SGLang."""
        ep_size = self.ep_size
        if self.moe_a2a_backend != "none" and ep_size == 1:
            ep_size = self.tp_size
        return Topology(tp_size=self.tp_size, pp_size=self.pp_size,
                        dp_size=self.dp_size if self.enable_dp_attention else 1, ep_size=ep_size,
                        nnodes=self.nnodes, node_rank=self.node_rank)

    @property
    def world_size(self) -> int:
        """Ranks of one worker: tp_size * pp_size."""
        return self.tp_size * self.pp_size
