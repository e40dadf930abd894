"""docker/: the pieces that can be checked without a Docker engine.

Every command line in compose.yaml and in the Dockerfile's CMDs is parsed by pdserve's real
argument parsers (a renamed flag breaks these tests, not a deployment); the gateway's
requirement set has no torch and is pinned like pyproject.toml; the entrypoint's `--host auto`
substitution and the health check script run as the containers run them, the latter against a
real pdserve gRPC server and a real HTTP server.
"""

from __future__ import annotations

import argparse
import http.server
import importlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import tomllib
import yaml

from services.common.grpc_server import start_grpc_server
from services.common.security import GrpcSecurity
from tests.certificates import make_certificates

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
COMMAND_MODULES = {"bootstrap": "services.bootstrap.main", "launch-server": "services.launch_server",
                   "launch-router": "services.gateway.main"}


def _parse_pdserve(argv: list[str]) -> argparse.Namespace:
    """Parse `pdserve SUBCOMMAND ARGS` with the subcommand's own parser (exits on an unknown flag)."""
    assert argv[0] == "pdserve", argv
    module = importlib.import_module(COMMAND_MODULES[argv[1]])
    parser = argparse.ArgumentParser(prog=f"pdserve {argv[1]}", exit_on_error=False)
    module.add_arguments(parser)
    return parser.parse_args(argv[2:])


def _substitute(text: str) -> str:
    """Compose variable defaults: `${NAME:-default}` -> default (what an empty environment gives)."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", text)


def _compose() -> dict:
    return yaml.safe_load(_substitute((DOCKER / "compose.yaml").read_text()))


def _run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})})


def test_compose_commands_parse_with_pdserve_flags():
    services = _compose()["services"]
    assert {"bootstrap", "prefill", "decode", "gateway"} <= set(services)
    parsed = {name: _parse_pdserve(services[name]["command"])
              for name in ("bootstrap", "prefill", "decode", "gateway")}
    assert parsed["prefill"].disaggregation_mode == "prefill"
    assert parsed["decode"].disaggregation_mode == "decode"
    for name in ("prefill", "decode"):
        assert parsed[name].bootstrap == f"bootstrap:{parsed['bootstrap'].port}"
        assert parsed[name].host == "auto"  # replaced by the entrypoint with the container's address
        assert parsed[name].model_path == parsed["prefill"].model_path == "/models/tiny"
    assert parsed["gateway"].model_path == ""  # the gateway learns the model from the workers
    assert parsed["gateway"].bootstrap == f"bootstrap:{parsed['bootstrap'].port}"
    # The health checks probe the ports the services are told to listen on.
    assert services["bootstrap"]["healthcheck"]["test"][-1] == str(parsed["bootstrap"].port)
    for name in ("prefill", "decode"):
        assert services[name]["healthcheck"]["test"][-1] == str(parsed[name].port)
    assert services["gateway"]["healthcheck"]["test"][-1] == f"http://127.0.0.1:{parsed['gateway'].port}/health"
    assert services["gateway"]["ports"] == [f"8000:{parsed['gateway'].port}"]


def test_compose_encoder_is_an_epd_profile_service_with_pdserve_flags():
    encoder = _compose()["services"]["encoder"]
    assert encoder["profiles"] == ["epd"]  # not started by default
    args = _parse_pdserve(encoder["command"])
    assert args.encoder_only and args.bootstrap == "bootstrap:8998"
    assert encoder["healthcheck"]["test"][-1] == str(args.port)


def test_compose_passes_every_pdserve_knob():
    from pdserve import envs

    passed = set(_compose()["x-pdserve-env"])
    assert passed == {var.name for var in envs.ALL}


def test_prometheus_scrapes_every_metrics_port():
    services = _compose()["services"]
    targets = set()
    for job in yaml.safe_load((DOCKER / "prometheus.yml").read_text())["scrape_configs"]:
        for static in job.get("static_configs", []):
            targets.update(static["targets"])
        for dns in job.get("dns_sd_configs", []):
            targets.update(f"{name}:{dns['port']}" for name in dns["names"])
    metrics = {f"{name}:{_parse_pdserve(services[name]['command']).metrics_port}"
               for name in ("bootstrap", "prefill", "decode")}
    metrics.add(f"gateway:{_parse_pdserve(services['gateway']['command']).port}")  # /metrics on its HTTP port
    assert targets == metrics


def test_dockerfile_cmds_parse_with_pdserve_flags():
    text = (DOCKER / "Dockerfile").read_text().replace("\\\n", " ")
    cmds = [json.loads(line.split("CMD", 1)[1]) for line in text.splitlines() if line.startswith("CMD ")]
    assert len(cmds) == 5  # bootstrap, gateway, worker (colocated), prefill, decode
    modes = [_parse_pdserve(cmd).disaggregation_mode for cmd in cmds if cmd[1] == "launch-server"]
    assert modes == ["null", "prefill", "decode"]
    targets = re.findall(r"^FROM \S+ AS (\S+)$", text, flags=re.MULTILINE)
    assert {"bootstrap", "gateway", "prefill", "decode"} <= set(targets)


def _copied_sources(text: str, target: str) -> list[str]:
    """Repository paths the Dockerfile copies into `target` and the stages it is built FROM
    (COPY --from=... copies from another stage, not from the repository, and is left out)."""
    stages: dict[str, tuple[str, list[str]]] = {}
    current = None
    for line in text.replace("\\\n", " ").splitlines():
        words = line.split()
        if line.startswith("FROM "):
            current = words[3] if len(words) >= 4 and words[2].upper() == "AS" else None
            if current:
                stages[current] = (words[1], [])
        elif line.startswith("COPY ") and current and not any(w.startswith("--from") for w in words):
            stages[current][1].extend(w for w in words[1:-1] if not w.startswith("--"))
    sources, stage = [], target
    while stage in stages:
        parent, copied = stages[stage]
        sources += copied
        stage = parent
    return sources


@pytest.mark.parametrize("target,modules", [
    ("gateway", "services.gateway.main, services.gateway.app, services.gateway.state, "
                "services.gateway.policies.cache_aware, services.gateway.model_source"),
    ("bootstrap", "services.bootstrap.main"),
    ("model", "pdserve.cli, tools.models.tiny_model"),  # the stage that runs `pdserve make-tiny-model`
])
def test_light_images_copy_every_module_their_service_imports(target: str, modules: str):
    """The gateway and registry images carry a hand-picked part of the repository (no torch): every
    project module their service imports must be in it, or the container restarts in a loop. The
    model stage likewise carries only the checkpoint builder of tools/."""
    code = ("import sys\n"
            f"import {modules}\n"
            "print('\\n'.join(m.__file__ for m in list(sys.modules.values())\n"
            "                 if getattr(m, '__file__', None)))\n")
    loaded = _run([sys.executable, "-c", code], env={"PYTHONPATH": str(ROOT)})
    assert loaded.returncode == 0, loaded.stderr
    # torch names a few of its modules by a bare relative file name: only absolute paths are files
    files = {Path(f).resolve().relative_to(ROOT).as_posix() for f in loaded.stdout.split()
             if Path(f).is_absolute() and Path(f).resolve().is_relative_to(ROOT)
             and ".venv" not in Path(f).parts}
    copied = [src.rstrip("/") for src in _copied_sources((DOCKER / "Dockerfile").read_text(), target)]
    missing = sorted(f for f in files if not any(f == src or f.startswith(src + "/") for src in copied))
    assert not missing, f"the {target} image lacks {missing}: add them to its COPY lines in docker/Dockerfile"


def test_requirements_come_from_pyproject_and_gateway_has_no_torch():
    pins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    light = _run([sys.executable, str(DOCKER / "requirements.py"), "light"]).stdout.split()
    worker = _run([sys.executable, str(DOCKER / "requirements.py"), "worker"]).stdout.split()
    assert worker == [pin.replace(" ", "") for pin in pins]
    assert set(light) < set(worker)
    names = {re.split(r"[<>=]", pin)[0] for pin in light}
    assert not names & {"torch", "triton", "transformers", "safetensors", "ucxx-cu12",
                        "mooncake-transfer-engine-non-cuda"}
    assert {"grpcio", "fastapi", "uvicorn", "tokenizers", "jinja2", "httpx", "protobuf"} <= names
    bad = _run([sys.executable, str(DOCKER / "requirements.py"), "nonsense"])
    assert bad.returncode != 0


def test_compose_hicache_profile_runs_the_store_master_from_the_worker_image():
    """Profile hicache: mooncake_master from the worker image (the Mooncake wheel), its health check on
    its RPC port; the workers name it through PDSERVE_HICACHE_MOONCAKE_MASTER (passed through, empty
    unless set) and do not depend on it, so the deployment without the profile is unchanged."""
    compose = _compose()
    services = compose["services"]
    master = services["mooncake-master"]
    assert master["profiles"] == ["hicache"]
    assert master["image"] == services["prefill"]["image"]
    assert master["entrypoint"] == ["mooncake_master"]
    flags = dict(zip(master["command"][::2], master["command"][1::2], strict=True))
    assert flags["-rpc_address"] == "0.0.0.0"
    assert f"('127.0.0.1', {flags['-rpc_port']})" in master["healthcheck"]["test"][-1]
    # the documented value
    assert "mooncake-master:" + flags["-rpc_port"] in (DOCKER / "compose.yaml").read_text()
    assert {"PDSERVE_HICACHE_MOONCAKE_MASTER", "MOONCAKE_MASTER"} <= set(compose["x-pdserve-env"])
    for name in ("prefill", "decode"):
        assert services[name]["environment"] == compose["x-pdserve-env"]
        assert "mooncake-master" not in services[name].get("depends_on", {})
        assert "--enable-hierarchical-cache" not in services[name]["command"]  # the entrypoint adds it


@pytest.mark.skipif(shutil.which("mooncake_master") is None
                    and not (Path(sys.executable).parent / "mooncake_master").exists(),
                    reason="mooncake_master (the Mooncake wheel) is not installed")
def test_compose_mooncake_master_flags_are_the_binarys(tmp_path: Path):
    """The master's command line, on free ports, starts the real mooncake_master (gflags exits on an
    unknown flag) and it listens on the RPC port."""
    from tools import mooncake_master

    command = list(_compose()["services"]["mooncake-master"]["command"])
    rpc_port, metrics_port = mooncake_master.free_port("127.0.0.1"), mooncake_master.free_port("127.0.0.1")
    command[command.index("-rpc_port") + 1] = str(rpc_port)
    command[command.index("-metrics_port") + 1] = str(metrics_port)
    command[command.index("-rpc_address") + 1] = "127.0.0.1"
    with open(tmp_path / "master.log", "w") as log:
        process = subprocess.Popen([mooncake_master.binary(), *command], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert process.poll() is None, (tmp_path / "master.log").read_text()
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", rpc_port)) == 0:
                    break
            assert time.monotonic() < deadline, "mooncake_master did not listen within 30 s"
            time.sleep(0.1)
    finally:
        process.kill()
        process.wait()


@pytest.mark.skipif(shutil.which("sh") is None, reason="needs a POSIX sh")
def test_entrypoint_turns_the_store_tier_on_for_workers_when_a_master_is_named(tmp_path: Path):
    (tmp_path / "pdserve").write_text('#!/bin/sh\necho "$@"\n')
    (tmp_path / "pdserve").chmod(0o755)
    entry = str(DOCKER / "entrypoint.sh")
    base = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "CONTAINER_HOST": "10.1.2.3",
            "PDSERVE_HICACHE_MOONCAKE_MASTER": "", "MOONCAKE_MASTER": ""}
    store = " --enable-hierarchical-cache --hicache-storage-backend mooncake"

    def run(*args: str, **env: str) -> str:
        out = _run(["sh", entry, "pdserve", *args], {**base, **env})
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    assert run("launch-server", "--host", "auto") == "launch-server --host 10.1.2.3"
    named = {"PDSERVE_HICACHE_MOONCAKE_MASTER": "mooncake-master:50051"}
    assert run("launch-server", "--host", "auto", **named) == "launch-server --host 10.1.2.3" + store
    assert run("launch-server", **{"MOONCAKE_MASTER": "m:1"}) == "launch-server" + store
    assert (run("launch-server", "--enable-hierarchical-cache", **named)
            == "launch-server --enable-hierarchical-cache")
    assert run("launch-router", "--host", "auto", **named) == "launch-router --host 10.1.2.3"
    # What the worker then parses: the store tier on, on the named master.
    parsed = _parse_pdserve(["pdserve", "launch-server", "--model-path", "/models/tiny", *store.split()])
    assert parsed.enable_hierarchical_cache and parsed.hicache_storage_backend == "mooncake"


@pytest.mark.skipif(shutil.which("sh") is None, reason="needs a POSIX sh")
def test_entrypoint_replaces_host_auto_only():
    entry = str(DOCKER / "entrypoint.sh")
    out = _run(["sh", entry, "echo", "--port", "auto", "--host", "auto", "a b"],
               {"CONTAINER_HOST": "10.1.2.3"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "--port auto --host 10.1.2.3 a b"
    # Without CONTAINER_HOST it resolves this machine's hostname, as the containers do.
    env = {k: v for k, v in os.environ.items() if k != "CONTAINER_HOST"}
    out = subprocess.run(["sh", entry, sys.executable, "-c", "import sys; print(sys.argv[1:])",
                          "--host", "auto"], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == repr(["--host", socket.gethostbyname(socket.gethostname())])
    exit_code = _run(["sh", entry, "sh", "-c", "exit 7"])
    assert exit_code.returncode == 7


async def test_healthcheck_grpc_follows_server_health():
    server = await start_grpc_server([], "127.0.0.1", 0)
    check = [sys.executable, str(DOCKER / "healthcheck.py"), "grpc", str(server.port)]
    env = {"CONTAINER_HOST": "127.0.0.1", "PYTHONPATH": str(ROOT)}
    try:
        healthy = await _run_async(check, env)
        assert healthy.returncode == 0, healthy.stdout + healthy.stderr
        await server.health.enter_graceful_shutdown()  # what a stopping pdserve server reports
        draining = await _run_async(check, env)
        assert draining.returncode == 1 and "NOT_SERVING" in draining.stdout
    finally:
        await server.server.stop(0)
    gone = await _run_async(check, env)
    assert gone.returncode == 1 and "UNAVAILABLE" in gone.stdout


async def test_healthcheck_grpc_speaks_mutual_tls_when_the_server_does(tmp_path: Path):
    """Under mTLS the check presents the container's own certificate (PDSERVE_GRPC_TLS_*, as compose
    passes them) and accepts a server certificate that names something other than the dialled
    address (here localhost, dialled as 127.0.0.1's name is not asked)."""
    certs = make_certificates(tmp_path)
    tls_env = {"PDSERVE_GRPC_TLS_CERT": str(certs["node.pem"]),
               "PDSERVE_GRPC_TLS_KEY": str(certs["node.key"]),
               "PDSERVE_GRPC_TLS_CA": str(certs["ca.pem"])}
    security = GrpcSecurity(grpc_tls_cert=tls_env["PDSERVE_GRPC_TLS_CERT"],
                            grpc_tls_key=tls_env["PDSERVE_GRPC_TLS_KEY"],
                            grpc_tls_ca=tls_env["PDSERVE_GRPC_TLS_CA"])
    server = await start_grpc_server([], "127.0.0.1", 0, security=security)
    check = [sys.executable, str(DOCKER / "healthcheck.py"), "grpc", str(server.port)]
    env = {"CONTAINER_HOST": "127.0.0.1", "PYTHONPATH": str(ROOT)}
    try:
        healthy = await _run_async(check, {**env, **tls_env})
        assert healthy.returncode == 0, healthy.stdout + healthy.stderr
        plaintext = await _run_async(check, env)  # what the check did before it read the TLS files
        assert plaintext.returncode == 1 and "UNAVAILABLE" in plaintext.stdout
        stranger = {**tls_env, "PDSERVE_GRPC_TLS_CERT": str(certs["stranger.pem"]),
                    "PDSERVE_GRPC_TLS_KEY": str(certs["stranger.key"])}
        refused = await _run_async(check, {**env, **stranger})  # a client certificate from another CA
        assert refused.returncode == 1 and "unhealthy" in refused.stdout
    finally:
        await server.server.stop(0)


def test_tls_files_come_from_the_environment_and_a_flag_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    certs = make_certificates(tmp_path)
    monkeypatch.setenv("PDSERVE_GRPC_TLS_CERT", str(certs["node.pem"]))
    monkeypatch.setenv("PDSERVE_GRPC_TLS_KEY", str(certs["node.key"]))
    monkeypatch.setenv("PDSERVE_GRPC_TLS_CA", str(certs["ca.pem"]))
    assert GrpcSecurity().describe().startswith("mTLS")
    flagged = GrpcSecurity(grpc_tls_cert=str(certs["stranger.pem"]), grpc_tls_key=str(certs["stranger.key"]))
    assert flagged.grpc_tls_cert == str(certs["stranger.pem"]) and flagged.grpc_tls_ca == str(certs["ca.pem"])
    monkeypatch.setenv("PDSERVE_GRPC_TLS_CA", str(tmp_path / "missing.pem"))
    with pytest.raises(ValueError, match="--grpc-tls-ca"):
        GrpcSecurity()


async def _run_async(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    import asyncio

    return await asyncio.to_thread(_run, args, env)


class _Health(http.server.BaseHTTPRequestHandler):
    status = 503

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self.send_response(type(self).status)
        self.end_headers()
        self.wfile.write(b'{"status": "no servable pair"}')

    def log_message(self, *args: object) -> None:
        pass


def test_healthcheck_http_needs_200():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}/health"
    check = [sys.executable, str(DOCKER / "healthcheck.py"), "http", url]
    try:
        waiting = _run(check)
        assert waiting.returncode == 1 and "503" in waiting.stdout and "no servable pair" in waiting.stdout
        _Health.status = 200
        assert _run(check).returncode == 0
    finally:
        server.shutdown()
        server.server_close()
    assert _run(check).returncode == 1
    assert _run([sys.executable, str(DOCKER / "healthcheck.py"), "tcp", "1"]).returncode == 2


@pytest.mark.skipif(shutil.which("docker-compose") is None,
                    reason="docker-compose not installed (scripts/setup.sh installs it)")
@pytest.mark.parametrize("profiles", [(), ("monitoring",), ("hicache",), ("monitoring", "hicache")])
def test_compose_file_is_valid_for_docker_compose(profiles: tuple[str, ...]):
    flags = [arg for profile in profiles for arg in ("--profile", profile)]
    base = ["docker-compose", "-f", str(DOCKER / "compose.yaml"), *flags]
    out = _run([*base, "config", "-q"])
    assert out.returncode == 0, out.stderr
    # compose 1.29 lists the profiled services with or without --profile
    services = set(_run([*base, "config", "--services"]).stdout.split())
    assert services == {"bootstrap", "prefill", "decode", "gateway", "prometheus", "grafana",
                        "mooncake-master", "encoder"}


def test_grafana_provisioning_matches_the_dashboards_and_compose():
    """The datasource uid the dashboards use is the provisioned one; the folders compose mounts
    are the ones the provisioning files name."""
    datasources = yaml.safe_load((DOCKER / "grafana/provisioning/datasources/prometheus.yml").read_text())
    (source,) = datasources["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    provisioning = (DOCKER / "grafana/provisioning/dashboards/pdserve.yml").read_text()
    providers = yaml.safe_load(provisioning)["providers"]
    grafana = _compose()["services"]["grafana"]
    assert f"./grafana/dashboards:{providers[0]['options']['path']}:ro" in grafana["volumes"]
    assert "./grafana/provisioning:/etc/grafana/provisioning:ro" in grafana["volumes"]
    uids = set()
    for path in sorted((DOCKER / "grafana/dashboards").glob("*.json")):
        dashboard = json.loads(path.read_text())
        uids.add(dashboard["uid"])
        for panel in dashboard["panels"]:
            if panel["type"] == "row":  # a heading over the panels below it: no query
                assert not panel.get("targets") and not panel.get("panels"), (path.name, panel["title"])
                continue
            where = (path.name, panel["title"])
            assert panel["datasource"] == {"type": "prometheus", "uid": source["uid"]}, where
            assert panel["targets"] and all(target["expr"] for target in panel["targets"])
    assert len(uids) == 3


def test_build_and_smoke_scripts_are_valid_bash():
    for script in ("build.sh", "smoke.sh"):
        out = _run(["bash", "-n", str(DOCKER / script)])
        assert out.returncode == 0, f"{script}: {out.stderr}"
