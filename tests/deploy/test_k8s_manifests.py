"""deploy/k8s/, checked offline (no cluster here): every resource against Kubernetes' own schemas
(kubernetes-validate, strict: an unknown or misplaced field fails), and what makes the four
services work together: container commands parse with pdserve's real argument parsers, probes hit
the port each service serves, the registry is reached by its Service's DNS name, every role has a
Service that selects its pods, resources are set, workers mount the model volume.
"""

from __future__ import annotations

import argparse
import importlib
import re
from pathlib import Path

import pytest
import yaml

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
ROLES = ("bootstrap", "prefill", "decode", "gateway")
COMMAND_MODULES = {"bootstrap": "services.bootstrap.main", "launch-server": "services.launch_server",
                   "launch-router": "services.gateway.main"}
KUBERNETES_VERSION = "1.30.0"  # the oldest version these manifests are meant for (native gRPC probes: 1.24+)


def _resources() -> list[tuple[str, dict]]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    found = []
    for name in kustomization["resources"]:
        found += [(name, doc) for doc in yaml.safe_load_all((K8S / name).read_text()) if doc]
    return found


def _by_kind(kind: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for _, doc in _resources() if doc["kind"] == kind}


def _config() -> dict[str, str]:
    return _by_kind("ConfigMap")["pdserve-config"]["data"]


def _container(role: str) -> dict:
    (container,) = _by_kind("Deployment")[f"pdserve-{role}"]["spec"]["template"]["spec"]["containers"]
    return container


def _args(role: str) -> list[str]:
    """The container's command with Kubernetes' $(VAR) expansion from the ConfigMap applied."""
    config = _config()
    return [re.sub(r"\$\((\w+)\)", lambda m: config[m[1]], arg) for arg in _container(role)["args"]]


def _parse(argv: list[str]) -> argparse.Namespace:
    assert argv[0] == "pdserve", argv
    module = importlib.import_module(COMMAND_MODULES[argv[1]])
    parser = argparse.ArgumentParser(prog=f"pdserve {argv[1]}", exit_on_error=False)
    module.add_arguments(parser)
    return parser.parse_args(argv[2:])


def test_kustomization_lists_every_manifest() -> None:
    listed = set(yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"])
    assert listed == {path.name for path in K8S.glob("*.yaml")} - {"kustomization.yaml"}


@pytest.mark.parametrize("version", [KUBERNETES_VERSION, "1.37.0"])
def test_every_resource_is_valid_kubernetes(version: str) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install -e '.[dev]'")
    resources = _resources()
    assert {doc["kind"] for _, doc in resources} == {"ConfigMap", "PersistentVolumeClaim", "Deployment",
                                                      "Service", "HorizontalPodAutoscaler"}
    for name, doc in resources:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name}: {doc['kind']}/{doc['metadata']['name']}: {exc.message} at {list(exc.path)}")


def test_commands_parse_and_use_the_registry_by_dns() -> None:
    bootstrap = _parse(_args("bootstrap"))
    service = _by_kind("Service")["pdserve-bootstrap"]
    assert {port["port"] for port in service["spec"]["ports"]} >= {bootstrap.port}
    registry = f"pdserve-bootstrap:{bootstrap.port}"
    for role in ("prefill", "decode"):
        worker = _parse(_args(role))
        assert (worker.disaggregation_mode, worker.bootstrap, worker.host) == (role, registry, "auto")
        assert worker.model_path == _config()["MODEL_PATH"] and worker.metrics_port == 9000
    gateway = _parse(_args("gateway"))
    assert gateway.bootstrap == registry and gateway.model_path == ""  # the model comes from the workers
    assert gateway.policy == _config()["ROUTING_POLICY"]


def _port(container: dict, name_or_number: str | int) -> int:
    if isinstance(name_or_number, int):
        return name_or_number
    return next(port["containerPort"] for port in container["ports"] if port["name"] == name_or_number)


def test_probes_hit_the_served_ports() -> None:
    for role in ("bootstrap", "prefill", "decode"):
        container, grpc_port = _container(role), _parse(_args(role)).port
        probes = [container[key] for key in ("startupProbe", "readinessProbe", "livenessProbe")
                  if key in container]
        assert len(probes) >= 2 and all(probe["grpc"]["port"] == grpc_port for probe in probes), role
    gateway, http_port = _container("gateway"), _parse(_args("gateway")).port
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/health"
    assert _port(gateway, gateway["readinessProbe"]["httpGet"]["port"]) == http_port
    assert _port(gateway, gateway["livenessProbe"]["tcpSocket"]["port"]) == http_port


def test_every_role_has_a_service_selecting_its_pods_and_resources() -> None:
    services, deployments = _by_kind("Service"), _by_kind("Deployment")
    for role in ROLES:
        pod_labels = deployments[f"pdserve-{role}"]["spec"]["template"]["metadata"]["labels"]
        selector = services[f"pdserve-{role}"]["spec"]["selector"]
        assert selector.items() <= pod_labels.items() and selector["app.kubernetes.io/component"] == role
        resources = _container(role)["resources"]
        assert (resources["requests"]["cpu"] and resources["requests"]["memory"]
                and resources["limits"]["memory"])
        annotations = deployments[f"pdserve-{role}"]["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert int(annotations["prometheus.io/port"]) in {port["containerPort"]
                                                          for port in _container(role)["ports"]}
        secret = {env["name"]: env for env in _container(role)["env"]}["PDSERVE_CLUSTER_SECRET"]
        assert secret["valueFrom"]["secretKeyRef"]["name"] == "pdserve"


def test_workers_mount_the_model_volume() -> None:
    claim = next(iter(_by_kind("PersistentVolumeClaim")))
    for role in ("prefill", "decode"):
        spec = _by_kind("Deployment")[f"pdserve-{role}"]["spec"]["template"]["spec"]
        volumes = {volume["name"]: volume for volume in spec["volumes"]}
        mounts = {mount["name"]: mount for mount in _container(role)["volumeMounts"]}
        assert volumes["models"]["persistentVolumeClaim"]["claimName"] == claim
        assert mounts["models"]["readOnly"] and mounts["models"]["mountPath"] == "/mnt/models"


def test_the_gateway_scales_out_on_cpu() -> None:
    deployment = _by_kind("Deployment")["pdserve-gateway"]
    (hpa,) = _by_kind("HorizontalPodAutoscaler").values()
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "pdserve-gateway")
    assert 2 <= hpa["spec"]["minReplicas"] == deployment["spec"]["replicas"] < hpa["spec"]["maxReplicas"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu" and metric["resource"]["target"]["type"] == "Utilization"
    # utilization is measured against the container's request: there must be one
    assert _container("gateway")["resources"]["requests"]["cpu"]
    assert _parse(_args("gateway")).workers == 1  # one process per pod: each pod's /metrics is whole
