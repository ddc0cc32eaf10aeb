"""Soak: a 20-step embedded run while a random child (trainer, rollout, redis-server) is killed with
SIGKILL every few steps and a client floods the replica with valid and invalid Generate requests. The
coordinator's supervisor restarts the processes each time; at the end every step appears exactly once,
the trainer's last checkpoint is the run's last step, and no process is left."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import pytest

from coordinator.metrics import read_metrics
from fp8rl.credentials import redis_url_with_password
from fp8rl.run_secrets import security_for
from fp8rl.transport import channel
from fp8rl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from tests.e2e.test_coordinator_run import assert_children_gone
from tests.support import SHORT_RUN, coordinator_start

pytestmark = pytest.mark.slow
STEPS, KILL_AT = 20, (4, 9, 14)


def committed_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) - 1 if path.exists() else -1


def run_info(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "run.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def flood(run_dir: Path, stop: threading.Event, counts: Counter[str]) -> None:
    """Valid and invalid requests, as fast as the replica answers, to whichever replica is current."""
    rng = random.Random(0)
    bad = [
        rollout_pb2.GenerateRequest(
            prompts=[rollout_pb2.Prompt(token_ids=rollout_pb2.TokenIds(ids=[5]))], n=0
        ),
        rollout_pb2.GenerateRequest(
            prompts=[rollout_pb2.Prompt(text="1+1=")],
            sampling=common_pb2.SamplingParams(temperature=float("inf")),
        ),
        rollout_pb2.GenerateRequest(prompts=[rollout_pb2.Prompt(text="9" * 100_000)]),
        rollout_pb2.GenerateRequest(prompts=[rollout_pb2.Prompt(text=f"{i}+1=") for i in range(100)], n=64),
    ]
    good = rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(text="12+34=")], sampling=common_pb2.SamplingParams(max_tokens=4)
    )
    while not stop.is_set():
        rollouts = run_info(run_dir).get("rollouts") or []
        if not rollouts:
            time.sleep(0.2)
            continue
        reader = security_for(run_dir / "secrets", "reader", tls=False)  # the run's tokens exist by now
        with channel(rollouts[0], reader, "rollout") as chan:
            stub = rollout_pb2_grpc.RolloutStub(chan)
            for _ in range(20):
                request = good if rng.random() < 0.5 else rng.choice(bad)
                try:
                    stub.Generate(request, timeout=30)
                    counts["served"] += 1
                except grpc.RpcError as err:
                    counts[err.code().name] += 1
                    if err.code() == grpc.StatusCode.UNAVAILABLE:  # restarting: look again shortly
                        time.sleep(0.1)
                        break
                if stop.is_set():
                    break


def assert_secrets_kept(run_dir: Path) -> None:
    """The embedded redis-server's password is in its 0600 file only: not in run.json (itself 0600), not
    in any child's command line; without it Redis refuses."""
    info_path, password_file = run_dir / "run.json", run_dir / "redis" / "password"
    info = json.loads(info_path.read_text())
    password = password_file.read_text()
    assert len(password) >= 24 and password not in info_path.read_text()
    assert info_path.stat().st_mode & 0o777 == 0o600 and password_file.stat().st_mode & 0o777 == 0o600
    names = ("update-signing.key", "registration.key", "trainer.token")
    secrets = [(run_dir / "secrets" / name).read_text().strip() for name in names]
    for pid in info["children"].values():
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert all(secret.encode() not in cmdline for secret in (password, *secrets))
    for path in (run_dir / "secrets").iterdir():
        assert path.stat().st_mode & 0o777 == 0o600, path
    assert all(secret not in info_path.read_text() for secret in secrets)
    import redis

    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(info["redis_url"]).set("x", 1)
    assert redis.Redis.from_url(
        redis_url_with_password(info["redis_url"], {"REDIS_PASSWORD": password})
    ).ping()


def test_a_run_survives_random_kills_and_a_flood(tiny_model_dir_f32: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [
        "--model",
        str(tiny_model_dir_f32),
        "--steps",
        str(STEPS),
        "--run-id",
        "soak",
    ]
    proc = subprocess.Popen(
        coordinator_start(run_dir, "--recipe", "fp8", *args, "--set", "max_restarts=5", *SHORT_RUN),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    stop, counts, kills = threading.Event(), Counter[str](), []
    flooder = threading.Thread(target=flood, args=(run_dir, stop, counts), daemon=True)
    started = time.monotonic()
    try:
        flooder.start()
        while committed_steps(run_dir) < 1 and proc.poll() is None:
            time.sleep(0.2)
        assert_secrets_kept(run_dir)
        seed = int(os.environ.get("SOAK_SEED", time.time()))  # printed: SOAK_SEED=... replays the order
        victims = random.Random(seed).sample(["trainer", "rollout", "redis-server"], 3)
        print(f"SOAK_SEED={seed}: kills {victims}")
        for at, victim in zip(KILL_AT, victims, strict=True):
            while committed_steps(run_dir) < at and proc.poll() is None:
                time.sleep(0.2)
            assert proc.poll() is None, "the run ended before the kills"
            pid = run_info(run_dir)["children"][victim]
            os.kill(pid, signal.SIGKILL)
            kills.append((victim, committed_steps(run_dir)))
        out, _ = proc.communicate(timeout=900)
    finally:
        stop.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    wall = time.monotonic() - started
    print(f"kills {kills}; requests {dict(counts)}; wall {wall:.0f} s")
    assert proc.returncode == 0, out[-4000:]
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(STEPS + 1))  # every step once, in order
    assert out.count("restarting (") == len(kills)
    # The trainer's own record of where it is: its newest complete checkpoint is the run's last step.
    newest = max(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert newest == f"step-{STEPS:08d}"
    assert counts["served"] > 0 and counts["INVALID_ARGUMENT"] > 0 and counts["RESOURCE_EXHAUSTED"] > 0
    assert_children_gone(run_dir)
