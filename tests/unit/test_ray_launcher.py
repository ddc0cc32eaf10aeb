"""The Ray launcher's parts that need no cluster: what an actor is given (its role's secret files, the
config pointing at its own copies), the command lines of trainer ranks, and the refusals made before
anything starts. The launcher itself runs on a real Ray cluster in tests/e2e/test_ray_run.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from coordinator.config import CoordinatorConfig
from coordinator.ray_launcher import private_files, relocated, trainer_command
from fp8rl.run_secrets import security_for
from fp8rl.serving import PARENT_ENV


def test_an_actor_gets_its_roles_files_and_a_config_naming_its_own_copies(tmp_path: Path) -> None:
    security = security_for(tmp_path / "secrets", "replica", tls=True)
    files = private_files(security)
    assert files["token_file"] == security.token_file.read_text()  # type: ignore[union-attr]
    assert files["tls_key"] == security.tls_key.read_text()  # type: ignore[union-attr]
    assert "update_signing_key_file" not in files  # (the trainer's alone)
    moved = relocated(security, tmp_path / "actor")
    named = {k: v for k, v in moved.items() if isinstance(v, str)}
    assert named and all(Path(v).parent == tmp_path / "actor" for v in named.values())
    assert set(files) <= set(named)


def test_trainer_ranks_are_torchrun_nodes_of_one_static_group(tmp_path: Path) -> None:
    security = security_for(tmp_path / "secrets", "trainer", tls=True)
    alone = trainer_command({"port": 0}, security, 0, 1, ("10.0.0.1", 29500))(tmp_path, "10.0.0.1")
    assert alone[1:3] == ["-m", "trainer_service.cli"]
    config = (tmp_path / "trainer.yaml").read_text()
    assert "host: 10.0.0.1" in config and str(tmp_path / "token_file") in config
    assert (tmp_path / "trainer.yaml").stat().st_mode & 0o777 == 0o600
    rank = trainer_command({"port": 0}, security, 1, 2, ("10.0.0.1", 29500))(tmp_path, "10.0.0.2")
    assert rank[:2] == ["sh", "-c"] and PARENT_ENV in rank[2]  # (ranks watch torchrun, their parent)
    assert {"--nnodes=2", "--node-rank=1", "--master-addr=10.0.0.1", "--master-port=29500"} <= set(rank)


def test_the_launcher_is_refused_for_running_services() -> None:
    with pytest.raises(ValidationError, match="launcher starts an embedded run"):
        CoordinatorConfig.model_validate(
            {"launcher": "ray", "redis_url": "redis://r:6379/0", "trainer": "t:1"}
        )
    with pytest.raises(ValidationError, match="configure launcher: ray"):
        CoordinatorConfig.model_validate({"ray": {"replicas": 2}})
    with pytest.raises(ValidationError, match=r"ray\.replicas"):
        CoordinatorConfig.model_validate({"launcher": "ray", "ray": {"replicas": 0}})


def test_without_a_cluster_to_join_the_run_is_refused_before_anything_starts(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    run = [sys.executable, "-m", "coordinator.cli", "start", "--launcher", "ray", "--run-dir", str(tmp_path)]
    done = subprocess.run(run, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "--ray-address or RAY_ADDRESS" in done.stderr
    assert not (tmp_path / "redis").exists()  # nothing started
