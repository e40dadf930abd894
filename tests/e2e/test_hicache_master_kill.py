"""mooncake_master killed, restarted and frozen while multi-turn chat runs through two workers that
share it (`--enable-hierarchical-cache --hicache-storage-backend mooncake`).

Clients talk continuously: each conversation's turns alternate between the two store workers (so a
turn's worker fetches the previous turn from the store), and every turn is also sent to a reference
worker with no cache at all; the answers must be greedy-identical (fp32: the same tokens, logprobs
within 1e-4: prompts split at other points and other batches round differently). Meanwhile the test
  1. waits for store hits (the store serves),
  2. SIGKILLs the master: both workers report `pdserve:hicache_store_up` 0 and keep answering,
  3. starts a master again on the same port (empty): `hicache_store_up` returns to 1 and the hit
     counter grows again (the workers write to the new master and fetch from it),
  4. SIGSTOPs the master for a few seconds (calls hang rather than fail; the client's bound cuts
     them), then SIGCONT: no request fails, and the store is up again afterwards.
Zero failed requests and zero differing answers throughout; pages idle at the end (the cluster
fixture also checks the leak detector). Every wait is bounded by a deadline; nothing asserts on timing.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import threading
import time
from dataclasses import dataclass, field

import pytest

from protos.v1 import worker_pb2_grpc
from services.common.channels import open_channel
from services.common.security import GrpcSecurity
from tests.e2e.cluster import Cluster, wait_until, worker_args
from tests.e2e.test_pd_services import assert_pages_idle
from tests.e2e.worker_client import generate
from tests.engine.test_hicache import MASTER, Master

pytestmark = [pytest.mark.e2e, pytest.mark.alone, pytest.mark.timeout(300),
              pytest.mark.skipif(not MASTER.exists(),
                                 reason="mooncake_master (the Mooncake wheel) is not installed")]

POOL = ("--num-pages", "512", "--chunked-prefill-size", "64", "--dtype", "float32")
CLIENTS = 3
TURNS = 3
NEW_TOKENS = 16
FROZEN_S = 3.0
LOGPROB_TOL = 1e-4


@dataclass
class Load:
    """Conversations sent by CLIENTS concurrent clients until `stop` is set. Counts per phase."""

    store_workers: list[str]
    reference: str
    phase: str = "start"
    stop: threading.Event = field(default_factory=threading.Event)
    answered: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)

    def run(self) -> None:
        asyncio.run(self._clients())

    async def _clients(self) -> None:
        security = GrpcSecurity()
        async with contextlib.AsyncExitStack() as stack:
            enter = stack.enter_async_context
            stubs = [worker_pb2_grpc.WorkerStub(await enter(open_channel(address, security)))
                     for address in self.store_workers]
            reference = worker_pb2_grpc.WorkerStub(await enter(open_channel(self.reference, security)))
            await asyncio.gather(*(self._client(i, stubs, reference) for i in range(CLIENTS)))

    async def _client(self, index: int, stubs, reference) -> None:
        rng = random.Random(index)
        conversation = 0
        while not self.stop.is_set():
            history = [rng.randrange(10, 4000) for _ in range(40)]
            for turn in range(TURNS):
                prompt = history + [rng.randrange(10, 4000) for _ in range(12)]
                phase = self.phase
                got, want = await asyncio.gather(
                    generate(stubs[(index + conversation + turn) % 2], prompt, max_new_tokens=NEW_TOKENS),
                    generate(reference, prompt, max_new_tokens=NEW_TOKENS))
                where = f"client {index} conversation {conversation} turn {turn} ({phase})"
                if got.code is not None or want.code is not None:
                    self.failures.append(f"{where}: {got.code} {got.details}"
                                         f" / reference {want.code} {want.details}")
                    return
                # Tokens exactly; logprobs closely, not bit for bit: a turn's prompt is split at
                # another point here (local and store hits) and batched with other clients' turns.
                if got.tokens != want.tokens or got.logprobs != pytest.approx(want.logprobs, abs=LOGPROB_TOL):
                    self.mismatches.append(f"{where}: {got.tokens} {got.logprobs}"
                                           f" != {want.tokens} {want.logprobs}")
                self.answered[phase] = self.answered.get(phase, 0) + 1
                history = prompt + got.tokens
            conversation += 1


def test_store_master_killed_restarted_and_frozen_under_load(cluster: Cluster, tiny_model, tmp_path):
    master = Master(tmp_path)
    try:
        _scenario(cluster, tiny_model, master)
    finally:
        if master.process is not None and master.process.poll() is None:
            master.process.send_signal(signal.SIGCONT)  # never leave it frozen, should the test stop mid-way
        master.kill()


def _scenario(cluster: Cluster, tiny_model, master: Master) -> None:
    store = ("--enable-hierarchical-cache", "--hicache-storage-backend", "mooncake",
             "--hicache-mooncake-master", master.address, "--hicache-mooncake-segment-mb", "32")
    reference, first, second = cluster.start_many([
        ("reference", worker_args(tiny_model, "null", extra=(*POOL, "--disable-radix-cache"))),
        ("first", worker_args(tiny_model, "null", extra=(*POOL, *store))),
        ("second", worker_args(tiny_model, "null", extra=(*POOL, *store))),
    ])
    workers = (first, second)

    def store_up(value: int) -> bool:
        return all(w.metric("pdserve:hicache_store_up") == value for w in workers)

    def hits() -> float:
        return sum(w.metric("pdserve:hicache_hit_pages_total") for w in workers)

    wait_until(lambda: store_up(1), 60, "both workers to reach the store")
    load = Load([first.address, second.address], reference.address)
    thread = threading.Thread(target=load.run, name="chat-load", daemon=True)
    thread.start()
    try:
        load.phase = "store up"
        wait_until(lambda: hits() > 0 or not thread.is_alive(), 60, "store hits before the kill")

        load.phase = "master killed"
        master.kill()  # SIGKILL
        wait_until(lambda: store_up(0) or not thread.is_alive(), 60, "hicache_store_up 0 on both workers")
        answered = load.answered.get("master killed", 0)
        wait_until(lambda: load.answered.get("master killed", 0) >= answered + 2 * CLIENTS
                   or not thread.is_alive(), 60, "answers while the store is down")

        master.start()  # the same port, empty
        load.phase = "master restarted"
        wait_until(lambda: store_up(1) or not thread.is_alive(), 60,
                   "hicache_store_up 1 again after the restart")
        after_restart = hits()
        wait_until(lambda: hits() > after_restart or not thread.is_alive(), 60,
                   "store hits after the restart")

        load.phase = "master frozen"
        answered = load.answered.get("master frozen", 0)
        master.process.send_signal(signal.SIGSTOP)
        time.sleep(FROZEN_S)  # the load runs on meanwhile
        master.process.send_signal(signal.SIGCONT)
        load.phase = "master thawed"
        wait_until(lambda: store_up(1) or not thread.is_alive(), 90, "hicache_store_up 1 after SIGCONT")
        wait_until(lambda: load.answered.get("master thawed", 0) >= 2 * CLIENTS or not thread.is_alive(),
                   60, "answers after the thaw")
    finally:
        load.stop.set()
        thread.join(timeout=120)
    assert not thread.is_alive(), "the clients did not finish"
    assert load.failures == [], load.failures
    print("answered per phase:", load.answered)
    assert load.mismatches == [], load.mismatches
    for phase in ("store up", "master killed", "master restarted", "master frozen", "master thawed"):
        assert load.answered.get(phase, 0) > 0, (phase, load.answered)
    assert all(w.metric("pdserve:hicache_corrupt_entries_total") == 0 for w in workers)
    assert all(w.metric("pdserve:hicache_store_errors_total") > 0 for w in workers)
    assert_pages_idle(reference, first, second)
