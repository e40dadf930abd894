"""The systems `pdserve bench engine` times, each loaded once in its own child process: pdserve's
engine (eager, with graphs, speculation or LoRA as asked) and HF transformers `generate`."""

from __future__ import annotations

import asyncio
import json
import resource
import time
from pathlib import Path

import torch

# (disable_cuda_graph, cuda_graph_max_bs, cuda_graph_bs): pdserve's decode graph flags
GraphFlags = tuple[bool, int | None, tuple[int, ...]]
NO_GRAPH_FLAGS: GraphFlags = (False, None, ())


def peak_rss_mib() -> float:
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
                 graphs: GraphFlags = NO_GRAPH_FLAGS, speculative: dict | None = None,
                 lora_paths: tuple[str, ...] = ()) -> None:
        # (graphs, speculation and adapters are pdserve's: HF runs the base model, as pdserve's
        # baseline system does)
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
