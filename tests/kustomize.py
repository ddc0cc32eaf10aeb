"""What `kubectl kustomize` makes of deploy/kubernetes, for tests on machines without it (no registry here
serves kustomize or kubectl). Only the part of Kustomize those files use is implemented, and anything
else is refused, so a kustomization that grows past it fails here rather than render differently:

- ``resources``: YAML files (several documents each) and directories holding a kustomization.yaml;
- ``images``: ``name`` -> ``newName`` / ``newTag`` in every container of a pod template;
- ``patches``: RFC 6902 JSON patches (add, replace, remove) given inline with a ``target`` of kind and
  name.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

FIELDS = {"apiVersion", "kind", "resources", "images", "patches"}


def render(directory: Path) -> list[dict[str, Any]]:
    """The objects the kustomization in ``directory`` makes, in order."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - FIELDS
    if unknown:
        raise ValueError(f"{directory}: kustomization fields this renderer does not know: {sorted(unknown)}")
    objects: list[dict[str, Any]] = []
    for resource in kustomization.get("resources", []):
        path = directory / resource
        if path.is_dir():
            objects += render(path)
        else:
            objects += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    for image in kustomization.get("images", []):
        for container in containers(objects):
            if container.get("image", "").split(":")[0] == image["name"]:
                container["image"] = f"{image.get('newName', image['name'])}:{image['newTag']}"
    for patch in kustomization.get("patches", []):
        if set(patch) != {"target", "patch"} or set(patch["target"]) != {"kind", "name"}:
            raise ValueError(f"{directory}: only inline JSON patches with a kind and name target: {patch}")
        target = patch["target"]
        matches = [
            o for o in objects if (o["kind"], o["metadata"]["name"]) == (target["kind"], target["name"])
        ]
        if len(matches) != 1:
            raise ValueError(f"{directory}: patch target {target} matches {len(matches)} objects")
        for operation in yaml.safe_load(patch["patch"]):
            apply(matches[0], operation)
    return objects


def containers(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every container (and init container) of every pod template among ``objects``."""
    found = []
    for o in objects:
        spec = o.get("spec", {})
        pod = spec.get("template", {}).get("spec", {}) if o["kind"] != "Pod" else spec
        found += pod.get("containers", []) + pod.get("initContainers", [])
    return found


def apply(document: dict[str, Any], operation: dict[str, Any]) -> None:
    """One RFC 6902 operation (add, replace or remove) on ``document``, in place."""
    op, path = operation["op"], operation["path"]
    keys = [k.replace("~1", "/").replace("~0", "~") for k in path.lstrip("/").split("/")]
    parent: Any = document
    for key in keys[:-1]:
        parent = parent[int(key)] if isinstance(parent, list) else parent[key]
    last = keys[-1]
    if op == "add":
        value = copy.deepcopy(operation["value"])
        if isinstance(parent, list):
            parent.insert(len(parent) if last == "-" else int(last), value)
        else:
            parent[last] = value
    elif op == "replace":
        if isinstance(parent, list):
            parent[int(last)] = copy.deepcopy(operation["value"])
        else:
            if last not in parent:
                raise KeyError(f"replace {path}: nothing there")
            parent[last] = copy.deepcopy(operation["value"])
    elif op == "remove":
        del parent[int(last) if isinstance(parent, list) else last]
    else:
        raise ValueError(f"JSON patch operation {op!r} is not implemented here")
