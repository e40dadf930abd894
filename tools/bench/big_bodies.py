"""`pdserve bench big-bodies`: what clients sending 40 MB image bodies do to everyone else's stream.

Starts one simulated colocated worker and two gateways in front of it, both told the model takes
images (a copy of the checkpoint's gateway files with a `vision_config`): one parses every body on
its event loop (`--body-parse-processes 0`, the baseline), the other parses large bodies in its pool
(services/gateway/large_bodies.py). For each gateway in turn: `--streams` streamed chats of
`--output-len` tokens at stream interval 1, first alone (idle), then while `--big-clients` clients
(in a process of their own at idle priority, as other machines would be) each send one `--body-mb`
MB body of two base64 PNG data URLs after another. The gateway measured has the first CPU to itself,
as in `bench gateway-relay`; the worker and the clients run on the others (`--no-pin`: anywhere).
It prints the p99 (and p50, max) of the gap between consecutive
SSE events of the streams in each phase, the loaded p99 over the idle p99 (the target: at most 2),
how the big-body requests ended and how many of their images went through the worker's image drop
(services/common/image_drop.py), the worker's own gaps over 40 and 80 ms (its inter-token latency
histogram: a stall that began in the worker, not the gateway), and the gateway's event-loop stalls
over 20 ms and 50 ms per big body (its gateway_event_loop_busy_seconds: CPU time on the loop,
which a busy machine barely changes, where the gaps are wall-clock and noisy when others run). The
simulated worker has no vision tower, so a big-body request ends in its 400 for images sent to a
text-only model: by then the gateway has read, parsed and decoded the body and sent the images to
the worker, which is the work measured here.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import multiprocessing
import os
import shutil
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import psutil

from tools.bench.cpu_pinning import pin, split_cpus
from tools.bench.sse_load import StreamTiming, chat_body, stream_one
from tools.launch import ProcessGroup, Service
from tools.up import DEFAULT_MODEL, ensure_model

PROMPT = "Write a long story about a lighthouse keeper and the ships that pass in the night."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-path", type=Path, default=DEFAULT_MODEL,
                        help="config.json and tokenizer to simulate (weights are not read; default: tiny)")
    parser.add_argument("--streams", type=int, default=16, help="concurrent streamed chats measured")
    parser.add_argument("--output-len", type=int, default=300, help="output tokens per stream")
    parser.add_argument("--big-clients", type=int, default=4, help="clients sending big bodies back to back")
    parser.add_argument("--body-mb", type=float, default=40.0, help="size of each big body (MB)")
    parser.add_argument("--body-parse-processes", type=int, default=2,
                        help="the measured gateway's --body-parse-processes (the baseline's is 0)")
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="leave every process on every CPU (default: the gateway on the first CPU, "
                             "the rest on the others)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/pdserve-bench-big-bodies"), help="logs")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


def vision_files(model_path: Path, folder: Path) -> Path:
    """The checkpoint's gateway files (no weights) under the same name, marked as a vision-language
    model's, with a chat template that writes an image-pad token per image part."""
    target = folder / model_path.name
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(model_path, target, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "vision_config": {}}))
    (target / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}"
        "{% else %}{% for p in m.content %}{{ '<|image_pad|>' if p.type == 'image' else p.text }}"
        "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
    return target


def big_body(model: str, megabytes: float) -> bytes:
    """A chat body of about `megabytes` MB: two random-byte images as base64 PNG data URLs."""
    image_bytes = int(megabytes * 1e6 * 3 / 8)  # two images, 4 base64 characters per 3 bytes
    urls = ["data:image/png;base64," + base64.b64encode(os.urandom(image_bytes)).decode() for _ in range(2)]
    content = [*({"type": "image_url", "image_url": {"url": url}} for url in urls),
               {"type": "text", "text": "what is in these?"}]
    return json.dumps({"model": model, "messages": [{"role": "user", "content": content}],
                       "max_tokens": 4}).encode()


async def _post(url: str, body: bytes) -> int:
    """POST `body` over a raw connection; the answer's status code (0: no answer)."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n" % (parts.netloc.encode(), len(body)))
        writer.write(body)
        await writer.drain()
        status = await reader.readline()
        await reader.read()
        fields = status.split()
        return int(fields[1]) if len(fields) > 1 else 0
    finally:
        writer.close()


def _send_big_bodies(url: str, big: bytes, clients: int, stop, answers) -> None:
    """`clients` clients sending `big` back to back until `stop` is set; puts their status counts on
    `answers`. Runs in a process of its own: writing a 40 MB body copies it into the transport's
    buffer with the GIL held, which in the measuring process would stall its own reading of the
    streams and show as the gateway's gaps. It runs at idle priority: clients on other machines take
    none of the gateway's or the worker's CPU (the kernel's receive of their bytes still counts)."""
    as_other_machines()
    statuses: dict[int, int] = {}

    async def sender() -> None:
        while not stop.is_set():
            try:
                status = await _post(url, big)
            except OSError:
                status = 0
            statuses[status] = statuses.get(status, 0) + 1

    async def senders() -> None:
        await asyncio.gather(*(sender() for _ in range(clients)))

    asyncio.run(senders())
    answers.put(statuses)


def as_other_machines() -> None:
    """This process runs only when nothing else wants the CPU (SCHED_IDLE; nice 19 where refused)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)


async def _phase(url: str, stream: bytes, streams: int, big: bytes | None,
                 big_clients: int) -> tuple[list[StreamTiming], dict[int, int]]:
    """The streams, with `big_clients` clients (in another process) sending `big` back to back
    until they end."""
    context = multiprocessing.get_context("spawn")
    stop, answers = context.Event(), context.Queue()
    sending = None
    if big and big_clients:
        sending = context.Process(target=_send_big_bodies, args=(url, big, big_clients, stop, answers),
                                  daemon=True)
        sending.start()
        await asyncio.sleep(3.0)  # the process started and the bodies are in flight before the streams
    try:
        timings = await asyncio.gather(*(stream_one(url, stream) for _ in range(streams)))
    finally:
        stop.set()
    statuses: dict[int, int] = {}
    if sending is not None:
        statuses = await asyncio.to_thread(answers.get, True, 300)
        sending.join(30)
    return list(timings), statuses


def _gap_figures(timings: list[StreamTiming]) -> dict:
    gaps = sorted(gap for t in timings if t.error is None for gap in t.gaps)
    errors = [t.error for t in timings if t.error is not None]

    def at(q: float) -> float | None:
        return round(1000 * gaps[min(len(gaps) - 1, int(q * len(gaps)))], 2) if gaps else None

    return {"gap_ms_p50": at(0.5), "gap_ms_p99": at(0.99), "gap_ms_max": at(1.0), "gaps": len(gaps),
            "stream_errors": len(errors), "first_error": errors[0] if errors else None}


_LOOP_BUSY = "pdserve:gateway_event_loop_busy_seconds_bucket"


def _loop_stalls(url: str) -> dict[str, float]:
    """The gateway's event-loop stretches so far (services/gateway/loop_watch.py), as counts by the
    least CPU time they held the loop: {"10": stretches of 10 ms or more, "20": ..., ...}."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    below: dict[float, float] = {}
    for line in text.splitlines():
        if line.startswith(_LOOP_BUSY + "{"):
            bound = line.partition('le="')[2].partition('"')[0]
            below[float(bound)] = float(line.rpartition(" ")[2])
    total = below.pop(float("inf"), 0.0)
    return {f"{1000 * bound:g}": total - count for bound, count in sorted(below.items())}


def _stall_figures(before: dict[str, float], after: dict[str, float], bodies: int) -> dict:
    """Stretches the loop ran without a turn for other streams during a phase, over 20 ms and over
    50 ms, in all and per big body answered (CPU time on the loop: a loaded machine barely changes
    it, where it changes the gaps)."""
    over = {ms: after.get(ms, 0.0) - before.get(ms, 0.0) for ms in ("20", "50")}
    figures: dict = {f"loop_stalls_over_{ms}ms": int(count) for ms, count in over.items()}
    if bodies:
        figures.update({f"loop_stalls_over_{ms}ms_per_big_body": round(count / bodies, 2)
                        for ms, count in over.items()})
    return figures


_WORKER_ITL = "pdserve:inter_token_latency_seconds_bucket"


def _worker_itl(worker: Service) -> dict[str, float]:
    """The worker's inter-token latency histogram so far (services/worker/metrics.py: the gaps as
    its gRPC handlers relay them, before any gateway), as cumulative counts by bucket bound."""
    counts: dict[str, float] = {}
    for key, value in worker.metrics().items():
        if key.startswith(_WORKER_ITL + "{"):
            bound = key.partition('le="')[2].partition('"')[0]
            counts[bound] = counts.get(bound, 0.0) + value
    return counts


def worker_gap_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    """The worker's own gaps in a phase, and how many were over 40 and 80 ms: which side of the
    gateway a stall the clients see began on."""
    total = after.get("+Inf", 0.0) - before.get("+Inf", 0.0)
    return {"worker_gaps": int(total),
            **{f"worker_gaps_over_{ms}ms": int(total - (after.get(bound, 0.0) - before.get(bound, 0.0)))
               for ms, bound in (("40", "0.04"), ("80", "0.08"))}}


def _measure(gateway: Service, worker: Service, model: str, args: argparse.Namespace, big: bytes,
             cpus: tuple[list[int], list[int]] | None) -> dict:
    url = f"http://{gateway.address}"
    stream = chat_body(model, PROMPT, args.output_len)
    asyncio.run(_phase(url, stream, 4, None, 0))  # warm-up
    if cpus is not None:  # after the warm-up: the pool's processes and gRPC's threads exist now
        pin(psutil.Process(gateway.pid), cpus[0])
        pin(psutil.Process(worker.pid), cpus[1])
    at_start, itl_at_start = _loop_stalls(url), _worker_itl(worker)
    idle, _ = asyncio.run(_phase(url, stream, args.streams, None, 0))
    after_idle, itl_after_idle = _loop_stalls(url), _worker_itl(worker)
    began = time.perf_counter()
    uploads = worker.metric("pdserve:image_drop_uploads")
    loaded, statuses = asyncio.run(_phase(url, stream, args.streams, big, args.big_clients))
    after_loaded, itl_after_loaded = _loop_stalls(url), _worker_itl(worker)
    uploads = worker.metric("pdserve:image_drop_uploads") - uploads
    figures = {"idle": {**_gap_figures(idle), **_stall_figures(at_start, after_idle, 0),
                        **worker_gap_figures(itl_at_start, itl_after_idle)},
               "big_bodies": {**_gap_figures(loaded),
                              **_stall_figures(after_idle, after_loaded, sum(statuses.values())),
                              **worker_gap_figures(itl_after_idle, itl_after_loaded)},
               "big_body_answers": {str(k): v for k, v in sorted(statuses.items())},
               # bodies whose images reached the worker beside the call (services/common/image_drop.py)
               "image_drop_uploads": int(uploads),
               "loaded_seconds": round(time.perf_counter() - began, 1)}
    idle_p99, loaded_p99 = figures["idle"]["gap_ms_p99"], figures["big_bodies"]["gap_ms_p99"]
    figures["p99_loaded_over_idle"] = round(loaded_p99 / idle_p99, 2) if idle_p99 and loaded_p99 else None
    if idle_p99:
        # steadier than a ratio of two p99s: a stall hits every stream at once, so a handful of
        # stalls decides the loaded p99
        over = sum(1 for t in loaded if t.error is None for gap in t.gaps if 1000 * gap > 2 * idle_p99)
        figures["loaded_gaps_over_twice_idle_p99"] = over
    return figures


def run(args: argparse.Namespace) -> dict:
    ensure_model(args.model_path)
    args.workdir.mkdir(parents=True, exist_ok=True)
    gateway_model = vision_files(args.model_path, args.workdir / "vision-files")
    model = args.model_path.name
    big = big_body(model, args.body_mb)
    # The gateway measured gets the first CPU to itself (with its body-parse pool); the worker, this
    # process's streams and the big-body clients share the rest. Unpinned, the scheduler's sharing
    # of two cores among all of them decided the figure more than the gateway did.
    cpus = split_cpus() if args.pin else None
    if cpus is not None:
        os.sched_setaffinity(0, cpus[1])
    with ProcessGroup(args.workdir) as group:
        # a simulated worker: no weights, tokens at the timing model's pace
        sim = ["launch-server", "--engine", "sim", "--model-path", str(args.model_path), "--port", "0",
               "--metrics-port", "0", "--num-threads", "1", "--decode-log-interval", "0"]
        worker = group.start("worker", sim, timeout_s=600)
        gateways = {
            name: group.start(name, ["launch-router", "--model-path", str(gateway_model), "--port", "0",
                                     "--worker", f"http://{worker.address}",
                                     "--body-parse-processes", str(processes)], timeout_s=300)
            for name, processes in (("on_loop", 0), ("pool", args.body_parse_processes))}
        for gateway in gateways.values():
            deadline = time.monotonic() + 60
            while httpx.get(f"http://{gateway.address}/health", timeout=5).status_code != 200:
                if time.monotonic() > deadline:
                    raise SystemExit(f"bench big-bodies: {gateway.name} did not become ready")
                time.sleep(0.5)
        return {"body_mb": round(len(big) / 1e6, 1), "streams": args.streams, "big_clients": args.big_clients,
                "pinned": cpus is not None,
                **{name: _measure(gateway, worker, model, args, big, cpus)
                   for name, gateway in gateways.items()}}


def main(args: argparse.Namespace) -> int:
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"{report['streams']} streams at stream interval 1; {report['big_clients']} clients sending "
              f"{report['body_mb']} MB image bodies")
        for name in ("on_loop", "pool"):
            figures = report[name]
            where = "on the event loop (baseline)" if name == "on_loop" else "in the pool"
            print(f"== bodies parsed {where}")
            for phase in ("idle", "big_bodies"):
                print(f"  {phase}: " + ", ".join(f"{k}={v}" for k, v in figures[phase].items()))
            stalls = figures["big_bodies"].get("loop_stalls_over_20ms_per_big_body")
            print(f"  big-body answers: {figures['big_body_answers']}; "
                  f"p99 gap under big bodies / idle: {figures['p99_loaded_over_idle']} "
                  f"({figures.get('loaded_gaps_over_twice_idle_p99')} gaps over twice the idle p99); "
                  f"event-loop stalls over 20 ms per big body: {stalls}; "
                  f"through the worker's image drop: {figures['image_drop_uploads']}")
    errors = sum(report[name][phase]["stream_errors"] for name in ("on_loop", "pool")
                 for phase in ("idle", "big_bodies"))
    return 0 if errors == 0 else 1
