"""The compose files and Dockerfiles, read and validated without an engine: what they require, what they
install, how the GPU override merges. `docker compose up` itself runs in tests/e2e/test_compose_up.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.containers import COMPOSE_BINARY
from tests.support import COMPOSE, ROOT, LocalCompose, interpolate


def test_redis_password_is_required_and_never_in_a_command_line() -> None:
    for environment in (COMPOSE["x-app"]["environment"], COMPOSE["services"]["redis"]["environment"]):
        with pytest.raises(ValueError, match="REDIS_PASSWORD"):
            interpolate(str(environment["REDIS_PASSWORD"]), {})
    assert "@" not in COMPOSE["x-app"]["environment"]["REDIS_URL"]  # the URL carries no password
    command = " ".join(COMPOSE["services"]["redis"]["command"])
    assert "requirepass" in command and "--appendonly" in command
    # Only the shell's variable is in the command line, expanded by the shell in a here-document.
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
    # (gguf: the GGUF converter's, ray: the Ray launcher's; the tests use them, the images do not need them.)
    assert re.search(r"pip install -q -e '\.\[cpu,dev,gguf,ray\]'", makefile)
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


def compose_config(*files: str) -> dict:
    """The compose files merged and validated by Docker Compose itself (`docker compose config`)."""
    args = [str(COMPOSE_BINARY), "--project-directory", str(ROOT)]
    args += [a for f in files for a in ("--file", str(ROOT / f))]
    env = {"PATH": os.environ["PATH"], "HOME": "/nonexistent", "REDIS_PASSWORD": "x"}
    done = subprocess.run([*args, "config", "--format", "json"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_gpu_file_validates_over_the_compose_file() -> None:
    cpu = compose_config("docker-compose.yml")
    gpu = compose_config("docker-compose.yml", "docker-compose.gpu.yml")
    assert gpu["services"].keys() == cpu["services"].keys()
    images = {name: s["image"] for name, s in gpu["services"].items()}
    assert images["rollout"] == "fp8rl:rollout-gpu" and images["trainer"] == images["coordinator"]
    for name in ("trainer", "rollout", "coordinator"):  # /config swapped for the GPU one, nothing else
        mounts = {v["target"]: v["source"] for v in gpu["services"][name]["volumes"]}
        before = {v["target"]: v["source"] for v in cpu["services"][name]["volumes"]}
        assert mounts.pop("/config").endswith("deploy/config-gpu") and before.pop("/config").endswith(
            "deploy/config"
        )
        assert mounts == before, name
    devices = gpu["services"]["trainer"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "device_ids": ["1"], "capabilities": ["gpu"]}]
    assert "deploy" not in cpu["services"]["trainer"]


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


def test_the_openai_file_publishes_the_replicas_face_on_loopback_only() -> None:
    cpu = compose_config("docker-compose.yml")
    openai = compose_config("docker-compose.yml", "docker-compose.openai.yml")
    assert "ports" not in cpu["services"]["rollout"]  # the face serves inside the project's network only
    assert "--http-port 8000" in " ".join(cpu["services"]["rollout"]["command"])
    [published] = openai["services"]["rollout"]["ports"]
    assert published["host_ip"] == "127.0.0.1" and published["target"] == 8000, published
    assert published["published"] == "8000-8007", published
    assert {k: v for k, v in openai["services"].items() if k != "rollout"} == {
        k: v for k, v in cpu["services"].items() if k != "rollout"
    }


def test_the_coordinator_comes_back_after_a_crash_and_stays_down_once_done() -> None:
    cpu = compose_config("docker-compose.yml")
    assert cpu["services"]["coordinator"]["restart"] == "on-failure:5"
    gpu = compose_config("docker-compose.yml", "docker-compose.gpu.yml")
    assert gpu["services"]["coordinator"]["restart"] == "on-failure:5"
