"""`coordinator start --consistency exact` end to end (embedded: redis-server, the trainer and a replica
as real processes): every step of the run records no divergence at all, under fp8 and under bf16."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from coordinator.metrics import read_metrics
from tests.support import SHORT_RUN, coordinator_start

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("recipe", ["fp8", "bf16"])
def test_every_step_of_an_exact_run_records_zero_divergence(
    recipe: str, tiny_model_dir_f32: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    args = ["--model", str(tiny_model_dir_f32), "--steps", "3", "--run-id", "exact"]
    args += ["--group-size", "8", "--max-tokens", "8", "--consistency", "exact"]
    proc = subprocess.run(
        coordinator_start(run_dir, "--recipe", recipe, *SHORT_RUN, *args),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    trained = [r for r in read_metrics(run_dir) if "gen_kl_error" in r]
    assert [r["step"] for r in trained] == [1, 2, 3]
    for record in trained:  # (the mean of exp|prev - gen| is 1.0 only if every token's difference is 0)
        assert record["gen_kl_error"] == 0.0 and record["token_mult_prob_error"] == 1.0, record
        assert record["is_weight_min"] == record["is_weight_max"] == 1.0, record
    assert json.loads((run_dir / "summary.json").read_text())["consistency"] == "exact"
    assert json.loads((run_dir / "run.json").read_text())["consistency"] == "exact"
    assert "consistency exact" in proc.stdout
