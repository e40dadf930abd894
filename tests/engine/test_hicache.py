"""The store tier (--enable-hierarchical-cache, libkv/store/) against a real mooncake_master on a
free loopback port: a prompt computed on one engine is fetched from Mooncake Store by a second
engine that never saw it, and greedy output and logprobs are those of an engine without the store,
bit for bit (fp32, C++ kernels; 1e-4 on the torch ops). A stored entry with flipped bytes is a
counted corrupt miss and the answer stays exact; with the master killed requests are computed
without the store, the tier says it is down, and it comes back when the master does.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.sampling import SamplingParams
from kernels import cpu_kernels, ops
from pdserve.page_hash import page_hashes
from services.worker.metrics import WorkerMetrics
from tests.engine.conftest import generate, prefill_first_token, random_prompts, run_in_turn, start_engine

PAGE = 16
GREEDY = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True, logprobs=True)
MASTER = Path(sys.executable).parent / "mooncake_master"

pytestmark = pytest.mark.skipif(not MASTER.exists() and shutil.which("mooncake_master") is None,
                                reason="mooncake_master (the Mooncake wheel) is not installed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Master:
    """A mooncake_master process on 127.0.0.1; `restart` starts it again on the same port (empty)."""

    def __init__(self, log_dir: Path, port: int | None = None, start: bool = True) -> None:
        self.port = port or _free_port()
        self.log_dir = log_dir
        self.process: subprocess.Popen | None = None
        if start:
            self.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        binary = str(MASTER) if MASTER.exists() else shutil.which("mooncake_master")
        log = open(self.log_dir / f"master-{time.monotonic_ns()}.log", "w")
        # Its HTTP metrics port too (default 9003): two masters on one host must not share it.
        self.process = subprocess.Popen([binary, "-rpc_port", str(self.port),
                                         "-metrics_port", str(_free_port())],
                                        stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # ready once it listens
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            assert self.process.poll() is None, "mooncake_master exited at start"
            time.sleep(0.05)
        raise AssertionError("mooncake_master did not listen within 30 s")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    master = Master(tmp_path_factory.mktemp("mooncake"))
    yield master
    master.kill()


def wait_for(condition, what: str, seconds: float = 60.0) -> None:
    """Poll until `condition()` (a bound on a background thread's progress, not a timing assertion)."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def hicache_engine(ckpt, master: Master, **overrides):
    engine = start_engine(ckpt, dtype="float32", page_size=PAGE, chunked_prefill_size=64, num_pages=128,
                          enable_hierarchical_cache=True, hicache_mooncake_master=master.address,
                          hicache_mooncake_segment_mb=32, **overrides)
    wait_for(lambda: engine.hicache.up, "the store tier to connect")
    return engine


def assert_same(got, expected) -> None:
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    for (_, logprobs), (_, reference) in zip(got, expected, strict=True):
        if cpu_kernels.available():
            assert logprobs == reference
        else:
            assert logprobs == pytest.approx(reference, abs=1e-4)


@pytest.fixture(scope="module")
def reference(qwen3_ckpt):
    engine = start_engine(qwen3_ckpt, dtype="float32", page_size=PAGE, chunked_prefill_size=64, num_pages=128,
                          disable_radix_cache=True)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def writer(qwen3_ckpt, master):
    engine = hicache_engine(qwen3_ckpt, master)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def reader(qwen3_ckpt, master):
    engine = hicache_engine(qwen3_ckpt, master)
    yield engine
    engine.shutdown()


def scrape(engine) -> dict[str, float]:
    """The worker's hicache metrics as /metrics shows them (name -> value; the histogram's count)."""
    metrics = WorkerMetrics("colocated", "tiny")
    metrics.store_tier(engine.hicache)
    values = {}
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for sample in family.samples:
            values[sample.name] = sample.value
    return values


def full_pages(prompts) -> int:
    return sum((len(p) - 1) // PAGE for p in prompts)


def test_second_engine_fetches_pages_and_answers_exactly(reference, writer, reader):
    prompts = random_prompts([3 * PAGE + 5, 2 * PAGE, 5 * PAGE + 1], seed=11)
    expected = asyncio.run(run_in_turn(reference, prompts, GREEDY))
    assert_same(asyncio.run(run_in_turn(writer, prompts, GREEDY)), expected)
    assert writer.hicache.stats.hit_pages == 0
    # Prompt pages are written through as they are computed; the decoded ones when a request ends.
    wait_for(lambda: writer.hicache.stats.pages_written >= full_pages(prompts), "the write-through")
    assert writer.hicache.stats.bytes_written \
        == writer.hicache.stats.pages_written * writer.pool.layout.page_nbytes

    got = asyncio.run(run_in_turn(reader, prompts, GREEDY))
    assert_same(got, expected)
    stats = reader.hicache.stats
    assert stats.hit_pages == full_pages(prompts)  # every leading page came from the store
    assert stats.bytes_read == stats.hit_pages * reader.pool.layout.page_nbytes
    assert stats.corrupt == 0 and stats.errors == 0 and stats.fetch_count == len(prompts)
    seen = scrape(reader)
    assert seen["pdserve:hicache_hit_pages_total"] == full_pages(prompts)
    assert seen["pdserve:hicache_read_bytes_total"] == stats.bytes_read
    assert seen["pdserve:hicache_fetch_latency_seconds_count"] == len(prompts)
    assert seen["pdserve:hicache_store_up"] == 1
    assert scrape(writer)["pdserve:hicache_written_pages_total"] == writer.hicache.stats.pages_written
    assert reader.stats().used_pages == 0 and writer.stats().used_pages == 0  # every page back to idle


def test_flipped_bytes_are_a_counted_miss_and_the_answer_is_exact(qwen3_ckpt, reference, writer, reader,
                                                                  master):
    from mooncake.store import MooncakeDistributedStore

    prompt = random_prompts([4 * PAGE + 3], seed=23)
    expected = asyncio.run(run_in_turn(reference, prompt, GREEDY))
    written = writer.hicache.stats.pages_written
    asyncio.run(run_in_turn(writer, prompt, GREEDY))
    wait_for(lambda: writer.hicache.stats.pages_written >= written + 4, "the write-through")

    # Flip one byte in the middle of the second page's stored KV bytes, through a client of our own
    # (kept until the reader has fetched: the rewritten entry may live in this client's segment).
    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", master.address) == 0
    try:
        key = writer.hicache.identity.key(page_hashes(prompt[0], PAGE)[1])
        value = bytearray(store.get(key))
        assert value, "the page was not in the store"
        value[len(value) // 2] ^= 0x40
        assert store.upsert(key, bytes(value)) == 0
        assert store.get(key) == bytes(value)

        hits, corrupt = reader.hicache.stats.hit_pages, reader.hicache.stats.corrupt
        assert_same(asyncio.run(run_in_turn(reader, prompt, GREEDY)), expected)
    finally:
        store.close()
    assert reader.hicache.stats.corrupt == corrupt + 1
    assert scrape(reader)["pdserve:hicache_corrupt_entries_total"] == corrupt + 1
    assert reader.hicache.stats.hit_pages == hits + 1  # the page before the corrupt one only
    # The reader computed the page again and overwrote the bad entry: a third fetch finds all four.
    wait_for(lambda: reader.hicache.repairs_pending == 0, "the corrupt entry to be overwritten")
    fresh = hicache_engine(qwen3_ckpt, master)
    try:
        assert_same(asyncio.run(run_in_turn(fresh, prompt, GREEDY)), expected)
        assert fresh.hicache.stats.hit_pages == 4 and fresh.hicache.stats.corrupt == 0
    finally:
        fresh.shutdown()
    assert reader.stats().used_pages == 0


def test_decode_writes_a_finished_request_so_the_next_turn_is_fetched(reference, writer, reader):
    """PD in process (tests/engine/test_pd_hooks.py): `reference` prefills, `writer` decodes with the
    store on. The decoded request's pages, prompt and answer, are written when it finishes, so the
    conversation's next turn, on an engine that saw neither, fetches them all."""
    prompt = random_prompts([2 * PAGE + 7], seed=41)[0]
    params = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True, logprobs=True)
    written = writer.hicache.stats.pages_written
    answer = asyncio.run(pd_generate(reference, writer, prompt, params, "turn1"))
    assert answer == asyncio.run(run_in_turn(reference, [prompt], params))[0][0]
    computed = len(prompt) + len(answer) - 1  # the last sampled token is never fed back
    wait_for(lambda: writer.hicache.stats.pages_written >= written + computed // PAGE,
             "the decode side's write-through")

    turn2 = [prompt + answer + random_prompts([9], seed=43)[0]]
    hits = reader.hicache.stats.hit_pages
    got = asyncio.run(run_in_turn(reader, turn2, GREEDY))
    assert reader.hicache.stats.hit_pages == hits + computed // PAGE
    # The answer's K/V came from the decode kernel, the reference computes it with the extend kernel:
    # tokens equal, logprobs to 1e-4 (as for a retracted request: tests/engine/test_prefix_cache_exact.py).
    expected = asyncio.run(run_in_turn(reference, turn2, GREEDY))
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    assert got[0][1] == pytest.approx(expected[0][1], abs=1e-4)
    # Bit for bit what the decode worker's own prefix cache gives: the store changes nothing.
    assert_same(got, asyncio.run(run_in_turn(writer, turn2, GREEDY)))
    assert writer.stats().used_pages == 0 and reader.stats().used_pages == 0


async def pd_generate(prefill, decode, prompt, params, room) -> list[int]:
    """Prefill on one engine, pages copied into the decode engine's reservation, decode there."""
    dst_pages = decode.reserve(room, len(prompt))
    filled = []
    first = await prefill_first_token(prefill, prompt, params, room,
                                      lambda pages, n: filled.append(list(pages)))
    ops.scatter_pages(decode.pool.buffer, dst_pages[:len(filled[-1])],
                      ops.gather_pages(prefill.pool.buffer, filled[-1]))
    assert prefill.release(room)
    return [o.token_id async for o in generate(decode, prompt, params, room, first_token=first)]


def test_a_prefill_worker_sends_decode_the_pages_it_fetched(reference, writer, reader):
    """PD in process with the store on the prefill side: `reader` prefills a prompt `writer` computed,
    fetching its leading pages; its page reports (what prefill transfers) include them, and the
    decode engine (`reference`, no cache) answers as it does colocated."""
    prompt = random_prompts([3 * PAGE + 11], seed=47)[0]
    expected = asyncio.run(run_in_turn(reference, [prompt], GREEDY))
    written = writer.hicache.stats.pages_written
    asyncio.run(run_in_turn(writer, [prompt], GREEDY))
    wait_for(lambda: writer.hicache.stats.pages_written >= written + 3, "the write-through")
    hits = reader.hicache.stats.hit_pages
    tokens = asyncio.run(pd_generate(reader, reference, prompt, GREEDY, "fetched-prefill"))
    assert reader.hicache.stats.hit_pages == hits + 3
    assert tokens == expected[0][0]
    assert reader.stats().used_pages == 0 and reference.stats().used_pages == 0


def test_a_full_write_queue_drops_pages_and_leaks_none(qwen3_ckpt, reference, master):
    """A one-page write queue: pages offered while it is full are dropped and counted, never waited
    for (6 of 10 in one run); every offered page is either written or dropped, and every page returns to
    idle."""
    engine = hicache_engine(qwen3_ckpt, master, hicache_write_queue_pages=1)
    try:
        prompts = random_prompts([5 * PAGE + 2, 4 * PAGE + 9], seed=59)
        assert_same(asyncio.run(run_in_turn(engine, prompts, GREEDY)),
                    asyncio.run(run_in_turn(reference, prompts, GREEDY)))
        offered = sum((len(p) + GREEDY.max_new_tokens - 1) // PAGE for p in prompts)
        stats = engine.hicache.stats
        wait_for(lambda: stats.pages_written + stats.dropped_pages == offered,
                 "every offered page written or dropped")
        assert engine.stats().used_pages == 0
    finally:
        engine.shutdown()


def test_a_frozen_master_costs_a_bounded_wait_and_the_tier_comes_back(reference, reader, master):
    """SIGSTOP: the master keeps its connections but answers nothing, so only the tier's own bound
    (--hicache-timeout) ends each call."""
    prompts = random_prompts([2 * PAGE + 3], seed=53)
    expected = asyncio.run(run_in_turn(reference, prompts, GREEDY))
    wait_for(lambda: reader.hicache.up, "the store tier to be up")
    errors = reader.hicache.stats.errors
    master.process.send_signal(signal.SIGSTOP)
    try:
        assert_same(asyncio.run(run_in_turn(reader, prompts, GREEDY)), expected)
        assert not reader.hicache.up and reader.hicache.stats.errors > errors
        assert reader.stats().used_pages == 0
    finally:
        master.process.send_signal(signal.SIGCONT)
    wait_for(lambda: reader.hicache.up, "the probe to find the master again")


def test_master_killed_requests_succeed_and_the_tier_comes_back(reference, reader, master):
    prompts = random_prompts([3 * PAGE + 2, 2 * PAGE + 9], seed=31)
    expected = asyncio.run(run_in_turn(reference, prompts, GREEDY))
    wait_for(lambda: reader.hicache.up, "the store tier to be up")
    master.kill()
    try:
        assert_same(asyncio.run(run_in_turn(reader, prompts, GREEDY)), expected)
        assert not reader.hicache.up
        assert scrape(reader)["pdserve:hicache_store_up"] == 0
        assert reader.hicache.stats.errors >= 1
        assert reader.stats().used_pages == 0
    finally:
        master.start()
    wait_for(lambda: reader.hicache.up, "the probe to find the restarted master")
    assert scrape(reader)["pdserve:hicache_store_up"] == 1
    written = reader.hicache.stats.pages_written
    more = random_prompts([3 * PAGE + 1], seed=37)
    assert_same(asyncio.run(run_in_turn(reader, more, GREEDY)),
                asyncio.run(run_in_turn(reference, more, GREEDY)))
    wait_for(lambda: reader.hicache.stats.pages_written >= written + 3, "writes to resume")


@pytest.mark.timeout(60)  # Mooncake's setup, called with no master, would hold the GIL for 90 s
def test_a_worker_started_before_its_master_serves_and_connects_later(qwen3_ckpt, reference, tmp_path):
    later = Master(tmp_path, start=False)
    engine = start_engine(qwen3_ckpt, dtype="float32", page_size=PAGE, chunked_prefill_size=64, num_pages=128,
                          enable_hierarchical_cache=True, hicache_mooncake_master=later.address,
                          hicache_mooncake_segment_mb=32)
    try:
        prompts = random_prompts([2 * PAGE + 1], seed=61)
        expected = asyncio.run(run_in_turn(reference, prompts, GREEDY))
        for _ in range(3):  # the probe keeps failing meanwhile; every request is computed
            assert_same(asyncio.run(run_in_turn(engine, prompts, GREEDY)), expected)
        assert not engine.hicache.up
        wait_for(lambda: engine.hicache.stats.errors >= 2, "the probe to retry")
        later.start()
        wait_for(lambda: engine.hicache.up, "the probe to connect")
        assert_same(asyncio.run(run_in_turn(engine, prompts, GREEDY)), expected)
    finally:
        engine.shutdown()
        later.kill()
