"""`coordinator start --launcher ray` on a real 2-node Ray cluster of this machine (tests/ray_cluster.py):
the trainer's 2 ranks as a placement group, replicas spread over both nodes. The second node is lost
mid-run, every process of it killed at once: a replica Ray brings back on the remaining node, or a
trainer rank, after which the run's processes start again and resume from the last checkpoint. Every
step is recorded once either way."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.metrics import read_metrics
from tests.ray_cluster import RayCluster, ray_cluster, unavailable
from tests.support import SHORT_RUN, child_process, coordinator_start, wait_for_line

pytestmark = [pytest.mark.slow, pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))]


@pytest.fixture(scope="module")
def cluster() -> Iterator[RayCluster]:
    """The head (4 CPUs); each test adds the second node (2 CPUs), which it may lose."""
    with ray_cluster({"head": 4}) as made:
        yield made


def node_ids(cluster: RayCluster) -> dict[str, str]:
    """Node name (its custom resource) -> the first 12 characters of its live Ray node ID."""
    code = f"import ray; ray.init(address={cluster.address!r}, logging_level='ERROR')\n"
    code += "for n in ray.nodes():\n    if n['Alive']: print(n['NodeID'][:12], *n['Resources'])"
    out = subprocess.run([*cluster.prefix(), sys.executable, "-c", code], capture_output=True, text=True)
    return {
        name: line.split()[0]
        for line in out.stdout.splitlines()
        for name in ("head", "second")
        if name in line.split()
    }


def ray_run(cluster: RayCluster, run_dir: Path, *extra: str) -> list[str]:
    return [
        *cluster.prefix(),
        *coordinator_start(
            run_dir,
            *("--launcher", "ray", "--ray-address", cluster.address, "--trainer-procs", "2"),
            *("--recipe", "fp8", "--steps", "4", "--run-id", "ray", *SHORT_RUN, *extra),
        ),
    ]


def placements(log: Path) -> dict[int, str]:
    """Replica -> the node it was first placed on, as the coordinator said."""
    found = re.findall(r"replica (\d+) on node (\w+)", log.read_text())
    return {int(i): node for i, node in reversed(found)}


def assert_no_secret_in_any_command_line(secrets: Path) -> None:
    """The actors got their secrets as values and keep them in files: no process shows one in argv."""
    names = ("trainer.token", "replica.token", "registration.key", "update-signing.key", "replica.key")
    values = [(secrets / name).read_bytes().strip() for name in names]
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes()
        except OSError:
            continue  # (gone meanwhile)
        assert not any(value in argv for value in values), cmdline


def test_a_replica_on_a_lost_node_comes_back_on_the_remaining_one(cluster, tmp_path):
    cluster.add_node("second", 2)
    ids = node_ids(cluster)
    run_dir, log = tmp_path / "run", tmp_path / "coordinator.log"
    args = ray_run(cluster, run_dir, "--replicas", "2", "--set", "ray.replica_restart_wait_s=300")
    with child_process(args, log) as proc:
        wait_for_line(proc, log, r"ray: trainer at", timeout=900)  # (every replica is placed by then)
        assert_no_secret_in_any_command_line(run_dir / "secrets")
        placed = placements(log)
        assert set(placed.values()) == {ids["head"], ids["second"]}, (ids, placed)  # spread
        lost = next(i for i, node in placed.items() if node == ids["second"])
        wait_for_line(proc, log, r"step 1/4", timeout=600)
        cluster.lose("second")
        back = wait_for_line(proc, log, rf"replica {lost} is back, on node (\w+)", timeout=600)
        assert back[1] == ids["head"]
        assert proc.wait(timeout=600) == 0, log.read_text()[-4000:]
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4], log.read_text()[-4000:]
    # Steps 2 to 4 waited for it (replica_restart_wait_s): each version reached both replicas.
    assert [r["sync_replicas"] for r in records[1:]] == [2, 2, 2, 2], records


def test_a_trainer_rank_on_a_lost_node_restarts_the_ranks_from_the_checkpoint(cluster, tmp_path):
    cluster.add_node("second", 2)
    ids = node_ids(cluster)
    run_dir, log = tmp_path / "run", tmp_path / "coordinator.log"
    # SPREAD: a rank on each node, as far as they go (PACK would keep both on the head).
    args = ray_run(cluster, run_dir, "--replicas", "1", "--set", "ray.trainer_strategy=SPREAD")
    with child_process(args, log) as proc:
        ranks = wait_for_line(proc, log, r"rank\(s\) on node\(s\) ([\w, ]+);", timeout=900)
        assert set(ranks[1].split(", ")) == {ids["head"], ids["second"]}, (ids, ranks[0])
        wait_for_line(proc, log, r"step 1/4", timeout=900)
        cluster.lose("second")
        wait_for_line(proc, log, r"trainer rank \d \(\w+\) died; restarting \(1/3\)", timeout=600)
        assert proc.wait(timeout=900) == 0, log.read_text()[-4000:]
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4], log.read_text()[-4000:]
