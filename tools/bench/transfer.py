"""`pdserve bench transfer`: KV page-run bandwidth of each backend between two processes,
against a plain memcpy of the same bytes measured in the same run.

For each backend a sender and a receiver process (tools.transfer_peer.worker) hold a page-major
pool of the small preset (12 layers x K/V x 16 tokens x 4 kv heads x 64 dims, fp32: 384 KiB
per page). Transfers of about 1, 16 and 256 MiB move in runs of `--run-pages` pages with a
one-page gap between runs on both sides, so each run is one engine write. Also timed: the KV of
one 2,048-token prompt (128 pages, 48 MiB), and the same bytes laid out layer-major, where a
run of pages is 2 x layers separate regions (one per layer and K/V) and so that many writes:
the number that justifies the page-major pool. Every figure is the median of `--repeats`.

The costs of the two safety checks the PD services run on every request:
- grant check: one verify_grant of the prompt's 128 destination pages (the prefill's check,
  before its first write, that decode reserved them for this room and request), always shown.
- integrity check (`--checksum`): per size, GB/s with and without page checksums on both
  sides: the sender checksums the source pages before the write, the receiver re-checksums
  the destination pages after it (KVPool.page_checksums, xxh3_64), each timed in its own
  process. Counting them as not overlapping the write is the worst case (a prefill can
  checksum a chunk while the previous one is on the wire), so the checked time is the sum of
  the three medians; timing the sum directly only buried a few percent in the write's noise.
  With it, the prompt row also shows decode's poisoning of the prompt's pages before it offers
  them to a one-sided writer (KVPool.poison: what makes the landing check sound).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from libkv.layout import KVLayout
from libkv.transfer import REAL_BACKENDS
from tools.transfer_peer.client import PeerError, PeerProcess

SMALL_PRESET = KVLayout(num_layers=12, num_kv_heads=4, head_dim=64, page_size=16, dtype="float32")
PROMPT_TOKENS = 2048
MIB = 1 << 20


@dataclass
class SizeResult:
    target_mib: int
    nbytes: int
    pages: int
    runs: int
    seconds: float
    gbps: float
    memcpy_gbps: float
    ratio: float
    # --checksum: throughput with both sides' checksums, and each side's checksum time
    checked_gbps: float | None = None
    sender_checksum_ms: float | None = None
    receiver_checksum_ms: float | None = None


@dataclass
class PromptResult:
    tokens: int
    nbytes: int
    page_major_writes: int
    page_major_ms: float
    layer_major_writes: int
    layer_major_ms: float
    verify_grant_ms: float  # one verify_grant of the prompt's destination pages (warm)
    checksum_ms: float | None = None  # --checksum: both sides' checksums of the prompt's pages
    poison_ms: float | None = None  # --checksum: decode poisoning the prompt's pages (KVPool.poison)


@dataclass
class BackendResult:
    backend: str
    sizes: list[SizeResult]
    prompt: PromptResult | None
    error: str = ""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pdserve import envs  # the entry point is where environment defaults are read

    parser.add_argument("--backend", default="all", choices=["all", *REAL_BACKENDS],
                        help="backend to measure, or all of them")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    parser.add_argument("--sizes-mib", default="1,16,256", help="comma-separated transfer sizes")
    parser.add_argument("--run-pages", type=int, default=8, help="pages per contiguous run")
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats per figure (median)")
    parser.add_argument("--checksum", action="store_true",
                        help="also measure each size with page checksums on both sides (KV integrity check)")
    parser.add_argument("--timeout-s", type=float, default=envs.TRANSFER_TIMEOUT.get())
    parser.add_argument("--nixl-backend", default=envs.NIXL_BACKEND.get())
    parser.add_argument("--nixl-threads", type=int, default=0, help="NIXL UCX plugin threads (0: default)")
    parser.add_argument("--mooncake-max-queued", type=int, default=envs.MOONCAKE_MAX_QUEUED_PER_PEER.get())


def run_pages(num_pages: int, run_pages: int, src_start: int = 0, dst_start: int = 0,
              plane_pages: int = 0, planes: int = 1) -> tuple[list[int], list[int]]:
    """Page lists of `num_pages` pages in runs of `run_pages` with a one-page gap between runs.

    With planes > 1 the same runs repeat in each of `planes` planes of `plane_pages` pages: a
    layer-major pool seen as pages of one (layer, K or V) slice.
    """
    src, dst = [], []
    for plane in range(planes):
        done, s, d = 0, src_start + plane * plane_pages, dst_start + plane * plane_pages
        while done < num_pages:
            length = min(run_pages, num_pages - done)
            src += range(s, s + length)
            dst += range(d, d + length)
            s, d, done = s + length + 1, d + length + 1, done + length
    return src, dst


def pool_pages_for(num_pages: int, run_pages: int) -> int:
    return num_pages + num_pages // run_pages + 2


def memcpy_gbps(nbytes: int, repeats: int) -> float:
    """A plain copy of `nbytes` between two pre-touched buffers in this process."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    dst.copy_(src)  # warm-up: fault in every page
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        seconds.append(time.perf_counter() - start)
    return nbytes / statistics.median(seconds) / 1e9


class _Pair:
    """A sender and a receiver process connected over one backend."""

    def __init__(self, backend: str, layout: KVLayout, num_pages: int, args: argparse.Namespace) -> None:
        options = {"nixl": {"nixl_backend": args.nixl_backend, "num_threads": args.nixl_threads},
                   "mooncake": {"max_queued_per_peer": args.mooncake_max_queued}}.get(backend, {})
        self.sender, self.receiver = PeerProcess("bench-sender"), PeerProcess("bench-receiver")
        for proc in (self.sender, self.receiver):
            proc.send("init", backend=backend, layout=layout.to_dict(), num_pages=num_pages,
                      timeout_s=args.timeout_s, options=options)
        self.sender.reply(timeout=120)
        endpoint = self.receiver.reply(timeout=120)["endpoint"]
        self.grant = os.urandom(16).hex()
        self.receiver.call("expect", key="bench", pages=list(range(num_pages)), grant=self.grant)
        self.peer = self.sender.call("connect", endpoint=endpoint)["peer"]

    def time_write(self, src: list[int], dst: list[int], repeats: int) -> tuple[float, int]:
        """Median seconds of one write + wait, after one warm-up; and its number of runs."""
        self.sender.call("bench_write", peer=self.peer, src=src, dst=dst, key="bench", grant=self.grant,
                         repeats=1, timeout=300)
        reply = self.sender.call("bench_write", peer=self.peer, src=src, dst=dst, key="bench",
                                 grant=self.grant, repeats=repeats, timeout=600)
        return statistics.median(reply["seconds"]), reply["runs"]

    def time_checksums(self, proc: PeerProcess, pages: list[int], repeats: int) -> float:
        """Median seconds of checksumming `pages` in `proc`'s pool, after one warm-up."""
        proc.call("bench_checksums", pages=pages, repeats=1, timeout=600)
        reply = proc.call("bench_checksums", pages=pages, repeats=repeats, timeout=600)
        return statistics.median(reply["seconds"])

    def time_poison(self, pages: list[int], repeats: int) -> float:
        """Median seconds of the receiver poisoning `pages`, after one warm-up."""
        self.receiver.call("bench_poison", pages=pages, repeats=1, timeout=600)
        return statistics.median(self.receiver.call("bench_poison", pages=pages, repeats=repeats,
                                                    timeout=600)["seconds"])

    def time_verify(self, dst: list[int], repeats: int) -> float:
        """Median seconds of one verify_grant of `dst`, after one warm-up."""
        self.sender.call("verify", peer=self.peer, pages=dst, key="bench", grant=self.grant)
        reply = self.sender.call("bench_verify", peer=self.peer, pages=dst, key="bench", grant=self.grant,
                                 repeats=repeats, timeout=600)
        return statistics.median(reply["seconds"])

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()


def measure_backend(backend: str, args: argparse.Namespace, sizes_mib: list[int]) -> BackendResult:
    layout, run = SMALL_PRESET, args.run_pages
    page_counts = {mib: -(-mib * MIB // layout.page_nbytes) for mib in sizes_mib}
    prompt_pages = layout.pages_for(PROMPT_TOKENS)
    pool_pages = pool_pages_for(max([*page_counts.values(), prompt_pages]), run)
    sizes: list[SizeResult] = []
    pair = _Pair(backend, layout, pool_pages, args)
    try:
        for mib, pages in page_counts.items():
            src, dst = run_pages(pages, run)
            nbytes = pages * layout.page_nbytes
            # memcpy right before the transfer: the machine's load changes over a run
            memcpy = memcpy_gbps(nbytes, args.repeats)
            seconds, runs = pair.time_write(src, dst, args.repeats)
            gbps = nbytes / seconds / 1e9
            size = SizeResult(mib, nbytes, pages, runs, seconds, gbps, memcpy, gbps / memcpy)
            if args.checksum:
                sender_s = pair.time_checksums(pair.sender, src, args.repeats)
                receiver_s = pair.time_checksums(pair.receiver, dst, args.repeats)
                size.checked_gbps = nbytes / (seconds + sender_s + receiver_s) / 1e9
                size.sender_checksum_ms, size.receiver_checksum_ms = sender_s * 1e3, receiver_s * 1e3
            sizes.append(size)
        src, dst = run_pages(prompt_pages, run)
        page_major_s, page_major_runs = pair.time_write(src, dst, args.repeats)
        verify_s = pair.time_verify(dst, args.repeats)
        prompt_checksum_s = ((pair.time_checksums(pair.sender, src, args.repeats)
                              + pair.time_checksums(pair.receiver, dst, args.repeats))
                             if args.checksum else None)
        poison_s = pair.time_poison(dst, args.repeats) if args.checksum else None
    finally:
        pair.close()

    # Layer-major: one "page" is one (layer, K or V) slice of a page, so a run of pages is
    # 2 x layers regions, one per plane of a pool with `pool_pages` pages per plane.
    planes = 2 * layout.num_layers
    slice_layout = KVLayout(num_layers=1, num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim,
                            page_size=layout.page_size // 2, dtype=layout.dtype)
    if slice_layout.page_nbytes * planes != layout.page_nbytes:
        raise ValueError(f"cannot emulate layer-major slices of {layout.describe()}")
    pair = _Pair(backend, slice_layout, pool_pages * planes, args)
    try:
        src, dst = run_pages(prompt_pages, run, plane_pages=pool_pages, planes=planes)
        layer_major_s, layer_major_runs = pair.time_write(src, dst, args.repeats)
    finally:
        pair.close()
    prompt = PromptResult(PROMPT_TOKENS, prompt_pages * layout.page_nbytes, page_major_runs,
                          page_major_s * 1e3, layer_major_runs, layer_major_s * 1e3, verify_s * 1e3,
                          None if prompt_checksum_s is None else prompt_checksum_s * 1e3,
                          None if poison_s is None else poison_s * 1e3)
    return BackendResult(backend, sizes, prompt)


def render_table(results: list[BackendResult]) -> str:
    checked = any(size.checked_gbps is not None for r in results for size in r.sizes)
    extra = " checksummed GB/s | time added | sender checksum ms | receiver checksum ms |" if checked else ""
    lines = ["| backend | size | runs | GB/s | memcpy GB/s | ratio |" + extra,
             "|---|---|---|---|---|---|" + "---|" * extra.count("|")]
    for result in results:
        if result.error:
            lines.append(f"| {result.backend} | error: {result.error} | | | | |")
        for size in result.sizes:
            line = (f"| {result.backend} | {size.nbytes / MIB:.1f} MiB | {size.runs} | {size.gbps:.2f} | "
                    f"{size.memcpy_gbps:.2f} | {size.ratio:.2f} |")
            if size.checked_gbps is not None:
                line += (f" {size.checked_gbps:.2f} | {size.gbps / size.checked_gbps - 1:+.0%} | "
                         f"{size.sender_checksum_ms:.2f} | {size.receiver_checksum_ms:.2f} |")
            lines.append(line)
    extra = " checksums ms (both sides) | poison ms (decode) |" if checked else ""
    lines += ["",
              f"| backend | {PROMPT_TOKENS}-token prompt | page-major writes | ms | layer-major writes | ms "
              "| verify_grant ms |" + extra,
              "|---|---|---|---|---|---|---|" + "---|" * extra.count("|")]
    for result in results:
        if result.prompt:
            p = result.prompt
            lines.append(f"| {result.backend} | {p.nbytes / MIB:.0f} MiB | {p.page_major_writes} | "
                         f"{p.page_major_ms:.1f} | {p.layer_major_writes} | {p.layer_major_ms:.1f} | "
                         f"{p.verify_grant_ms:.3f} |"
                         + (f" {p.checksum_ms:.2f} | {p.poison_ms:.2f} |"
                            if p.checksum_ms is not None else ""))
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)  # memcpy baseline: one core, like one engine copy
    sizes_mib = [int(s) for s in args.sizes_mib.split(",") if s]
    backends = list(REAL_BACKENDS) if args.backend == "all" else [args.backend]
    layout = SMALL_PRESET
    results = []
    for backend in backends:
        try:
            results.append(measure_backend(backend, args, sizes_mib))
        except (PeerError, TimeoutError, ImportError) as exc:
            results.append(BackendResult(backend, [], None, error=str(exc).splitlines()[0]))
    if args.json:
        print(json.dumps({"layout": layout.to_dict(), "page_nbytes": layout.page_nbytes,
                          "run_pages": args.run_pages, "repeats": args.repeats,
                          "results": [asdict(r) for r in results]}, indent=2))
    else:
        print(render_table(results))
    return 1 if any(r.error for r in results) else 0
