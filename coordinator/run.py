"""`coordinator start`: run one GRPO run, embedded (a private redis-server, the trainer and one rollout
replica as child processes on loopback, stopped on exit, error or Ctrl-C) or against running services."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import sys
import time
from contextlib import ExitStack
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
)
from fp8rl.run_secrets import security_for
from fp8rl.security import SecurityConfig
from trainer_service.config import TrainerConfig

if TYPE_CHECKING:
    from coordinator.tasks import Task


def run_paths(config: CoordinatorConfig) -> tuple[str, Path]:
    run_id = config.run_id or time.strftime("run-%Y%m%d-%H%M%S")
    return run_id, (config.run_dir or Path("runs") / run_id).resolve()


def start(config: CoordinatorConfig) -> int:
    if has_password(config.redis_url):
        print(PASSWORD_IN_URL.format(prog="coordinator"), file=sys.stderr)
    missing = config.security.missing_files()
    if missing:
        print(f"coordinator: no such file: {'; '.join(missing)}", file=sys.stderr)
        return 2
    from coordinator.tasks import build_task

    try:
        task = build_task(config)  # reads the dataset: a bad file, row or key stops here
    except ConfigError as exc:
        print(f"coordinator: {exc}", file=sys.stderr)
        return 2
    run_id, run_dir = run_paths(config)
    run_dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        with ExitStack() as stack:
            stack.callback(task.close)
            holder = lock_run_dir(run_dir, stack)
            if holder is not None:
                print(
                    f"coordinator: run {run_id} is being driven by another coordinator (pid {holder}; "
                    f"{run_dir / LOCK_FILE}): stop it first, or use another --run-id",
                    file=sys.stderr,
                )
                return 3
            return supervise(config, task, run_id, run_dir)
    except KeyboardInterrupt:
        print(f"coordinator: interrupted; resume with --run-id {run_id}", file=sys.stderr)
        return 130
    except models.ShippedModelError as exc:
        print(f"coordinator: {exc}", file=sys.stderr)
        return 2


LOCK_FILE = "coordinator.lock"


def redis_password_file(run_dir: Path) -> Path:
    """Where an embedded run keeps its redis-server's password (mode 0600)."""
    return run_dir / "redis" / "password"


def secrets_dir(run_dir: Path) -> Path:
    """An embedded run's tokens, update key and (with tls) CA and certificates (fp8rl/run_secrets.py)."""
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


def supervise(config: CoordinatorConfig, task: Task, run_id: str, run_dir: Path) -> int:
    """Drive the run. Embedded, when a child process (redis-server, trainer, rollout) dies, the others are
    stopped and all three started again, and the run goes on from Redis' append-only file and the
    trainer's last checkpoint (the resume path of a rerun): at most ``max_restarts`` times, waiting 1, 2,
    4... s between attempts; each restart is recorded as a `restart` event."""
    from coordinator.processes import Child

    restarts = 0
    unrecorded: list[str] = []  # restart events not in Redis yet (drive records them once it is back)
    while True:
        watched: list[Child] = []
        with ExitStack() as stack:
            try:
                return drive(config, task, run_id, run_dir, stack, watched, unrecorded)
            except Exception as exc:
                dead = dying_children(watched) if config.embedded else []
                if not (config.embedded and dead) or restarts >= config.max_restarts:
                    raise
                restarts += 1
                what = ", ".join(f"{c.name} (exit status {c.proc.returncode})" for c in dead)
                unrecorded.append(f"{what} died ({type(exc).__name__}); restarted the run's processes")
                print(
                    f"coordinator: {what} died; restarting ({restarts}/{config.max_restarts})",
                    file=sys.stderr,
                    flush=True,
                )
        time.sleep(min(2 ** (restarts - 1), 30))


def dying_children(watched: list[Any], grace_s: float = 15.0) -> list[Any]:
    """The children that died; a call that failed because a child is going down often fails before the
    child has exited (a sharded trainer's rank 0 reports its lost peer, then torchrun ends the group), so
    wait up to ``grace_s`` for one to go."""
    deadline = time.monotonic() + grace_s
    while not (dead := [c for c in watched if c.proc.poll() is not None]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return dead


def drive(
    config: CoordinatorConfig,
    task: Task,
    run_id: str,
    run_dir: Path,
    stack: ExitStack,
    watched: list[Any] | None = None,
    restarts: list[str] | None = None,
) -> int:
    import redis

    from coordinator.clients import RolloutPool, TrainerClient
    from coordinator.driver import Driver, TrainingRefused
    from coordinator.metrics import MetricsSink, summarize
    from coordinator.state import ConfigMismatch, LeaseLost, RunStore
    from fp8rl.registry import live_replicas

    children: dict[str, int] = {}
    if config.embedded:
        redis_url, trainer_address, rollouts, security = launch_embedded(
            config, run_dir, stack, children, watched
        )
    else:
        redis_url, trainer_address = str(config.redis_url), str(config.trainer)
        rollouts = list(config.rollout)
        security = config.security
    redis_url = redis_url_with_password(str(redis_url))
    info = {
        "run_id": run_id,
        "redis_url": redacted(redis_url),  # run files never hold a password (only the file meant for it)
        "pid": os.getpid(),
        "children": children,
        "trainer": trainer_address,
        "rollouts": rollouts,
    }
    if config.embedded:
        info["redis_password_file"] = str(redis_password_file(run_dir))
    precision = linear_precision(config)
    info["linears"] = precision
    write_private(run_dir / "run.json", json.dumps(info))
    client = redis.Redis.from_url(redis_url)
    store = RunStore(client, run_id)
    try:
        store.init_config(config.identity(), config_hash(config))
    except ConfigMismatch as exc:
        print(f"coordinator: {exc}", file=sys.stderr)
        return 2
    while restarts:
        store.event("restart", restarts.pop(0), store.read().step)
    addresses = (lambda: rollouts) if rollouts else (lambda: sorted(live_replicas(client)))
    trainer = TrainerClient(str(trainer_address), security)
    pool = RolloutPool(addresses, security)
    stack.callback(trainer.close)
    stack.callback(pool.close)
    sink = MetricsSink(
        run_dir,
        config.steps,
        config.progress,
        config.mult_prob_warn,
        config.tensorboard,
        config.wandb_project,
        run_id,
        config.model_dump(mode="json"),
    )
    stack.callback(sink.close)
    sink.say(f"run {run_id}: recipe {config.recipe}, {config.steps} steps, run dir {run_dir}")
    sink.say(f"linears: {precision['summary']}")
    try:
        records = Driver(config, run_id, store, trainer, pool, task, sink).run()
    except LeaseLost as exc:
        print(f"coordinator: {exc}", file=sys.stderr)
        return 3
    except TrainingRefused as exc:
        print(f"coordinator: {exc}", file=sys.stderr)
        return 1
    summary = summarize(records) | {"linears": precision["summary"]}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    sink.say("summary: " + ", ".join(f"{k}={_short(v)}" for k, v in summary.items()))
    from coordinator.report import write_plots

    for path in write_plots(records, run_dir):
        sink.say(f"plot: {path}")
    return 0


def linear_precision(config: CoordinatorConfig) -> dict[str, Any]:
    """Which linears of the model run in FP8 under the run's recipe (fp8rl.architectures), for the run's
    metadata and summary: ``summary`` in a line, the modules kept in high precision per layer and why."""
    from fp8rl.architectures import fp8_plan, read_config
    from fp8rl.recipes import get_recipe

    if not get_recipe(config.recipe).fp8_rollout:
        return {"summary": "none in FP8 (bf16 recipe)", "high_precision_per_layer": [], "reasons": []}
    if config.model is None and not config.embedded:  # (the trainer's own --model decides)
        return {"summary": "as the trainer's model decides (give --model to record it)"}
    plan = fp8_plan(read_config(config.model or models.TINY_ARITH)).summary()
    kept = plan["high_precision_per_layer"]
    line = "all block linears in FP8" + (f" but {', '.join(kept)} (every layer)" if kept else "")
    return {"summary": line, **plan}


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
        security=security_for(secrets_dir(run_dir), "trainer", config.tls),
        **config.learner.model_dump(),
        model=model,
        recipe=config.recipe,
        host="127.0.0.1",
        port=0,
        compute_dtype=dtype,
        checkpoint_dir=run_dir / "checkpoints",
        resume=True,
        seed=config.seed,
    )


def launch_embedded(
    config: CoordinatorConfig,
    run_dir: Path,
    stack: ExitStack,
    children: dict[str, int],
    watched: list[Any] | None = None,
) -> tuple[str, str, list[str], SecurityConfig]:
    """Start redis-server, the trainer and one rollout replica; ``children`` gets their PIDs, ``watched``
    their processes. Returns the Redis URL, the services' addresses and the coordinator's identity."""
    from coordinator.processes import Child, python_module, start_redis, wait_healthy
    from fp8rl.serving import PARENT_ENV

    logs = run_dir / "logs"
    model = config.model or models.verified(models.TINY_ARITH)
    dtype = resolve_dtype(config.compute_dtype)
    from rollout_service.config import RolloutConfig
    from rollout_service.engine import Platform, unsupported_reason

    reason = unsupported_reason(
        RolloutConfig(model=model, recipe=config.recipe, dtype=dtype), Platform.here()
    )
    if reason:  # refused before anything starts
        print(f"coordinator: {reason}", file=sys.stderr)
        raise SystemExit(2)
    # The embedded redis-server requires a password of its own (kept in a 0600 file, never in argv), so
    # other local users cannot rewrite the run's state.
    password_file = redis_password_file(run_dir)
    if not password_file.exists():
        write_private(password_file, new_password())
    redis_url, children["redis-server"] = start_redis(
        stack, run_dir / "redis", logs / "redis.log", watch=watched, password=password_file.read_text()
    )
    # The run's secrets (written here, first): tokens and the update key always, a CA with certificates
    # with --tls; other local users can reach loopback ports too.
    me = security_for(secrets_dir(run_dir), "coordinator", config.tls)
    trainer_yaml = run_dir / "trainer.yaml"  # the embedded trainer's whole TrainerConfig, validated here
    trainer_yaml.write_text(
        yaml.safe_dump(embedded_trainer(config, model, dtype, run_dir).model_dump(mode="json"))
    )
    trainer_args = ["serve", "--config", str(trainer_yaml)]
    checkpoints = list((run_dir / "checkpoints").glob("step-*"))
    if config.trainer_procs > 1 and any(not (c / "shards").is_dir() for c in checkpoints):
        print(
            "coordinator: this run's checkpoints were written by one trainer process; resume it with "
            "--trainer-procs 1 (a sharded trainer resumes sharded checkpoints only)",
            file=sys.stderr,
        )
        raise SystemExit(2)
    if config.trainer_procs > 1:  # (one process resumes any number of ranks' checkpoints)
        trainer_args += ["--nproc-per-node", str(config.trainer_procs)]
    rollout_args = [
        "serve",
        "--model",
        str(model),
        "--recipe",
        config.recipe,
        "--port",
        "0",
        "--dtype",
        dtype,
    ]
    rollout_args += ["--kv-cache-gib", str(config.kv_cache_gib)]
    rollout_security = security_for(secrets_dir(run_dir), "replica", config.tls)
    rollout_args += as_sets({"seed": config.seed, "security": rollout_security.model_dump(mode="json")})
    env = {**os.environ, "PYTHONUNBUFFERED": "1", PARENT_ENV: str(os.getpid())}
    trainer = Child("trainer", python_module("trainer_service.cli", *trainer_args), logs / "trainer.log", env)
    stack.callback(trainer.stop)
    rollout = Child("rollout", python_module("rollout_service.cli", *rollout_args), logs / "rollout.log", env)
    stack.callback(rollout.stop)
    children |= {"trainer": trainer.pid, "rollout": rollout.pid}
    if watched is not None:
        watched += [trainer, rollout]
    trainer_address, rollout_address = trainer.bound_address(), rollout.bound_address()
    wait_healthy(trainer, trainer_address, "trainer", me)
    wait_healthy(rollout, rollout_address, "rollout", me)
    return redis_url, trainer_address, [rollout_address], me
