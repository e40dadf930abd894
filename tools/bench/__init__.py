"""The benchmarks behind `pdserve bench ...` and the timing scripts run by hand.

engine.py            `bench engine`: decode throughput of the engine against HF transformers (and
                     vLLM through peer_vllm.py, run by another Python)
transfer.py          `bench transfer`: KV page transfer bandwidth against memcpy
gateway.py           `bench gateway`: latency the gateway adds over a direct worker call
serving/             `bench serving`, `pd-vs-colocated`, `serving-vs-vllm`, `prefix-cache`
request_path.py      `bench request-path`: the files one streaming PD chat request runs (call_tracer.py)
grpc_messages.py     `bench grpc-messages`: gRPC messages per request, PD against colocated
profile_step.py      one engine step timed and profiled with torch.profiler
decode_attention.py  the torch CPU decode-attention variants considered, timed
registry.py          registry RPC latency, in-memory store against etcd
"""
