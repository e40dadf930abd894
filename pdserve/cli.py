"""The `pdserve` console command.

Each subcommand lives in the module that owns it; this file only maps names to modules so
that `pdserve --help` and every command start without importing torch or grpc they do not need.
A command module exposes `add_arguments(parser)` and `main(args) -> int | None`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help). Two-word names are subcommands of a group ("bench engine").
COMMANDS: dict[str, tuple[str, str]] = {
    "make-tiny-model": ("tools.models.tiny_model", "write the built-in random-weight HF checkpoint"),
    "generate": ("tools.models.generate", "stream a generation from a local checkpoint in-process"),
    "launch-server": ("services.launch_server",
                      "start a prefill, decode or colocated worker, or an EPD encoder (--encoder-only)"),
    "bootstrap": ("services.bootstrap.main", "start the bootstrap registry"),
    "launch-router": ("services.gateway.main", "start the OpenAI-compatible gateway"),
    "up": ("tools.up", "start registry, prefill, decode and gateway as local processes"),
    "bench engine": ("tools.bench.engine", "decode throughput of the engine against HF transformers"),
    "bench transfer": ("tools.bench.transfer", "KV page transfer bandwidth against memcpy"),
    "bench kv-bytes": ("tools.bench.kv_bytes",
                       "KV bytes prefill ships per prompt token, model against model"),
    "bench parallel": ("tools.bench.parallel",
                       "decode tokens/s and collective bytes per step, rank layout against layout"),
    "bench grammar": ("tools.bench.grammar",
                      "structured outputs: xgrammar against llguidance, compile time and per-step mask cost"),
    "bench structured": ("tools.bench.structured",
                         "decode tok/s with a JSON schema on every request against none; a 50-property "
                         "schema's compile time"),
    "bench gateway": ("tools.bench.gateway", "latency the gateway adds over a direct worker call"),
    "bench registry-scale": ("tools.bench.registry_scale", "many workers heartbeating and gateways watching: "
                             "registry CPU, time for a killed worker to leave every view"),
    "bench fleet": ("tools.bench.fleet", "simulated prefill/decode workers and gateways at a target rate: "
                    "gateway CPU per token, routing decision, registry CPU, TTFT/TPOT vs the timing model"),
    "bench gateway-relay": ("tools.bench.gateway_relay", "one gateway process pinned to one core relaying "
                            "streams from fixed-schedule token sources: tokens/s, CPU per token, TPOT"),
    "bench big-bodies": ("tools.bench.big_bodies", "other streams' inter-token gap p99 idle and while "
                         "clients send 40 MB image bodies, bodies parsed on the event loop vs in the pool"),
    "bench kv-events": ("tools.bench.kv_events", "cache-aware routing fed by 64 workers' KV events at GPU "
                        "rates: decision p50/p99, event lag, the views' memory bound"),
    "bench epd": ("tools.bench.epd",
                  "EPD: encoder images/s, embedding bytes per image, TTFT colocated vs EPD"),
    "bench chaos": ("tools.chaos.main", "faults under load on a real PD deployment: hung, wrong, leaked"),
    "bench serving": ("tools.bench.serving.main", "load an OpenAI-compatible server: TTFT, ITL, goodput"),
    "bench pd-vs-colocated": ("tools.bench.serving.pd_vs_colocated",
                              "PD against colocated on the prefill-interruption workload, swept over rate"),
    "bench serving-vs-vllm": ("tools.bench.serving.vs_peer",
                              "pdserve colocated and PD against vLLM's CPU server on vllm bench serve's load "
                              "(random prompts to the chat endpoint, a warm-up pass of other prompts first), "
                              "with TPOT against the engine's step"),
    "bench request-path": ("tools.bench.request_path",
                           "the files one streaming PD chat request passes through, per process"),
    "bench grpc-messages": ("tools.bench.grpc_messages",
                            "gRPC messages per request, PD against colocated, on one load"),
    "bench prefix-cache": ("tools.bench.serving.prefix_cache",
                           "multi-turn chat with a shared system prompt: TTFT, prefill tokens, KV bytes, "
                           "cache off/on"),
    "bench serving-spec": ("tools.bench.serving.spec_pd",
                           "1 prefill + 1 decode with speculative decoding on and off: TPOT, ITL, tok/s"),
}


def _usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: pdserve COMMAND [ARGS]", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def _resolve(argv: list[str]) -> tuple[str, list[str]] | None:
    if len(argv) >= 2 and f"{argv[0]} {argv[1]}" in COMMANDS:
        return f"{argv[0]} {argv[1]}", argv[2:]
    if argv and argv[0] in COMMANDS:
        return argv[0], argv[1:]
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    found = _resolve(argv)
    if found is None:
        print(_usage(), file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    name, rest = found
    module_name, help_ = COMMANDS[name]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"pdserve {name}", description=help_)
    module.add_arguments(parser)
    args = parser.parse_args(rest)
    return int(module.main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
