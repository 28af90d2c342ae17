"""What the rendered manifests allow and require beyond their schemas: who may reach whom
(NetworkPolicies, evaluated with netpol.py over every pair of pods and every port in use), the
Secrets every pod needs (Redis password, worker RPC secret), the HorizontalPodAutoscalers and
their metrics adapter, and the LeaderWorkerSet groups."""

from __future__ import annotations

import copy
import itertools
import re
from urllib.parse import urlsplit

import pytest
import yaml
from k8s_objects import (
    DEPLOY,
    LWS_INJECTED_ENV,
    OVERLAYS,
    ROOT,
    WORKER_ROLES,
    component,
    container_env,
    effective_config,
    find,
    main_container,
    of_kind,
    pod_templates,
    pool,
    secret_value,
    workloads,
)
from netpol import Pod, allowed

AUTOSCALED = ("prod-multi-node", "prod-multi-node-lws")
LWS_NAME = "leaderworkerset.sigs.k8s.io/name"
OUTSIDERS = {  # pods of other namespaces the policies name or must keep out
    "client": Pod("client", "clients", {"app": "client"}),
    "prometheus": Pod("prometheus", "monitoring", {"app": "prometheus"}),
    "coredns": Pod("coredns", "kube-system", {"k8s-app": "kube-dns"}),
}
ADAPTER_VALUES = DEPLOY / "k8s" / "metrics-adapter" / "prometheus-adapter-values.yaml"


def cluster_pods(objs) -> dict[str, Pod]:
    """One pod per Deployment; a leader and a worker per LeaderWorkerSet (with the labels the
    LWS controller adds); and the outsiders. Keys: `role` or `role-rank`."""
    pods = dict(OUTSIDERS)
    for workload in workloads(objs):
        namespace = workload["metadata"].get("namespace", "default")
        for rank, template in enumerate(pod_templates(workload)):
            labels = dict(template["metadata"]["labels"])
            key = component(workload)
            if workload["kind"] == "LeaderWorkerSet":
                labels[LWS_NAME] = workload["metadata"]["name"]
                key = f"{key}-{rank}"
            pods[key] = Pod(key, namespace, labels)
    return pods


def _ports(container, name: str) -> int:
    return next(p["containerPort"] for p in container["ports"] if p["name"] == name)


def expected_flows(objs) -> tuple[set[tuple[str, str, int, str]], list[tuple[int, str]]]:
    """(source role, destination role, port, protocol) the design allows, and the ports to try."""
    router, worker = main_container(pool(objs, "router")), main_container(pool(objs, "prefill"))
    api, rpc, metrics = _ports(router, "grpc"), _ports(worker, "grpc"), _ports(router, "metrics")
    http = _ports(router, "http")
    redis = _ports(main_container(pool(objs, "redis")), "redis")
    ucx_lo, ucx_hi = map(int, container_env(worker)["UCX_TCP_PORT_RANGE"].split("-"))
    dsv4 = ("router", "prefill", "decode")
    flows = {(x, "router", p, "TCP") for x in OUTSIDERS for p in (api, http)}  # any client
    flows.add(("decode", "prefill", rpc, "TCP"))
    flows |= {("router", role, rpc, "TCP") for role in WORKER_ROLES}
    flows |= {("prometheus", role, metrics, "TCP") for role in dsv4}
    flows |= {(role, "redis", redis, "TCP") for role in dsv4}
    flows |= {
        (a, b, p, "TCP") for a, b in itertools.permutations(WORKER_ROLES) for p in (ucx_lo, ucx_hi)
    }
    flows |= {(role, "coredns", 53, proto) for role in (*dsv4, "redis") for proto in ("UDP", "TCP")}
    tried = [(p, "TCP") for p in (api, http, rpc, metrics, redis, ucx_lo, ucx_hi, ucx_hi + 1)]
    tried.append((29500, "TCP"))  # the LWS groups' torch.distributed store
    return flows, [*tried, (53, "UDP"), (53, "TCP")]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_allow_exactly_the_designed_flows(rendered, overlay):
    objs = rendered[overlay]
    policies = of_kind(objs, "NetworkPolicy")
    deny = find(objs, "NetworkPolicy", "dsv4-default-deny")["spec"]
    assert deny == {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}
    pods = cluster_pods(objs)
    flows, ports = expected_flows(objs)
    wrong = []
    for (a, src), (b, dst) in itertools.permutations(pods.items(), 2):
        if a in OUTSIDERS and b in OUTSIDERS:
            continue
        for port, proto in ports:
            role_a, role_b = a.split("-")[0], b.split("-")[0]
            same_group = LWS_NAME in src.labels and src.labels[LWS_NAME] == dst.labels.get(LWS_NAME)
            want = (role_a, role_b, port, proto) in flows or (same_group and proto == "TCP")
            if allowed(policies, src, dst, port, proto) != want:
                wrong.append(f"{a} -> {b}:{port}/{proto} should be {'open' if want else 'closed'}")
    assert not wrong, "\n".join(wrong)


def test_the_policy_evaluator_sees_a_hole(rendered):
    """An extra allow-all-ingress policy on Redis must show up as wrong flows."""
    objs = copy.deepcopy(rendered["prod-multi-node"])
    policies = of_kind(objs, "NetworkPolicy")
    redis_policy = copy.deepcopy(find(objs, "NetworkPolicy", "dsv4-redis"))
    redis_policy["spec"]["ingress"] = [{}]
    pods = cluster_pods(objs)
    assert not allowed(policies, pods["client"], pods["redis"], 6379)
    assert allowed([*policies, redis_policy], pods["client"], pods["redis"], 6379)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_redis_requires_the_password_from_its_secret(rendered, overlay):
    objs = rendered[overlay]
    redis = main_container(pool(objs, "redis"))
    args = redis["args"]
    assert args[args.index("--protected-mode") + 1] == "yes"
    reference = re.fullmatch(r"\$\((\w+)\)", args[args.index("--requirepass") + 1])
    assert reference, "the password comes from the environment, never the manifest"
    (source,) = [e["valueFrom"] for e in redis["env"] if e["name"] == reference[1]]
    assert source["secretKeyRef"] == {"name": "dsv4-redis-auth", "key": "password"}
    assert reference[1] == "REDISCLI_AUTH", "redis-cli (the readiness probe) must authenticate"
    assert "PONG" in " ".join(redis["readinessProbe"]["exec"]["command"])


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("role", ("router", *WORKER_ROLES))
def test_services_get_redis_and_the_worker_secret_from_secrets(rendered, overlay, role, tmp_path):
    objs = rendered[overlay]
    config = effective_config(objs, pool(objs, role), tmp_path)
    url = urlsplit(config.discovery.redis_url)
    service = find(objs, "Service", "dsv4-redis")
    assert (url.hostname, url.port) == ("dsv4-redis", service["spec"]["ports"][0]["port"])
    assert url.password == secret_value("dsv4-redis-auth", "password")
    assert config.security.shared_secret == secret_value("dsv4-internal-token", "token")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_secret_is_optional(rendered, overlay):
    """Closed by default: a pod whose Secret is missing does not start, rather than run open."""
    for workload in workloads(rendered[overlay]):
        for template in pod_templates(workload):
            for container in template["spec"]["containers"]:
                for item in container.get("env", []):
                    ref = item.get("valueFrom", {}).get("secretKeyRef")
                    assert not (ref and ref.get("optional")), f"{item['name']} is optional"


def _adapter_metric_names(series: str) -> list[str]:
    """The custom-metric names prometheus-adapter serves for a Prometheus series name."""
    names = []
    for rule in yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]:
        selected = re.search(r'__name__=~"([^"]+)"', rule["seriesQuery"])
        if selected and re.fullmatch(selected[1], series):
            as_ = re.sub(r"\$\{(\d+)\}", r"\\\1", rule["name"]["as"])
            names.append(re.sub(rule["name"]["matches"], as_, series))
    return names


HPA_SERIES = {  # pool -> the vLLM-compatible series its HPA scales on
    "prefill": {"vllm:num_requests_waiting"},
    "decode": {"vllm:kv_cache_usage_perc", "vllm:num_requests_running"},
}


@pytest.mark.parametrize("overlay", AUTOSCALED)
def test_every_pool_has_an_hpa_on_its_workload_and_adapter_metrics(rendered, overlay):
    objs = rendered[overlay]
    for role in ("router", *WORKER_ROLES):
        hpa = find(objs, "HorizontalPodAutoscaler", f"dsv4-{role}")["spec"]
        workload = pool(objs, role)
        target = hpa["scaleTargetRef"]
        assert (target["kind"], target["name"]) == (workload["kind"], workload["metadata"]["name"])
        assert target["apiVersion"] == workload["apiVersion"]
        assert "replicas" not in workload["spec"], "an apply must not reset the HPA's count"
        assert 1 <= hpa["minReplicas"] <= hpa["maxReplicas"]
        pods_metrics = {m["pods"]["metric"]["name"] for m in hpa["metrics"] if m["type"] == "Pods"}
        served = {name for s in HPA_SERIES.get(role, ()) for name in _adapter_metric_names(s)}
        assert pods_metrics == served, f"{role}: every Pods metric comes from the adapter rules"
        if role in WORKER_ROLES:  # GPU pods start in minutes: scale down slower than up
            behavior = hpa["behavior"]
            assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 300
            assert behavior["scaleUp"]["policies"] == [
                {"type": "Pods", "value": 1, "periodSeconds": 300}
            ]


def test_decode_scales_before_its_batch_is_full(rendered):
    objs = rendered["prod-multi-node"]
    args = main_container(pool(objs, "decode"))["args"]
    max_num_seqs = int(args[args.index("--max-num-seqs") + 1])
    metrics = find(objs, "HorizontalPodAutoscaler", "dsv4-decode")["spec"]["metrics"]
    targets = {m["pods"]["metric"]["name"]: m["pods"]["target"]["averageValue"] for m in metrics}
    assert 0 < int(targets["vllm_num_requests_running"]) < max_num_seqs
    assert targets["vllm_kv_cache_usage_perc"].endswith("m"), "a fraction of 1, in milli-units"
    assert 0 < int(targets["vllm_kv_cache_usage_perc"][:-1]) < 1000


def test_the_services_export_the_series_the_hpas_use():
    source = (ROOT / "dsv4" / "serving" / "metrics.py").read_text()
    if "vllm:" not in source:
        pytest.skip(
            "dsv4/serving/metrics.py exports no vllm:* series yet (they land with the metrics work)"
        )
    for series in set().union(*HPA_SERIES.values()):
        assert f'"{series}"' in source, f"dsv4/serving/metrics.py defines no {series}"


def test_lws_groups_run_the_prod_pods_with_the_rank_environment(rendered):
    objs, prod = rendered["prod-multi-node-lws"], rendered["prod-multi-node"]
    for role in WORKER_ROLES:
        assert not [d for d in of_kind(objs, "Deployment") if component(d) == role]
        group = find(objs, "LeaderWorkerSet", f"dsv4-{role}")
        spec = group["spec"]["leaderWorkerTemplate"]
        assert spec["size"] >= 2 and spec["restartPolicy"] == "RecreateGroupOnPodRestart"
        leader, worker = copy.deepcopy(pod_templates(group))
        for rank, template in enumerate((leader, worker)):
            injected = {**LWS_INJECTED_ENV, "LWS_WORKER_INDEX": str(rank)}
            injected["LWS_GROUP_SIZE"] = str(spec["size"])
            env = container_env(template["spec"]["containers"][0], injected)
            assert env["MASTER_ADDR"] == injected["LWS_LEADER_ADDRESS"]
            assert (env["NNODES"], env["NODE_RANK"]) == (str(spec["size"]), str(rank))
            assert int(env["MASTER_PORT"]) > 0
            rank_env = {"MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK"}
            container = template["spec"]["containers"][0]
            container["env"] = [e for e in container["env"] if e["name"] not in rank_env]
        # The leader is prod's worker pod as it was; ranks > 0 lose only the probes and drain.
        assert leader == find(prod, "Deployment", f"dsv4-{role}")["spec"]["template"]
        for key in ("startupProbe", "readinessProbe", "livenessProbe", "lifecycle"):
            assert key not in worker["spec"]["containers"][0]
            del leader["spec"]["containers"][0][key]
        assert worker == leader


def test_single_host_rank_groups_are_one_pod_that_starts_its_ranks(rendered):
    """prod-single-host-lws: one pod per group (the worker spawns its 8 ranks); its env makes
    the worker's config a replica of 8 ranks, experts whole per rank, without MTP."""
    from dsv4.config.load import load_config

    objs = rendered["prod-single-host-lws"]
    for role in WORKER_ROLES:
        group = find(objs, "LeaderWorkerSet", f"dsv4-{role}")
        assert group["spec"]["leaderWorkerTemplate"]["size"] == 1
        leader, _ = pod_templates(group)
        injected = {**LWS_INJECTED_ENV, "LWS_WORKER_INDEX": "0", "LWS_GROUP_SIZE": "1"}
        env = container_env(leader["spec"]["containers"][0], injected)
        assert env["NCCL_NVLS_ENABLE"] == "0"
        dsv4_env = {k: v for k, v in env.items() if k in ("DSV4_TENSOR_PARALLEL_SIZE",
                    "DSV4_EXPERT_PARALLEL", "DSV4_SPEC_METHOD")}  # fmt: skip
        config = load_config({}, None, dsv4_env)
        assert config.model.tensor_parallel_size == 8 and config.model.expert_parallel
        assert config.speculative.method == "none"
