"""A mixture-of-experts model end to end: a random-init Qwen3-MoE (tests/families.QWEN3_MOE, float32)
trained with ``--recipe fp8`` by the embedded coordinator on the chat arithmetic task: every expert GEMM
FP8 in both engines, the experts shipped per expert and refitted in vLLM at every step, every step
recorded once with token_mult_prob_error inside the dense families' band and its routing mismatch (the
rollout's routed experts against the trainer's routers), the routers recorded as kept in high
precision."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from coordinator.metrics import read_metrics
from tests.families import QWEN3_MOE, write_checkpoint
from tests.support import coordinator_start

pytestmark = pytest.mark.slow


def test_a_qwen3_moe_trains_under_fp8(smollm2_dir: Path, tmp_path: Path) -> None:
    model = write_checkpoint(QWEN3_MOE, smollm2_dir, tmp_path / "qwen3-moe")
    run_dir = tmp_path / "run"
    args = coordinator_start(run_dir, "--recipe", "fp8", "--model", str(model), "--task", "arith-chat")
    args += ["--steps", "2", "--prompts-per-step", "4", "--group-size", "2", "--max-tokens", "8"]
    args += ["--val-every", "0"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=900)
    out = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, out
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2], out
    # The band of the dense families (tests/integration/test_architectures.py), after a refit each step.
    errors = [r["token_mult_prob_error"] for r in records[1:]]
    assert all(1 <= e <= 1.01 for e in errors), errors
    mismatch = [r["routing_mismatch"] for r in records[1:]]
    assert all(0 <= m < 0.05 for m in mismatch), mismatch  # (measured: 0)
    run = json.loads((run_dir / "run.json").read_text())
    assert run["linears"]["high_precision_per_layer"] == ["mlp.gate"], run["linears"]
    assert "mlp.gate" in json.loads((run_dir / "summary.json").read_text())["linears"]
