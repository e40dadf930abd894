"""The chaos suite behind `pdserve bench chaos`: a real PD deployment (registry, 2 prefill, 2 decode,
gateway as processes) under steady greedy load, one fault at a time, each followed by a recovery check.

Files, each with one job: config (flags and bounds), lifecycle (waiting on the children that
tools/launch.py starts), deployment (the services under test), netns (network namespaces),
prompts / reference / client / load (the clients and how an answer is judged), disconnects,
scenarios (the faults), observe / recovery (what the workers hold and whether they serve
afterwards), report (rows, table, JSON), runner and main.
"""
