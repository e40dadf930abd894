"""`pdserve bench engine`: decode throughput of the engine against HF transformers `generate`.

Both systems get the same checkpoint, the same equal-length random prompts (so HF's batch needs
no padding), greedy decoding with eos disabled, and the same torch thread count. Each runs in its
own child process, so peak RSS is per system and one cannot warm the other's caches.

Decode tokens/s excludes prefill. pdserve: tokens emitted after the moment every request has its
first token, divided by the time from that moment to the last token (all those steps are pure
decode batches). HF: the time of generate(N) minus generate(1) on the same inputs, for the
B * (N - 1) tokens after the first. Numbers are medians over `--repeats` runs after a warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import resource
import statistics
import sys
import time

import torch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="HF checkpoint folder")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-hf", action="store_true", help="measure pdserve only")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def make_prompts(batch: int, prompt_len: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    # Skip the low ids, where the built-in tokenizer keeps its special tokens.
    return torch.randint(10, vocab_size, (batch, prompt_len), generator=generator).tolist()


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


async def _pdserve_round(engine, prompts: list[list[int]], new_tokens: int, tag: str) -> dict:
    from engine.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    stamps: list[list[float]] = [[] for _ in prompts]
    tokens: list[list[int]] = [[] for _ in prompts]

    async def one(index: int) -> None:
        async for output in engine.generate(prompts[index], params, room=f"{tag}-{index}"):
            stamps[index].append(time.perf_counter())
            tokens[index].append(output.token_id)

    started = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(len(prompts))))
    all_first = max(s[0] for s in stamps)
    last = max(s[-1] for s in stamps)
    decoded = sum(1 for s in stamps for t in s if t > all_first)
    return {"prefill_s": all_first - started, "decode_s": last - all_first,
            "decode_tokens": decoded, "decode_tokens_per_s": decoded / (last - all_first),
            "tokens": tokens}


def run_pdserve(model: str, prompts: list[list[int]], new_tokens: int, threads: int, repeats: int) -> dict:
    from engine.config import EngineConfig
    from engine.engine import Engine

    torch.set_num_threads(threads)
    batch, prompt_len = len(prompts), len(prompts[0])
    page_size = 16
    pages_per_request = -(-(prompt_len + new_tokens) // page_size) + 1
    engine = Engine.load(EngineConfig(
        model_path=model, num_threads=threads, page_size=page_size,
        num_pages=batch * pages_per_request + 8, max_running_requests=max(batch, 1),
        chunked_prefill_size=512))
    engine.start()
    try:
        rounds = [asyncio.run(_pdserve_round(engine, prompts, new_tokens, f"r{i}")) for i in range(repeats + 1)]
    finally:
        engine.shutdown()
    return _summary(rounds[1:], _peak_rss_mib())


def run_hf(model: str, prompts: list[list[int]], new_tokens: int, threads: int, repeats: int) -> dict:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    hf.generation_config.eos_token_id = None  # same as the engine's ignore_eos
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)

    def generate(n: int) -> torch.Tensor:
        return hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)

    rounds = []
    with torch.inference_mode():
        generate(2)  # warm-up
        for _ in range(repeats):
            t0 = time.perf_counter()
            generate(1)
            t1 = time.perf_counter()
            out = generate(new_tokens)
            t2 = time.perf_counter()
            prefill, total = t1 - t0, t2 - t1
            decoded = len(prompts) * (new_tokens - 1)
            rounds.append({"prefill_s": prefill, "decode_s": total - prefill, "decode_tokens": decoded,
                           "decode_tokens_per_s": decoded / (total - prefill),
                           "tokens": out[:, ids.shape[1]:].tolist()})
    return _summary(rounds, _peak_rss_mib())


def _summary(rounds: list[dict], peak_rss_mib: float) -> dict:
    return {
        "decode_tokens_per_s": statistics.median(r["decode_tokens_per_s"] for r in rounds),
        "decode_ms_per_step": statistics.median(1000 * r["decode_s"] * len(r["tokens"]) / r["decode_tokens"]
                                                for r in rounds),
        "prefill_s": statistics.median(r["prefill_s"] for r in rounds),
        "runs_decode_tokens_per_s": [round(r["decode_tokens_per_s"], 1) for r in rounds],
        "peak_rss_mib": round(peak_rss_mib, 1),
        "tokens": rounds[-1]["tokens"],
    }


def _child(target, args, conn) -> None:
    conn.send(target(*args))
    conn.close()


def _in_child(target, *args) -> dict:
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe(duplex=False)
    process = context.Process(target=_child, args=(target, args, child))
    process.start()
    child.close()
    try:
        result = parent.recv()
    except EOFError as exc:
        raise RuntimeError(f"{target.__name__} failed in its child process") from exc
    finally:
        process.join()
    return result


def main(args: argparse.Namespace) -> int:
    from engine.models.config import ModelConfig

    vocab = ModelConfig.from_dir(args.model).vocab_size
    prompts = make_prompts(args.batch, args.prompt_len, vocab)
    common = (args.model, prompts, args.new_tokens, args.threads, args.repeats)
    report: dict = {"model": args.model, "batch": args.batch, "prompt_len": args.prompt_len,
                    "new_tokens": args.new_tokens, "threads": args.threads, "repeats": args.repeats}
    pdserve = _in_child(run_pdserve, *common)
    report["pdserve"] = pdserve
    if not args.skip_hf:
        hf = _in_child(run_hf, *common)
        report["hf"] = hf
        report["ratio"] = pdserve["decode_tokens_per_s"] / hf["decode_tokens_per_s"]
        same = sum(a == b for a, b in zip(pdserve["tokens"], hf["tokens"], strict=True))
        report["greedy_outputs_equal"] = f"{same}/{len(prompts)}"
    for system in ("pdserve", "hf"):
        if system in report:
            report[system].pop("tokens")
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_table(report)
    return 0


def _print_table(report: dict) -> None:
    out = sys.stdout
    out.write(f"batch {report['batch']}, prompt {report['prompt_len']}, {report['new_tokens']} new tokens, "
              f"{report['threads']} threads\n")
    for system in ("pdserve", "hf"):
        if system in report:
            r = report[system]
            out.write(f"  {system:8s} decode {r['decode_tokens_per_s']:8.1f} tok/s "
                      f"({r['decode_ms_per_step']:.1f} ms/step), prefill {r['prefill_s']:.2f} s, "
                      f"peak RSS {r['peak_rss_mib']:.0f} MiB\n")
    if "ratio" in report:
        out.write(f"  ratio {report['ratio']:.2f}x, greedy outputs equal {report['greedy_outputs_equal']}\n")
