"""Embedded mode's processes: the run's secrets, a private redis-server, and the trainer and one rollout
replica as child processes on loopback (:class:`EmbeddedProcesses`), stopped by the run's exit stack. A
launcher that places the trainer and replicas elsewhere subclasses it (coordinator/ray_launcher.py)."""

from __future__ import annotations

import json
import os
import time
from contextlib import ExitStack, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import yaml

from coordinator.config import CoordinatorConfig
from fp8rl import models
from fp8rl.credentials import new_password, write_private, write_private_atomic
from fp8rl.run_secrets import security_for
from fp8rl.security import SecurityConfig
from trainer_service.config import TrainerConfig

if TYPE_CHECKING:
    from coordinator.processes import Child


class RunExit(Exception):
    """Ends `coordinator start` with exit status ``status``; :func:`start` prints ``message`` (one line,
    if any) once, after every child process has been stopped."""

    def __init__(self, status: int, message: str = "") -> None:
        super().__init__(message)
        self.status, self.message = status, message


def redis_password_file(run_dir: Path) -> Path:
    """Where an embedded run keeps its redis-server's password (mode 0600)."""
    return run_dir / "redis" / "password"


def secrets_dir(run_dir: Path) -> Path:
    """An embedded run's tokens, update-signing pair, registration key, the replica's high-water mark and
    (with tls) CA and certificates (fp8rl/run_secrets.py)."""
    return run_dir / "secrets"


@dataclass
class Services:
    """Where the run's services are, and the coordinator's identity towards them."""

    redis_url: str
    trainer: str
    rollouts: list[str]  # empty: discover the replicas in Redis
    security: SecurityConfig


def as_sets(values: dict[str, Any]) -> list[str]:
    """``{"a.b": 1}`` -> ``["--set", "a.b=1"]`` (values as JSON, which the CLIs read as YAML)."""
    return [arg for key, value in values.items() for arg in ("--set", f"{key}={json.dumps(value)}")]


def resolve_dtype(requested: str) -> str:
    if requested != "auto":
        return requested
    from fp8rl.devices import resolve_device

    return "bfloat16" if resolve_device() == "cuda" else "float32"


def embedded_trainer(
    config: CoordinatorConfig, model: Path, dtype: str, run_dir: Path, tls: bool | None = None
) -> TrainerConfig:
    """The embedded trainer's config: the run's learner, model, recipe and seed, a port of its own choosing
    on loopback, checkpoints in the run directory (resumed from when the run is), the run's secrets
    (under TLS with ``tls``; None: as the run's `tls` says)."""
    return TrainerConfig(
        security=security_for(secrets_dir(run_dir), "trainer", config.embedded.tls if tls is None else tls),
        **config.embedded.learner.model_dump(),
        model=model,
        recipe=config.run.recipe,
        precision=config.run.precision,
        host="127.0.0.1",
        port=0,
        compute_dtype=dtype,
        checkpoint_dir=run_dir / "checkpoints",
        resume=True,
        seed=config.run.seed,
    )


def kept_port(path: Path) -> int | None:
    """The port in ``path``, if there is one that reads as a port."""
    with suppress(OSError, ValueError):
        port = int(path.read_text())
        if 0 < port < 65536:
            return port
    return None


class EmbeddedProcesses:
    """An embedded run's child processes (redis-server, the trainer and one rollout replica), started by
    :meth:`start` and stopped by ``stack``. Subclasses place the trainer and replicas elsewhere
    (:meth:`start_services`); Redis and the coordinator stay here."""

    tls_required = False  # (the run's processes talk mutual TLS only with the `tls` setting)

    def __init__(self, config: CoordinatorConfig, run_dir: Path, stack: ExitStack) -> None:
        self.config, self.run_dir, self.stack = config, run_dir, stack
        self.tls = config.embedded.tls or self.tls_required
        self.pids: dict[str, int] = {}  # for run.json
        self.watched: list[Child] = []
        self.rollouts: list[str] = []

    def dead(self, grace_s: float = 15.0) -> list[str]:
        """What died, a phrase each; a call that failed because a child is going down often fails before
        the child has exited (a sharded trainer's rank 0 reports its lost peer, then torchrun ends the
        group), so wait up to ``grace_s`` for one to go."""
        deadline = time.monotonic() + grace_s
        while True:
            dead = [
                f"{c.name} (exit status {c.proc.returncode})"
                for c in self.watched
                if c.proc.poll() is not None
            ]
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(0.2)

    def compute_dtype(self) -> str:
        """The trainer's and replicas' dtype: `auto` as this machine's device calls for."""
        return resolve_dtype(self.config.embedded.compute_dtype)

    def platform_refusal(self, model: Path, dtype: str) -> str | None:
        """Why this machine cannot run the replica the run asks for (None: it can)."""
        from rollout_service.config import RolloutConfig
        from rollout_service.engine import Platform, unsupported_reason

        config = self.config
        wanted = RolloutConfig(
            model=model, recipe=config.run.recipe, dtype=dtype, precision=config.run.precision
        )
        return unsupported_reason(wanted, Platform.here())

    def replica_addresses(self) -> list[str]:
        """The replicas this run started, as they are now (asked before each step)."""
        return self.rollouts

    def start(self) -> Services:
        """Start redis-server, the trainer and the replicas; their addresses once all are healthy."""
        from coordinator.processes import start_redis

        config, run_dir, stack = self.config, self.run_dir, self.stack
        logs = run_dir / "logs"
        model = config.run.model or models.verified(models.TINY_ARITH)
        dtype = self.compute_dtype()
        reason = self.platform_refusal(model, dtype)
        if reason:  # refused before anything starts
            raise RunExit(2, reason)
        # The embedded redis-server requires a password of its own (kept in a 0600 file, never in argv), so
        # other local users cannot rewrite the run's state.
        password_file = redis_password_file(run_dir)
        if not password_file.exists():
            write_private(password_file, new_password())
        # Redis keeps its port across restarts while it is free, so a replica added by hand with the run's
        # Redis URL (run.json) finds it again.
        port_file = run_dir / "redis" / "port"
        redis_url, self.pids["redis-server"] = start_redis(
            stack,
            run_dir / "redis",
            logs / "redis.log",
            preferred=kept_port(port_file),
            watch=self.watched,
            password=password_file.read_text(),
        )
        with suppress(OSError):  # (a full disk: the file keeps the port before, or there is none)
            write_private_atomic(port_file, str(urlsplit(redis_url).port))
        # The run's secrets (written here, first): tokens and the update keys always, a CA with certificates
        # with --tls; other local users can reach loopback ports too.
        me = security_for(secrets_dir(run_dir), "coordinator", self.tls)
        trainer_address, self.rollouts = self.start_services(model, dtype, me)
        return Services(redis_url, trainer_address, list(self.rollouts), me)

    def start_services(self, model: Path, dtype: str, me: SecurityConfig) -> tuple[str, list[str]]:
        """Start the trainer and one replica as child processes; their addresses once both are healthy."""
        from coordinator.processes import Child, python_module, wait_healthy
        from fp8rl.serving import PARENT_ENV

        run_dir, stack = self.run_dir, self.stack
        logs = run_dir / "logs"
        trainer_yaml = run_dir / "trainer.yaml"  # the embedded trainer's whole TrainerConfig, validated here
        trainer_config = embedded_trainer(self.config, model, dtype, run_dir, self.tls)
        trainer_yaml.write_text(yaml.safe_dump(trainer_config.model_dump(mode="json")))
        trainer_args = ["serve", "--config", str(trainer_yaml), *self.trainer_ranks()]
        rollout_args = self.rollout_args(model, dtype)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", PARENT_ENV: str(os.getpid())}
        trainer = Child(
            "trainer", python_module("trainer_service.cli", *trainer_args), logs / "trainer.log", env
        )
        stack.callback(trainer.stop)
        rollout = Child(
            "rollout", python_module("rollout_service.cli", *rollout_args), logs / "rollout.log", env
        )
        stack.callback(rollout.stop)
        self.pids |= {"trainer": trainer.pid, "rollout": rollout.pid}
        self.watched += [trainer, rollout]
        trainer_address, rollout_address = trainer.bound_address(), rollout.bound_address()
        wait_healthy(trainer, trainer_address, "trainer", me)
        wait_healthy(rollout, rollout_address, "rollout", me)
        return trainer_address, [rollout_address]

    def trainer_ranks(self) -> list[str]:
        """The trainer's torchrun flags, with --trainer-procs > 1 (one process resumes any number of ranks'
        checkpoints; only the older one-process layout, without shards, needs one process)."""
        procs = self.config.embedded.trainer_procs
        checkpoints = list((self.run_dir / "checkpoints").glob("step-*"))
        if procs > 1 and any(not (c / "shards").is_dir() for c in checkpoints):
            raise RunExit(
                2,
                "this run's checkpoints were written by one trainer process; resume it with "
                "--trainer-procs 1 (a sharded trainer resumes sharded checkpoints only)",
            )
        if procs > 1:
            return ["--nproc-per-node", str(procs)]
        return []

    def rollout_args(self, model: Path, dtype: str, with_security: bool = True) -> list[str]:
        """The rollout replica's command line: the run's model, recipe, seed and secrets (unless
        ``with_security`` is false: a launcher that ships them), port 0."""
        config = self.config
        args = [
            "serve",
            "--model",
            str(model),
            "--recipe",
            config.run.recipe,
            "--port",
            "0",
            "--dtype",
            dtype,
        ]
        args += ["--kv-cache-gib", str(config.embedded.kv_cache_gib)]
        if config.task.env is not None:  # (episodes reach the policy over its OpenAI-compatible face)
            args += ["--http-port", "0"]
        sets: dict[str, Any] = {
            "seed": config.run.seed,
            "precision": config.run.precision.model_dump(mode="json"),
        }
        if with_security:
            security = security_for(secrets_dir(self.run_dir), "replica", self.tls)
            sets["security"] = security.model_dump(mode="json")
        return args + as_sets(sets)
