"""The demo's pieces end to end: the trained base model (deterministic, in the accuracy window RL needs)
and a short fp8 run from it that raises validation accuracy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.metrics import read_metrics
from coordinator.model import default_model
from fp8rl import arith

pytestmark = pytest.mark.slow


def greedy_val_answers(model_dir: Path, count: int = 256) -> list[tuple[str, str]]:
    """(greedy answer, right answer) for ``count`` validation pairs."""
    import torch
    from transformers import AutoModelForCausalLM

    from fp8rl.tiny import greedy_answer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return [(greedy_answer(model, a, b), arith.answer(a, b)) for a, b in arith.val_pairs(0, count)]


def test_trained_base_model_is_deterministic_and_leaves_rl_room(tmp_path: Path) -> None:
    built = tmp_path / "base"
    proc = subprocess.run(
        [sys.executable, "-m", "fp8rl.tiny", "--out", str(built), "--trained"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    cached = default_model(say=lambda _: None)  # built by the coordinator's own path (or cached)
    assert (built / "model.safetensors").read_bytes() == (cached / "model.safetensors").read_bytes()
    answers = greedy_val_answers(built)
    accuracy = sum(got == right for got, right in answers) / len(answers)
    assert 0.2 <= accuracy <= 0.6
    # The room RL has: the model knows far more sums than it answers without a hedge ("108?").
    known = sum(got.removesuffix("?") == right for got, right in answers) / len(answers)
    assert known >= accuracy + 0.2, (accuracy, known)


def test_short_fp8_run_raises_validation_accuracy(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "coordinator.cli", "start", "--recipe", "fp8", "--steps", "40"]
    args += ["--val-every", "0", "--set", "val_size=256", "--run-dir", str(run_dir), "--progress", "plain"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = read_metrics(run_dir)
    base, final = records[0]["val_accuracy"], records[-1]["val_accuracy"]
    assert final >= base + 0.15, f"val accuracy {base} -> {final}"
    assert "summary:" in proc.stdout and "final_val_accuracy" in proc.stdout
