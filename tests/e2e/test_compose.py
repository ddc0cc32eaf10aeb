"""docker compose without Docker: the compose file's own command lines, environment and health checks run
as local processes (service hostnames mapped to 127.0.0.1, ports remapped to free ones, volumes to
temporary directories) and drive a short run; the Dockerfiles install what `make setup` installs."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
import redis
import yaml

from coordinator.metrics import read_metrics
from fp8rl.credentials import redis_url_with_password
from tests.support import child_process, free_port, wait_for_line

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's variable syntax: ${VAR}, ${VAR:-default}, ${VAR:?error}; $$ is a literal $."""

    def value(match: re.Match[str]) -> str:
        name, op, arg = match.group(1), match.group(2), match.group(3)
        if name in env and env[name] != "":
            return env[name]
        if op == ":?":
            raise ValueError(f"compose: {arg}")
        return arg or ""

    text = re.sub(r"(?<!\$)\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:-|:\?)([^}]*))?\}", value, text)
    return text.replace("$$", "$")


def test_redis_password_is_required_and_never_in_a_command_line() -> None:
    for environment in (COMPOSE["x-app"]["environment"], COMPOSE["services"]["redis"]["environment"]):
        with pytest.raises(ValueError, match="REDIS_PASSWORD"):
            interpolate(str(environment["REDIS_PASSWORD"]), {})
    assert "@" not in COMPOSE["x-app"]["environment"]["REDIS_URL"]  # the URL carries no password
    command = " ".join(COMPOSE["services"]["redis"]["command"])
    assert "requirepass" in command and "--appendonly" in command
    # Only the shell's variable is in the command line, expanded by the shell inside printf (a builtin).
    assert "${REDIS_PASSWORD" not in command and interpolate(command, {}).count("$REDIS_PASSWORD") == 1


@pytest.mark.parametrize("config", ["config", "config-gpu"])
def test_the_compose_trainer_learns_as_the_embedded_demo_does(config: str) -> None:
    from coordinator.config import CoordinatorConfig
    from trainer_service.config import LearnerConfig, TrainerConfig

    trainer = TrainerConfig.model_validate(
        yaml.safe_load((ROOT / "deploy" / config / "trainer.yaml").read_text())
    )
    learner = LearnerConfig.model_validate(trainer.model_dump(include=set(LearnerConfig.model_fields)))
    assert learner == CoordinatorConfig().embedded.learner


def test_dockerfiles_install_what_make_setup_installs() -> None:
    makefile = (ROOT / "Makefile").read_text()
    uninstalled = re.search(r"pip uninstall -y -q ([\w ]+)", makefile).group(1).split()  # type: ignore[union-attr]
    # (gguf: the GGUF converter's, which the tests use and the images do not need.)
    assert re.search(r"pip install -q -e '\.\[cpu,dev,gguf\]'", makefile)
    images = (
        ("Dockerfile", "cpu"),
        ("Dockerfile.rollout-gpu", "gpu-rollout"),
        ("Dockerfile.trainer-gpu", "gpu-trainer"),
    )
    for dockerfile, extra in images:
        text = (ROOT / dockerfile).read_text()
        assert f'".[{extra}]"' in text, dockerfile  # the pinned extra from pyproject.toml, nothing by hand
        assert re.search(r"pip uninstall -y " + " ".join(uninstalled), text), dockerfile
        assert "COPY pyproject.toml" in text
        assert not re.search(r"pip install [^\n]*==", text), (
            f"{dockerfile} pins a version outside pyproject.toml"
        )
        if extra != "cpu":  # the GPU images keep their base's torch: pip runs under the image's own pins
            assert "-c /tmp/image-constraints.txt" in text and "torch==" in text, dockerfile


def test_the_trainer_image_lifts_ngcs_grpc_and_protobuf_pins_and_no_other() -> None:
    """NGC's /etc/pip/constraint.txt (25.03 on) may pin grpcio and protobuf below the project's needs: the
    trainer image's build removes those lines, keeps the rest in force through PIP_CONSTRAINT, and adds
    torch and TE at the image's versions. The pattern it removes them with, run by grep here."""
    text = (ROOT / "Dockerfile.trainer-gpu").read_text()
    assert "PIP_CONSTRAINT=/tmp/image-constraints.txt pip install" in text
    lifted = re.search(r"lifted='([^']+)'", text).group(1)  # type: ignore[union-attr]
    image_list = [
        "grpcio==1.62.1",
        "grpcio-tools==1.62.1",
        "grpcio_status == 1.62.1",
        "GRPCIO-health-checking>=1.60",
        "protobuf==4.24.4",
        "protobuf",
        "torch==2.9.0a0+50eac811a6.nv25.9",
        "tensorboard==2.16.2",
        "protobuf3-to-dict==0.1.5",
        "grpcioxyz==1.0",
        "numpy==1.26.4",
    ]
    kept = subprocess.run(
        ["grep", "-viE", lifted],
        input="\n".join(image_list) + "\n",
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")
    assert [c for c in image_list if c not in kept] == image_list[:6]


def test_gpu_compose_gives_each_service_its_own_image_and_device() -> None:
    gpu = yaml.safe_load((ROOT / "docker-compose.gpu.yml").read_text())
    services = gpu["services"]
    assert services["rollout"]["build"]["dockerfile"] == "Dockerfile.rollout-gpu"
    assert services["trainer"]["build"]["dockerfile"] == "Dockerfile.trainer-gpu"
    assert services["coordinator"]["image"] == services["trainer"]["image"]
    devices = {
        name: services[name]["deploy"]["resources"]["reservations"]["devices"][0]
        for name in ("rollout", "trainer")
    }
    assert all(d["driver"] == "nvidia" and "count" not in d for d in devices.values())
    chosen = {name: interpolate(d["device_ids"][0], {}) for name, d in devices.items()}
    assert chosen == {"rollout": "0", "trainer": "1"}
    assert interpolate(devices["trainer"]["device_ids"][0], {"FP8RL_TRAINER_GPU": "0"}) == "0"


class LocalCompose:
    """Maps the compose world onto this machine."""

    def __init__(self, tmp: Path, env: dict[str, str]) -> None:
        self.ports = {"6379": str(free_port()), "50051": str(free_port()), "50052": str(free_port())}
        self.volumes = {name: tmp / name for name in COMPOSE["volumes"]}
        for path in self.volumes.values():
            path.mkdir()
        self.config = tmp / "config"
        shutil.copytree(ROOT / "deploy" / "config", self.config)
        self.env = env
        for service in ("trainer", "rollout", "coordinator"):  # each reads its own secrets at /secrets
            path = self.config / f"{service}.yaml"
            path.write_text(self.localize(path.read_text(), service))

    def mounts(self, service: str) -> dict[str, Path]:
        """Container path -> local path, from the service's own volume list (longest paths first)."""
        entries = COMPOSE["services"][service].get("volumes") or COMPOSE["x-app"]["volumes"]
        found = {}
        for entry in entries:
            source, target = entry.split(":")[:2]
            found[target] = self.config if source.startswith("./") else self.volumes[source]
        return dict(sorted(found.items(), key=lambda item: -len(item[0])))

    def localize(self, text: str, service: str = "coordinator") -> str:
        text = interpolate(text, self.env)
        for port, local in self.ports.items():
            text = re.sub(rf"\b{port}\b", local, text)
        text = (
            text.replace("redis://redis:", "redis://127.0.0.1:")
            .replace("rediss://redis:", "rediss://127.0.0.1:")
            .replace("trainer:", "127.0.0.1:")
            .replace("0.0.0.0", "127.0.0.1")
        )
        for target, path in self.mounts(service).items():
            text = re.sub(rf"(?<![\w/.]){target}\b", str(path), text)
        return text

    def environment(self, service: str) -> dict[str, str]:
        merged = {**COMPOSE["x-app"]["environment"], **COMPOSE["services"][service].get("environment", {})}
        env = {k: self.localize(str(v), service) for k, v in merged.items()}
        return {**os.environ, **env, "ADVERTISE_HOST": "127.0.0.1", "PYTHONUNBUFFERED": "1"}

    def command(self, service: str) -> list[str]:
        command = [self.localize(part, service) for part in COMPOSE["services"][service]["command"]]
        return [sys.executable, *command[1:]] if command[0] == "python" else command  # the image's python

    def healthy(self, service: str, timeout: float = 300) -> None:
        test = [
            self.localize(part, service) for part in COMPOSE["services"][service]["healthcheck"]["test"][1:]
        ]
        if test[0] == "python":
            test[0] = sys.executable  # the image's python is this venv's
        deadline = time.monotonic() + timeout
        while subprocess.run(test, capture_output=True, env=self.environment(service)).returncode != 0:
            assert time.monotonic() < deadline, f"{service} not healthy after {timeout}s"
            time.sleep(1)


@pytest.fixture
def local(tmp_path: Path) -> Iterator[LocalCompose]:
    env = {"REDIS_PASSWORD": "compose-secret", "FP8RL_STEPS": "2", "FP8RL_RUN_ID": "compose-test"}
    yield LocalCompose(tmp_path, env)


@pytest.mark.parametrize("service", ["trainer", "rollout"])
def test_services_use_the_shipped_model_unless_told_otherwise(local: LocalCompose, service: str) -> None:
    shell, flag, script = local.command(service)
    argv_of = script.replace("exec ", "printf '%s\\n' ", 1)  # the argv the service would get
    for model in ("", "/models/my model"):
        env = {**local.environment(service), "FP8RL_MODEL": model}
        argv = subprocess.run([shell, flag, argv_of], env=env, capture_output=True, text=True).stdout
        expected = ["--model", model] if model else []
        assert [a for a in argv.splitlines() if a in ("--model", model)] == expected, argv


@pytest.mark.slow
def test_compose_wiring_runs_a_short_run(local: LocalCompose, tmp_path: Path) -> None:
    bin_dir = Path(sys.executable).parent  # the services' console scripts live beside the interpreter
    path_env = f"{bin_dir}:{os.environ['PATH']}"
    with ExitStack() as stack:
        # The one-shot secrets service first (docker compose waits for it to complete): Redis needs its
        # certificate too.
        secrets = subprocess.run(local.command("secrets"), env=local.environment("secrets"), timeout=120)
        assert secrets.returncode == 0 and (local.volumes["secrets"] / "ca.pem").exists()
        redis_cmd = [
            *local.command("redis"),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(local.volumes["redis-data"]),
        ]
        proc = stack.enter_context(
            child_process(redis_cmd, tmp_path / "redis.log", local.environment("redis"))
        )
        wait_for_line(proc, tmp_path / "redis.log", "Ready to accept connections", timeout=30)
        url = local.localize(COMPOSE["x-app"]["environment"]["REDIS_URL"])
        assert redis.Redis.from_url(redis_url_with_password(url, local.environment("redis"))).ping()
        tls = {"ssl": True, "ssl_ca_certs": str(local.volumes["secrets"] / "ca.pem")}
        with pytest.raises(redis.AuthenticationError):  # nothing works without the password
            redis.Redis(port=int(local.ports["6379"]), **tls).set("x", 1)  # type: ignore[arg-type]
        with pytest.raises(redis.ConnectionError):  # nor in plaintext
            redis.Redis(port=int(local.ports["6379"])).ping()

        services = [proc]
        for service in ("trainer", "rollout"):
            env = {**local.environment(service), "PATH": path_env}
            services.append(
                stack.enter_context(child_process(local.command(service), tmp_path / f"{service}.log", env))
            )
        for service in ("trainer", "rollout"):
            local.healthy(service)
        tokens = [p.read_bytes().strip() for p in local.volumes["secrets"].glob("*.token")]
        for service_proc in services:  # no process shows a password or token in its command line (`ps`)
            for pid in [service_proc.pid, *_descendants(service_proc.pid)]:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                assert all(secret not in cmdline for secret in (b"compose-secret", *tokens))
        # The services speak mutual TLS only: a plaintext client, or one without a certificate, gets nothing.
        from fp8rl.healthcheck import serving
        from fp8rl.security import SecurityConfig

        trainer = f"127.0.0.1:{local.ports['50052']}"
        assert not serving(trainer, "fp8rl.v1.Trainer", server="trainer")
        ca_only = SecurityConfig(tls_ca=local.volumes["secrets"] / "ca.pem")
        assert not serving(trainer, "fp8rl.v1.Trainer", security=ca_only, server="trainer")
        env = {**local.environment("coordinator"), "PATH": path_env}
        run = subprocess.run(
            local.command("coordinator"), env=env, capture_output=True, text=True, timeout=600
        )
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        steps = [r["step"] for r in read_metrics(local.volumes["runs"] / "compose-test")]
        assert steps == [0, 1, 2]
        # The replica found the run through its Redis registration (no --rollout in the compose file).
        assert "--rollout" not in " ".join(COMPOSE["services"]["coordinator"]["command"])


def _descendants(pid: int) -> list[int]:
    """PIDs of ``pid``'s children, recursively (from /proc)."""
    children = Path(f"/proc/{pid}/task/{pid}/children")
    found = [int(c) for c in children.read_text().split()] if children.exists() else []
    return found + [d for c in found for d in _descendants(c)]
