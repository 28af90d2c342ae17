"""Helpers of the deploy/ tests: rendered kustomizations and the pods' effective config.

Rendering uses `kubectl kustomize` (kustomize v5, in the machine image) when it is on PATH, else
tests/deploy/kustomize_lite.py; test_kustomize.py checks that both give the same objects.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from kustomize_lite import render

from dsv4.config import ServeConfig, add_config_args, config_from_args

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
OVERLAYS = {
    "base": DEPLOY / "k8s" / "base",
    "dev-single-node": DEPLOY / "k8s" / "overlays" / "dev-single-node",
    "prod-multi-node": DEPLOY / "k8s" / "overlays" / "prod-multi-node",
}
WORKER_ROLES = ("prefill", "decode")
KUBECTL = shutil.which("kubectl")
_VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
_FAKE_FIELD_VALUES = {"status.podIP": "10.0.0.7", "metadata.name": "dsv4-pod-0"}

Obj = dict[str, Any]


def render_with_kubectl(path: Path) -> list[Obj]:
    assert KUBECTL is not None
    out = subprocess.run(
        [KUBECTL, "kustomize", str(path)], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def render_overlay(name: str) -> list[Obj]:
    path = OVERLAYS[name]
    return render_with_kubectl(path) if KUBECTL else render(path)


def find(objs: list[Obj], kind: str, name: str) -> Obj:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def deployments(objs: list[Obj]) -> Iterator[Obj]:
    return (o for o in objs if o["kind"] == "Deployment")


def pod_spec(deployment: Obj) -> Obj:
    return deployment["spec"]["template"]["spec"]


def main_container(deployment: Obj) -> Obj:
    return pod_spec(deployment)["containers"][0]


def config_text(objs: list[Obj]) -> str:
    """The config.yaml every dsv4 pod mounts (from the one generated ConfigMap)."""
    maps = [o for o in objs if o["kind"] == "ConfigMap" and "config.yaml" in o.get("data", {})]
    assert len(maps) == 1, "expected exactly one ConfigMap carrying config.yaml"
    return maps[0]["data"]["config.yaml"]


def container_env(container: Obj) -> dict[str, str]:
    """The container's environment as the kubelet builds it: fieldRefs get sample values,
    $(VAR) expands only to variables defined earlier, optional secrets are left out."""
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = _VAR_REF.sub(lambda m: env.get(m[1], m[0]), str(item["value"]))
            continue
        source = item["valueFrom"]
        if "fieldRef" in source:
            env[item["name"]] = _FAKE_FIELD_VALUES[source["fieldRef"]["fieldPath"]]
        elif not source.get("secretKeyRef", {}).get("optional"):
            raise AssertionError(f"env {item['name']}: only optional secrets are expected")
    return env


def effective_config(objs: list[Obj], deployment: Obj, tmp_path: Path) -> ServeConfig:
    """The ServeConfig a dsv4 container of `deployment` builds: its mounted YAML, its env and
    its `dsv4 <role> ...` arguments, through the same argparse glue as the real entry points."""
    container = main_container(deployment)
    assert container["command"] == ["dsv4"], "dsv4 containers run the dsv4 console script"
    role, *flags = container["args"]
    env = container_env(container)
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
