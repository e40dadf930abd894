"""Finding 9.1: nobody can make a prefill write pages that decode did not reserve for that request.

The attack of the finding, on mooncake and nixl (one-sided engines, where the receiver cannot
refuse a write): learn decode's transfer endpoint from the registry, then call Prefill on the
prefill worker naming it and pages 0-23, which belong to other rooms while greedy load runs
through the gateway. Without the cluster secret every call is refused (UNAUTHENTICATED); with it,
every call is refused before anything is written (PERMISSION_DENIED: decode never granted those
pages to that room), and every concurrent answer stays identical to its fault-free text. Also
against a decode with DP attention, whose groups each guard their own pool.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from protos.v1 import bootstrap_pb2, bootstrap_pb2_grpc, common_pb2, worker_pb2, worker_pb2_grpc
from services.common.channels import open_channel
from services.common.security import GrpcSecurity
from tests.e2e.cluster import Cluster, wait_until, worker_args
from tests.e2e.test_pd_services import assert_pages_idle

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

SECRET = "forged-write-test-secret"
PAGES = list(range(24))  # the attacker's destination: the pages other rooms get first
PROMPT = list(range(100, 100 + 24 * 16))  # needs exactly 24 pages of 16 tokens
FORGED_CALLS = 150
CLIENTS = 4
QUESTIONS = [f"Question {i}: tell me about the river, the bridge and the old mill number {i}." * 3
             for i in range(8)]


def answer(gateway_address: str, question: str) -> str:
    reply = httpx.post(f"http://{gateway_address}/v1/chat/completions", timeout=120, json={
        "model": "tiny", "messages": [{"role": "user", "content": question}], "max_tokens": 24,
        "temperature": 0})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["message"]["content"]


async def forge(registry_address: str, prefill_address: str, security: GrpcSecurity, calls: int
                ) -> dict[grpc.StatusCode, int]:
    """The attack: Prefill calls that name decode's endpoint and pages of other rooms."""
    codes: dict[grpc.StatusCode, int] = {}
    async with open_channel(registry_address, security) as channel:
        try:
            listed = await bootstrap_pb2_grpc.BootstrapStub(channel).List(
                bootstrap_pb2.ListRequest(role=common_pb2.WORKER_ROLE_DECODE), timeout=10)
            endpoint = listed.workers[0].transfer_endpoint
        except grpc.aio.AioRpcError as exc:
            return {exc.code(): calls}  # without the secret the registry tells nothing
    async with open_channel(prefill_address, security) as channel:
        stub = worker_pb2_grpc.PrefillStub(channel)
        for index in range(calls):
            request = worker_pb2.PrefillRequest(
                room=f"forged-{index}", prompt_token_ids=PROMPT, model="tiny", dst_page_ids=PAGES,
                dst=endpoint, sampling=common_pb2.SamplingParams(temperature=0, max_new_tokens=1),
                grant=secrets.token_bytes(16) if index % 2 else b"")
            try:
                await stub.Prefill(request, timeout=30)
                code = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
            codes[code] = codes.get(code, 0) + 1
    return codes


# A decode with DP attention: each group has its own pool and grant table behind its own endpoint,
# and the registry lists group 0's; pages 0-23 there belong to the rooms placed on group 0.
DP_DECODE = ("--tp-size", "2", "--dp-size", "2", "--enable-dp-attention")


# The plain mooncake decode is the DP decode's case with one group: `make test-all` only.
@pytest.mark.parametrize(("backend", "decode_layout"),
                         [pytest.param("mooncake", (), marks=pytest.mark.long), ("nixl", ()),
                          ("mooncake", DP_DECODE)],
                         ids=["mooncake", "nixl", "mooncake-dp-decode"])
def test_forged_prefill_calls_cannot_touch_other_rooms(cluster: Cluster, tiny_model, tmp_path, backend,
                                                       decode_layout):
    cluster.env["PDSERVE_CLUSTER_SECRET"] = SECRET
    bootstrap = cluster.bootstrap()
    prefill, decode = cluster.start_many([
        ("prefill", worker_args(tiny_model, "prefill", backend=backend, bootstrap=bootstrap,
                                extra=("--num-pages", "512"))),
        ("decode", worker_args(tiny_model, "decode", backend=backend, bootstrap=bootstrap,
                               extra=("--num-pages", "512", *decode_layout)))])
    gateway = cluster.start("gateway", ["launch-router", "--model-path", str(tiny_model), "--port", "0",
                                        "--bootstrap", bootstrap.address])
    wait_until(lambda: httpx.get(f"http://{gateway.address}/health", timeout=5).status_code == 200, 60,
               "the gateway to be ready")
    expected = {question: answer(gateway.address, question) for question in QUESTIONS}
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET)
    insider = GrpcSecurity(cluster_secret_file=str(secret_file))

    # Without the secret: refused outright.
    outsider_codes = asyncio.run(forge(bootstrap.address, prefill.address, GrpcSecurity(), 5))
    assert outsider_codes == {grpc.StatusCode.UNAUTHENTICATED: 5}

    # With the secret, during steady greedy load.
    stop = threading.Event()
    wrong: list[tuple[str, str]] = []
    answered = [0]

    def client(offset: int) -> None:
        index = offset
        while not stop.is_set():
            question = QUESTIONS[index % len(QUESTIONS)]
            got = answer(gateway.address, question)
            answered[0] += 1
            if got != expected[question]:
                wrong.append((question, got))
            index += 1

    with ThreadPoolExecutor(CLIENTS) as pool:
        clients = [pool.submit(client, offset) for offset in range(CLIENTS)]
        wait_until(lambda: decode.metric("pdserve:kv_pages_used") > 0, 30, "load to hold pages on decode")
        insider_codes = asyncio.run(forge(bootstrap.address, prefill.address, insider, FORGED_CALLS))
        stop.set()
        for future in clients:
            future.result(timeout=120)
    assert insider_codes == {grpc.StatusCode.PERMISSION_DENIED: FORGED_CALLS}, insider_codes
    assert answered[0] >= CLIENTS and not wrong, wrong[:3]
    assert prefill.metric("pdserve:pd_failures_total", stage="grant") == FORGED_CALLS
    assert_pages_idle(prefill, decode)
    if decode_layout:  # both groups served the load, and both are back to idle
        assert all(decode.metric("pdserve:dp_rank_requests_total", dp_rank=g) > 0 for g in ("0", "1"))
        assert all(decode.metric("pdserve:dp_rank_kv_pages_used", dp_rank=g) == 0 for g in ("0", "1"))
