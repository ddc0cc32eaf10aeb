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
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coordinator.config import CoordinatorConfig
from coordinator.embedded import (
    EmbeddedProcesses,
    RunExit,
    Services,
    redis_password_file,
)
from fp8rl import models
from fp8rl.config import ConfigError, config_hash
from fp8rl.credentials import (
    PASSWORD_IN_URL,
    has_password,
    redacted,
    redis_url_with_password,
    write_private,
)

if TYPE_CHECKING:
    from coordinator.tasks import Task


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
                embedded = launcher(self.config, self.run_dir, stack) if self.config.is_embedded else None
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
                    what = ", ".join(dead)
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
            addresses = lambda: sorted({*embedded.replica_addresses(), *live_replicas(client)})  # noqa: E731
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
        # (A figure the run has none of, such as routing mismatch on a dense model, and the validation
        # curve stay in summary.json.)
        shown = {k: v for k, v in summary.items() if v is not None and not isinstance(v, dict)}
        sink.say("summary: " + ", ".join(f"{k}={_short(v)}" for k, v in shown.items()))
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


def launcher(config: CoordinatorConfig, run_dir: Path, stack: ExitStack) -> EmbeddedProcesses:
    """An embedded run's processes, where its ``launcher`` puts them."""
    if config.embedded.launcher == "ray":
        from coordinator.ray_launcher import RayProcesses

        return RayProcesses(config, run_dir, stack)
    return EmbeddedProcesses(config, run_dir, stack)
