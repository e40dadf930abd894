"""The control plane's trust boundary (issue 9, findings 3 and 7), with real processes.

- With a cluster secret, every gRPC call but health checks must carry it: an attacker who reaches
  the registry, a prefill or a decode gets UNAUTHENTICATED; the deployment itself works.
- With certificates, the control plane speaks mTLS: plaintext and unknown clients are refused.
- Bad gRPC input gets INVALID_ARGUMENT naming the field (a corpus of what was found).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.v1 import bootstrap_pb2, bootstrap_pb2_grpc, common_pb2, worker_pb2, worker_pb2_grpc
from services.common.channels import open_channel
from services.common.security import GrpcSecurity
from tests.certificates import make_certificates
from tests.e2e.cluster import Cluster, Proc, wait_until, worker_args
from tests.e2e.conftest import leak_detections
from tests.e2e.test_pd_services import assert_pages_idle, prompts_of
from tests.e2e.worker_client import run_all

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

SECRET = "correct horse battery staple"


def security_with(tmp_path: Path, secret: str | None = None, **tls: str) -> GrpcSecurity:
    secret_file = None
    if secret is not None:
        secret_file = tmp_path / f"secret-{abs(hash(secret))}"
        secret_file.write_text(secret)
    return GrpcSecurity(cluster_secret_file=str(secret_file) if secret_file else None, **tls)


async def call(address: str, security: GrpcSecurity, method: str, request) -> grpc.StatusCode:
    """The status of one unary call (OK when it succeeds)."""
    async with open_channel(address, security) as channel:
        stubs = {"List": bootstrap_pb2_grpc.BootstrapStub, "Register": bootstrap_pb2_grpc.BootstrapStub,
                 "Prefill": worker_pb2_grpc.PrefillStub, "PrefillAbort": worker_pb2_grpc.PrefillStub,
                 "Abort": worker_pb2_grpc.WorkerStub, "GetLoad": worker_pb2_grpc.WorkerStub}
        stub = stubs[method](channel)
        rpc = getattr(stub, "Abort" if method == "PrefillAbort" else method)
        try:
            await rpc(request, timeout=10)
            return grpc.StatusCode.OK
        except grpc.aio.AioRpcError as exc:
            return exc.code()


async def generate_status(address: str, security: GrpcSecurity, request: worker_pb2.GenerateRequest
                          ) -> tuple[grpc.StatusCode, str]:
    async with open_channel(address, security) as channel:
        try:
            async for _ in worker_pb2_grpc.WorkerStub(channel).Generate(request, timeout=30):
                pass
            return grpc.StatusCode.OK, ""
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details() or ""


async def health_status(address: str, security: GrpcSecurity) -> int:
    async with open_channel(address, security) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        return reply.status


@dataclass
class Secured:
    """A registry, a prefill and a decode sharing the cluster secret, shared by the tests that neither
    kill nor change them; `insider` is a client's security with the secret."""

    bootstrap: Proc
    prefill: Proc
    decode: Proc
    insider: GrpcSecurity


@pytest.fixture(scope="module")
def secured(tiny_model, tmp_path_factory) -> Iterator[Secured]:
    folder = tmp_path_factory.mktemp("secured")
    with Cluster(folder, env={"PDSERVE_CLUSTER_SECRET": SECRET}) as cluster:
        try:
            bootstrap = cluster.bootstrap()
            prefill, decode = cluster.start_many([
                ("prefill", worker_args(tiny_model, "prefill", bootstrap=bootstrap)),
                ("decode", worker_args(tiny_model, "decode", bootstrap=bootstrap))])
            yield Secured(bootstrap, prefill, decode, security_with(folder, SECRET))
            # As the per-test `cluster` fixture does: the tests fail if a worker's leak detector fired.
            leaks = {name: count for name, count in leak_detections(cluster).items() if count}
            assert not leaks, f"KV page leak detector fired: {leaks}"
        except BaseException:
            print(cluster.logs())
            raise


def test_cluster_secret_guards_every_control_api(secured: Secured, tmp_path):
    bootstrap, prefill, decode, insider = secured.bootstrap, secured.prefill, secured.decode, secured.insider
    assert "cluster secret" in decode.log()
    attackers = {"no secret": GrpcSecurity(), "wrong secret": security_with(tmp_path, "guess")}
    prefill_request = worker_pb2.PrefillRequest(room="forged", prompt_token_ids=[5, 6, 7], model="tiny",
                                                dst_page_ids=[0])
    for name, attacker in attackers.items():
        statuses = asyncio.run(_attempts(bootstrap, prefill, decode, attacker, prefill_request))
        assert set(statuses.values()) == {grpc.StatusCode.UNAUTHENTICATED}, (name, statuses)
        # Health stays open for probes, and tells nothing else.
        assert asyncio.run(health_status(decode.address, attacker)) == health_pb2.HealthCheckResponse.SERVING
    # The deployment itself works with the secret.
    (result,) = run_all(decode.address, prompts_of([40]), [prefill.address], max_new_tokens=4,
                        security=insider)
    assert result.code is None and len(result.tokens) == 4
    listed = asyncio.run(call(bootstrap.address, insider, "List", bootstrap_pb2.ListRequest()))
    assert listed == grpc.StatusCode.OK
    assert_pages_idle(prefill, decode)


async def _attempts(bootstrap: Proc, prefill: Proc, decode: Proc, attacker: GrpcSecurity,
                    prefill_request: worker_pb2.PrefillRequest) -> dict[str, grpc.StatusCode]:
    generate = worker_pb2.GenerateRequest(room="forged", prompt_token_ids=[5, 6, 7],
                                          sampling=common_pb2.SamplingParams(max_new_tokens=2),
                                          prefill_address=prefill.address)
    return {
        "Bootstrap/List": await call(bootstrap.address, attacker, "List", bootstrap_pb2.ListRequest()),
        "Bootstrap/Register": await call(bootstrap.address, attacker, "Register",
                                         bootstrap_pb2.RegisterRequest()),
        "Prefill/Prefill": await call(prefill.address, attacker, "Prefill", prefill_request),
        "Prefill/Abort": await call(prefill.address, attacker, "PrefillAbort",
                                    worker_pb2.AbortRequest(room="x")),
        "Worker/Generate": (await generate_status(decode.address, attacker, generate))[0],
        "Worker/Abort": await call(decode.address, attacker, "Abort", worker_pb2.AbortRequest(room="x")),
        "Worker/GetLoad": await call(decode.address, attacker, "GetLoad", worker_pb2.GetLoadRequest()),
    }


def test_worker_without_the_secret_cannot_join(cluster: Cluster, tiny_model):
    cluster.env["PDSERVE_CLUSTER_SECRET"] = SECRET
    bootstrap = cluster.bootstrap()
    cluster.env["PDSERVE_CLUSTER_SECRET"] = "not the secret"
    rogue = cluster.spawn("rogue", worker_args(tiny_model, "null", bootstrap=bootstrap))
    assert rogue.popen.wait(timeout=120) == 1
    assert "UNAUTHENTICATED" in rogue.log()
    assert bootstrap.metric("pdserve:bootstrap_workers") == 0


def test_mutual_tls_control_plane(cluster: Cluster, tiny_model, tmp_path):
    certs = make_certificates(tmp_path)
    tls = ("--grpc-tls-cert", str(certs["node.pem"]), "--grpc-tls-key", str(certs["node.key"]),
           "--grpc-tls-ca", str(certs["ca.pem"]))
    bootstrap = cluster.bootstrap(*tls)
    assert "mTLS" in bootstrap.log()
    prefill, decode = cluster.start_many([
        ("prefill", worker_args(tiny_model, "prefill", bootstrap=bootstrap, extra=tls)),
        ("decode", worker_args(tiny_model, "decode", bootstrap=bootstrap, extra=tls))])
    gateway = cluster.start("gateway", ["launch-router", "--model-path", str(tiny_model), "--port", "0",
                                        "--bootstrap", bootstrap.address, *tls])
    wait_until(lambda: httpx.get(f"http://{gateway.address}/health", timeout=5).status_code == 200, 60,
               "the gateway to reach its TLS workers")
    reply = httpx.post(f"http://{gateway.address}/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": "The river", "max_tokens": 4, "temperature": 0})
    assert reply.status_code == 200, reply.text
    member = GrpcSecurity(grpc_tls_cert=str(certs["node.pem"]), grpc_tls_key=str(certs["node.key"]),
                          grpc_tls_ca=str(certs["ca.pem"]))
    assert asyncio.run(call(bootstrap.address, member, "List",
                            bootstrap_pb2.ListRequest())) == grpc.StatusCode.OK
    strangers = {
        "plaintext": GrpcSecurity(),
        "no client certificate": GrpcSecurity(grpc_tls_ca=str(certs["ca.pem"])),
        "certificate of another CA": GrpcSecurity(grpc_tls_cert=str(certs["stranger.pem"]),
                                                  grpc_tls_key=str(certs["stranger.key"]),
                                                  grpc_tls_ca=str(certs["ca.pem"])),
    }
    for name, stranger in strangers.items():
        status = asyncio.run(call(bootstrap.address, stranger, "List", bootstrap_pb2.ListRequest()))
        assert status == grpc.StatusCode.UNAVAILABLE, (name, status)  # the handshake fails
    assert_pages_idle(prefill, decode)


def test_bad_grpc_input_gets_invalid_argument(secured: Secured):
    """Finding 9.7 and its neighbours: each bad value names the field, nothing is held afterwards
    (calls from an insider: the secret admits them, the checks behind it refuse them)."""
    bootstrap, prefill, decode = secured.bootstrap, secured.prefill, secured.decode
    statuses = asyncio.run(_bad_calls(bootstrap, prefill, decode, secured.insider))
    for name, (code, details) in statuses.items():
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (name, code, details)
    assert "dst_page_ids" in statuses["Prefill: page outside the pool"][1]
    assert "dst_page_ids" in statuses["Prefill: page named twice"][1]
    assert "role" in statuses["Register: role 99"][1]
    assert "does not serve pdserve.v1.Prefill" in statuses["Generate: prefill_address of a decode"][1]
    assert_pages_idle(prefill, decode)
    assert bootstrap.metric("pdserve:bootstrap_workers") == 2


async def _bad_calls(bootstrap: Proc, prefill: Proc, decode: Proc,
                     security: GrpcSecurity) -> dict[str, tuple[grpc.StatusCode, str]]:
    async with open_channel(bootstrap.address, security) as channel:
        registry = bootstrap_pb2_grpc.BootstrapStub(channel)
        (decode_info,) = (await registry.List(
            bootstrap_pb2.ListRequest(role=common_pb2.WORKER_ROLE_DECODE))).workers
    endpoint = decode_info.transfer_endpoint
    prompt = list(range(10, 50))  # 3 pages of 16 tokens

    rooms = iter(range(1000))

    def prefill_request(pages: list[int], **fields) -> worker_pb2.PrefillRequest:
        room = fields.pop("room", f"bad-input-{next(rooms)}")
        return worker_pb2.PrefillRequest(room=room, prompt_token_ids=prompt,
                                         model="tiny", dst_page_ids=pages, dst=endpoint, **fields)

    async def unary(address: str, stub_class, method: str, request) -> tuple[grpc.StatusCode, str]:
        async with open_channel(address, security) as channel:
            try:
                await getattr(stub_class(channel), method)(request, timeout=10)
                return grpc.StatusCode.OK, ""
            except grpc.aio.AioRpcError as exc:
                return exc.code(), exc.details() or ""

    worker = decode_info
    bogus = bootstrap_pb2.WorkerInfo()
    bogus.CopyFrom(worker)
    bogus.role = 99
    bogus.grpc_address = "127.0.0.1:1"
    prefill_stub = worker_pb2_grpc.PrefillStub
    return {
        "Prefill: page outside the pool": await unary(prefill.address, prefill_stub, "Prefill",
                                                      prefill_request([0, 1, endpoint.num_pages + 7])),
        "Prefill: page named twice": await unary(prefill.address, prefill_stub, "Prefill",
                                                 prefill_request([4, 5, 4])),
        "Prefill: too few pages": await unary(prefill.address, prefill_stub, "Prefill", prefill_request([1])),
        "Prefill: no room": await unary(prefill.address, prefill_stub, "Prefill",
                                        prefill_request([1, 2, 3], room="")),
        "Register: role 99": await unary(bootstrap.address, bootstrap_pb2_grpc.BootstrapStub, "Register",
                                         bootstrap_pb2.RegisterRequest(worker=bogus)),
        "List: role 99": await unary(bootstrap.address, bootstrap_pb2_grpc.BootstrapStub, "List",
                                     bootstrap_pb2.ListRequest(role=99)),
        "Generate: prefill_address of a decode": await generate_status(
            decode.address, security, worker_pb2.GenerateRequest(
                room="bad-prefill", prompt_token_ids=prompt,
                sampling=common_pb2.SamplingParams(max_new_tokens=2), prefill_address=decode.address)),
        "Generate: token outside the vocabulary": await generate_status(
            decode.address, security, worker_pb2.GenerateRequest(
                prompt_token_ids=[10, 1 << 30], sampling=common_pb2.SamplingParams(max_new_tokens=2),
                prefill_address=prefill.address)),
        "Generate: negative temperature": await generate_status(
            decode.address, security, worker_pb2.GenerateRequest(
                prompt_token_ids=[10, 11],
                sampling=common_pb2.SamplingParams(max_new_tokens=2, temperature=-1),
                prefill_address=prefill.address)),
    }


def test_a_room_in_use_is_refused_not_shared(secured: Secured):
    """Two calls naming the same room: the second gets ALREADY_EXISTS; the first is unaffected."""
    prefill, decode, insider = secured.prefill, secured.decode, secured.insider

    async def both() -> tuple[tuple[grpc.StatusCode, str], tuple[grpc.StatusCode, str]]:
        def request(max_new_tokens: int) -> worker_pb2.GenerateRequest:
            return worker_pb2.GenerateRequest(
                room="shared-room", prompt_token_ids=list(range(10, 60)), prefill_address=prefill.address,
                sampling=common_pb2.SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))
        first = asyncio.ensure_future(generate_status(decode.address, insider, request(2000)))
        await asyncio.sleep(0.5)
        second = await generate_status(decode.address, insider, request(2))
        return await first, second

    first, second = asyncio.run(both())
    assert first[0] == grpc.StatusCode.OK, first
    assert second[0] == grpc.StatusCode.ALREADY_EXISTS, second
    assert_pages_idle(prefill, decode)


@pytest.mark.parametrize("with_secret", [False, True])
def test_a_registry_open_to_other_hosts_without_a_secret_says_so(cluster: Cluster, tmp_path, with_secret):
    extra = (["--cluster-secret-file", security_with(tmp_path, "s3cret").cluster_secret_file]
             if with_secret else [])
    registry = cluster.start("bootstrap", ["bootstrap", "--host", "0.0.0.0", "--port", "0",
                                           "--metrics-port", "0", *extra])
    warned = ("listens on 0.0.0.0 without a cluster secret: anyone who can reach this address"
              in registry.log())
    assert warned is not with_secret, registry.log()[-2000:]
