"""docker compose without Docker: the compose file's own command lines, environment and health checks run
as local processes (service hostnames mapped to 127.0.0.1, ports remapped to free ones, volumes to
temporary directories) and drive a short run; the Dockerfiles install what `make setup` installs."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
import redis
import yaml

from coordinator.metrics import read_metrics
from fp8rl.credentials import redis_url_with_password
from tests.support import COMPOSE, ROOT, LocalCompose, child_process, interpolate, wait_for_line


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
            log, env = tmp_path / f"{service}.log", local.environment(service)
            services.append(stack.enter_context(child_process(local.command(service), log, env)))
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
        env = local.environment("coordinator")
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
