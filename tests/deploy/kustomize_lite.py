"""A small, faithful renderer for the kustomize subset deploy/k8s uses (no binary needed).

Why: tests must render every overlay on a fresh CI machine. `kubectl kustomize` (kustomize v5)
is used when it is installed, and tests/deploy/test_kustomize.py checks that this renderer gives
the same objects; without kubectl this renderer is the one that runs. Anything outside the subset
raises `Unsupported`, so the manifests cannot silently drift beyond what is rendered here.

Subset: `resources` (files and directories), `namespace`, `labels` (includeSelectors false),
`patches` (strategic merge, from `path`, with an optional `target` of kind / name regex),
`configMapGenerator` (files and literals; behavior create / replace / merge; the content-hash
name suffix, and the renaming of references to it in pod templates), `images`, `replicas`.

CLI: `python tests/deploy/kustomize_lite.py deploy/k8s/overlays/dev-single-node` prints YAML.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

Obj = dict[str, Any]


def _words(text: str) -> list[str]:
    return text.split()


KNOWN_KEYS = set(
    _words("apiVersion kind resources namespace labels patches configMapGenerator images replicas")
)
CLUSTER_SCOPED = set(
    _words(
        "Namespace ClusterRole ClusterRoleBinding PersistentVolume StorageClass PriorityClass "
        "CustomResourceDefinition"
    )
)
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}
# Strategic-merge keys of the lists our patches touch (k8s.io/api patchMergeKey); others replace.
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "volumes": "name",
    "env": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
    "imagePullSecrets": "name",
    "topologySpreadConstraints": "topologyKey",
}
# kustomize's legacy output order (kubectl kustomize's default), then by name.
KIND_ORDER = _words(
    "Namespace ResourceQuota StorageClass CustomResourceDefinition ServiceAccount "
    "PodSecurityPolicy Role ClusterRole RoleBinding ClusterRoleBinding ConfigMap Secret Endpoints "
    "Service LimitRange PriorityClass PersistentVolume PersistentVolumeClaim Deployment "
    "StatefulSet CronJob PodDisruptionBudget"
)
_HASHED = "__kustomize_lite_hashed__"  # marks a generated ConfigMap awaiting its suffix


class Unsupported(ValueError):
    """The kustomization uses something outside the subset above."""


def render(path: str | Path) -> list[Obj]:
    """All objects of the kustomization in `path`, as `kubectl kustomize path` would print."""
    objs = _build(Path(path))
    _add_hash_suffixes(objs)
    return sorted(objs, key=_order_key)


def _order_key(obj: Obj) -> tuple[int, str, str]:
    kind = obj["kind"]
    rank = KIND_ORDER.index(kind) if kind in KIND_ORDER else len(KIND_ORDER)
    return (rank, kind if rank == len(KIND_ORDER) else "", obj["metadata"]["name"])


def _build(root: Path) -> list[Obj]:
    kust = yaml.safe_load((root / "kustomization.yaml").read_text())
    extra = set(kust) - KNOWN_KEYS
    if extra:
        raise Unsupported(f"{root}/kustomization.yaml: unsupported keys {sorted(extra)}")
    objs: list[Obj] = []
    for entry in kust.get("resources", []):
        target = root / entry
        if target.is_dir():
            objs.extend(_build(target))
        else:
            objs.extend(d for d in yaml.safe_load_all(target.read_text()) if d)
    for spec in kust.get("configMapGenerator", []):
        _generate_config_map(root, spec, objs)
    for patch in kust.get("patches", []):
        _apply_patch(root, patch, objs)
    if "namespace" in kust:
        for obj in objs:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = kust["namespace"]
    for spec in kust.get("labels", []):
        _apply_labels(spec, objs)
    for spec in kust.get("replicas", []):
        _find(objs, spec["name"], kinds=WORKLOADS)["spec"]["replicas"] = spec["count"]
    for spec in kust.get("images", []):
        for obj in objs:
            for container in _containers(obj):
                container["image"] = _retag(container["image"], spec)
    return objs


# ---- generators -----------------------------------------------------------------------------


def _generate_config_map(root: Path, spec: Obj, objs: list[Obj]) -> None:
    extra = set(spec) - {"name", "behavior", "files", "literals", "options"}
    options = spec.get("options", {})
    if extra or set(options) - {"disableNameSuffixHash"}:
        raise Unsupported(f"configMapGenerator {spec['name']}: unsupported {extra or options}")
    data: dict[str, str] = {}
    for item in spec.get("files", []):
        key, _, rel = item.rpartition("=") if "=" in item else (Path(item).name, "", item)
        data[key] = (root / rel).read_text()
    for item in spec.get("literals", []):
        key, _, value = item.partition("=")
        data[key] = value
    behavior = spec.get("behavior", "create")
    if behavior == "create":
        cm: Obj = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": spec["name"]}}
        cm["data"] = data
        if not options.get("disableNameSuffixHash"):
            cm[_HASHED] = True
        objs.append(cm)
        return
    base = _find(objs, spec["name"], kinds={"ConfigMap"})
    if behavior == "replace":
        base["data"] = data
    elif behavior == "merge":
        base.setdefault("data", {}).update(data)
    else:
        raise Unsupported(f"configMapGenerator behavior {behavior!r}")


def _add_hash_suffixes(objs: list[Obj]) -> None:
    renames: dict[str, str] = {}
    for obj in objs:
        if obj.pop(_HASHED, False):
            name = obj["metadata"]["name"]
            obj["metadata"]["name"] = renames[name] = f"{name}-{config_map_hash(obj)}"
    for obj in objs:
        for pod in _pod_specs(obj):
            for volume in pod.get("volumes", []):
                _rename(volume.get("configMap"), renames)
                for source in volume.get("projected", {}).get("sources", []):
                    _rename(source.get("configMap"), renames)
            for container in pod.get("containers", []) + pod.get("initContainers", []):
                for env in container.get("env", []):
                    _rename(env.get("valueFrom", {}).get("configMapKeyRef"), renames)
                for source in container.get("envFrom", []):
                    _rename(source.get("configMapRef"), renames)


def _rename(ref: Obj | None, renames: dict[str, str]) -> None:
    if ref and ref.get("name") in renames:
        ref["name"] = renames[ref["name"]]


def config_map_hash(cm: Obj) -> str:
    """kustomize's suffix: sha256 of Go's json.Marshal of {data, kind, name}, 10 hex digits
    with 0 1 3 a e swapped for g h k m t (api/hasher). NOTE: kustomize v5 looks the name up
    with a path that finds nothing, so it hashes name "" (checked against kubectl's v5.5.0)."""
    encoded: Obj = {"data": cm.get("data", {}), "kind": "ConfigMap", "name": ""}
    if cm.get("binaryData"):
        encoded["binaryData"] = cm["binaryData"]
    text = json.dumps(encoded, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    for char, escaped in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026")):
        text = text.replace(char, escaped)  # Go's json.Marshal escapes HTML characters
    text = text.replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")
    digest = hashlib.sha256(text.encode()).hexdigest()[:10]
    return digest.translate(str.maketrans("013ae", "ghkmt"))


# ---- transformers ---------------------------------------------------------------------------


def _apply_patch(root: Path, spec: Obj, objs: list[Obj]) -> None:
    if set(spec) - {"path", "target"}:
        raise Unsupported(f"patch {spec}: only path (+ target) is supported")
    patch = yaml.safe_load((root / spec["path"]).read_text())
    target = spec.get("target")
    if target is None:
        targets = [_find(objs, patch["metadata"]["name"], kinds={patch["kind"]})]
    else:
        if set(target) - {"kind", "name"}:
            raise Unsupported(f"patch target {target}: only kind and name are supported")
        name = re.compile(target.get("name", ".*"))
        targets = [
            o
            for o in objs
            if o["kind"] == target.get("kind", o["kind"]) and name.fullmatch(o["metadata"]["name"])
        ]
        if not targets:
            raise Unsupported(f"patch {spec['path']}: target {target} matches nothing")
    for obj in targets:
        body = copy.deepcopy(patch)
        body.pop("metadata", None)  # name and labels of a targeted patch are not applied
        body.pop("apiVersion", None)
        body.pop("kind", None)
        strategic_merge(obj, body)


def strategic_merge(base: Obj, patch: Obj) -> Obj:
    """Merge `patch` into `base` in place: maps merge, None deletes, keyed lists merge by key."""
    for key, value in patch.items():
        if value is None:
            base.pop(key, None)
        elif isinstance(value, dict) and isinstance(base.get(key), dict):
            strategic_merge(base[key], value)
        elif isinstance(value, list) and MERGE_KEYS.get(key) and isinstance(base.get(key), list):
            _merge_list(base[key], value, MERGE_KEYS[key])
        else:
            base[key] = copy.deepcopy(value)
    return base


def _merge_list(base: list[Obj], patch: list[Obj], merge_key: str) -> None:
    """As apimachinery's strategic merge orders it: the patch's items first (merged with their
    base twins), then the base items the patch does not name, in their old order."""
    merged = []
    for item in patch:
        if "$patch" in item:
            raise Unsupported(f"$patch directives are not supported: {item}")
        match = next((b for b in base if b.get(merge_key) == item.get(merge_key)), None)
        merged.append(copy.deepcopy(item) if match is None else strategic_merge(match, item))
    named = {item.get(merge_key) for item in patch}
    merged += [b for b in base if b.get(merge_key) not in named]
    base[:] = merged


def _apply_labels(spec: Obj, objs: list[Obj]) -> None:
    if spec.get("includeSelectors") or set(spec) - {
        "pairs",
        "includeSelectors",
        "includeTemplates",
    }:
        raise Unsupported(f"labels {spec}: only pairs + includeTemplates are supported")
    for obj in objs:
        obj["metadata"].setdefault("labels", {}).update(spec["pairs"])
        if spec.get("includeTemplates") and obj["kind"] in WORKLOADS:
            template_meta = obj["spec"]["template"].setdefault("metadata", {})
            template_meta.setdefault("labels", {}).update(spec["pairs"])


def _retag(image: str, spec: Obj) -> str:
    name, digest = image.partition("@")[::2]
    slash = name.rfind("/")
    tag = ""
    if ":" in name[slash + 1 :]:
        name, tag = name.rsplit(":", 1)
    if name != spec["name"]:
        return image
    name = spec.get("newName", name)
    if "digest" in spec:
        return f"{name}@{spec['digest']}"
    tag = spec.get("newTag", tag)
    return name + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")


# ---- helpers --------------------------------------------------------------------------------


def _find(objs: list[Obj], name: str, *, kinds: set[str]) -> Obj:
    found = [o for o in objs if o["kind"] in kinds and o["metadata"]["name"] == name]
    if len(found) != 1:
        raise Unsupported(f"expected one {sorted(kinds)} named {name!r}, found {len(found)}")
    return found[0]


def _pod_specs(obj: Obj) -> list[Obj]:
    return [obj["spec"]["template"]["spec"]] if obj["kind"] in WORKLOADS else []


def _containers(obj: Obj) -> list[Obj]:
    return [
        c
        for pod in _pod_specs(obj)
        for c in pod.get("containers", []) + pod.get("initContainers", [])
    ]


if __name__ == "__main__":
    print(yaml.safe_dump_all(render(sys.argv[1]), sort_keys=False), end="")
