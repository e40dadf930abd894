"""Failures of real PD processes: each ends with a clear status to the caller within the configured
bound, and every surviving worker's KV pages in use (read from /metrics) back at zero.

- kill -9 of the decode worker while prefill is pushing KV to it;
- kill -9 of the prefill worker in the middle of a prompt;
- a prefill worker that stops heartbeating (SIGSTOP): its lease expires and decode fails the
  requests waiting on it instead of waiting for their deadline.
The prompts are long and the prefill chunks small, so the window in which to fail is seconds wide.
"""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tests.e2e.cluster import Cluster, Proc, wait_until, worker_args
from tests.e2e.test_pd_services import assert_pages_idle, prompts_of
from tests.e2e.worker_client import run_all

pytestmark = [pytest.mark.e2e, pytest.mark.alone, pytest.mark.timeout(300)]

BACKEND = "mooncake"
LONG = [3000] * 4  # 4 prompts x 188 chunks of 16 tokens: seconds of prefill on the tiny model
SLOW_PREFILL = ("--chunked-prefill-size", "16", "--num-pages", "1024", "--transfer-timeout", "5")
DECODE = ("--num-pages", "1024", "--transfer-timeout", "5")
BOUND_S = 30.0  # every failure must reach the caller (and free its pages) well within this


def start_pair(cluster: Cluster, model, *, bootstrap: Proc | None = None,
               decode_extra: tuple[str, ...] = ()) -> tuple[Proc, Proc]:
    return tuple(cluster.start_many([
        ("prefill", worker_args(model, "prefill", backend=BACKEND, bootstrap=bootstrap, extra=SLOW_PREFILL)),
        ("decode", worker_args(model, "decode", backend=BACKEND, bootstrap=bootstrap,
                               extra=DECODE + decode_extra)),
    ]))


def submit_long_prompts(pool: ThreadPoolExecutor, decode: Proc, prefill: Proc):
    return pool.submit(run_all, decode.address, prompts_of(LONG, seed=3), [prefill.address] * len(LONG),
                       max_new_tokens=4, timeout_s=BOUND_S * 2)


def test_decode_killed_while_prefill_pushes(cluster: Cluster, tiny_model):
    prefill, decode = start_pair(cluster, tiny_model)
    with ThreadPoolExecutor(1) as pool:
        pending = submit_long_prompts(pool, decode, prefill)
        wait_until(lambda: prefill.metric("pdserve:kv_pages_used") > 0, BOUND_S, "prefill to start pushing")
        decode.kill(signal.SIGKILL)
        killed_at = time.monotonic()
        results = pending.result(timeout=BOUND_S)
    assert all(r.code == grpc.StatusCode.UNAVAILABLE for r in results), [(r.code, r.details) for r in results]
    assert_pages_idle(prefill, timeout_s=BOUND_S)
    assert time.monotonic() - killed_at < BOUND_S
    assert prefill.alive()
    # The leak detector runs in every worker (the cluster fixture fails the test if it fired).
    assert any(key.startswith("pdserve:kv_leak_detections_total") for key in prefill.metrics())
    # The prefill worker is still usable: a new decode worker gets correct service from it.
    new_decode = cluster.start("decode2", worker_args(tiny_model, "decode", backend=BACKEND, extra=DECODE))
    (result,) = run_all(new_decode.address, prompts_of([40]), [prefill.address], max_new_tokens=4)
    assert result.code is None and len(result.tokens) == 4
    assert_pages_idle(prefill, new_decode)


def test_prefill_killed_mid_prompt(cluster: Cluster, tiny_model):
    prefill, decode = start_pair(cluster, tiny_model)
    with ThreadPoolExecutor(1) as pool:
        pending = submit_long_prompts(pool, decode, prefill)
        wait_until(lambda: prefill.metric("pdserve:queue_requests", queue="waiting") > 0, BOUND_S,
                   "prompts to be running on prefill")
        prefill.kill(signal.SIGKILL)
        results = pending.result(timeout=BOUND_S)
    for result in results:
        assert result.code == grpc.StatusCode.UNAVAILABLE, (result.code, result.details)
        assert f"prefill {prefill.address}" in result.details  # names the failed worker: retryable elsewhere
    assert_pages_idle(decode, timeout_s=BOUND_S)
    assert decode.alive()
    assert decode.metric("pdserve:pd_failures_total") >= len(LONG)


def test_prefill_that_stops_heartbeating_fails_its_requests(cluster: Cluster, tiny_model):
    # Finding 8.3. Leases of 1 s (0.5 s heartbeats, 2 missed). Decode's own deadline for a Prefill
    # call is 2 x 60 s and the transfer timeout (which used to bound decode's wait for the frozen
    # prefill's Abort) is 60 s, so prompts answered within BOUND_S were failed by the lease at once.
    cluster.env.update(PDSERVE_DISAGGREGATION_HEARTBEAT_INTERVAL="0.5",
                       PDSERVE_DISAGGREGATION_HEARTBEAT_MAX_FAILURE="2")
    bootstrap = cluster.bootstrap()
    patient = ("--bootstrap-timeout", "60", "--waiting-timeout", "60", "--transfer-timeout", "60")
    prefill, decode = start_pair(cluster, tiny_model, bootstrap=bootstrap, decode_extra=patient)
    try:
        with ThreadPoolExecutor(1) as pool:
            pending = submit_long_prompts(pool, decode, prefill)
            wait_until(lambda: prefill.metric("pdserve:queue_requests", queue="waiting") > 0, BOUND_S,
                       "prompts to be running on prefill")
            prefill.popen.send_signal(signal.SIGSTOP)
            stopped_at = time.monotonic()
            results = pending.result(timeout=BOUND_S)
        assert time.monotonic() - stopped_at < BOUND_S
        for result in results:
            assert result.code == grpc.StatusCode.UNAVAILABLE, (result.code, result.details)
            assert "stopped heartbeating" in result.details, result.details
        # The frozen prefill may still hold KV writes it will finish when it runs again (a
        # one-sided engine cannot recall them): decode keeps the rooms' pages quarantined meanwhile.
        assert decode.metric("pdserve:kv_pages_used") > 0
        prefill.popen.send_signal(signal.SIGCONT)
        # Thawed, the prefill answers decode's retried Abort: every page returns, on both sides.
        assert_pages_idle(decode, prefill, timeout_s=BOUND_S)
        (result,) = run_all(decode.address, prompts_of([40]), [prefill.address], max_new_tokens=4)
        assert result.code is None and len(result.tokens) == 4
    finally:
        prefill.popen.send_signal(signal.SIGKILL)
