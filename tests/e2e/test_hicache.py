"""The store tier across real worker processes: two colocated workers started with
`--enable-hierarchical-cache --hicache-storage-backend mooncake --hicache-mooncake-master` and a
mooncake_master on a free port. Prompts computed on the first are fetched from Mooncake Store by
the second, which never saw them (its /metrics count every leading page as a store hit), and both
answer with the tokens and logprobs of a worker without any cache. Pages return to idle and the
leak detector stays quiet (the cluster fixture checks it).
"""

from __future__ import annotations

import signal

import pytest

from kernels import cpu_kernels
from tests.e2e.cluster import Cluster, wait_until, worker_args
from tests.e2e.test_pd_services import assert_pages_idle, prompts_of
from tests.e2e.worker_client import run_all
from tests.engine.test_hicache import MASTER, Master

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300),
              pytest.mark.skipif(not MASTER.exists(),
                                 reason="mooncake_master (the Mooncake wheel) is not installed")]

PAGE = 16
NEW_TOKENS = 8
POOL = ("--num-pages", "256", "--chunked-prefill-size", "64", "--dtype", "float32")


@pytest.fixture
def master(tmp_path):
    master = Master(tmp_path)
    yield master
    master.kill()


def test_a_second_worker_fetches_what_the_first_computed(cluster: Cluster, tiny_model, master):
    store = ("--enable-hierarchical-cache", "--hicache-storage-backend", "mooncake",
             "--hicache-mooncake-master", master.address, "--hicache-mooncake-segment-mb", "32")
    reference, first, second = cluster.start_many([
        ("reference", worker_args(tiny_model, "null", extra=(*POOL, "--disable-radix-cache"))),
        ("first", worker_args(tiny_model, "null", extra=(*POOL, *store))),
        ("second", worker_args(tiny_model, "null", extra=(*POOL, *store))),
    ])
    for worker in (first, second):
        wait_until(lambda worker=worker: worker.metric("pdserve:hicache_store_up") == 1, 60,
                   f"{worker.name}'s store")
    prompts = prompts_of([100, 57, 33], seed=17)
    full_pages = sum((len(p) - 1) // PAGE for p in prompts)
    expected = run_all(reference.address, prompts, max_new_tokens=NEW_TOKENS)

    def same(results) -> None:
        for got, want in zip(results, expected, strict=True):
            assert got.code is None, got.details
            assert got.tokens == want.tokens
            if cpu_kernels.available():
                assert got.logprobs == want.logprobs
            else:
                assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)

    same(run_all(first.address, prompts, max_new_tokens=NEW_TOKENS))
    wait_until(lambda: first.metric("pdserve:hicache_written_pages_total") >= full_pages, 60,
               "the write-through")
    same(run_all(second.address, prompts, max_new_tokens=NEW_TOKENS))
    assert second.metric("pdserve:hicache_hit_pages_total") == full_pages
    assert second.metric("pdserve:hicache_corrupt_entries_total") == 0
    assert second.metric("pdserve:hicache_fetch_latency_seconds_count") == len(prompts)
    assert first.metric("pdserve:hicache_hit_pages_total") == 0
    assert_pages_idle(first, second)
    # With the master gone, SIGTERM still stops each worker within the 10 s `pdserve up` gives a
    # process before SIGKILL. Mooncake's store teardown, when the worker ran it, held the GIL until
    # its unmount RPC to the master failed: 19 s for the first worker here.
    master.kill()
    for worker in (second, first):
        assert worker.kill(signal.SIGTERM, wait_s=10), \
            f"{worker.name} outlived SIGTERM:\n{worker.log()[-3000:]}"
        assert worker.popen.returncode == 0, worker.log()[-3000:]
