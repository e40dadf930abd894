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
import json
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tools.bench.engine_children import PeerChild, SystemChild
from tools.bench.engine_report import SEED_FIGURE, SYSTEMS, compare_runs, kernels_name, print_table
from tools.bench.engine_systems import NO_GRAPH_FLAGS, GraphFlags, HfSystem, PdserveEagerSystem, PdserveSystem
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


def make_prompts(batch: int, prompt_len: int, vocab_size: int, seed: int = 0,
                 workload: str = "random") -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    # Skip the low ids, where the built-in tokenizer keeps its special tokens.
    if workload == "repeat":
        runs = torch.randint(10, vocab_size, (batch, 8), generator=generator).tolist()
        return [(run * (prompt_len // 8 + 1))[:prompt_len] for run in runs]
    return torch.randint(10, vocab_size, (batch, prompt_len), generator=generator).tolist()


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
        children[name] = SystemChild(cls, (model, prompts, new_tokens, threads, system_dtype, cpu_kernels,
                                           tp_size, device, graphs, spec, adapters), env)
        children[name].wait_ready()
    if peer_python:
        peer = PeerChild(peer_python, model, prompts, new_tokens, threads, dtype)
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
        report["cpu_isa"] = kernels_name(isas[0] if isas else None)
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
        compared = compare_runs(results["pdserve_spec"], results["pdserve"])
        report.update({"spec_" + key: value for key, value in compared.items()})
    if "pdserve_lora" in results:
        report["lora_adapters"], report["lora_rank"] = args.lora_adapters, args.lora_rank
        report["base_over_lora"] = (results["pdserve"]["decode_tokens_per_s"]
                                    / results["pdserve_lora"]["decode_tokens_per_s"])
    report["variants"] = [v.name for v in extra]
    for variant in extra:
        results[variant.name].update(engine_variants.compare(results["pdserve"], results[variant.name]))
        results[variant.name]["cpu_isa"] = kernels_name(variant.isa)
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
            compared = compare_runs(results["pdserve"], results[peer])
            report.update({prefix + key: value for key, value in compared.items()})
    for system in (*SYSTEMS, *report["variants"]):
        if system in report:
            report[system].pop("tokens")
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)
    return 0


def _write_adapters(model: str, folder: Path, count: int, rank: int) -> tuple[str, ...]:
    """`count` random adapters NAME=PATH (tools.models.lora_adapter) in `folder`."""
    from tools.models.lora_adapter import write_random_adapter

    return tuple(f"bench{i}={write_random_adapter(model, folder / f'bench{i}', rank=rank, seed=i)}"
                 for i in range(count))
