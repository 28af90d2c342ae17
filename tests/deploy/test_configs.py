"""Every ServeConfig YAML under deploy/ loads with `dsv4.config.load_config`, and every dsv4 pod
of every overlay builds a valid config from what it is given (mounted YAML + DSV4_* env + flags)
that agrees with its manifest: ports, probes, advertised address, Redis Service, role."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

import pytest
from k8s_objects import (
    DEPLOY,
    OVERLAYS,
    WORKER_ROLES,
    config_text,
    container_env,
    effective_config,
    find,
    injected_env,
    main_container,
    pod_spec,
    pod_templates,
    pool,
    workloads,
)

from dsv4.config import load_config
from dsv4.config.load import env_layer

CONFIG_FILES = sorted(DEPLOY.glob("configs/*.yaml")) + sorted(DEPLOY.glob("k8s/**/config.yaml"))


def test_there_are_example_configs():
    names = {p.name for p in DEPLOY.glob("configs/*.yaml")}
    assert {"local-1p1d.yaml", "multi-host-redis.yaml", "baseline-switches-off.yaml"} <= names


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_config_file_loads(path: Path):
    config = load_config(None, str(path), {})
    assert config.transfer.pull_timeout_s < config.transfer.lease_ttl_s


def test_local_example_is_a_static_1p1d():
    config = load_config(None, str(DEPLOY / "configs" / "local-1p1d.yaml"), {})
    assert len(config.discovery.prefill_addresses) == len(config.discovery.decode_addresses) == 1
    assert not config.discovery.redis_url


def test_baseline_example_switches_every_feature_off():
    config = load_config(None, str(DEPLOY / "configs" / "baseline-switches-off.yaml"), {})
    f = config.features
    assert not (f.index_cache or f.skip_topk or f.shared_sparse_metadata or f.fused_mhc)
    assert not (f.cached_token_to_req_indices or f.skip_redundant_fill)
    assert not f.compressor_boundary_only
    assert f.router_kernel == "reference" and config.scheduler.prefill_chunk_plan == "fixed"
    assert config.speculative.budget == "static"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_dsv4_env_var_names_a_config_field(rendered, overlay):
    for workload in workloads(rendered[overlay]):
        for template in pod_templates(workload):
            for container in template["spec"]["containers"]:
                env = container.get("env", [])
                names = {e["name"] for e in env if e["name"].startswith("DSV4_")}
                env_layer(dict.fromkeys(names - {"DSV4_CONFIG"}, "1"))  # unknown ones raise


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("component", ("router", *WORKER_ROLES))
def test_pod_config_loads_and_matches_its_manifest(rendered, overlay, component, tmp_path):
    objs = rendered[overlay]
    workload = pool(objs, component)
    config = effective_config(objs, workload, tmp_path)
    container = main_container(workload)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert config.metrics.prometheus_port == ports["metrics"]
    annotations = pod_templates(workload)[0]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(ports["metrics"])
    redis = urlsplit(config.discovery.redis_url)
    redis_service = find(objs, "Service", "dsv4-redis")
    assert redis.hostname == redis_service["metadata"]["name"]
    assert redis.port == redis_service["spec"]["ports"][0]["port"]
    if component == "router":
        assert config.router.host == "0.0.0.0" and config.router.port == ports["grpc"]
        assert config.router.http_port == ports["http"], "the OpenAI-compatible front is served"
        grace_s = pod_spec(workload)["terminationGracePeriodSeconds"]
        assert grace_s > config.worker.drain_timeout_s, "router stop grace must fit the pod's"
        service = find(objs, "Service", "dsv4-router")
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(ports)
        return
    assert config.worker.role == component
    assert config.worker.host == "0.0.0.0" and config.worker.port == ports["grpc"]
    assert config.worker.advertise_address == f"10.0.0.7:{ports['grpc']}"  # $(POD_IP):port
    assert config.worker.worker_id == "dsv4-pod-0"  # $(POD_NAME)


def pod_gpus(container: dict, env: dict[str, str]) -> int:
    """The GPUs a worker container gets: its device-plugin allocation (`nvidia.com/gpu`), else
    (dev-single-node: every GPU visible under the nvidia RuntimeClass) `CUDA_VISIBLE_DEVICES`."""
    resources = container["resources"]
    limit = resources.get("limits", {}).get("nvidia.com/gpu")
    if limit is not None:
        assert resources["requests"].get("nvidia.com/gpu") == limit, "GPU requests == limits"
        return int(limit)
    visible = env.get("CUDA_VISIBLE_DEVICES")
    assert visible, "a worker pod with no nvidia.com/gpu must name its GPUs"
    return len(visible.split(","))


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("role", WORKER_ROLES)
def test_each_worker_pod_gets_one_gpu_per_rank(rendered, overlay, role, tmp_path):
    """A worker of T ranks runs one per GPU (cuda:0..T-1, docs/operations.md §2): a pod that
    requests more GPUs than its config runs ranks holds idle cards; fewer cannot start."""
    workload = pool(rendered[overlay], role)
    for index, template in enumerate(pod_templates(workload)):
        config = effective_config(rendered[overlay], workload, tmp_path, index)
        container = template["spec"]["containers"][0]
        injected = {**injected_env(workload), "LWS_WORKER_INDEX": str(index)}
        gpus = pod_gpus(container, container_env(container, injected))
        ranks = config.model.tensor_parallel_size
        where = f"{overlay} {role} pod template {index}"
        assert gpus == ranks, f"{where}: {gpus} GPUs for {ranks} tensor-parallel ranks"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_share_one_config(rendered, overlay):
    objs = rendered[overlay]
    text = config_text(objs)
    (name,) = [o["metadata"]["name"] for o in objs if o["kind"] == "ConfigMap"]
    for workload in workloads(objs):
        for template in pod_templates(workload):
            if workload["metadata"]["name"] != "dsv4-redis":
                assert {"name": "config", "configMap": {"name": name}} in template["spec"][
                    "volumes"
                ]
    assert text.strip()
