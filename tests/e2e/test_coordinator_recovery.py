"""Distributed mode against separately started services, all speaking mutual TLS with tokens and signed
updates: replica discovery through Redis, one coordinator per run, and recovery when the trainer (from an
older checkpoint), the rollout replica (fresh weights) and Redis (from its AOF) all restart."""

from __future__ import annotations

import json
import subprocess
import time
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path

import pytest
import redis

from coordinator.state import RunStore
from fp8rl.run_secrets import security_for
from tests.support import SHORT_RUN, coordinator, free_port, redis_server, service_process

pytestmark = pytest.mark.slow


def restartable(service: AbstractContextManager[object]) -> ExitStack:
    """``service`` entered in a stack of its own, which the test closes to stop it (and the outer stack
    closes again, harmlessly, on the way out)."""
    stack = ExitStack()
    stack.enter_context(service)
    return stack


def secured(secrets: Path, role: str) -> list[str]:
    """``--set security=...``: mutual TLS, bearer tokens and signed updates, as ``role`` of the run."""
    return ["--set", f"security={json.dumps(security_for(secrets, role, tls=True).model_dump(mode='json'))}"]


def serve_trainer(model: Path, port: int, ckpt: Path, log: Path) -> AbstractContextManager[object]:
    args = ["--recipe", "fp8", "--compute-dtype", "float32", "--checkpoint-dir", str(ckpt), "--resume"]
    args += [
        "--set",
        "checkpoint_every=4",
        "--set",
        "optimizer.lr=1e-4",
        *secured(log.parent / "secrets", "trainer"),
    ]
    return service_process("trainer_service.cli", model, log, *args, port=port)


def serve_rollout(model: Path, port: int, redis_url: str, log: Path) -> AbstractContextManager[object]:
    args = ["--recipe", "fp8", "--dtype", "float32", "--redis-url", redis_url]
    args += [
        "--advertise",
        f"127.0.0.1:{port}",
        "--set",
        "heartbeat_s=0.5",
        *secured(log.parent / "secrets", "replica"),
    ]
    return service_process("rollout_service.cli", model, log, *args, port=port)


def run_coordinator(redis_url: str, trainer: str, steps: int, log: Path) -> subprocess.CompletedProcess[str]:
    args = coordinator("start", "--redis-url", redis_url, "--trainer", trainer)
    args += secured(log.parent / "secrets", "coordinator")
    args += ["--run-id", "dist", "--run-dir", str(log.parent / "run"), "--steps", str(steps)]
    args += [*SHORT_RUN, "--progress", "plain"]
    return subprocess.run(args, capture_output=True, text=True, timeout=600)


def test_recovery_from_every_service_restart(tiny_model_dir_f32: Path, tmp_path: Path) -> None:
    redis_port, trainer_port, rollout_port = free_port(), free_port(), free_port()
    redis_url, trainer = f"redis://127.0.0.1:{redis_port}/0", f"127.0.0.1:{trainer_port}"
    data, ckpt = tmp_path / "redis", tmp_path / "ckpt"
    data.mkdir()
    model = tiny_model_dir_f32
    with ExitStack() as stack:
        redis_stack = stack.enter_context(restartable(redis_server(data, redis_port, aof=True)))
        trainer_stack = stack.enter_context(
            restartable(serve_trainer(model, trainer_port, ckpt, tmp_path / "t1.log"))
        )
        rollout_stack = stack.enter_context(
            restartable(serve_rollout(model, rollout_port, redis_url, tmp_path / "r1.log"))
        )
        # Discovery: no --rollout given; the replica registered itself.
        first = run_coordinator(redis_url, trainer, 6, tmp_path / "c1.log")
        assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]

        # A second coordinator on a run that is being driven exits with a clear message.
        client = redis.Redis.from_url(redis_url)
        client.set("fp8rl:run:dist:lease", "someone-else", px=60_000)
        second = run_coordinator(redis_url, trainer, 8, tmp_path / "c2.log")
        assert second.returncode == 3 and "driven by another coordinator" in second.stderr
        client.delete("fp8rl:run:dist:lease")

        # Everything restarts: the trainer from its step-4 checkpoint (the run is at 6), the replica with
        # fresh weights, Redis from its AOF.
        trainer_stack.close()
        rollout_stack.close()
        redis_stack.close()
        stack.enter_context(redis_server(data, redis_port, aof=True, log="redis2.log"))
        stack.enter_context(serve_trainer(model, trainer_port, ckpt, tmp_path / "t2.log"))
        stack.enter_context(serve_rollout(model, rollout_port, redis_url, tmp_path / "r2.log"))
        time.sleep(1.5)  # the old replica's registration has expired; the new one's is fresh
        third = run_coordinator(redis_url, trainer, 8, tmp_path / "c3.log")
        assert third.returncode == 0, third.stdout[-3000:] + third.stderr[-3000:]
        assert "rewound" in third.stdout

        store = RunStore(redis.Redis.from_url(redis_url), "dist")
        steps = [r["step"] for r in store.metrics()]
        assert steps == list(range(9))  # steps 5 and 6 retrained after the rewind to 4, recorded once
        assert store.read().step == 8
        kinds = [e["kind"] for e in store.events()]
        assert "recovery" in kinds
        heals = [e for e in store.events() if e["kind"] == "heal"]
        assert heals and "sent keyframe" in heals[0]["detail"]  # the fresh replica was detected and healed
        assert json.loads(sorted(ckpt.glob("step-*"))[-1].joinpath("trainer.json").read_text())["step"] == 8
