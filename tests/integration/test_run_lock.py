"""One coordinator per run directory: a second `coordinator start` on a run being driven exits 3 before
it starts anything (two embedded coordinators once each started a redis-server on the same AOF files)."""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

from coordinator.run import lock_run_dir


def test_a_second_coordinator_on_a_driven_run_exits_3_before_starting_anything(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    args = [sys.executable, "-m", "coordinator.cli", "start", "--run-id", "locked", "--run-dir", str(run_dir)]
    with ExitStack() as stack:
        assert lock_run_dir(run_dir, stack) is None  # this test process drives the run
        proc = subprocess.run([*args, "--steps", "1"], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 3, proc.stderr
        assert f"driven by another coordinator (pid {os.getpid()}" in proc.stderr
        assert sorted(p.name for p in run_dir.iterdir()) == ["coordinator.lock"]  # no redis, no run.json
        with ExitStack() as other:
            assert lock_run_dir(run_dir, other) == str(os.getpid())
    with ExitStack() as stack:  # released with its holder
        assert lock_run_dir(run_dir, stack) is None
