"""`pdserve bench engine`: decode throughput of the engine against HF transformers `generate` and,
with `--peer-python`, vLLM's offline engine.

Every system gets the same checkpoint, the same equal-length random prompts (so HF's batch needs
no padding), greedy decoding with eos disabled, and the same thread count. Each runs in its
own child process (peak RSS per system); their rounds alternate so load changes on a shared
machine hit all alike. vLLM runs under the Python of another environment (`--peer-python`, one
with vLLM's CPU build; vLLM is never a dependency of pdserve) through tools/bench/peer_vllm.py,
its OpenMP threads bound to the first `--threads` cores as vLLM's CPU backend expects.

With `--speculative-algorithm`, pdserve runs twice in the same rounds, speculation off and on
(`pdserve_spec`), and the report gives spec-on over spec-off ratios; `--never-accepted-drafts` swaps
the drafter for one whose drafts the target never takes (the cost of a useless drafter), and
`--workload repeat` makes each prompt one short random run repeated (n-gram lookup finds matches in
it; whether drafts are accepted is up to the model's answers).

Decode tokens/s excludes prefill. pdserve: tokens emitted after the moment every request has its
first token, divided by the time from that moment to the last token (all those steps are pure
decode batches). HF: the time of generate(N) minus generate(1) on the same inputs, for the
B * (N - 1) tokens after the first; vLLM the same way, prefix caching off. Numbers are medians over
`--repeats` runs after a warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tools.bench.step_floor import step_floor

if TYPE_CHECKING:
    from tools.bench.engine_variants import Variant


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="HF checkpoint folder")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="weights and activations of both systems")
    parser.add_argument("--skip-hf", action="store_true", help="leave HF transformers out")
    parser.add_argument("--peer-python", default=None,
                        help="python of an environment with vLLM's CPU build: also measure vLLM's offline "
                             "engine")
    parser.add_argument("--cpu-kernels", choices=["auto", "on", "off"], default="auto",
                        help="pdserve's fused C++ CPU kernels (engine config cpu_kernels)")
    parser.add_argument("--cpu-isa", default=None,
                        help="kernel variants, comma-separated (avx512, avx2, portable: PDSERVE_CPU_ISA): "
                             "pdserve runs the first, each other one is measured beside it "
                             "(tools/bench/engine_variants.py)")
    parser.add_argument("--onednn-baselines", action="store_true",
                        help="also measure pdserve with its linears on oneDNN, in this dtype (the C++ bf16 "
                             "GEMM off) and in fp32")
    parser.add_argument("--tp-size", type=int, default=1,
                        help="pdserve's tensor-parallel ranks; --threads is shared out between them")
    parser.add_argument("--device", default="cpu",
                        help="cpu, cuda or cuda:N: where pdserve and HF run (vLLM picks its own)")
    parser.add_argument("--disable-cuda-graph", action="store_true",
                        help="pdserve runs every decode step eagerly (engine config disable_cuda_graph)")
    parser.add_argument("--cuda-graph-max-bs", type=int, default=None,
                        help="pdserve's largest graph batch (engine config; on CPU: the padded replay)")
    parser.add_argument("--cuda-graph-bs", type=int, nargs="+", default=(),
                        help="pdserve's graph batch sizes (engine config; on CPU: the padded replay)")
    parser.add_argument("--eager-baseline", action="store_true",
                        help="also run pdserve with --disable-cuda-graph, rounds alternating, and print the "
                             "step time with graphs (on CPU: the padded replay) over the eager one's")
    parser.add_argument("--lora-adapters", type=int, default=0,
                        help="also run pdserve with this many random LoRA adapters (rank --lora-rank, every "
                             "projection), the batch's requests spread over them round robin, and report its "
                             "decode tok/s over the base model's alone")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--speculative-algorithm", choices=["NGRAM", "STANDALONE", "NEXTN"], default=None,
                        help="also run pdserve with speculative decoding and print its ratios to spec off")
    parser.add_argument("--speculative-num-draft-tokens", type=int, default=5,
                        help="the verified token plus drafts per step (engine flag of the same name)")
    parser.add_argument("--speculative-num-steps", type=int, default=None,
                        help="drafts per step (engine flag of the same name)")
    parser.add_argument("--speculative-draft-model-path", default=None,
                        help="STANDALONE's draft model (the --model itself: every draft accepted)")
    parser.add_argument("--never-accepted-drafts", action="store_true",
                        help="with --speculative-algorithm: a drafter whose drafts are never accepted")
    parser.add_argument("--workload", choices=["random", "repeat"], default="random",
                        help="random prompts, or prompts that repeat one random run of 8 tokens")


# The figure a CUDA run is set beside: SGLang's decode log for Qwen3-4B at batch 1 in the seeds
# (../shared/seeds/000_*.txt, "gen throughput (token/s): 144.11", CUDA graphs on, one GPU per role).
SEED_FIGURE = {"system": "SGLang, Qwen3-4B, batch 1, CUDA graphs", "decode_tokens_per_s": 144.0}


def make_prompts(batch: int, prompt_len: int, vocab_size: int, seed: int = 0,
                 workload: str = "random") -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    # Skip the low ids, where the built-in tokenizer keeps its special tokens.
    if workload == "repeat":
        runs = torch.randint(10, vocab_size, (batch, 8), generator=generator).tolist()
        return [(run * (prompt_len // 8 + 1))[:prompt_len] for run in runs]
    return torch.randint(10, vocab_size, (batch, prompt_len), generator=generator).tolist()


# (disable_cuda_graph, cuda_graph_max_bs, cuda_graph_bs): pdserve's decode graph flags
GraphFlags = tuple[bool, int | None, tuple[int, ...]]
NO_GRAPH_FLAGS: GraphFlags = (False, None, ())


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


class PdserveSystem:
    """The engine, loaded once; each round generates for every prompt at once."""

    def __init__(self, model: str, prompts: list[list[int]], new_tokens: int, threads: int,
                 dtype: str, cpu_kernels: str = "auto", tp_size: int = 1, device: str = "cpu",
                 graphs: GraphFlags = NO_GRAPH_FLAGS, speculative: dict | None = None,
                 lora_paths: tuple[str, ...] = ()) -> None:
        from engine.config import EngineConfig
        from engine.engine import Engine
        from engine.speculative.config import SpeculativeConfig

        threads = max(1, threads // tp_size)  # per rank: the ranks share the `threads` cores
        torch.set_num_threads(threads)
        self.prompts, self.new_tokens = prompts, new_tokens
        pages_per_request = -(-(len(prompts[0]) + new_tokens) // EngineConfig.page_size) + 1  # its default
        self.engine = Engine.load(EngineConfig(
            model_path=model, dtype=dtype, num_threads=threads,
            num_pages=len(prompts) * pages_per_request + 8, max_running_requests=max(len(prompts), 1),
            cpu_kernels=cpu_kernels, tp_size=tp_size, device=device, disable_cuda_graph=graphs[0],
            cuda_graph_max_bs=graphs[1], cuda_graph_bs=tuple(graphs[2]),
            # Every round repeats the same prompts: with the prefix cache, rounds after the first would
            # skip their prefill, which the systems compared with do not.
            disable_radix_cache=True,
            speculative=SpeculativeConfig(**{k: v for k, v in (speculative or {}).items() if k != "never"}),
            **_lora_flags(lora_paths)))
        if speculative and speculative.get("never"):
            _install_never_accepted_drafter(self.engine)
        # request i runs under adapter i mod N (none: the base model)
        self.adapters = [path.partition("=")[0] for path in lora_paths]
        self.engine.start()

    def round(self, index: int) -> dict:
        return asyncio.run(self._round(f"r{index}"))

    async def _round(self, tag: str) -> dict:
        from engine.request import EngineRequest
        from engine.sampling import SamplingParams

        params = SamplingParams(temperature=0, max_new_tokens=self.new_tokens, ignore_eos=True)
        stamps: list[list[float]] = [[] for _ in self.prompts]
        tokens: list[list[int]] = [[] for _ in self.prompts]

        async def one(index: int) -> None:
            adapter = self.adapters[index % len(self.adapters)] if self.adapters else None
            request = self.engine.check(EngineRequest(f"{tag}-{index}", self.prompts[index], params,
                                                      lora=adapter))
            async for batch in self.engine.generate(request):
                now = time.perf_counter()
                for output in batch:
                    stamps[index].append(now)
                    tokens[index].append(output.token_id)

        before = self.engine.stats()
        started = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(len(self.prompts))))
        after = self.engine.stats()
        all_first = max(s[0] for s in stamps)
        last = max(s[-1] for s in stamps)
        decoded = sum(1 for s in stamps for t in s if t > all_first)
        return {"prefill_s": all_first - started, "decode_s": last - all_first, "decode_tokens": decoded,
                "decode_tokens_per_s": decoded / (last - all_first), "tokens": tokens,
                "spec_drafted_tokens": after.spec_drafted_tokens - before.spec_drafted_tokens,
                "spec_accepted_tokens": after.spec_accepted_tokens - before.spec_accepted_tokens,
                "spec_verify_rows": after.spec_verify_rows - before.spec_verify_rows}

    def close(self) -> None:
        self.engine.shutdown()


class PdserveEagerSystem(PdserveSystem):
    """The engine with every decode step eager: the baseline of --eager-baseline."""

    def __init__(self, model: str, prompts: list[list[int]], new_tokens: int, threads: int,
                 dtype: str, cpu_kernels: str = "auto", tp_size: int = 1, device: str = "cpu",
                 graphs: GraphFlags = NO_GRAPH_FLAGS, speculative: dict | None = None) -> None:
        super().__init__(model, prompts, new_tokens, threads, dtype, cpu_kernels, tp_size, device,
                         (True, None, ()))


def _install_never_accepted_drafter(engine) -> None:
    """Replace the engine's drafter with one proposing a token below the eos/special ids for every
    draft: a random-weight model's greedy choice is practically never that token, so every verify
    rejects its drafts (the cost of a useless drafter, adaptive drafting included)."""
    from engine.speculative.speculator import Speculator

    speculator = Speculator(engine.config.speculative, engine.scheduler, engine.pages,
                            lambda request, n: [3] * n)
    engine.thread.speculator = engine.speculator = speculator


def _lora_flags(lora_paths: tuple[str, ...]) -> dict:
    """The engine flags serving `lora_paths` (NAME=PATH) all in one batch."""
    if not lora_paths:
        return {}
    folders = [Path(p.partition("=")[2]) for p in lora_paths]
    ranks = [json.loads((folder / "adapter_config.json").read_text())["r"] for folder in folders]
    return {"enable_lora": True, "lora_paths": lora_paths, "max_loras_per_batch": len(lora_paths),
            "max_lora_rank": max(ranks)}


class HfSystem:
    """HF transformers generate on the same prompts as one unpadded batch, eos disabled."""

    def __init__(self, model: str, prompts: list[list[int]], new_tokens: int, threads: int,
                 dtype: str, cpu_kernels: str = "auto", tp_size: int = 1, device: str = "cpu",
                 graphs: GraphFlags = NO_GRAPH_FLAGS, speculative: dict | None = None) -> None:
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).to(self.device)
        self.model.generation_config.eos_token_id = None  # same as the engine's ignore_eos
        self.ids = torch.tensor(prompts, device=self.device)
        self.new_tokens = new_tokens

    def _generate(self, n: int) -> torch.Tensor:
        with torch.inference_mode():
            out = self.model.generate(input_ids=self.ids, attention_mask=torch.ones_like(self.ids),
                                      max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the clock stops when the GPU is done, not when it is queued
        return out

    def round(self, index: int) -> dict:
        t0 = time.perf_counter()
        self._generate(1)
        t1 = time.perf_counter()
        out = self._generate(self.new_tokens)
        t2 = time.perf_counter()
        prefill, total = t1 - t0, t2 - t1
        decoded = self.ids.shape[0] * (self.new_tokens - 1)
        return {"prefill_s": prefill, "decode_s": total - prefill, "decode_tokens": decoded,
                "decode_tokens_per_s": decoded / (total - prefill),
                "tokens": out[:, self.ids.shape[1]:].tolist()}

    def close(self) -> None:
        pass


def _serve(system_cls, args, conn) -> None:
    """Child process: load a system, then run one round per request until told to stop."""
    system = system_cls(*args)
    conn.send("ready")
    while True:
        index = conn.recv()
        if index is None:
            system.close()
            conn.send({"peak_rss_mib": _peak_rss_mib()})
            return
        conn.send(system.round(index))


class _Child:
    def __init__(self, system_cls, args, env: dict[str, str] | None = None) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child_conn = context.Pipe()
        self.process = context.Process(target=_serve, args=(system_cls, args, child_conn), daemon=True)
        saved = {key: os.environ.get(key) for key in env or {}}
        os.environ.update(env or {})  # a spawned child starts with the parent's environment
        try:
            self.process.start()
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        child_conn.close()
        self.name = system_cls.__name__

    def call(self, message):
        self.conn.send(message)
        try:
            return self.conn.recv()
        except EOFError as exc:
            raise RuntimeError(f"{self.name} child process died") from exc

    def wait_ready(self) -> None:
        if self.conn.recv() != "ready":
            raise RuntimeError(f"{self.name} did not start")

    def stop(self) -> float:
        peak = self.call(None)["peak_rss_mib"]
        self.process.join(timeout=60)
        return peak


class _PeerChild:
    """vLLM in a process of `peer_python` speaking tools/bench/peer_vllm.py's JSON-lines protocol."""

    SCRIPT = Path(__file__).with_name("peer_vllm.py")
    PREFIX = "PDSERVE-PEER "

    def __init__(self, peer_python: str, model: str, prompts: list[list[int]], new_tokens: int, threads: int,
                 dtype: str) -> None:
        self.name = "vllm"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="pdserve-bench-vllm-", suffix=".log",
                                               delete=False)
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}" if threads > 1 else "0")
        self.process = subprocess.Popen([peer_python, str(self.SCRIPT)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self.log, text=True, env=env,
                                        cwd=tempfile.gettempdir())
        self._send({"model": model, "prompts": prompts, "new_tokens": new_tokens, "dtype": dtype,
                    "threads": threads})

    def _send(self, message: dict) -> None:
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()

    def _receive(self) -> dict:
        for line in self.process.stdout:
            if line.startswith(self.PREFIX):
                reply = json.loads(line[len(self.PREFIX):])
                if "error" in reply:
                    raise RuntimeError(f"vLLM peer failed (log: {self.log.name}):\n{reply['error']}")
                return reply
            self.log.write(line)  # vLLM's own log lines
        raise RuntimeError(f"vLLM peer exited with {self.process.wait()} (log: {self.log.name})")

    def wait_ready(self) -> None:
        self._receive()

    def call(self, index: int) -> dict:
        self._send({"round": index})
        return self._receive()

    def stop(self) -> float | None:
        try:
            self._send({"stop": True})
            self._receive()
            self.process.wait(timeout=60)
        except (RuntimeError, OSError, subprocess.TimeoutExpired):
            self.process.kill()
        self.log.close()
        return None  # vLLM's work happens in its own worker processes: not measured here


def _ms_per_step(result: dict) -> float:
    return 1000 * result["decode_s"] * len(result["tokens"]) / result["decode_tokens"]


def _summary(rounds: list[dict], peak_rss_mib: float | None) -> dict:
    return {
        "decode_tokens_per_s": statistics.median(r["decode_tokens_per_s"] for r in rounds),
        "decode_ms_per_step": statistics.median(_ms_per_step(r) for r in rounds),
        # The fastest round: on a shared machine, the one least disturbed by other processes.
        "best_decode_ms_per_step": min(_ms_per_step(r) for r in rounds),
        "prefill_s": statistics.median(r["prefill_s"] for r in rounds),
        "runs_decode_tokens_per_s": [round(r["decode_tokens_per_s"], 1) for r in rounds],
        "peak_rss_mib": None if peak_rss_mib is None else round(peak_rss_mib, 1),
        "tokens": rounds[-1]["tokens"],
    } | _speculation(rounds)


def _speculation(rounds: list[dict]) -> dict:
    """Drafted and accepted tokens over the rounds, and SGLang's accept length (tokens per verify)."""
    verifies = sum(r.get("spec_verify_rows", 0) for r in rounds)
    if not verifies:
        return {}
    drafted = sum(r["spec_drafted_tokens"] for r in rounds)
    accepted = sum(r["spec_accepted_tokens"] for r in rounds)
    return {"spec_drafted_tokens": drafted, "spec_accepted_tokens": accepted,
            "spec_accept_len": 1 + accepted / verifies}


def run(model: str, prompts: list[list[int]], new_tokens: int, threads: int, repeats: int,
        with_hf: bool, dtype: str = "float32", peer_python: str | None = None,
        cpu_kernels: str = "auto", tp_size: int = 1, device: str = "cpu",
        graphs: GraphFlags = NO_GRAPH_FLAGS, eager_baseline: bool = False,
        speculative: dict | None = None, lora_paths: tuple[str, ...] = (), cpu_isa: str | None = None,
        variants: Sequence[Variant] = ()) -> dict[str, dict]:
    """Rounds alternate between the systems (one child process each, only one busy at a time), so
    a change of load on a shared machine hits all alike. One warm-up round each is discarded.
    `speculative` (SpeculativeConfig's fields, and "never": the never-accepted drafter): pdserve
    also runs with it, as "pdserve_spec". `lora_paths`: also pdserve with these adapters
    ("pdserve_lora"). `cpu_isa` is pdserve's kernel variant (PDSERVE_CPU_ISA); `variants` more pdserve
    systems."""
    from tools.bench.engine_variants import isa_env

    main_env = isa_env(cpu_isa) if cpu_isa else {}
    # (name, class, dtype, environment, speculative, lora paths)
    systems: list[tuple[str, type, str, dict, dict | None, tuple[str, ...]]] = [
        ("pdserve", PdserveSystem, dtype, main_env, None, ())]
    if eager_baseline:
        systems.append(("pdserve_eager", PdserveEagerSystem, dtype, main_env, None, ()))
    if speculative:
        systems.append(("pdserve_spec", PdserveSystem, dtype, main_env, speculative, ()))
    if lora_paths:
        systems.append(("pdserve_lora", PdserveSystem, dtype, main_env, None, lora_paths))
    systems += [(v.name, v.system, v.dtype, isa_env(v.isa), None, ()) for v in variants]
    systems += [("hf", HfSystem, dtype, {}, None, ())] if with_hf else []
    children: dict = {}
    for name, cls, system_dtype, env, spec, adapters in systems:  # one after the other: peak RSS per system
        children[name] = _Child(cls, (model, prompts, new_tokens, threads, system_dtype, cpu_kernels, tp_size,
                                      device, graphs, spec, adapters), env)
        children[name].wait_ready()
    if peer_python:
        peer = _PeerChild(peer_python, model, prompts, new_tokens, threads, dtype)
        try:
            peer.wait_ready()
        except RuntimeError:
            for child in children.values():  # vLLM did not start: leave no engine process behind
                child.stop()
            raise
        children["vllm"] = peer
    rounds: dict[str, list[dict]] = {name: [] for name in children}
    try:
        for index in range(repeats + 1):
            for name, child in children.items():
                result = child.call(index)
                if index > 0:
                    rounds[name].append(result)
    finally:
        peaks = {name: child.stop() for name, child in children.items()}
    return {name: _summary(rounds[name], peaks[name]) for name in children}


def main(args: argparse.Namespace) -> int:
    from engine.models.config import ModelConfig

    # Absolute: the vLLM peer runs in another working directory, and transformers reads a relative
    # path that does not exist there as a hub repo id.
    args.model = str(Path(args.model).resolve())
    vocab = ModelConfig.from_dir(args.model).vocab_size
    prompts = make_prompts(args.batch, args.prompt_len, vocab, workload=args.workload)
    speculative = None
    if args.speculative_algorithm:
        speculative = {"speculative_algorithm": args.speculative_algorithm,
                       "speculative_num_draft_tokens": args.speculative_num_draft_tokens,
                       "speculative_num_steps": args.speculative_num_steps,
                       "speculative_draft_model_path": args.speculative_draft_model_path,
                       "never": args.never_accepted_drafts}
    report: dict = {"model": args.model, "batch": args.batch, "prompt_len": args.prompt_len,
                    "new_tokens": args.new_tokens, "threads": args.threads, "repeats": args.repeats,
                    "dtype": args.dtype, "tp_size": args.tp_size, "device": args.device}
    if args.device.startswith("cuda"):
        report["seed_figure"] = SEED_FIGURE
    from tools.bench import engine_variants

    isas = engine_variants.parse_isas(args.cpu_isa)
    extra = engine_variants.variants(isas, args.onednn_baselines, args.dtype)
    if args.device == "cpu" and args.cpu_kernels != "off":
        report["cpu_isa"] = _kernels_name(isas[0] if isas else None)
    floor = None
    if args.device == "cpu" or args.tp_size == 1:  # measured first, with no engine process busy
        floor = step_floor(args.model, args.dtype, args.batch, args.prompt_len, args.new_tokens, args.threads,
                           args.device)
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-lora-") as adapters:
        lora_paths = _write_adapters(args.model, Path(adapters), args.lora_adapters, args.lora_rank)
        results = run(args.model, prompts, args.new_tokens, args.threads, args.repeats, not args.skip_hf,
                      args.dtype, args.peer_python, args.cpu_kernels, args.tp_size, args.device,
                      (args.disable_cuda_graph, args.cuda_graph_max_bs, tuple(args.cuda_graph_bs)),
                      args.eager_baseline, speculative, lora_paths, isas[0] if isas else None, extra)
    report.update(results)
    if speculative:
        report["speculative"] = speculative | {"workload": args.workload}
        compared = _compare(results["pdserve_spec"], results["pdserve"])
        report.update({"spec_" + key: value for key, value in compared.items()})
    if "pdserve_lora" in results:
        report["lora_adapters"], report["lora_rank"] = args.lora_adapters, args.lora_rank
        report["base_over_lora"] = (results["pdserve"]["decode_tokens_per_s"]
                                    / results["pdserve_lora"]["decode_tokens_per_s"])
    report["variants"] = [v.name for v in extra]
    for variant in extra:
        results[variant.name].update(engine_variants.compare(results["pdserve"], results[variant.name]))
        results[variant.name]["cpu_isa"] = _kernels_name(variant.isa)
    if floor is not None:
        report["floor"] = floor.to_dict()
        report["pdserve_step_over_floor"] = results["pdserve"]["decode_ms_per_step"] / floor.ms
        report["pdserve_best_step_over_floor"] = results["pdserve"]["best_decode_ms_per_step"] / floor.ms
        if floor.compute_ms is not None:
            report["pdserve_step_over_compute_floor"] = (results["pdserve"]["decode_ms_per_step"]
                                                         / floor.compute_ms)
    # Keys: "ratio" etc. against HF (as before), "vllm_ratio" etc. against vLLM.
    for peer, prefix in (("hf", ""), ("vllm", "vllm_"), ("pdserve_eager", "eager_")):
        if peer in results:
            compared = _compare(results["pdserve"], results[peer])
            report.update({prefix + key: value for key, value in compared.items()})
    for system in (*SYSTEMS, *report["variants"]):
        if system in report:
            report[system].pop("tokens")
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)
    return 0


SYSTEMS = ("pdserve", "pdserve_eager", "pdserve_spec", "pdserve_lora", "hf", "vllm")


def _write_adapters(model: str, folder: Path, count: int, rank: int) -> tuple[str, ...]:
    """`count` random adapters NAME=PATH (tools.models.lora_adapter) in `folder`."""
    from tools.models.lora_adapter import write_random_adapter

    return tuple(f"bench{i}={write_random_adapter(model, folder / f'bench{i}', rank=rank, seed=i)}"
                 for i in range(count))


def _kernels_name(isa: str | None) -> str:
    from kernels import cpu_ext

    return cpu_ext.active_isa().name if isa in (None, "auto") else str(isa)


def _compare(pdserve: dict, peer: dict) -> dict:
    """pdserve's decode tokens/s over the peer's; rounds alternate, so round i of each system ran
    under about the same machine load and the median of per-round ratios is the steadier figure."""
    paired = [a / b for a, b in zip(pdserve["runs_decode_tokens_per_s"], peer["runs_decode_tokens_per_s"],
                                    strict=True)]
    same = sum(a == b for a, b in zip(pdserve["tokens"], peer["tokens"], strict=True))
    return {"ratio": pdserve["decode_tokens_per_s"] / peer["decode_tokens_per_s"],
            "ratio_median_of_paired_rounds": statistics.median(paired),
            "ratio_of_best_rounds": peer["best_decode_ms_per_step"] / pdserve["best_decode_ms_per_step"],
            "greedy_outputs_equal": f"{same}/{len(pdserve['tokens'])}"}


def _accepted(run: dict) -> str:
    if "spec_accept_len" not in run:
        return "; nothing drafted"
    return (f"; {run['spec_accepted_tokens']}/{run['spec_drafted_tokens']} drafts accepted, accept len "
            f"{run['spec_accept_len']:.2f}")


def print_table(report: dict) -> None:
    out = sys.stdout
    out.write(f"batch {report['batch']}, prompt {report['prompt_len']}, {report['new_tokens']} new tokens, "
              f"{report['threads']} threads, {report['dtype']}, {report['device']}\n")
    if "cpu_isa" in report:
        out.write(f"  pdserve runs the {report['cpu_isa']} C++ CPU kernels\n")
    for system in (*SYSTEMS, *report.get("variants", [])):
        if system in report:
            r = report[system]
            out.write(f"  {system:13s} decode {r['decode_tokens_per_s']:8.1f} tok/s "
                      f"({r['decode_ms_per_step']:.1f} ms/step), prefill {r['prefill_s']:.2f} s"
                      + (f", peak RSS {r['peak_rss_mib']:.0f} MiB" if r["peak_rss_mib"] is not None else "")
                      + (f"; step / pdserve's {r['step_over_pdserve']:.2f}x (median of paired rounds "
                         f"{r['step_over_pdserve_median_of_paired_rounds']:.2f}x)"
                         if "step_over_pdserve" in r else "")
                      + "\n")
    if "base_over_lora" in report:
        out.write(f"  pdserve_lora: {report['lora_adapters']} adapters of rank {report['lora_rank']} mixed "
                  f"in the batch; base alone / with them: {report['base_over_lora']:.2f}x\n")
    for peer, prefix in (("hf", ""), ("vllm", "vllm_")):
        if prefix + "ratio" in report:
            out.write(f"  pdserve / {peer}: {report[prefix + 'ratio']:.2f}x (median of paired rounds "
                      f"{report[prefix + 'ratio_median_of_paired_rounds']:.2f}x), "
                      f"greedy outputs equal {report[prefix + 'greedy_outputs_equal']}\n")
    if "eager_ratio" in report:
        out.write(f"  graphs   step time with graphs / eager {1 / report['eager_ratio_of_best_rounds']:.3f}x "
                  f"(best rounds; decode tok/s ratio {report['eager_ratio']:.3f}x, median of paired rounds "
                  f"{report['eager_ratio_median_of_paired_rounds']:.3f}x), greedy outputs equal "
                  f"{report['eager_greedy_outputs_equal']}\n")
    if "spec_ratio" in report:
        spec, spec_run = report["speculative"], report["pdserve_spec"]
        out.write(f"  spec on / off ({spec['speculative_algorithm']}"
                  f"{', never-accepted drafts' if spec['never'] else ''}, {spec['workload']} prompts, "
                  f"{spec['speculative_num_draft_tokens']} draft tokens): {report['spec_ratio']:.2f}x "
                  f"(median of paired rounds {report['spec_ratio_median_of_paired_rounds']:.2f}x), "
                  f"greedy outputs equal {report['spec_greedy_outputs_equal']}{_accepted(spec_run)}\n")
    if "floor" in report:
        floor = report["floor"]
        out.write(f"  floor    {floor['floor_ms']:.1f} ms/step: {floor['weight_bytes'] / 1e6:.0f} MB of "
                  f"weights + {floor['kv_bytes'] / 1e6:.1f} MB of K/V at {floor['read_gb_s']:.1f} GB/s read "
                  "(tools/bench/step_floor.py); pdserve step / floor "
                  f"{report['pdserve_step_over_floor']:.2f}x "
                  f"(best round {report['pdserve_best_step_over_floor']:.2f}x); the floor's bound "
                  f"{report['batch'] * 1e3 / floor['floor_ms']:.0f} tok/s, pdserve at "
                  f"{100 / report['pdserve_step_over_floor']:.0f}% of it\n")
        if "compute_floor_ms" in floor:
            out.write(f"  compute  {floor['compute_floor_ms']:.1f} ms/step: {floor['flops'] / 1e9:.2f} "
                      f"GFLOP at {floor['matmul_gflop_s']:.0f} GFLOP/s (torch's best square matmul here, "
                      f"{floor['matmul_dtype']}); pdserve step / compute floor "
                      f"{report['pdserve_step_over_compute_floor']:.2f}x\n")
    if "seed_figure" in report:
        seed = report["seed_figure"]
        out.write(f"  seeds    decode {seed['decode_tokens_per_s']:8.1f} tok/s ({seed['system']}; "
                  "pdserve / seeds: "
                  f"{report['pdserve']['decode_tokens_per_s'] / seed['decode_tokens_per_s']:.2f}x)\n")
