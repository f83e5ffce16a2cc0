"""Kubernetes manifests validated against the Kubernetes schemas (kubernetes-validate, offline), the
kustomization rendered from its resources, the Prometheus Operator objects checked against the Services, and
the compose file validated by docker-compose; tokens never on a command line."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_utils import DEPLOY, REPO, unavailable

K8S = DEPLOY / "k8s"
K8S_VERSION = "1.30.0"
NOT_IN_KUSTOMIZATION = {"kustomization.yaml", "secret.example.yaml"}
OPERATOR_KINDS = {"ServiceMonitor", "PrometheusRule"}


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def render_kustomization() -> list[dict[str, Any]]:
    """What `kubectl kustomize deploy/k8s` emits for our kustomization (plain resources, no transformers)."""
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert set(kust) <= {"apiVersion", "kind", "resources"}, "only plain resources are rendered here"
    objects: list[dict[str, Any]] = []
    for name in kust["resources"]:
        objects.extend(_docs(K8S / name))
    return objects


def _by_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def _pod_specs(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o["spec"]["template"] for o in objects if o["kind"] in ("Deployment", "StatefulSet")}


def test_every_manifest_is_in_the_kustomization() -> None:
    listed = set(yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"])
    present = {p.name for p in K8S.glob("*.yaml")} - NOT_IN_KUSTOMIZATION
    assert listed == present


def test_manifests_validate_against_kubernetes_schemas() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    objects = render_kustomization() + _docs(K8S / "secret.example.yaml")
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "StatefulSet", "Service", "PersistentVolumeClaim", "ServiceMonitor"} <= kinds
    for obj in objects:
        if obj["kind"] in OPERATOR_KINDS:
            continue  # a CRD: checked against the Services below
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    deployment = _by_kind(objects, "Deployment")["specroll"]
    broken = {**deployment, "spec": {**deployment["spec"], "replicas": "one"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_names_wire_up() -> None:
    """Services select pods that exist and name their ports; PVCs, Secrets and Redis are the ones defined."""
    objects = render_kustomization()
    pods = _pod_specs(objects)
    services = _by_kind(objects, "Service")
    claims = set(_by_kind(objects, "PersistentVolumeClaim"))
    secret = _docs(K8S / "secret.example.yaml")[0]
    for svc in services.values():
        selector = svc["spec"]["selector"]
        matching = [t for t in pods.values() if selector.items() <= t["metadata"]["labels"].items()]
        assert len(matching) == 1, svc["metadata"]["name"]
        port_names = {p["name"] for c in matching[0]["spec"]["containers"] for p in c.get("ports", [])}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= port_names
    for name, template in pods.items():
        for vol in template["spec"].get("volumes", []):
            if "persistentVolumeClaim" in vol:
                assert vol["persistentVolumeClaim"]["claimName"] in claims, name
        for c in template["spec"]["containers"]:
            assert not any("token" in a.lower() for a in c.get("args", [])), f"{name}: token on a command line"
            for env in c.get("env", []):
                if "TOKEN" in env["name"]:
                    ref = env["valueFrom"]["secretKeyRef"]
                    assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["stringData"]
                if env["name"] == "SPECROLL_REDIS_URL":
                    host = env["value"].split("//")[1].split(":")[0]
                    assert host in services and services[host]["spec"]["ports"][0]["port"] == 6379


def test_network_policy_limits_who_reaches_specroll() -> None:
    """The pods --control-auth none opens are reachable only from the pods the policy names, on the server's
    ports; the router it lets in is a pod of the kustomization whose discovery selects the specroll pods."""
    objects = render_kustomization()
    pods = _pod_specs(objects)
    [policy] = _by_kind(objects, "NetworkPolicy").values()
    selected = [n for n, t in pods.items()
                if policy["spec"]["podSelector"]["matchLabels"].items() <= t["metadata"]["labels"].items()]
    assert selected == ["specroll"] and policy["spec"]["policyTypes"] == ["Ingress"]
    [rule] = policy["spec"]["ingress"]
    assert rule["from"] and all("podSelector" in peer and "namespaceSelector" not in peer for peer in rule["from"])
    server_ports = {p["containerPort"] for p in pods["specroll"]["spec"]["containers"][0]["ports"]}
    assert {p["port"] for p in rule["ports"]} == server_ports
    allowed = [peer["podSelector"]["matchLabels"] for peer in rule["from"]]
    router = pods["sglang-router"]
    assert any(sel.items() <= router["metadata"]["labels"].items() for sel in allowed)
    args = " ".join(router["spec"]["containers"][0]["args"])
    assert "--selector app.kubernetes.io/name=specroll" in args and "--service-discovery-port 8000" in args


def test_sidecar_has_probes_metrics_port_and_checkpoint_volume() -> None:
    objects = render_kustomization()
    template = _pod_specs(objects)["specroll-drafter-trainer"]
    [container] = template["spec"]["containers"]
    assert container["args"][0] == "drafter-trainer"
    port = container["args"][container["args"].index("--metrics-port") + 1]
    [metrics] = [p for p in container["ports"] if p["name"] == "metrics"]
    assert str(metrics["containerPort"]) == port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/metrics", "port": "metrics"}, probe
    ckpt = container["args"][container["args"].index("--checkpoint-dir") + 1]
    assert ckpt in {m["mountPath"] for m in container["volumeMounts"]}
    server = _pod_specs(objects)["specroll"]["spec"]["containers"][0]
    assert {p["name"] for p in server["ports"]} == {"http", "grpc"}
    assert server["readinessProbe"]["httpGet"]["path"] == "/ready"


def test_service_monitors_name_real_ports_and_paths() -> None:
    objects = render_kustomization()
    services = _by_kind(objects, "Service")
    monitors = _by_kind(objects, "ServiceMonitor")
    assert len(monitors) == 2
    scraped = set()
    for mon in monitors.values():
        sel = mon["spec"]["selector"]["matchLabels"]
        [svc] = [s for s in services.values() if sel.items() <= s["metadata"]["labels"].items()]
        ports = {p["name"] for p in svc["spec"]["ports"]}
        for ep in mon["spec"]["endpoints"]:
            assert ep["port"] in ports and ep["path"] == "/metrics"
            scraped.add((svc["metadata"]["name"], ep["port"]))
    assert scraped == {("specroll", "http"), ("specroll-drafter-trainer", "metrics")}


def _compose() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def test_compose_services_volumes_and_secrets() -> None:
    compose = _compose()
    services = compose["services"]
    assert set(services) == {"specroll", "drafter-trainer", "redis", "prometheus", "grafana"}
    assert "--appendonly" in services["redis"]["command"] and any(v.endswith(":/data")
                                                                    for v in services["redis"]["volumes"])
    trainer = services["drafter-trainer"]
    assert trainer["command"][0] == "drafter-trainer"
    ckpt = trainer["command"][trainer["command"].index("--checkpoint-dir") + 1]
    assert any(v.split(":")[1] == ckpt for v in trainer["volumes"])
    for name in ("specroll", "drafter-trainer"):
        svc = services[name]
        assert not any("token" in str(a).lower() for a in svc.get("command", [])), name
        secret_file = svc["environment"]["SPECROLL_ADMIN_TOKEN_FILE"]
        assert secret_file.rsplit("/", 1)[1] in svc["secrets"] and "SPECROLL_ADMIN_TOKEN" not in svc["environment"]
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = {t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    port = trainer["command"][trainer["command"].index("--metrics-port") + 1]
    assert targets == {"specroll:8000", f"drafter-trainer:{port}"}


def test_docker_compose_config_validates(tmp_path: Path) -> None:
    """`docker-compose config` (Debian's docker-compose, the compose file format's own validator)."""
    import shutil

    binary = shutil.which("docker-compose")
    if binary is None:
        unavailable("docker-compose not found (apt-get install docker-compose)")
    assert binary is not None
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "admin-token").write_text("t")
    (secrets / "grafana-admin-password").write_text("p")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "SPECROLL_SECRETS_DIR": str(secrets)}
    out = subprocess.run([binary, "-f", str(DEPLOY / "docker-compose.yml"), "config"], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rendered = yaml.safe_load(out.stdout)
    assert rendered["services"]["specroll"]["environment"]["SPECROLL_REDIS_URL"] == "redis://redis:6379/0"
    assert rendered["secrets"]["specroll_admin_token"]["file"] == str(secrets / "admin-token")
    bad = tmp_path / "bad.yml"
    bad.write_text((DEPLOY / "docker-compose.yml").read_text().replace("restart: unless-stopped",
                                                                       "restart: [unless-stopped]", 1))
    out = subprocess.run([binary, "-f", str(bad), "config"], env=env, cwd=DEPLOY, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0 and "restart" in out.stderr, out.stderr


def _dockerfile_tail(path: Path) -> list[str]:
    """The instructions from USER on (user, ports, HEALTHCHECK, ENTRYPOINT), continuation lines joined."""
    text = path.read_text().replace("\\\n", " ")
    lines = [" ".join(line.split()) for line in text.splitlines() if line.strip() and not line.startswith("#")]
    return lines[next(i for i, line in enumerate(lines) if line.startswith("USER ")):]


def test_cuda_dockerfile_runs_like_the_cpu_image() -> None:
    """The CUDA variant cannot be built here (no GPU, no registry): it must at least start the same way."""
    cpu, cuda = REPO / "Dockerfile", DEPLOY / "docker" / "Dockerfile.cuda"
    assert _dockerfile_tail(cuda) == _dockerfile_tail(cpu)
    assert "torch==2.13.0" in cuda.read_text() and "ARG BASE=nvidia/cuda" in cuda.read_text()


def test_compose_fleet_routes_to_its_replicas() -> None:
    """The fleet override's router names every specroll replica (base file's and its own) by service and port."""
    fleet = yaml.safe_load((DEPLOY / "docker-compose.fleet.yml").read_text())["services"]
    services = {**_compose()["services"], **fleet}
    command = " ".join(fleet["router"]["command"])
    workers = command.split("--worker-urls", 1)[1].split()
    replicas = sorted(n for n in services if n.startswith("specroll") and n != "specroll-drafter-trainer"
                      and "drafter" not in n)
    assert sorted(w.removeprefix("http://").split(":")[0] for w in workers) == replicas
    assert all(w.endswith(":8000") for w in workers)
