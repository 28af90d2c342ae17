"""Render every kustomization under deploy/k8s with `kubectl kustomize` and check it: Kubernetes
schemas (the `kubernetes-validate` package, strict; LeaderWorkerSets against their v1 API), and
the operational invariants (probes, drain, grace vs lease, images, security, RDMA environment).
Network policies, Secrets, autoscaling and worker groups: test_cluster_policy.py."""

from __future__ import annotations

import copy
import os
import tomllib

import jsonschema
import kubernetes_validate
import pytest
import yaml
from k8s_objects import (
    CANNOT_RENDER,
    K8S,
    OVERLAYS,
    ROOT,
    VAR_REF,
    WORKER_ROLES,
    component,
    config_text,
    container_env,
    deployments,
    find,
    injected_env,
    main_container,
    pod_spec,
    pod_templates,
    pool,
    render,
    validate,
    workloads,
)

# The oldest Kubernetes the manifests target (gRPC probes are GA in 1.27) and the newest schema.
K8S_VERSIONS = ("1.27.0", kubernetes_validate.latest_version())
SERVICE_NAMES = {
    "router": "dsv4.v1.Router",
    "prefill": "dsv4.v1.PrefillWorker",
    "decode": "dsv4.v1.DecodeWorker",
}
DSV4_IMAGES = {"dsv4-worker", "dsv4-router"}  # the names manifests use; overlays set the rest
needs_kubectl = pytest.mark.skipif(CANNOT_RENDER is not None, reason=CANNOT_RENDER or "")


def _lease_ttl_s(objs) -> float:
    return float(yaml.safe_load(config_text(objs))["transfer"]["lease_ttl_s"])


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_validates_against_the_kubernetes_schema(rendered, overlay, version):
    objs = rendered[overlay]
    kinds = {o["kind"] for o in objs}
    assert {"Deployment", "Service", "ConfigMap", "ServiceAccount", "NetworkPolicy"} <= kinds
    for obj in objs:
        validate(obj, version)


def test_the_validators_are_strict(rendered):
    broken = copy.deepcopy(find(rendered["base"], "Deployment", "dsv4-prefill"))
    main_container(broken)["livenessProbe"]["grpc"]["prot"] = 50061
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(broken, K8S_VERSIONS[-1])
    group = copy.deepcopy(find(rendered["prod-multi-node-lws"], "LeaderWorkerSet", "dsv4-decode"))
    group["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "Always"
    with pytest.raises(jsonschema.ValidationError):
        validate(group, K8S_VERSIONS[-1])
    group = copy.deepcopy(find(rendered["prod-multi-node-lws"], "LeaderWorkerSet", "dsv4-decode"))
    main_container(group)["imagePullPolice"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(group, K8S_VERSIONS[-1])


@needs_kubectl
def test_a_config_change_renames_the_config_map_everywhere(tmp_path):
    (tmp_path / "config.yaml").write_text("model: {path: tiny}\n")
    base = os.path.relpath(OVERLAYS["base"], tmp_path)  # kustomize refuses absolute bases
    (tmp_path / "kustomization.yaml").write_text(
        f"resources: [{base}]\nconfigMapGenerator:\n"
        "  - {name: dsv4-config, behavior: replace, files: [config.yaml]}\n"
    )
    (old,) = [o["metadata"]["name"] for o in render(OVERLAYS["base"]) if o["kind"] == "ConfigMap"]
    objs = render(tmp_path)
    (new,) = [o["metadata"]["name"] for o in objs if o["kind"] == "ConfigMap"]
    assert new != old and new.startswith("dsv4-config-") and old.startswith("dsv4-config-")
    for dep in deployments(objs):
        names = [v["configMap"]["name"] for v in pod_spec(dep)["volumes"] if "configMap" in v]
        assert names in ([], [new]), "every pod must roll when the config changes"


@needs_kubectl
def test_a_kustomize_error_fails_with_kustomizes_message(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: [no-such-file.yaml]\n")
    with pytest.raises(AssertionError, match=r"no-such-file\.yaml"):
        render(tmp_path)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_grpc_probes_on_grpc_health(rendered, overlay):
    for workload in workloads(rendered[overlay]):
        if component(workload) not in SERVICE_NAMES:
            continue
        container = main_container(workload)
        port = next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == port, (component(workload), probe)
        # readiness on the role's service (NOT_SERVING while draining or unroutable),
        # liveness on "" (the process).
        assert container["readinessProbe"]["grpc"]["service"] == SERVICE_NAMES[component(workload)]
        assert container["livenessProbe"]["grpc"].get("service", "") == ""


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_drain_before_stopping_and_outlive_the_kv_lease(rendered, overlay):
    objs = rendered[overlay]
    lease_ttl_s = _lease_ttl_s(objs)
    drain_timeout_s = float(yaml.safe_load(config_text(objs))["worker"]["drain_timeout_s"])
    for role in WORKER_ROLES:
        workload = pool(objs, role)
        container = main_container(workload)
        command = container["lifecycle"]["preStop"]["exec"]["command"]
        assert command[:2] == ["python", "/opt/dsv4/drain.py"]
        address = command[command.index("--address") + 1]
        port = next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc")
        assert address == f"127.0.0.1:{port}"
        prestop_s = float(command[command.index("--timeout-s") + 1])
        grace_s = pod_spec(workload)["terminationGracePeriodSeconds"]
        assert grace_s > lease_ttl_s, f"{role}: grace must outlive unpulled KV leases"
        assert grace_s >= prestop_s + drain_timeout_s + 5, f"{role}: grace too short"
        if role == "prefill":
            assert prestop_s > lease_ttl_s, "prefill drain must wait out unpulled leases"


def test_no_placeholder_registry_in_the_manifests():
    for path in K8S.rglob("*.yaml"):
        assert "example.com" not in path.read_text(), f"{path}: placeholder registry"


def test_base_leaves_the_dsv4_images_to_the_overlays(rendered):
    images = {c["image"] for w in workloads(rendered["base"]) for c in pod_spec(w)["containers"]}
    assert images >= DSV4_IMAGES, "base names the images without registry or tag"


@pytest.mark.parametrize("overlay", [o for o in OVERLAYS if o != "base"])
def test_overlays_pin_every_image_through_kustomize_images(rendered, overlay):
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    for workload in workloads(rendered[overlay]):
        for template in pod_templates(workload):
            for container in template["spec"]["containers"]:
                image = container["image"]
                name, _, tag = image.rpartition(":")
                assert "@sha256:" in image or (tag and tag != "latest" and "/" not in tag), image
                assert name not in DSV4_IMAGES, f"{overlay}: {image} not set by `images:`"
                if "dsv4" in name:
                    assert tag == version, f"{image}: the tag is the release ({version})"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_security_context(rendered, overlay):
    for workload in workloads(rendered[overlay]):
        for template in pod_templates(workload):
            pod = template["spec"]
            assert pod["automountServiceAccountToken"] is False
            for container in pod["containers"]:
                sc = container["securityContext"]
                assert sc["allowPrivilegeEscalation"] is False
                assert sc["capabilities"]["drop"] == ["ALL"]
                assert set(sc["capabilities"].get("add", [])) <= {"IPC_LOCK"}
                is_root = pod["securityContext"].get("runAsUser") == 0
                assert is_root == bool(sc["capabilities"].get("add")), "root only for IPC_LOCK"
                assert "resources" in container and container["resources"]["limits"]
            if not (overlay.startswith("prod") and component(workload) in WORKER_ROLES):
                assert pod["securityContext"]["runAsNonRoot"] is True


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_env_references_are_defined_before_use(rendered, overlay):
    for workload in workloads(rendered[overlay]):
        for template in pod_templates(workload):
            for container in template["spec"]["containers"]:
                defined = set(injected_env(workload))
                for item in container.get("env", []):
                    for ref in VAR_REF.findall(str(item.get("value", ""))):
                        assert ref in defined, f"{item['name']} uses $({ref}) before it is set"
                    defined.add(item["name"])
                for arg in (*container.get("command", []), *container.get("args", [])):
                    for ref in VAR_REF.findall(arg):
                        assert ref in defined, f"argument {arg!r}: $({ref}) is not defined"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_selectors_match_pods(rendered, overlay):
    objs = rendered[overlay]
    templates = [t["metadata"]["labels"] for w in workloads(objs) for t in pod_templates(w)[:1]]
    for obj in objs:
        if obj["kind"] == "Service":
            selector = obj["spec"]["selector"]
        elif obj["kind"] in ("PodDisruptionBudget", "Deployment"):
            selector = obj["spec"]["selector"]["matchLabels"]
        else:
            continue
        matches = [t for t in templates if selector.items() <= t.items()]
        assert len(matches) == 1, f"{obj['kind']} {obj['metadata']['name']}: {selector}"


@pytest.mark.parametrize("overlay", ["base", "prod-multi-node", "prod-multi-node-lws"])
def test_workers_request_gpus_and_rdma(rendered, overlay):
    for role in WORKER_ROLES:
        for template in pod_templates(pool(rendered[overlay], role)):
            limits = template["spec"]["containers"][0]["resources"]["limits"]
            assert int(limits["nvidia.com/gpu"]) >= 1 and int(limits["rdma/ib"]) >= 1


@pytest.mark.parametrize("overlay", ["prod-multi-node", "prod-multi-node-lws"])
def test_prod_overlays_set_the_nixl_rdma_environment(rendered, overlay):
    objs = rendered[overlay]
    assert yaml.safe_load(config_text(objs))["transfer"]["transport"] == "nixl"
    for role in WORKER_ROLES:
        assert find(objs, "HorizontalPodAutoscaler", f"dsv4-{role}")["spec"]["minReplicas"] > 1
        workload = pool(objs, role)
        container = main_container(workload)
        env = container_env(container, injected_env(workload))
        assert "rc" in env["UCX_TLS"].split(",") and "tcp" not in env["UCX_TLS"].split(",")
        assert env["UCX_NET_DEVICES"] and env["NCCL_NVLS_ENABLE"] == "0"
        assert container["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        assert container["resources"]["limits"]["hugepages-2Mi"]
        anti = pod_spec(workload)["affinity"]["podAntiAffinity"]
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
