"""The vLLM side of `pdserve bench engine --peer-python PATH`, run by that other Python.

This file is executed as a script by the interpreter of an environment that has vLLM's CPU build
(vLLM is never a dependency of pdserve), so it imports nothing from pdserve: only the standard
library and vLLM. It talks to tools.bench.engine over stdin/stdout in JSON lines; vLLM logs to stdout
too, so protocol lines carry the PREFIX below and everything else is passed through as log.

Protocol (parent -> child, one JSON object per line):
  {"model", "prompts", "new_tokens", "dtype", "threads"}  -> {"ready": true} once loaded
  {"round": i}                                            -> one round's result (see `_round`)
  {"stop": true}                                          -> {"stopped": true}, then exit
Errors come back as {"error": "..."}.

A round measures decode the way pdserve's rounds do (tools.bench.engine_systems.PdserveSystem): all
prompts are added to vLLM's LLMEngine at once and its step() loop is driven here, stamping every token as it
comes out; decode time runs from the moment every request has its first token to the last token,
and counts the tokens emitted after that moment (all of them from pure decode steps). Prefix
caching is off, so every round prefills again.
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

    def round(self, index: int) -> dict:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        engine = self.llm.llm_engine
        params = SamplingParams(temperature=0, max_tokens=self.new_tokens, min_tokens=self.new_tokens,
                                ignore_eos=True)
        started = time.perf_counter()
        for i, prompt in enumerate(self.prompts):
            engine.add_request(f"r{index}-{i}", TokensPrompt(prompt_token_ids=prompt), params)
        stamps: dict[str, list[float]] = {}
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            outputs = engine.step()
            now = time.perf_counter()
            for output in outputs:  # cumulative outputs: the new tokens are the ones not seen yet
                ids = list(output.outputs[0].token_ids)
                seen = stamps.setdefault(output.request_id, [])
                seen.extend([now] * (len(ids) - len(seen)))
                tokens[output.request_id] = ids
        all_first = max(s[0] for s in stamps.values())
        last = max(s[-1] for s in stamps.values())
        decoded = sum(1 for s in stamps.values() for t in s if t > all_first)
        order = [f"r{index}-{i}" for i in range(len(self.prompts))]
        return {"prefill_s": all_first - started, "decode_s": last - all_first, "decode_tokens": decoded,
                "decode_tokens_per_s": decoded / (last - all_first), "tokens": [tokens[r] for r in order]}


def main() -> int:
    system = None
    for line in sys.stdin:
        message = json.loads(line)
        try:
            if "model" in message:
                system = VllmSystem(message["model"], message["prompts"], message["new_tokens"],
                                    message["dtype"])
                _reply({"ready": True})
            elif "round" in message:
                _reply(system.round(message["round"]))  # type: ignore[union-attr]
            elif message.get("stop"):
                _reply({"stopped": True})
                return 0
        except Exception:
            _reply({"error": traceback.format_exc()})
            return 1
    return 0


if __name__ == "__main__":  # vLLM starts worker processes that re-import this file
    sys.exit(main())
