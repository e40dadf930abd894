"""docker/compose.yaml for real: build the images with no registry, bring the deployment up with
docker-compose, stream one OpenAI chat request through the published gateway port, compare the
text with a colocated worker on this host, tear everything down.

The Docker engine comes from docker/engine.sh: Debian's packages are installed if absent and
dockerd is started if none answers (and stopped again after the test). The test is skipped, with
the reason printed, only when no engine can run (not root, no apt, dockerd does not start).
docker/build.sh makes the images offline: a debootstrap base and host-downloaded wheels, both
cached in /var/cache/pdserve-docker, and Docker's layer cache between runs. Build time, time to
healthy and the answer are printed (pytest -s shows them).
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.cluster import Cluster

# `make test-all`: on a fresh machine the build is mostly the cold start (the Docker engine's packages,
# a debootstrap base, the wheels: 430 s of a 44-minute `make test`). `make test` checks the files
# statically (tests/docker/test_docker_files.py: the Dockerfile, and the compose file with
# docker-compose config).
pytestmark = [pytest.mark.e2e, pytest.mark.long, pytest.mark.timeout(2400)]

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "Hello from docker! Tell me about the river."
BUILD_TIMEOUT_S = 1800
HEALTHY_TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _chat(base_url: str) -> str:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    chunks = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                            max_tokens=24, temperature=0, stream=True)
    return "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)


@pytest.fixture(scope="module")
def docker_engine() -> Iterator[None]:
    """A Docker engine that answers: the one running, or one started here (stopped afterwards)."""
    out = subprocess.run(["bash", str(ROOT / "docker/engine.sh"), "ensure"], capture_output=True, text=True,
                         timeout=900)
    if out.returncode == 3:
        print(f"SKIPPED compose test: no Docker engine can run here: {out.stderr.strip()}")
        pytest.skip(f"no Docker engine can run here: {out.stderr.strip()}")
    assert out.returncode == 0, out.stderr
    started = out.stdout.split()[1] if out.stdout.startswith("started") else None
    try:
        yield
    finally:
        if started is not None:
            subprocess.run(["bash", str(ROOT / "docker/engine.sh"), "stop", started], timeout=60, check=False)


def test_compose_up_answers_like_colocated(docker_engine: None, cluster: Cluster, tiny_model: Path) -> None:
    began = time.monotonic()
    build = subprocess.run(["bash", str(ROOT / "docker/build.sh")], capture_output=True, text=True,
                           timeout=BUILD_TIMEOUT_S, cwd=ROOT)
    build_s = time.monotonic() - began
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    print(f"\n[compose test] docker/build.sh: {build_s:.0f}s\n{build.stdout.strip()}")

    # the reference: the same built-in model (same seed, same bytes) on a colocated worker here
    worker = cluster.start("colocated", ["launch-server", "--model-path", str(tiny_model),
                                         "--disaggregation-mode", "null", "--port", "0",
                                         "--metrics-port", "0", "--num-threads", "1"])
    reference = cluster.start("gateway-ref", ["launch-router", "--model-path", str(tiny_model), "--port", "0",
                                              "--worker", worker.address])
    expected = _chat(f"http://{reference.address}/v1")

    port = _free_port()
    project = f"pdserve-test-{os.getpid()}"
    env = {**os.environ, "GATEWAY_PORT": str(port), "IMAGE_TAG": os.environ.get("IMAGE_TAG", "latest")}
    compose = ["docker-compose", "-p", project, "-f", str(ROOT / "docker/compose.yaml")]

    def run(*args: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([*compose, *args], capture_output=True, text=True, timeout=timeout_s, env=env)

    up_began = time.monotonic()
    try:
        up = run("up", "-d")
        assert up.returncode == 0, up.stderr
        deadline = time.monotonic() + HEALTHY_TIMEOUT_S
        while True:  # docker-compose 1.29 has no `up --wait`
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=3).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            states = run("ps").stdout
            assert "Exit" not in states, f"a container exited while starting:\n{states}"
            assert time.monotonic() < deadline, f"gateway not healthy within {HEALTHY_TIMEOUT_S}s:\n{states}"
            time.sleep(2)
        healthy_s = time.monotonic() - up_began
        answer = _chat(f"http://127.0.0.1:{port}/v1")
        print(f"[compose test] healthy {healthy_s:.0f}s after `up -d`; answer {answer!r}")
        assert answer and answer == expected
        # The worker images build the C++ CPU kernels (docker/Dockerfile); the engine says which
        # ops it runs when it loads.
        workers_log = run("logs", "--no-color", "prefill", "decode").stdout
        assert "C++ CPU kernels loaded" in workers_log, workers_log[-3000:]
        assert "C++ CPU kernels unavailable" not in workers_log
    except BaseException:
        print(run("ps").stdout, run("logs", "--no-color", "--tail", "40").stdout)
        raise
    finally:
        down = run("down", "-v", "--remove-orphans", timeout_s=120)
        print(f"[compose test] down: rc {down.returncode}")
