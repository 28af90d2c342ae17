"""Kubernetes NetworkPolicy semantics (networking.k8s.io/v1), for checking who may reach whom in
the rendered manifests without a cluster: a connection is allowed when the source's egress
policies and the destination's ingress policies both allow it; a pod no policy of a direction
selects is open in that direction. Pods are modelled by labels and namespace; ipBlock peers
match no pod (the manifests use none)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

Obj = dict[str, Any]
NAMESPACE_LABEL = "kubernetes.io/metadata.name"  # set on every namespace by the API server


@dataclass(frozen=True)
class Pod:
    name: str
    namespace: str
    labels: Mapping[str, str]


def selects(selector: Obj, labels: Mapping[str, str]) -> bool:
    """A LabelSelector against a label set ({} selects everything)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def _namespace(obj: Obj) -> str:
    return obj["metadata"].get("namespace", "default")


def _peer_matches(peer: Obj, pod: Pod, policy_namespace: str) -> bool:
    if "ipBlock" in peer:
        return False
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], {NAMESPACE_LABEL: pod.namespace}):
            return False
    elif pod.namespace != policy_namespace:
        return False
    return selects(peer.get("podSelector", {}), pod.labels)


def _port_matches(ports: list[Obj], port: int, protocol: str) -> bool:
    if not ports:
        return True
    for p in ports:
        if p.get("protocol", "TCP") != protocol:
            continue
        if "port" not in p:
            return True
        assert isinstance(p["port"], int), f"named port {p['port']!r}: use the number"
        if p["port"] <= port <= p.get("endPort", p["port"]):
            return True
    return False


def _direction_allows(
    policies: Iterable[Obj], pod: Pod, peer: Pod, port: int, protocol: str, direction: str
) -> bool:
    kind, rules_key, peers_key = {
        "Ingress": ("Ingress", "ingress", "from"),
        "Egress": ("Egress", "egress", "to"),
    }[direction]
    applying = [
        p
        for p in policies
        if _namespace(p) == pod.namespace
        and kind in p["spec"].get("policyTypes", ["Ingress"])
        and selects(p["spec"]["podSelector"], pod.labels)
    ]
    if not applying:
        return True
    return any(
        _port_matches(rule.get("ports", []), port, protocol)
        and (
            not rule.get(peers_key)
            or any(_peer_matches(x, peer, _namespace(p)) for x in rule[peers_key])
        )
        for p in applying
        for rule in p["spec"].get(rules_key) or []
    )


def allowed(policies: list[Obj], src: Pod, dst: Pod, port: int, protocol: str = "TCP") -> bool:
    """Whether `src` may open a connection to `dst` on port/protocol."""
    return _direction_allows(policies, src, dst, port, protocol, "Egress") and _direction_allows(
        policies, dst, src, port, protocol, "Ingress"
    )
