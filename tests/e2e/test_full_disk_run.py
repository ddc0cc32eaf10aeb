"""An embedded run whose trainer checkpoints onto a disk that fills (a 40 MB tmpfs: two checkpoints of the
tiny model fit, the third does not): every step is trained and recorded once, the checkpoints that failed
left nothing behind, and a rerun on the still-full disk resumes from the last complete checkpoint."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from coordinator.metrics import read_metrics
from tests.e2e.test_coordinator_run import assert_children_gone, start_fp8
from tests.support import child_process, fill_disk, tmpfs, wait_for_line
from trainer_service import checkpoint

pytestmark = pytest.mark.slow


def test_a_run_whose_checkpoints_fill_their_disk_trains_every_step_and_resumes(
    tiny_model_dir_f32: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    with tmpfs(run_dir / "checkpoints", "40m") as disk:
        args = start_fp8(tiny_model_dir_f32, 5, "full-disk", run_dir)
        first = subprocess.run(args, capture_output=True, text=True, timeout=900)
        assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
        assert [r["step"] for r in read_metrics(run_dir)] == [0, 1, 2, 3, 4, 5]
        kept = sorted(p.name for p in disk.iterdir())
        assert kept == ["step-00000001", "step-00000002"], kept  # complete ones only, nothing staged
        assert all(checkpoint.verify(disk / name) for name in kept)
        trainer_log = (run_dir / "logs" / "trainer.log").read_text()
        assert "No space left on device" in trainer_log and "retried after the next step" in trainer_log
        assert_children_gone(run_dir)
        # Run again on the still-full disk: the trainer resumes from step 2, the run rewinds to it and
        # trains steps 2-4 again (their checkpoints failing as before), and ends.
        again = subprocess.run(args, capture_output=True, text=True, timeout=900)
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
        assert "rewound" in again.stdout, again.stdout[-3000:]
        assert [r["step"] for r in read_metrics(run_dir)] == [0, 1, 2, 3, 4, 5]
        assert sorted(p.name for p in disk.iterdir()) == kept
        assert "resumed from" in (run_dir / "logs" / "trainer.log").read_text()
        assert_children_gone(run_dir)


def test_a_run_directory_that_fills_stops_the_run_losing_no_step_and_a_rerun_resumes(
    tiny_model_dir_f32: Path, tmp_path: Path
) -> None:
    """The whole run directory (Redis' append-only file, checkpoints, logs, metrics) on a disk that fills
    mid-run: redis-server exits at the first write it cannot make durable, the processes restarted on the
    full disk fail again, and the coordinator exits 1; once there is room, the same command resumes and
    every step is recorded once."""
    run_dir = tmp_path / "run"
    with tmpfs(run_dir, "150m"):
        args = start_fp8(tiny_model_dir_f32, 8, "full-run-dir", run_dir, "--set", "max_restarts=1")
        log = tmp_path / "first.log"
        with child_process(args, log) as proc:
            wait_for_line(proc, log, r"step 2/8", timeout=600)
            fill_disk(run_dir, 0)
            assert proc.wait(timeout=600) == 1
        output = log.read_text(errors="replace")
        assert "redis-server (exit status 1) died; restarting (1/1)" in output, output[-3000:]
        assert_children_gone(run_dir)
        (run_dir / ".ballast").unlink()
        again = subprocess.run(args, capture_output=True, text=True, timeout=900)
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
        assert [r["step"] for r in read_metrics(run_dir)] == list(range(9))
        assert_children_gone(run_dir)
