"""Serving benchmarks: `pdserve bench serving` (a load generator against any OpenAI-compatible server)
and `pdserve bench pd-vs-colocated` (both deployments, the same load, side by side).

workload.py  what is sent: request classes, the mixed-workload spec, arrival times
datasets.py  prompts: random token ids (SGLang's `random`) or a local ShareGPT JSON file
client.py    one streamed /v1/completions request, timed per token
runner.py    sends a workload (Poisson arrivals, closed loops, a concurrency cap), bounded in time
metrics.py   the report's figures: throughput, TTFT, TPOT, ITL, E2E, goodput against SLOs
report.py    the seeds' "Serving Benchmark Result" text block and the JSON file
plots.py     the PNG figures (matplotlib, no display)
"""
