"""The CPU overlay of deploy/kubernetes played on podman (`podman kube play`), in the closest form podman
4.3 runs (scripts/podman_kube.py): Pods on a network of their own, each with a static IP, PVCs as podman
volumes, the run's Secrets as files and podman secrets, the ConfigMap through `--configmap`. Its pods and
volumes have the manifests' names: it refuses to start where podman already has one, and removes
everything it made at the end."""

from __future__ import annotations

import base64
import json
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from scripts.podman_kube import config_map, to_podman
from tests.containers import LOCAL_BASE, podman_settings
from tests.kustomize import render

ROOT = Path(__file__).resolve().parent.parent
ROLES = {  # the Secrets the manifests mount -> the run_secrets role whose files stand in for each
    "fp8rl-trainer": "trainer",
    "fp8rl-replica": "replica",
    "fp8rl-coordinator": "coordinator",
    "fp8rl-redis": "redis",
}
REDIS_PASSWORD = "fp8rl-redis-password"  # (the Secret the manifests' env reads)


@dataclass
class Play:
    workdir: Path
    env: dict[str, str]
    network: str
    rendered: list[dict[str, Any]] = field(default_factory=list)  # (the manifests, as Kubernetes gets them)
    objects: list[dict[str, Any]] = field(default_factory=list)
    ips: dict[str, str] = field(default_factory=dict)

    def podman(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run(
            ["podman", *args], capture_output=True, text=True, env=self.env, timeout=timeout
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"podman {' '.join(args)}: {done.stderr.strip()[-2000:]}")
        return done

    def pod(self, name: str) -> dict[str, Any]:
        return next(o for o in self.objects if o["kind"] == "Pod" and o["metadata"]["name"] == name)

    def play(self, name: str) -> None:
        """Play pod ``name`` (again: its previous one is replaced), at its own IP."""
        path = self.workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(self.pod(name)))
        args = ["kube", "play", "--replace", "--network", self.network, "--ip", self.ips[name]]
        self.podman(*args, "--configmap", str(self.workdir / "configmap.yaml"), str(path))

    def logs(self, name: str, container: str) -> str:
        """The container's output, stdout and stderr as they came (each restart's, in turn)."""
        done = subprocess.run(
            ["podman", "logs", f"{name}-{container}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=self.env,
            timeout=60,
        )
        return done.stdout

    def names(self) -> dict[str, list[str]]:
        """What this play makes, by podman object type."""
        claims = [o["metadata"]["name"] for o in self.objects if o["kind"] == "PersistentVolumeClaim"]
        return {
            "pod": list(self.ips),
            "volume": [*claims, "fp8rl-config"],
            "network": [self.network],
            "secret": [REDIS_PASSWORD],
        }

    def run_job(self, name: str, timeout: float) -> tuple[int, list[str]]:
        """What the Job controller does with Job ``name``'s pod: play it again after a failure, up to its
        ``backoffLimit`` times, but not after an exit its pod failure policy ends the Job on. Its exit
        status and each attempt's log."""
        job = next(o for o in self.rendered if o["kind"] == "Job" and o["metadata"]["name"] == name)
        rules = job["spec"].get("podFailurePolicy", {}).get("rules", [])
        final = {
            code for rule in rules if rule["action"] == "FailJob" for code in rule["onExitCodes"]["values"]
        }
        logs: list[str] = []
        deadline = time.monotonic() + timeout
        while True:
            container = job["spec"]["template"]["spec"]["containers"][0]["name"]
            while (status := self.exit_code(name, container)) is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"Job {name} still running:\n{self.logs(name, container)[-3000:]}")
                time.sleep(2)
            logs.append(self.logs(name, container))
            if status == 0 or status in final or len(logs) > job["spec"].get("backoffLimit", 6):
                return status, logs
            self.play(name)

    def left_over(self, names: dict[str, list[str]]) -> list[str]:
        """Those of ``names`` (``names()``) that podman has now."""
        return [
            f"{kind} {name}"
            for kind, listed in names.items()
            for name in listed
            if self.podman(kind, "exists", name, check=False).returncode == 0
        ]

    def restarts(self, name: str, container: str) -> int:
        """How many times the pod has started the container again (its restart policy)."""
        return int(self.podman("inspect", f"{name}-{container}", "--format", "{{.RestartCount}}").stdout)

    def exit_code(self, name: str, container: str) -> int | None:
        state = json.loads(self.podman("inspect", f"{name}-{container}").stdout)[0]["State"]
        return None if state["Running"] else int(state["ExitCode"])


@contextmanager
def played(overrides: dict[str, list[str]]) -> Iterator[Play]:
    """The CPU overlay on podman; ``overrides``: a workload's container args to replace (by its name)."""
    workdir = Path(tempfile.mkdtemp(prefix="fp8rl-kube-"))
    tag = workdir.name[-6:].lower().replace("_", "x")
    play = Play(
        workdir, {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", **podman_settings(workdir)}, f"fp8rl-{tag}"
    )
    objects = render(ROOT / "deploy" / "kubernetes" / "overlays" / "cpu")
    for workload, args in overrides.items():
        named = next(o for o in objects if o["metadata"]["name"] == workload and "template" in o["spec"])
        named["spec"]["template"]["spec"]["containers"][0]["args"] = args
    dirs = {secret: workdir / "secrets" / secret for secret in ROLES}
    play.rendered = objects
    play.objects, play.ips = to_podman(objects, "10.89.77.0/24", dirs, {"redis:7.4": LOCAL_BASE})
    clash = play.left_over(play.names() | {"network": []})
    if clash:  # (podman names are the host's: never take over, nor remove, what this play did not make)
        shutil.rmtree(workdir)
        raise RuntimeError(f"podman already has {clash}: remove them to play the manifests here")
    try:
        subprocess.run(
            [sys.executable, "-m", "fp8rl.run_secrets", str(workdir / "secrets" / "all")]
            + [
                a
                for secret, role in ROLES.items()
                for a in ("--export", f"{role}={workdir / 'secrets' / secret}")
            ],
            check=True,
            capture_output=True,
        )
        (workdir / "configmap.yaml").write_text(
            yaml.safe_dump(config_map("fp8rl-config", ROOT / "deploy" / "config"))
        )
        # podman 4.3 reads an env secret as a JSON object of base64 values; stdin keeps it out of argv.
        password = base64.b64encode(secrets.token_urlsafe(24).encode()).decode()
        subprocess.run(
            ["podman", "secret", "create", REDIS_PASSWORD, "-"],
            input=json.dumps({"password": password}).encode(),
            env=play.env,
            check=True,
            capture_output=True,
        )
        play.podman("network", "create", "--subnet", "10.89.77.0/24", play.network)
        claims = [o for o in play.objects if o["kind"] == "PersistentVolumeClaim"]
        (workdir / "volumes.yaml").write_text(yaml.safe_dump_all(claims))
        play.podman("kube", "play", "--network", play.network, str(workdir / "volumes.yaml"))
        yield play
    finally:
        made = play.names()
        for name in made["pod"]:
            play.podman("pod", "rm", "--force", name, check=False, timeout=120)
        for name in made["volume"]:
            play.podman("volume", "rm", "--force", name, check=False)
        play.podman("secret", "rm", REDIS_PASSWORD, check=False)
        play.podman("network", "rm", "--force", play.network, check=False)
        shutil.rmtree(workdir, ignore_errors=True)


def wait_for(
    play: Play, pod: str, container: str, pattern: str, timeout: float = 600, every: float = 2
) -> str:
    """The container's log once ``pattern`` is in it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        logs = play.logs(pod, container)
        if re.search(pattern, logs):
            return logs
        time.sleep(every)
    raise TimeoutError(f"{pod}: no {pattern!r} after {timeout:.0f}s:\n{play.logs(pod, container)[-3000:]}")
