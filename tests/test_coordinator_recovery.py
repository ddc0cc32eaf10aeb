"""Distributed mode against separately started services: replica discovery through Redis, one
coordinator per run, and recovery when the trainer (from an older checkpoint), the rollout replica
(fresh weights) and Redis (from its AOF) all restart."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import pytest
import redis

from coordinator.state import RunStore
from tests.support import child_process, free_port, wait_for_line

pytestmark = pytest.mark.slow


def start_redis(stack: ExitStack, data: Path, port: int, log: Path) -> ExitStack:
    inner = ExitStack()
    args = [
        "redis-server",
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--dir",
        str(data),
        "--appendonly",
        "yes",
        "--appendfsync",
        "always",
        "--save",
        "",
    ]
    proc = inner.enter_context(child_process(args, log))
    wait_for_line(proc, log, r"Ready to accept connections", timeout=30)
    stack.push(inner)
    return inner


def start_trainer(model: Path, port: int, ckpt: Path, log: Path) -> ExitStack:
    stack = ExitStack()
    args = [
        sys.executable,
        "-m",
        "trainer_service.cli",
        "serve",
        "--model",
        str(model),
        "--recipe",
        "fp8",
        "--port",
        str(port),
        "--compute-dtype",
        "float32",
        "--checkpoint-dir",
        str(ckpt),
        "--resume",
        "--set",
        "checkpoint_every=4",
        "--set",
        "optimizer.lr=1e-4",
    ]
    proc = stack.enter_context(child_process(args, log))
    wait_for_line(proc, log, r"serving on", timeout=120)
    return stack


def start_rollout(model: Path, port: int, redis_url: str, log: Path) -> ExitStack:
    stack = ExitStack()
    args = [
        sys.executable,
        "-m",
        "rollout_service.cli",
        "serve",
        "--model",
        str(model),
        "--recipe",
        "fp8",
        "--dtype",
        "float32",
        "--port",
        str(port),
        "--redis-url",
        redis_url,
        "--advertise",
        f"127.0.0.1:{port}",
        "--set",
        "heartbeat_s=0.5",
    ]
    proc = stack.enter_context(child_process(args, log))
    wait_for_line(proc, log, r"serving on", timeout=300)
    return stack


def run_coordinator(redis_url: str, trainer: str, steps: int, log: Path) -> subprocess.CompletedProcess[str]:
    args = [
        sys.executable,
        "-m",
        "coordinator.cli",
        "start",
        "--redis-url",
        redis_url,
        "--trainer",
        trainer,
        "--run-id",
        "dist",
        "--run-dir",
        str(log.parent / "run"),
        "--steps",
        str(steps),
        "--prompts-per-step",
        "4",
        "--group-size",
        "4",
        "--max-tokens",
        "4",
        "--val-every",
        "0",
        "--set",
        "val_size=8",
        "--progress",
        "plain",
    ]
    return subprocess.run(args, capture_output=True, text=True, timeout=600)


def test_recovery_from_every_service_restart(tiny_model_dir_f32: Path, tmp_path: Path) -> None:
    redis_port, trainer_port, rollout_port = free_port(), free_port(), free_port()
    redis_url, trainer = f"redis://127.0.0.1:{redis_port}/0", f"127.0.0.1:{trainer_port}"
    data, ckpt = tmp_path / "redis", tmp_path / "ckpt"
    data.mkdir()
    with ExitStack() as stack:
        redis_stack = start_redis(stack, data, redis_port, tmp_path / "redis.log")
        trainer_stack = stack.enter_context(
            start_trainer(tiny_model_dir_f32, trainer_port, ckpt, tmp_path / "t1.log")
        )
        rollout_stack = stack.enter_context(
            start_rollout(tiny_model_dir_f32, rollout_port, redis_url, tmp_path / "r1.log")
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
        start_redis(stack, data, redis_port, tmp_path / "redis2.log")
        stack.enter_context(start_trainer(tiny_model_dir_f32, trainer_port, ckpt, tmp_path / "t2.log"))
        stack.enter_context(start_rollout(tiny_model_dir_f32, rollout_port, redis_url, tmp_path / "r2.log"))
        time.sleep(1.5)  # the old replica's registration has expired; the new one's is fresh
        third = run_coordinator(redis_url, trainer, 8, tmp_path / "c3.log")
        assert third.returncode == 0, third.stdout[-3000:] + third.stderr[-3000:]
        assert "rewound" in third.stdout

        store = RunStore(redis.Redis.from_url(redis_url), "dist")
        steps = [r["step"] for r in store.metrics()]
        assert steps == [0, 1, 2, 3, 4, 5, 6, 5, 6, 7, 8]  # steps 5 and 6 retrained after the rewind to 4
        assert store.read().step == 8
        kinds = [e["kind"] for e in store.events()]
        assert "recovery" in kinds
        heals = [e for e in store.events() if e["kind"] == "heal"]
        assert heals and "sent keyframe" in heals[0]["detail"]  # the fresh replica was detected and healed
        assert json.loads(sorted(ckpt.glob("step-*"))[-1].joinpath("trainer.json").read_text())["step"] == 8
