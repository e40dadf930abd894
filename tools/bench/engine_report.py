"""What `pdserve bench engine` prints: its table, and the ratios of one system's rounds to another's."""

from __future__ import annotations

import statistics
import sys

# The figure a CUDA run is set beside: SGLang's decode log for Qwen3-4B at batch 1 in the seeds
# (../shared/seeds/000_*.txt, "gen throughput (token/s): 144.11", CUDA graphs on, one GPU per role).
SEED_FIGURE = {"system": "SGLang, Qwen3-4B, batch 1, CUDA graphs", "decode_tokens_per_s": 144.0}

SYSTEMS = ("pdserve", "pdserve_eager", "pdserve_spec", "pdserve_lora", "hf", "vllm")


def kernels_name(isa: str | None) -> str:
    from kernels import cpu_ext

    return cpu_ext.active_isa().name if isa in (None, "auto") else str(isa)


def compare_runs(pdserve: dict, peer: dict) -> dict:
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
