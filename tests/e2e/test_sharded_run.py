"""The embedded run with a sharded trainer (two ranks under torchrun): a rank killed mid-run ends the group,
the run restarts it and carries on with every step once; the same run then resumes on one rank."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from coordinator.metrics import read_metrics
from tests.e2e.test_coordinator_run import assert_children_gone, start_fp8
from tests.support import child_process, wait_for_line


@pytest.mark.slow
def test_an_embedded_run_on_two_ranks_survives_a_killed_rank_and_resumes_on_one(
    tiny_model_dir_f32: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    log = tmp_path / "coordinator.log"
    with child_process(
        start_fp8(tiny_model_dir_f32, 3, "ranks", run_dir, "--trainer-procs", "2"), log
    ) as proc:
        wait_for_line(proc, log, r"step 1/3", timeout=600)
        torchrun = json.loads((run_dir / "run.json").read_text())["children"]["trainer"]
        ranks = [int(p) for p in Path(f"/proc/{torchrun}/task/{torchrun}/children").read_text().split()]
        assert len(ranks) == 2
        os.kill(ranks[-1], signal.SIGKILL)  # one rank, mid-run: torchrun ends the group, the run restarts it
        assert proc.wait(timeout=900) == 0, log.read_text()[-3000:]
    out = log.read_text()
    assert "trainer (exit status" in out and "restarting (1/" in out
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1, 2, 3]  # nothing skipped, nothing twice
    assert list((run_dir / "checkpoints").glob("step-*/shards"))
    assert_children_gone(run_dir)
    # The same run, one step more, on one rank: the two ranks' checkpoint is resharded.
    more = start_fp8(tiny_model_dir_f32, 4, "ranks", run_dir, "--trainer-procs", "1")
    again = subprocess.run(more, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1, 2, 3, 4]
    assert "resumed from" in (run_dir / "logs" / "trainer.log").read_text()
