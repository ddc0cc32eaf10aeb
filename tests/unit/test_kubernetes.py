"""deploy/kubernetes, offline: both overlays rendered (tests/kustomize.py) and every object validated
against Kubernetes' own schemas (kubernetes-validate, strict: an unknown field fails), then the things a
schema cannot see: the FP8 recipe's processes wired as compose wires them, probes on the health ports the
services open, secrets only by reference, and every file a service's config names in its role's bundle."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from fp8rl.run_secrets import BUNDLES
from tests.kustomize import containers, render

ROOT = Path(__file__).resolve().parents[2]
OVERLAYS = ROOT / "deploy" / "kubernetes" / "overlays"
# The oldest release whose features the manifests use (the pod-index label: 1.28), and the newest known.
VERSIONS = ["1.28.0", kubernetes_validate.latest_version()]
CONFIGS = {"cpu": ROOT / "deploy" / "config", "gpu": ROOT / "deploy" / "config-gpu"}
ROLES = {"trainer": "trainer", "rollout": "replica", "coordinator": "coordinator", "redis": "redis"}


def objects(overlay: str) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in render(OVERLAYS / overlay)}


def pod(o: dict[str, Any]) -> dict[str, Any]:
    return o["spec"]["template"]["spec"]


def command_line(container: dict[str, Any]) -> list[str]:
    """A container's command line as words (a ``sh -c`` script split as the shell would, roughly)."""
    words = container.get("command", []) + container.get("args", [])
    return shlex.split(words[2]) if words[:2] == ["sh", "-c"] else words


def flag(args: list[str], name: str) -> str:
    """The value of ``--name=VALUE`` or ``--set name=VALUE`` in ``args``."""
    for i, arg in enumerate(args):
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
        if arg == "--set" and args[i + 1].startswith(f"{name}="):
            return args[i + 1].split("=", 1)[1]
    raise KeyError(name)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("overlay", ["cpu", "gpu"], ids=["cpu-overlay", "gpu-overlay"])  # (not the gpu mark)
def test_every_object_validates_against_kubernetes_schemas(overlay: str, version: str) -> None:
    for key, o in objects(overlay).items():
        try:
            kubernetes_validate.validate(o, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{overlay} {key} against Kubernetes {version}: {exc.message}")


@pytest.mark.parametrize("overlay", ["cpu", "gpu"], ids=["cpu-overlay", "gpu-overlay"])  # (not the gpu mark)
def test_secrets_are_referenced_never_written(overlay: str) -> None:
    rendered = objects(overlay)
    assert not [k for k in rendered if k[0] in ("Secret", "ConfigMap")]  # made by the documented commands
    for container in containers(list(rendered.values())):
        for env in container.get("env", []):
            if "PASSWORD" in env["name"]:
                assert "value" not in env and "secretKeyRef" in env["valueFrom"], env


@pytest.mark.parametrize("overlay", ["cpu", "gpu"], ids=["cpu-overlay", "gpu-overlay"])  # (not the gpu mark)
def test_each_services_config_finds_its_files_in_its_roles_bundle(overlay: str) -> None:
    """The Secret `fp8rl-<role>` holds `python -m fp8rl.run_secrets --export ROLE=...`'s files: every
    /secrets/ path a service's config (or command) names is one of them."""
    rendered = objects(overlay)
    for (kind, name), o in rendered.items():
        if kind not in ("StatefulSet", "Deployment", "Job"):
            continue
        role = ROLES[name]
        secret = next(v["secret"]["secretName"] for v in pod(o)["volumes"] if "secret" in v)
        assert secret == f"fp8rl-{role}"
        (container,) = pod(o)["containers"]
        texts = [" ".join(command_line(container))]
        config = CONFIGS[overlay] / f"{name}.yaml"
        if config.exists():
            texts.append(config.read_text())
        named = {m for text in texts for m in re.findall(r"/secrets/([\w.-]+)", text)}
        assert named and named <= set(BUNDLES[role]), (name, named - set(BUNDLES[role]))


@pytest.mark.parametrize("overlay", ["cpu", "gpu"], ids=["cpu-overlay", "gpu-overlay"])  # (not the gpu mark)
def test_the_processes_are_wired_as_compose_wires_them(overlay: str) -> None:
    rendered = objects(overlay)
    redis = pod(rendered["StatefulSet", "redis"])["containers"][0]
    assert "--appendfsync always" in redis["command"][-1]  # every acknowledged write on disk
    trainer = rendered["StatefulSet", "trainer"]
    args = command_line(pod(trainer)["containers"][0])
    assert int(flag(args, "nnodes")) == trainer["spec"]["replicas"]  # a rank per pod
    assert flag(args, "node-rank") == "${HOSTNAME##*-}"  # the pod's ordinal
    assert flag(args, "master-addr") == f"trainer-0.{trainer['spec']['serviceName']}"
    assert trainer["spec"]["updateStrategy"]["type"] == "OnDelete"  # a group is replaced whole
    assert rendered["Service", "trainer-ranks"]["spec"]["clusterIP"] == "None"
    assert (
        rendered["Service", "trainer"]["spec"]["selector"]["statefulset.kubernetes.io/pod-name"]
        == "trainer-0"
    )
    job = rendered["Job", "coordinator"]
    assert flag(command_line(pod(job)["containers"][0]), "trainer") == "trainer:50052"
    (fail_at_once,) = job["spec"]["podFailurePolicy"]["rules"]  # a config error or a fenced-out exit
    assert fail_at_once["action"] == "FailJob" and fail_at_once["onExitCodes"]["values"] == [2, 3]
    for kind, name in (("StatefulSet", "trainer"), ("Deployment", "rollout")):
        (container,) = pod(rendered[kind, name])["containers"]
        health = int(flag(command_line(container), "health_port"))
        probes = [container[p] for p in ("startupProbe", "readinessProbe", "livenessProbe")]
        assert all(p["grpc"]["port"] == health for p in probes), name  # native gRPC probes, plaintext port
        assert any(m["mountPath"] == "/config" for m in container["volumeMounts"])


def test_the_gpu_overlay_gives_each_rank_and_replica_a_gpu_and_the_cpu_one_none() -> None:
    for overlay, gpus in (("cpu", None), ("gpu", 1)):
        rendered = objects(overlay)
        for kind, name in (("StatefulSet", "trainer"), ("Deployment", "rollout")):
            (container,) = pod(rendered[kind, name])["containers"]
            assert container["resources"].get("limits", {}).get("nvidia.com/gpu") == gpus
    images = {c["image"] for c in containers(list(objects("gpu").values())) if c["name"] != "redis"}
    assert images == {"fp8rl:trainer-gpu", "fp8rl:rollout-gpu"}
    assert {c["image"] for c in containers(list(objects("cpu").values())) if c["name"] != "redis"} == {
        "fp8rl:cpu"
    }
    assert all(yaml.safe_load((CONFIGS[o] / "trainer.yaml").read_text()) for o in CONFIGS)


def test_the_podman_form_is_pods_and_claims_that_stand_in_for_every_service_name(tmp_path: Path) -> None:
    """scripts/podman_kube.py on the CPU overlay (played for real in tests/e2e/test_kube_play.py): only
    kinds podman 4.3 plays, each still valid Kubernetes; every name a service dials resolves from every
    pod's /etc/hosts; nothing left that podman would not fill in (fieldRefs, $(VAR), gRPC probes)."""
    from scripts.podman_kube import to_podman

    rendered = render(OVERLAYS / "cpu")
    dirs = {
        name: tmp_path / name
        for name in ("fp8rl-trainer", "fp8rl-replica", "fp8rl-coordinator", "fp8rl-redis")
    }
    played, ips = to_podman(rendered, "10.89.77.0/24", dirs, {"redis:7.4": "localhost/base"})
    assert {o["kind"] for o in played} == {"Pod", "PersistentVolumeClaim"}
    for o in played:
        kubernetes_validate.validate(o, VERSIONS[-1], strict=True)
    pods = {o["metadata"]["name"]: o["spec"] for o in played if o["kind"] == "Pod"}
    assert (
        set(pods)
        == set(ips)
        == {"redis-0", "trainer-0", "trainer-1", "rollout-0", "rollout-1", "coordinator"}
    )
    assert len(set(ips.values())) == len(ips)
    hosts = {name: a["ip"] for a in pods["coordinator"]["hostAliases"] for name in a["hostnames"]}
    assert hosts == {
        "redis": ips["redis-0"],
        "trainer": ips["trainer-0"],
        "trainer-0.trainer-ranks": ips["trainer-0"],
        "trainer-1.trainer-ranks": ips["trainer-1"],
    }
    for name, spec in pods.items():
        assert spec["hostAliases"] == pods["coordinator"]["hostAliases"]
        text = yaml.safe_dump(spec)
        assert "fieldRef" not in text and "grpc:" not in text and "containerPort" not in text, name
        for container in spec["containers"]:
            words = " ".join(container.get("command", []) + container.get("args", []))
            assert "$(REDIS_URL)" not in words and "$(POD_IP)" not in words, name
        assert not any("secret" in volume for volume in spec.get("volumes", []))
    assert f"--advertise={ips['rollout-1']}:50051" in pods["rollout-1"]["containers"][0]["args"]
    assert pods["trainer-1"]["hostname"] == "trainer-1"  # (its node rank, from ${HOSTNAME##*-})
    claims = {o["metadata"]["name"] for o in played if o["kind"] == "PersistentVolumeClaim"}
    assert {"fp8rl-checkpoints", "data-redis-0"} <= claims
