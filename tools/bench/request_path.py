"""`pdserve bench request-path`: the files one streaming PD chat request passes through.

Starts a prefill worker, a decode worker and a gateway (static lists, round robin) under
tools.bench.call_tracer, sends two warm-up chats (first connections, first-use paths), then records
`--repeat` streaming chat requests one at a time, each with a prompt of its own (no prefix-cache
hit), and prints, per process, every file of the deployed code whose functions ran for every one of
them. Taking the files common to all the recordings leaves out background work that happened to
tick during one (the leak detector, heartbeats). Counted: hand-written files. Not counted:
generated protobuf code and the model's forward pass (engine/models/, kernels/), listed apart.
Files that also ran in an idle window of the same length (the engine loop) are marked.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from tools.launch import ProcessGroup, Service
from tools.up import ensure_model

REPO = Path(__file__).resolve().parents[2]
# The deployed code; tools/ (the tracer itself) and the venv are not part of a request's path.
DEPLOYED = ("pdserve/", "protos/", "services/", "engine/", "libkv/", "kernels/")
FORWARD_PASS = ("engine/models/", "kernels/")
_SETTLE_S = 0.5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-path", type=Path, default=Path(".cache/models/tiny"),
                        help="checkpoint (default: built-in tiny)")
    parser.add_argument("--transfer-backend", default="mooncake",
                        help="KV transfer backend (default mooncake)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens generated (default 16)")
    parser.add_argument("--repeat", type=int, default=3, help="requests recorded, one at a time (default 3)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")


def classify(path: str) -> str | None:
    """'counted', 'generated' or 'forward' for a file of the deployed code; None for anything else."""
    if not path.startswith(str(REPO) + "/"):
        return None
    relative = path[len(str(REPO)) + 1:]
    if not relative.startswith(DEPLOYED):
        return None
    if "_pb2" in relative:
        return "generated"
    if relative.startswith(FORWARD_PASS):
        return "forward"
    return "counted"


def _relative(paths: set[str], kind: str) -> list[str]:
    return sorted(p[len(str(REPO)) + 1:] for p in paths if classify(p) == kind)


def _record(services: list[Service], outputs: dict[str, Path], action) -> dict[str, set[str]]:
    for service in services:
        service.send(signal.SIGUSR1)
    action()
    for service in services:
        service.send(signal.SIGUSR2)
    time.sleep(_SETTLE_S)
    return {s.name: set(outputs[s.name].read_text().split()) for s in services}


def main(args: argparse.Namespace) -> int:
    ensure_model(args.model_path)
    model = str(args.model_path.resolve())
    with tempfile.TemporaryDirectory(prefix="pdserve-request-path-") as tmp, ProcessGroup(Path(tmp)) as group:
        outputs = {name: Path(tmp) / f"{name}.files" for name in ("prefill", "decode", "gateway")}

        def traced(name: str, pdserve_args: list[str]) -> Service:
            wrapper = (sys.executable, "-m", "tools.bench.call_tracer", str(outputs[name]))
            return group.start(name, pdserve_args, wrapper=wrapper)

        worker = ["launch-server", "--model-path", model, "--port", "0", "--metrics-port", "0",
                  "--num-threads", "1", "--disaggregation-transfer-backend", args.transfer_backend,
                  "--decode-log-interval", "0"]
        prefill = traced("prefill", [*worker, "--disaggregation-mode", "prefill"])
        decode = traced("decode", [*worker, "--disaggregation-mode", "decode"])
        gateway = traced("gateway", ["launch-router", "--model-path", model, "--pd-disaggregation",
                                     "--port", "0", "--prefill", f"http://{prefill.address}",
                                     "--decode", f"http://{decode.address}", "--policy", "round_robin"])
        sent = iter(range(1_000_000))

        def chat() -> None:
            content = f"Request {next(sent)}: hello there, how are you today? " * 4  # never a cache hit
            body = json.dumps({"model": args.model_path.resolve().name, "stream": True, "temperature": 0,
                               "max_tokens": args.max_tokens,
                               "messages": [{"role": "user", "content": content}]}).encode()
            request = urllib.request.Request(f"http://{gateway.address}/v1/chat/completions", body,
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=120) as response:
                text = response.read().decode()
            if "[DONE]" not in text:
                raise RuntimeError(f"the chat request did not finish: {text[-500:]}")

        services = [prefill, decode, gateway]
        chat()
        chat()
        started = time.monotonic()
        recordings = [_record(services, outputs, chat) for _ in range(args.repeat)]
        elapsed = (time.monotonic() - started) / args.repeat
        idle = _record(services, outputs, lambda: time.sleep(elapsed))
    request = {name: set.intersection(*(r[name] for r in recordings)) for name in outputs}
    result = {name: {"counted": _relative(files, "counted"), "generated": _relative(files, "generated"),
                     "forward": _relative(files, "forward"), "idle": _relative(idle[name], "counted")}
              for name, files in request.items()}
    counted = sorted({f for entry in result.values() for f in entry["counted"]})
    if args.json:
        print(json.dumps({"processes": result, "distinct_counted": counted}, indent=2))
        return 0
    for name, entry in result.items():
        print(f"{name}: {len(entry['counted'])} files")
        for path in entry["counted"]:
            print(f"  {path}{'  (also ran idle)' if path in entry['idle'] else ''}")
        print(f"  not counted: {len(entry['generated'])} generated, {len(entry['forward'])} of the "
              "forward pass")
    print(f"distinct files over the three processes: {len(counted)}")
    return 0
