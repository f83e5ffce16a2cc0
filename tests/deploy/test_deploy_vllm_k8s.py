"""The vLLM backend's Kubernetes examples (one pod with N GPUs, a model across nodes): schema-valid pod templates
that run specroll with --backend vllm, readiness on the API, pushes staged where every worker can read them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_utils import DEPLOY

VLLM = DEPLOY / "k8s" / "vllm"
K8S_VERSION = "1.30.0"


def _doc(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


def test_single_pod_tensor_parallel_deployment_validates():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    dep = _doc(VLLM / "single-pod-tp.yaml")
    kubernetes_validate.validate(dep, K8S_VERSION, strict=True)
    [c] = dep["spec"]["template"]["spec"]["containers"]
    env = _env(c)
    gpus = c["resources"]["limits"]["nvidia.com/gpu"]
    assert env["SPECROLL_BACKEND"] == "vllm" and int(env["SPECROLL_TENSOR_PARALLEL_SIZE"]) == gpus
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert "SPECROLL_ADMIN_TOKEN" in {e["name"] for e in c["env"]} and not any("token" in a for a in c["args"])


def test_multi_node_leader_worker_set_pods_validate():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    lws = _doc(VLLM / "multi-node-lws.yaml")
    assert lws["kind"] == "LeaderWorkerSet"
    tmpl = lws["spec"]["leaderWorkerTemplate"]
    for role in ("leaderTemplate", "workerTemplate"):  # a CRD: its pod templates are plain pods
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": role.lower()}, "spec": tmpl[role]["spec"]}
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    [leader] = tmpl["leaderTemplate"]["spec"]["containers"]
    env = _env(leader)
    assert env["SPECROLL_DISTRIBUTED_EXECUTOR_BACKEND"] == "ray"
    total = int(env["SPECROLL_TENSOR_PARALLEL_SIZE"]) * int(env["SPECROLL_PIPELINE_PARALLEL_SIZE"])
    assert total == tmpl["size"] * leader["resources"]["limits"]["nvidia.com/gpu"]
    assert leader["readinessProbe"]["httpGet"]["path"] == "/ready"
    stage = env["SPECROLL_VLLM_STAGE_DIR"]
    for role in ("leaderTemplate", "workerTemplate"):
        mounts = [m["mountPath"] for c in tmpl[role]["spec"]["containers"] for m in c["volumeMounts"]]
        assert any(stage.startswith(m) for m in mounts), f"{role} cannot read staged pushes at {stage}"
