"""deploy/kubernetes's CPU overlay played for real on podman (`podman kube play`, 4.3), in the closest
form podman runs (scripts/podman_kube.py, tests/kube_play.py): Redis, the trainer as 2 pods (2 torchrun
nodes), 2 replicas and the coordinator's Job pod, each from the manifests' own commands, images, configs
and secrets. A trainer pod is killed mid-run, its network with it; the other's rank sees its heartbeats
stop and leaves the group, its pod restarts it (restartPolicy Always), the killed pod is played again
(the StatefulSet's controller, by hand), and the ranks resume from the checkpoint on the shared volume;
a coordinator that failed with the trainer's step is started again, as its Job would. Every step once.
Nothing is left after teardown."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from coordinator.metrics import read_metrics
from tests.containers import IMAGE_BUILD, base_images, build_image, container_engine, podman_usable
from tests.kube_play import played, wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not podman_usable(), reason="podman kube play needs podman and runc, as root"),
]

STEPS = 4
# The Job's own arguments, with a short run's shape (the manifests train 60 steps of 32 x 8 samples).
COORDINATOR = [
    "start",
    "--config=/config/coordinator.yaml",
    f"--steps={STEPS}",
    "--run-id=kubernetes",
    "--run-dir=/runs/kubernetes",
    "--redis-url=$(REDIS_URL)",
    "--trainer=trainer:50052",
    "--progress=plain",
    *("--prompts-per-step=16", "--group-size=8", "--val-every=0", "--set", "val_size=8"),
]


def test_the_cpu_overlay_plays_on_podman_and_resumes_after_a_trainer_pod_is_killed(request, tmp_path):
    with container_engine(tmp_path) as engine:  # (the image: the session's background build, or here)
        if engine.cli != "podman":
            pytest.skip("kube play needs podman (Docker answers here)")
        if background := request.config.stash.get(IMAGE_BUILD, None):
            background.bases()
        else:
            build_image(engine, base_images(engine), tmp_path)
    with played({"coordinator": COORDINATOR}) as play:
        for pod in ("redis-0", "trainer-0", "trainer-1", "rollout-0", "rollout-1", "coordinator"):
            play.play(pod)
        wait_for(play, "coordinator", "coordinator", r"step 1/4", timeout=900, every=0.5)
        play.podman("pod", "kill", "trainer-1")  # (its network goes with it: no connection closes)
        # Rank 0 leaves the broken group (a collective fails, or rank 1's heartbeats stop), and its pod
        # starts it again (restartPolicy Always).
        deadline = time.monotonic() + 300
        while play.restarts("trainer-0", "trainer") < 1:
            assert time.monotonic() < deadline, play.logs("trainer-0", "trainer")[-3000:]
            time.sleep(2)
        play.play("trainer-1")  # (the StatefulSet's controller, by hand)
        twice = r"(?s)serving on .*serving on \S+ at step \d+"
        logs = wait_for(play, "trainer-0", "trainer", twice, timeout=600)
        resumed_at = int(re.findall(r"serving on \S+ at step (\d+)", logs)[-1])
        # The coordinator's pod fails if the trainer's does mid-step; its Job starts another, which
        # resumes the run from Redis (tests/kube_play.py does what the Job controller would).
        status, attempts = play.run_job("coordinator", timeout=900)
        log = "".join(attempts)
        assert status == 0, log[-4000:]
        volume = play.podman("volume", "inspect", "fp8rl-runs", "--format", "{{.Mountpoint}}").stdout
        records = read_metrics(Path(volume.strip()) / "kubernetes")
        names = play.names()
    assert [r["step"] for r in records] == list(range(STEPS + 1)), log[-4000:]  # every step once
    assert resumed_at >= 1, logs[-3000:]  # from a checkpoint on the shared volume, not from scratch
    assert not play.left_over(names), play.left_over(names)  # nothing left: pods, volumes, network, secret
