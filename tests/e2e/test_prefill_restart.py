"""A prefill worker killed while it pushes KV, then started again as a new process on the same host and
gRPC port (what a supervisor or a pod restart with a fixed port does). Decode knows that address; it
must not treat the new process as the old one: the requests that were in flight end with a clear
status, the pages they had reserved are freed on both sides, and the next requests through the same
address are served at once with the same greedy tokens as before the restart.
"""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tests.e2e.cluster import Cluster, wait_until, worker_args
from tests.e2e.test_pd_faults import BACKEND, BOUND_S, DECODE, SLOW_PREFILL, submit_long_prompts
from tests.e2e.test_pd_services import assert_pages_idle, prompts_of
from tests.e2e.worker_client import run_all

pytestmark = [pytest.mark.e2e, pytest.mark.alone, pytest.mark.timeout(300)]

SHORT = [40, 70, 120]
NEW_TOKENS = 6


def test_prefill_restarted_at_its_address_mid_transfer(cluster: Cluster, tiny_model):
    # Short leases, so that the old process's lease expiry may reach decode after the new process
    # registered at the same address: decode must not fail the new process's calls for it.
    cluster.env.update(PDSERVE_DISAGGREGATION_HEARTBEAT_INTERVAL="0.5",
                       PDSERVE_DISAGGREGATION_HEARTBEAT_MAX_FAILURE="2")
    bootstrap = cluster.bootstrap()
    prefill, decode = cluster.start_many([
        ("prefill", worker_args(tiny_model, "prefill", backend=BACKEND, bootstrap=bootstrap,
                                extra=SLOW_PREFILL)),
        ("decode", worker_args(tiny_model, "decode", backend=BACKEND, bootstrap=bootstrap, extra=DECODE)),
    ])
    address = prefill.address
    before = run_all(decode.address, prompts_of(SHORT), [address] * len(SHORT), max_new_tokens=NEW_TOKENS)
    assert all(r.code is None for r in before), [r.details for r in before]

    with ThreadPoolExecutor(1) as pool:
        pending = submit_long_prompts(pool, decode, prefill)
        wait_until(lambda: prefill.metric("pdserve:kv_pages_used") > 0
                   and decode.metric("pdserve:kv_pages_used") > 0,
                   BOUND_S, "prefill to be pushing KV into decode's pages")
        prefill.kill(signal.SIGKILL)
        in_flight = pending.result(timeout=BOUND_S)
    for result in in_flight:
        assert result.code == grpc.StatusCode.UNAVAILABLE, (result.code, result.details)
        # names the failed worker: the gateway retries elsewhere
        assert f"prefill {address}" in result.details
    # While nothing listens there, a request fails clearly (and decode's channel to the address
    # sees refused connections: it must not keep that state for the new process).
    (down,) = run_all(decode.address, prompts_of([40]), [address], max_new_tokens=NEW_TOKENS)
    assert down.code == grpc.StatusCode.UNAVAILABLE, (down.code, down.details)

    port_args = (*SLOW_PREFILL, "--port", str(prefill.port))  # the last --port wins
    restarted = cluster.restart(prefill, args=worker_args(tiny_model, "prefill", backend=BACKEND,
                                                          bootstrap=bootstrap, extra=port_args))
    assert restarted.address == address and restarted.pid != prefill.pid
    after = run_all(decode.address, prompts_of(SHORT), [address] * len(SHORT), max_new_tokens=NEW_TOKENS)
    assert [(r.code, r.details) for r in after] == [(None, "")] * len(SHORT)
    assert [r.tokens for r in after] == [r.tokens for r in before]
    assert_pages_idle(decode, restarted, timeout_s=BOUND_S)
    # Past the old process's lease (if it had not been replaced already), the new one still serves.
    wait_until(lambda: bootstrap.metric("pdserve:bootstrap_workers", role="prefill") == 1, BOUND_S,
               "the registry to hold one prefill worker")
    again = run_all(decode.address, prompts_of(SHORT), [address] * len(SHORT), max_new_tokens=NEW_TOKENS)
    assert [r.tokens for r in again] == [r.tokens for r in before]
    assert_pages_idle(decode, restarted, timeout_s=BOUND_S)
