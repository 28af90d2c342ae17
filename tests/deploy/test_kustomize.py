"""Render every kustomization under deploy/k8s and check it: Kubernetes schemas (the
`kubernetes-validate` package, strict), our renderer against real kustomize, and the operational
invariants (probes, drain, grace vs lease, images, security, RDMA environment)."""

from __future__ import annotations

import copy
import re

import kubernetes_validate
import pytest
import yaml
from k8s_objects import (
    KUBECTL,
    OVERLAYS,
    WORKER_ROLES,
    config_text,
    container_env,
    deployments,
    find,
    main_container,
    pod_spec,
    render_with_kubectl,
)
from kustomize_lite import Unsupported, render

# The oldest Kubernetes the manifests target (gRPC probes are GA in 1.27) and the newest schema.
K8S_VERSIONS = ("1.27.0", kubernetes_validate.latest_version())
SERVICE_NAMES = {
    "router": "dsv4.v1.Router",
    "prefill": "dsv4.v1.PrefillWorker",
    "decode": "dsv4.v1.DecodeWorker",
}
_VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def _key(obj):
    return (obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"])


def _component(obj) -> str:
    return obj["metadata"]["labels"]["app.kubernetes.io/component"]


def _lease_ttl_s(objs) -> float:
    return float(yaml.safe_load(config_text(objs))["transfer"]["lease_ttl_s"])


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_validates_against_the_kubernetes_schema(rendered, overlay, version):
    objs = rendered[overlay]
    kinds = {o["kind"] for o in objs}
    assert {"Deployment", "Service", "ConfigMap", "ServiceAccount"} <= kinds
    for obj in objs:
        kubernetes_validate.validate(obj, version, strict=True)


def test_the_validator_is_strict(rendered):
    broken = copy.deepcopy(find(rendered["base"], "Deployment", "dsv4-prefill"))
    main_container(broken)["livenessProbe"]["grpc"]["prot"] = 50061
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSIONS[-1], strict=True)


@pytest.mark.skipif(KUBECTL is None, reason="kubectl (with kustomize) is not installed")
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_lite_renderer_matches_kubectl_kustomize(overlay):
    real = {_key(o): o for o in render_with_kubectl(OVERLAYS[overlay])}
    lite = {_key(o): o for o in render(OVERLAYS[overlay])}
    assert sorted(lite) == sorted(real)
    for key, obj in real.items():
        assert lite[key] == obj, f"{key} differs"


def test_lite_renderer_refuses_what_it_does_not_implement(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: []\nnamePrefix: x-\n")
    with pytest.raises(Unsupported, match="namePrefix"):
        render(tmp_path)


def test_a_config_change_renames_the_config_map_everywhere(tmp_path):
    (tmp_path / "config.yaml").write_text("model: {path: tiny}\n")
    (tmp_path / "kustomization.yaml").write_text(
        f"resources: [{OVERLAYS['base']}]\nconfigMapGenerator:\n"
        "  - {name: dsv4-config, behavior: replace, files: [config.yaml]}\n"
    )
    (old,) = [o["metadata"]["name"] for o in render(OVERLAYS["base"]) if o["kind"] == "ConfigMap"]
    objs = render(tmp_path)
    (new,) = [o["metadata"]["name"] for o in objs if o["kind"] == "ConfigMap"]
    assert new != old and new.startswith("dsv4-config-") and old.startswith("dsv4-config-")
    for dep in deployments(objs):
        names = [v["configMap"]["name"] for v in pod_spec(dep)["volumes"] if "configMap" in v]
        assert names in ([], [new]), "every pod must roll when the config changes"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_grpc_probes_on_grpc_health(rendered, overlay):
    for dep in deployments(rendered[overlay]):
        component = _component(dep)
        if component not in SERVICE_NAMES:
            continue
        container = main_container(dep)
        port = next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == port, (dep["metadata"]["name"], probe)
        # readiness on the role's service (NOT_SERVING while draining or unroutable),
        # liveness on "" (the process).
        assert container["readinessProbe"]["grpc"]["service"] == SERVICE_NAMES[component]
        assert container["livenessProbe"]["grpc"].get("service", "") == ""


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_drain_before_stopping_and_outlive_the_kv_lease(rendered, overlay):
    objs = rendered[overlay]
    lease_ttl_s = _lease_ttl_s(objs)
    drain_timeout_s = float(yaml.safe_load(config_text(objs))["worker"]["drain_timeout_s"])
    for role in WORKER_ROLES:
        dep = find(objs, "Deployment", f"dsv4-{role}")
        container = main_container(dep)
        command = container["lifecycle"]["preStop"]["exec"]["command"]
        assert command[:2] == ["python", "/opt/dsv4/drain.py"]
        address = command[command.index("--address") + 1]
        port = next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc")
        assert address == f"127.0.0.1:{port}"
        prestop_s = float(command[command.index("--timeout-s") + 1])
        grace_s = pod_spec(dep)["terminationGracePeriodSeconds"]
        assert grace_s > lease_ttl_s, f"{role}: grace must outlive unpulled KV leases"
        assert grace_s >= prestop_s + drain_timeout_s + 5, f"{role}: grace too short"
        if role == "prefill":
            assert prestop_s > lease_ttl_s, "prefill drain must wait out unpulled leases"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_images_are_pinned(rendered, overlay):
    for dep in deployments(rendered[overlay]):
        for container in pod_spec(dep)["containers"]:
            image = container["image"]
            tag = image.rsplit("/", 1)[-1].partition(":")[2]
            assert "@sha256:" in image or (tag and tag != "latest"), image


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_security_context(rendered, overlay):
    for dep in deployments(rendered[overlay]):
        pod = pod_spec(dep)
        assert pod["automountServiceAccountToken"] is False
        for container in pod["containers"]:
            sc = container["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert set(sc["capabilities"].get("add", [])) <= {"IPC_LOCK"}
            is_root = pod["securityContext"].get("runAsUser") == 0
            assert is_root == bool(sc["capabilities"].get("add")), "root only for IPC_LOCK"
            assert "resources" in container and container["resources"]["limits"]
        if not (overlay == "prod-multi-node" and _component(dep) in WORKER_ROLES):
            assert pod["securityContext"]["runAsNonRoot"] is True


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_env_references_are_defined_before_use(rendered, overlay):
    for dep in deployments(rendered[overlay]):
        for container in pod_spec(dep)["containers"]:
            defined: set[str] = set()
            for item in container.get("env", []):
                for ref in _VAR_REF.findall(str(item.get("value", ""))):
                    assert ref in defined, f"{item['name']} uses $({ref}) before it is defined"
                defined.add(item["name"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_selectors_match_pods(rendered, overlay):
    objs = rendered[overlay]
    templates = [d["spec"]["template"]["metadata"]["labels"] for d in deployments(objs)]
    for obj in objs:
        if obj["kind"] == "Service":
            selector = obj["spec"]["selector"]
        elif obj["kind"] in ("PodDisruptionBudget", "Deployment"):
            selector = obj["spec"]["selector"]["matchLabels"]
        else:
            continue
        matches = [t for t in templates if selector.items() <= t.items()]
        assert len(matches) == 1, f"{obj['kind']} {obj['metadata']['name']}: {selector}"


def test_workers_request_gpus_and_rdma_in_base_and_prod(rendered):
    for overlay in ("base", "prod-multi-node"):
        for role in WORKER_ROLES:
            limits = main_container(find(rendered[overlay], "Deployment", f"dsv4-{role}"))[
                "resources"
            ]["limits"]
            assert int(limits["nvidia.com/gpu"]) >= 1 and int(limits["rdma/ib"]) >= 1


def test_prod_overlay_sets_the_nixl_rdma_environment(rendered):
    objs = rendered["prod-multi-node"]
    assert find(objs, "Deployment", "dsv4-prefill")["spec"]["replicas"] > 1
    assert find(objs, "Deployment", "dsv4-decode")["spec"]["replicas"] > 1
    assert yaml.safe_load(config_text(objs))["transfer"]["transport"] == "nixl"
    for role in WORKER_ROLES:
        dep = find(objs, "Deployment", f"dsv4-{role}")
        container = main_container(dep)
        env = container_env(container)
        assert "rc" in env["UCX_TLS"].split(",") and "tcp" not in env["UCX_TLS"].split(",")
        assert env["UCX_NET_DEVICES"] and env["NCCL_NVLS_ENABLE"] == "0"
        assert container["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        assert container["resources"]["limits"]["hugepages-2Mi"]
        anti = pod_spec(dep)["affinity"]["podAntiAffinity"]
        assert anti["requiredDuringSchedulingIgnoredDuringExecution"]


def test_dev_overlay_is_one_node_with_cuda_ipc(rendered):
    objs = rendered["dev-single-node"]
    assert yaml.safe_load(config_text(objs))["transfer"]["transport"] == "cuda_ipc"
    for role in WORKER_ROLES:
        dep = find(objs, "Deployment", f"dsv4-{role}")
        pod = pod_spec(dep)
        assert dep["spec"]["replicas"] == 1
        assert pod["hostIPC"] and pod["hostPID"], "CUDA IPC needs shared IPC and PID namespaces"
        assert pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert "rdma/ib" not in main_container(dep)["resources"]["limits"]
        assert not any(v.get("persistentVolumeClaim") for v in pod["volumes"])
