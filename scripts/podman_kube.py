"""The closest form of rendered Kubernetes manifests that `podman kube play` (4.3) runs: Pods and
PersistentVolumeClaims on one podman network, with a ConfigMap file for `--configmap`.

What podman 4.3 lacks, and what stands in for it (docs/kubernetes.md#playing-on-podman):

- StatefulSet of N: N Pods `NAME-i`, hostname `NAME-i`; its `volumeClaimTemplates` as PVCs `CLAIM-NAME-i`.
- Deployment of N: N Pods `NAME-i` (podman plays one pod per Deployment, whatever its `replicas`).
- Job: one Pod of its template; its retries are the caller's (play it again).
- Services: each pod gets a static IP on the network, and every pod's /etc/hosts (`hostAliases`) names
  the pod a Service selects under the Service's name, and each pod of a headless one as `POD.SERVICE`
  (gRPC reads /etc/hosts with `GRPC_DNS_RESOLVER=native`). A Service over several pods
  (`rollout-openai`) has no such form: call a pod.
- `fieldRef: status.podIP`: the pod's static IP.
- `$(VAR)` in a command line: expanded from the container's env, as the kubelet does.
- Secret volumes: `hostPath` directories, one per Secret, that the caller fills (`secret_dirs`).
- Secret env (`secretKeyRef`): kept; podman secrets the caller creates, each a JSON object of base64
  values (what podman 4.3 reads).
- gRPC probes: dropped (podman has none); the services' own retries wait for each other.
- Container ports: dropped (podman would publish each on the host); pods reach each other's directly.
- PodDisruptionBudget, NetworkPolicy: dropped; nothing on one host evicts pods or enforces policies.
"""

from __future__ import annotations

import copy
import ipaddress
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

PLAYED = {"Pod", "PersistentVolumeClaim"}
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DROPPED = {"PodDisruptionBudget", "NetworkPolicy", "Service"}
WORKLOADS = ("StatefulSet", "Deployment", "Job")  # (each becomes its pods)


def pod_name(workload: dict[str, Any], index: int) -> str:
    name = workload["metadata"]["name"]
    return name if workload["kind"] == "Job" else f"{name}-{index}"


def count(workload: dict[str, Any]) -> int:
    return 1 if workload["kind"] == "Job" else int(workload["spec"].get("replicas", 1))


def matches(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def to_podman(
    objects: list[dict[str, Any]],
    subnet: str,
    secret_dirs: Mapping[str, Path],
    images: Mapping[str, str] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Pods and PVCs for ``objects``, and each pod's static IP (in ``subnet``: .2, .3, ... in order).
    ``secret_dirs``: the directory standing in for each Secret a volume mounts; ``images``: image names
    to replace by images this machine has, bare root filesystems (given a container runtime's default
    PATH, which podman does not give)."""
    unknown = {o["kind"] for o in objects} - PLAYED - DROPPED - set(WORKLOADS)
    if unknown:
        raise ValueError(f"no podman form for {sorted(unknown)}")
    hosts = ipaddress.ip_network(subnet).hosts()
    next(hosts)  # (.1: the network's gateway)
    pods: list[dict[str, Any]] = []
    played: list[dict[str, Any]] = [copy.deepcopy(o) for o in objects if o["kind"] in PLAYED]
    ips: dict[str, str] = {}
    for workload in (o for o in objects if o["kind"] in WORKLOADS):
        template = workload["spec"]["template"]
        for i in range(count(workload)):
            name = pod_name(workload, i)
            labels = dict(template["metadata"].get("labels", {}))
            spec = copy.deepcopy(template["spec"])
            if workload["kind"] == "StatefulSet":
                labels["statefulset.kubernetes.io/pod-name"] = name
                spec["hostname"] = name
                for claim in workload["spec"].get("volumeClaimTemplates", []):
                    pvc = f"{claim['metadata']['name']}-{name}"
                    played.append(
                        {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": pvc}}
                        | {"spec": copy.deepcopy(claim["spec"])}
                    )
                    spec.setdefault("volumes", []).append(
                        {"name": claim["metadata"]["name"], "persistentVolumeClaim": {"claimName": pvc}}
                    )
            ips[name] = str(next(hosts))
            pods.append(
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": name, "labels": labels},
                    "spec": spec,
                }
            )
    aliases = host_aliases(objects, pods, ips)
    for pod in pods:
        pod_ip = ips[pod["metadata"]["name"]]
        pod["spec"]["hostAliases"] = aliases
        for volume in pod["spec"].get("volumes", []):
            if "secret" in volume:
                secret = volume.pop("secret")["secretName"]
                volume["hostPath"] = {"path": str(secret_dirs[secret]), "type": "Directory"}
        for container in pod["spec"]["containers"]:
            container.pop("ports", None)  # (podman publishes them on the host; pods reach pods directly)
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if "grpc" in container.get(probe, {}):
                    del container[probe]
            env = container.setdefault("env", [])
            for var in env:
                field = var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
                if field == "status.podIP":
                    var.pop("valueFrom")
                    var["value"] = pod_ip
                elif field is not None:
                    raise ValueError(f"no podman form for fieldRef {field}")
            # $(VAR) in a command line is the kubelet's expansion of the container's own env; podman's not.
            values = {var["name"]: var["value"] for var in env if "value" in var}
            for key in ("command", "args"):
                if key in container:
                    container[key] = [expand(word, values) for word in container[key]]
            env.append({"name": "GRPC_DNS_RESOLVER", "value": "native"})
            if images and container["image"] in images:  # (a root filesystem: no PATH of its own)
                container["image"] = images[container["image"]]
                env.append({"name": "PATH", "value": DEFAULT_PATH})
    return played + pods, ips


def expand(word: str, env: Mapping[str, str]) -> str:
    """``$(NAME)`` replaced by ``env[NAME]`` where it is one, as the kubelet does (``$$`` escapes)."""
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: "$" if m[0] == "$$" else env.get(m[1], m[0]), word
    )


def host_aliases(
    objects: list[dict[str, Any]], pods: list[dict[str, Any]], ips: Mapping[str, str]
) -> list[dict[str, Any]]:
    """/etc/hosts entries that stand in for the Services' DNS names."""
    names: dict[str, list[str]] = {ip: [] for ip in ips.values()}
    for service in (o for o in objects if o["kind"] == "Service"):
        selected = [p for p in pods if matches(service["spec"]["selector"], p["metadata"]["labels"])]
        headless = service["spec"].get("clusterIP") == "None"
        if headless:
            for pod in selected:
                names[ips[pod["metadata"]["name"]]].append(
                    f"{pod['metadata']['name']}.{service['metadata']['name']}"
                )
        elif len(selected) == 1:
            names[ips[selected[0]["metadata"]["name"]]].append(service["metadata"]["name"])
        # (a Service spreading calls over several pods, rollout-openai: no /etc/hosts form; call a pod)
    return [{"ip": ip, "hostnames": hostnames} for ip, hostnames in names.items() if hostnames]


def config_map(name: str, directory: Path) -> dict[str, Any]:
    """The ConfigMap `kubectl create configmap NAME --from-file=DIRECTORY` makes (for `--configmap`)."""
    data = {path.name: path.read_text() for path in sorted(directory.iterdir()) if path.is_file()}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": data}
