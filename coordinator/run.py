"""`coordinator start`: run one GRPO run, embedded (a private redis-server, the trainer and one rollout
replica as child processes on loopback, stopped on exit, error or Ctrl-C) or against running services.

Each expected way a run ends short of success raises :class:`RunExit` (2: bad input, 3: another
coordinator drives the run, 1: the trainer refused a step, 130: interrupted); :func:`start` prints its
one line and returns its status. Anything else (a child that died past max_restarts) propagates."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import sys
import time
from contextlib import ExitStack, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from coordinator.config import CoordinatorConfig
from fp8rl import models
from fp8rl.config import ConfigError, config_hash
from fp8rl.credentials import (
    PASSWORD_IN_URL,
    has_password,
    new_password,
    redacted,
    redis_url_with_password,
    write_private,
    write_private_atomic,
)
from fp8rl.run_secrets import security_for
from fp8rl.security import SecurityConfig
from trainer_service.config import TrainerConfig

if TYPE_CHECKING:
    from coordinator.processes import Child
    from coordinator.tasks import Task


class RunExit(Exception):
    """Ends `coordinator start` with exit status ``status``; :func:`start` prints ``message`` (one line,
    if any) once, after every child process has been stopped."""

    def __init__(self, status: int, message: str = "") -> None:
        super().__init__(message)
        self.status, self.message = status, message


def run_paths(config: CoordinatorConfig) -> tuple[str, Path]:
    run_id = config.run.run_id or time.strftime("run-%Y%m%d-%H%M%S")
    return run_id, (config.run.run_dir or Path("runs") / run_id).resolve()


def start(config: CoordinatorConfig) -> int:
    """Run ``config``'s run to its end; the process's exit status (0: done)."""
    try:
        return run(config)
    except RunExit as exc:
        if exc.message:
            print(f"coordinator: {exc.message}", file=sys.stderr)
        return exc.status


def run(config: CoordinatorConfig) -> int:
    """:func:`start`, but raising :class:`RunExit` for every end but success."""
    if has_password(config.distributed.redis_url):
        print(PASSWORD_IN_URL.format(prog="coordinator"), file=sys.stderr)
    missing = config.distributed.security.missing_files()
    if missing:
        raise RunExit(2, f"no such file: {'; '.join(missing)}")
    from coordinator.tasks import build_task

    try:
        task = build_task(config)  # reads the dataset: a bad file, row or key stops here
    except ConfigError as exc:
        raise RunExit(2, str(exc)) from None
    run_id, run_dir = run_paths(config)
    run_dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        with ExitStack() as stack:
            stack.callback(task.close)
            holder = lock_run_dir(run_dir, stack)
            if holder is not None:
                raise RunExit(
                    3,
                    f"run {run_id} is being driven by another coordinator (pid {holder}; "
                    f"{run_dir / LOCK_FILE}): stop it first, or use another --run-id",
                )
            return Supervisor(config, task, run_id, run_dir).run()
    except KeyboardInterrupt:
        raise RunExit(130, f"interrupted; resume with --run-id {run_id}") from None
    except models.ShippedModelError as exc:
        raise RunExit(2, str(exc)) from None


LOCK_FILE = "coordinator.lock"


def redis_password_file(run_dir: Path) -> Path:
    """Where an embedded run keeps its redis-server's password (mode 0600)."""
    return run_dir / "redis" / "password"


def secrets_dir(run_dir: Path) -> Path:
    """An embedded run's tokens, update-signing pair, registration key, the replica's high-water mark and
    (with tls) CA and certificates (fp8rl/run_secrets.py)."""
    return run_dir / "secrets"


def lock_run_dir(run_dir: Path, stack: ExitStack) -> str | None:
    """Hold an exclusive lock on the run directory while the run is driven (released by the kernel when
    this process ends, however it ends). Returns the holder's PID if another process has it."""
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        return holder
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    stack.callback(os.close, fd)
    return None


def _interrupt(*_: object) -> None:
    """SIGTERM unwinds like Ctrl-C, so every child is stopped on the way out."""
    raise KeyboardInterrupt


@dataclass
class Services:
    """Where the run's services are, and the coordinator's identity towards them."""

    redis_url: str
    trainer: str
    rollouts: list[str]  # empty: discover the replicas in Redis
    security: SecurityConfig


class Supervisor:
    """Drives the run. Embedded, when a child process (redis-server, trainer, rollout) dies, the others are
    stopped and all three started again, and the run goes on from Redis' append-only file and the
    trainer's last checkpoint (the resume path of a rerun): at most ``max_restarts`` times, waiting 1, 2,
    4... s between attempts; each restart is recorded as a `restart` event."""

    def __init__(self, config: CoordinatorConfig, task: Task, run_id: str, run_dir: Path) -> None:
        self.config, self.task, self.run_id, self.run_dir = config, task, run_id, run_dir
        self.restarts = 0
        # Restart events not in Redis yet: drive records them once it is back.
        self.unrecorded: list[str] = []

    def run(self) -> int:
        from coordinator.clients import ReplicaFailed

        limit = self.config.embedded.max_restarts
        while True:
            with ExitStack() as stack:
                embedded = (
                    EmbeddedProcesses(self.config, self.run_dir, stack) if self.config.is_embedded else None
                )
                try:
                    return self.drive(stack, embedded)
                except RunExit:
                    raise
                except Exception as exc:
                    dead = embedded.dead() if embedded else []
                    if not dead or self.restarts >= limit:
                        if isinstance(exc, ReplicaFailed):  # waited for one already: say so in a line
                            raise RunExit(1, f"{exc}; the same --run-id resumes") from None
                        raise
                    self.restarts += 1
                    what = ", ".join(f"{c.name} (exit status {c.proc.returncode})" for c in dead)
                    self.unrecorded.append(
                        f"{what} died ({type(exc).__name__}); restarted the run's processes"
                    )
                    print(
                        f"coordinator: {what} died; restarting ({self.restarts}/{limit})",
                        file=sys.stderr,
                        flush=True,
                    )
            time.sleep(min(2 ** (self.restarts - 1), 30))

    def drive(self, stack: ExitStack, embedded: EmbeddedProcesses | None) -> int:
        """One attempt at the run: start (embedded) or reach the services, then drive the steps."""
        import redis

        from coordinator.clients import (
            EMBEDDED_UNAVAILABLE_WAIT_S,
            UNAVAILABLE_WAIT_S,
            FencedOut,
            RolloutPool,
            TrainerClient,
        )
        from coordinator.driver import Driver, TrainingRefused
        from coordinator.metrics import MetricsSink, summarize
        from coordinator.state import ConfigMismatch, LeaseLost, RunStore
        from fp8rl.redis_link import connect
        from fp8rl.registry import live_replicas

        config, run_id, run_dir = self.config, self.run_id, self.run_dir
        services = embedded.start() if embedded else distributed_services(config)
        redis_url = redis_url_with_password(services.redis_url)
        info = {
            "run_id": run_id,
            "redis_url": redacted(redis_url),  # run files never hold a password (only the file meant for it)
            "pid": os.getpid(),
            "children": embedded.pids if embedded else {},
            "trainer": services.trainer,
            "rollouts": services.rollouts,
        }
        if embedded:
            info["redis_password_file"] = str(redis_password_file(run_dir))
        precision = linear_precision(config)
        info["linears"] = precision
        info["consistency"] = config.run.precision.consistency
        write_private(run_dir / "run.json", json.dumps(info))
        # Embedded, a Redis that stops answering has died, and the supervisor restarts it: fail at once.
        # Distributed, ride out an outage (a restart, a partition: fp8rl/redis_link.py).
        client = redis.Redis.from_url(redis_url) if embedded else connect(redis_url)
        store = RunStore(client, run_id)
        try:
            store.init_config(config.identity(), config_hash(config))
        except ConfigMismatch as exc:
            raise RunExit(2, str(exc)) from None
        while self.unrecorded:
            store.event("restart", self.unrecorded.pop(0), store.read().step)
        # Given replicas, or those registered in Redis; an embedded run takes both, so a replica started
        # by hand with the run's Redis URL and secrets joins it (and leaves when it stops).
        rollouts = services.rollouts
        if embedded:
            addresses = lambda: sorted({*rollouts, *live_replicas(client)})  # noqa: E731
        else:
            addresses = (lambda: rollouts) if rollouts else (lambda: sorted(live_replicas(client)))
        wait_s = EMBEDDED_UNAVAILABLE_WAIT_S if embedded else UNAVAILABLE_WAIT_S
        trainer = TrainerClient(services.trainer, services.security, wait_s)
        pool = RolloutPool(addresses, services.security, wait_s)
        stack.callback(trainer.close)
        stack.callback(pool.close)
        sink = MetricsSink(
            run_dir,
            config.run.steps,
            config.metrics.progress,
            config.metrics.mult_prob_warn,
            config.metrics.tensorboard,
            config.metrics.wandb_project,
            run_id,
            config.model_dump(mode="json"),
        )
        stack.callback(sink.close)
        sink.say(f"run {run_id}: recipe {config.run.recipe}, {config.run.steps} steps, run dir {run_dir}")
        sink.say(f"linears: {precision['summary']}; consistency {config.run.precision.consistency}")
        try:
            records = Driver(config, run_id, store, trainer, pool, self.task, sink).run()
        except (LeaseLost, FencedOut) as exc:
            raise RunExit(3, str(exc)) from None
        except TrainingRefused as exc:
            raise RunExit(1, str(exc)) from None
        summary = summarize(records) | {
            "linears": precision["summary"],
            "consistency": config.run.precision.consistency,
        }
        # (A figure the run has none of, such as routing mismatch on a dense model, stays in summary.json.)
        sink.say("summary: " + ", ".join(f"{k}={_short(v)}" for k, v in summary.items() if v is not None))
        try:  # every step is committed by now: a full disk costs the files, not the run
            (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
            from coordinator.report import write_plots

            for path in write_plots(records, run_dir):
                sink.say(f"plot: {path}")
        except OSError as exc:
            print(
                f"coordinator: the run is complete, but its summary and plots were not written ({exc}); "
                f"`coordinator report --run-id {run_id}` draws the plots once there is room",
                file=sys.stderr,
            )
        return 0


def distributed_services(config: CoordinatorConfig) -> Services:
    given = config.distributed
    return Services(str(given.redis_url), str(given.trainer), list(given.rollout), given.security)


def linear_precision(config: CoordinatorConfig) -> dict[str, Any]:
    """Which linears of the model run in FP8 under the run's recipe and precision knobs
    (fp8rl.architectures), for the run's metadata and summary: ``summary`` in a line, the modules kept in
    high precision per layer, the layers each is kept in, and why."""
    from fp8rl.recipes import get_recipe

    if not get_recipe(config.run.recipe).fp8_rollout:
        return {"summary": "none in FP8 (bf16 recipe)", "high_precision_per_layer": [], "reasons": []}
    if config.run.model is None and not config.is_embedded:  # (the trainer's own --model decides)
        return {"summary": "as the trainer's model decides (give --model to record it)"}
    return config.run.precision.plan(config.run.model or models.TINY_ARITH).summary()


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def as_sets(values: dict[str, Any]) -> list[str]:
    """``{"a.b": 1}`` -> ``["--set", "a.b=1"]`` (values as JSON, which the CLIs read as YAML)."""
    return [arg for key, value in values.items() for arg in ("--set", f"{key}={json.dumps(value)}")]


def resolve_dtype(requested: str) -> str:
    if requested != "auto":
        return requested
    from fp8rl.devices import resolve_device

    return "bfloat16" if resolve_device() == "cuda" else "float32"


def embedded_trainer(config: CoordinatorConfig, model: Path, dtype: str, run_dir: Path) -> TrainerConfig:
    """The embedded trainer's config: the run's learner, model, recipe and seed, a port of its own choosing
    on loopback, checkpoints in the run directory (resumed from when the run is), the run's secrets."""
    return TrainerConfig(
        security=security_for(secrets_dir(run_dir), "trainer", config.embedded.tls),
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
    :meth:`start` and stopped by ``stack``."""

    def __init__(self, config: CoordinatorConfig, run_dir: Path, stack: ExitStack) -> None:
        self.config, self.run_dir, self.stack = config, run_dir, stack
        self.pids: dict[str, int] = {}  # for run.json
        self.watched: list[Child] = []

    def dead(self, grace_s: float = 15.0) -> list[Child]:
        """The children that died; a call that failed because a child is going down often fails before the
        child has exited (a sharded trainer's rank 0 reports its lost peer, then torchrun ends the group), so
        wait up to ``grace_s`` for one to go."""
        deadline = time.monotonic() + grace_s
        while True:
            dead = [c for c in self.watched if c.proc.poll() is not None]
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(0.2)

    def start(self) -> Services:
        """Start redis-server, the trainer and one rollout replica; their addresses once all are healthy."""
        from coordinator.processes import Child, free_port, python_module, start_redis, wait_healthy
        from fp8rl.serving import PARENT_ENV

        config, run_dir, stack = self.config, self.run_dir, self.stack
        logs = run_dir / "logs"
        model = config.run.model or models.verified(models.TINY_ARITH)
        dtype = resolve_dtype(config.embedded.compute_dtype)
        from rollout_service.config import RolloutConfig
        from rollout_service.engine import Platform, unsupported_reason

        reason = unsupported_reason(
            RolloutConfig(model=model, recipe=config.run.recipe, dtype=dtype, precision=config.run.precision),
            Platform.here(),
        )
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
        port = free_port(kept_port(port_file))
        redis_url, self.pids["redis-server"] = start_redis(
            stack,
            run_dir / "redis",
            logs / "redis.log",
            port=port,
            watch=self.watched,
            password=password_file.read_text(),
        )
        with suppress(OSError):  # (a full disk: the file keeps the port before, or there is none)
            write_private_atomic(port_file, str(port))
        # The run's secrets (written here, first): tokens and the update keys always, a CA with certificates
        # with --tls; other local users can reach loopback ports too.
        me = security_for(secrets_dir(run_dir), "coordinator", config.embedded.tls)
        trainer_yaml = run_dir / "trainer.yaml"  # the embedded trainer's whole TrainerConfig, validated here
        trainer_yaml.write_text(
            yaml.safe_dump(embedded_trainer(config, model, dtype, run_dir).model_dump(mode="json"))
        )
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
        return Services(redis_url, trainer_address, [rollout_address], me)

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

    def rollout_args(self, model: Path, dtype: str) -> list[str]:
        """The rollout replica's command line: the run's model, recipe, seed and secrets, port 0."""
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
        security = security_for(secrets_dir(self.run_dir), "replica", config.embedded.tls)
        return args + as_sets(
            {
                "seed": config.run.seed,
                "precision": config.run.precision.model_dump(mode="json"),
                "security": security.model_dump(mode="json"),
            }
        )
