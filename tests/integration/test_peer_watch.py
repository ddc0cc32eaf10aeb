"""The trainer ranks' peer watch (trainer_service/distributed.py) on a real two-rank gloo group, with the
loss deadline cut to seconds: a rank waiting at leave_group's barrier, or exited, is no lost peer however
long the other takes to follow, and one that stops beating without leaving (its host frozen) ends the
group, its peer working or at the barrier."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from tests.support import child_process, free_port

LOST_S = 3.0
RANK = f"""
import os, signal, sys, time
from trainer_service import distributed
distributed.PEER_LOST_S, distributed.HEARTBEAT_S = {LOST_S}, 0.25
ranks = distributed.join_group("cpu")
print("joined", flush=True)
scenario, peer_away_s = sys.argv[1], 3 * {LOST_S}
if scenario == "leave":  # rank 1 waits at the barrier while rank 0 works on
    if ranks.rank == 0:
        time.sleep(peer_away_s)
    distributed.leave_group()
elif scenario == "exit":  # rank 1 ends without leave_group (a follower stopped by rank 0's stop)
    if ranks.rank == 0:
        time.sleep(peer_away_s)
    else:
        sys.exit(0)
elif scenario.startswith("freeze"):  # rank 1 stops dead, its connections open: a host lost
    if ranks.rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    if scenario == "freeze-at-barrier":
        distributed.leave_group()
    time.sleep(10 * peer_away_s)
print("done", flush=True)
"""


@contextmanager
def two_ranks(scenario: str, tmp_path: Path) -> Iterator[list[tuple[subprocess.Popen, Path]]]:
    port = str(free_port())
    with ExitStack() as stack:
        ranks = []
        for rank in range(2):
            env = os.environ | {
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                "WORLD_SIZE": "2",
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
            }
            log = tmp_path / f"rank{rank}.log"
            args = [sys.executable, "-c", RANK, scenario]
            ranks.append((stack.enter_context(child_process(args, log, env)), log))
        try:
            yield ranks
        finally:
            for proc, _ in ranks:  # (a stopped rank ignores SIGTERM until it is killed)
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


@pytest.mark.parametrize("scenario", ["leave", "exit"])
def test_a_rank_that_left_is_not_taken_for_lost(scenario: str, tmp_path: Path) -> None:
    with two_ranks(scenario, tmp_path) as ranks:
        for proc, log in ranks:
            assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
        assert "done" in ranks[0][1].read_text()
        assert "no sign of life" not in ranks[0][1].read_text()


@pytest.mark.parametrize("scenario", ["freeze", "freeze-at-barrier"])
def test_a_rank_that_stops_beating_without_leaving_ends_the_group(scenario: str, tmp_path: Path) -> None:
    """Rank 0 working on, or waiting at leave_group's barrier, when rank 1 freezes."""
    with two_ranks(scenario, tmp_path) as ranks:
        (rank0, log0), (rank1, _) = ranks
        start = time.monotonic()
        assert rank0.wait(timeout=120) == 1, log0.read_text()[-3000:]
        assert time.monotonic() - start < 60  # (long before its sleep of 90 s would have ended)
        assert "rank(s) [1] gave no sign of life" in log0.read_text()
        assert "done" not in log0.read_text() and rank1.poll() is None  # (still frozen)
