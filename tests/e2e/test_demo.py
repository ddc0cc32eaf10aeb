"""The demo's pieces end to end: the base model's builder (deterministic, checking its own
postconditions) and a short fp8 run from the shipped base model that raises validation accuracy."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.metrics import read_metrics
from fp8rl import models
from fp8rl.tiny import score_base_model
from tests.support import coordinator_start

pytestmark = pytest.mark.slow


def build_base_model(out: Path) -> dict:
    """Builds on the shipped model's kernels where this CPU has them (its ATen path and thread count;
    OpenMP's threads sleep rather than spin while they wait, for whatever else runs beside)."""
    import torch

    shipped = models.read_manifest(models.TINY_ARITH)["built_on"]
    kernels = {"OMP_NUM_THREADS": str(shipped["threads"]), "OMP_WAIT_POLICY": "PASSIVE"}
    # (torch takes any x86 level it is told, and a CPU without it dies of SIGILL: only one it has)
    levels = ("DEFAULT", "AVX2", "AVX512")
    wanted, here = shipped["aten_cpu_capability"], torch.backends.cpu.get_cpu_capability()
    if wanted in levels and here in levels and levels.index(wanted) <= levels.index(here):
        kernels["ATEN_CPU_CAPABILITY"] = wanted.lower()
    proc = subprocess.run(
        [sys.executable, "-m", "fp8rl.tiny", "--out", str(out), "--trained"],
        capture_output=True,
        text=True,
        timeout=400,
        env={**os.environ, **kernels},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip() == str(out)  # progress goes to stderr
    return models.read_manifest(models.verified(out))


def test_base_model_builder_is_deterministic_and_checks_its_postconditions(tmp_path: Path) -> None:
    """Builds on one machine are byte-identical: on the kernels the shipped model was built with (asked
    for, where this CPU has them), one build is the shipped bytes; on others (another CPU's kernels may
    build another model) two builds agree. And what the manifest claims is what the model scores."""
    import torch
    from transformers import AutoModelForCausalLM

    first = build_base_model(tmp_path / "a")
    shipped = models.read_manifest(models.TINY_ARITH)
    if first["built_on"] == shipped["built_on"]:  # the shipped model's own kernels: the same bytes
        assert first == shipped
    else:
        print(f"built on {first['built_on']}, shipped from {shipped['built_on']}: bytes may differ")
        assert first == build_base_model(tmp_path / "b")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "a", dtype=torch.float32)
    score = score_base_model(model, first["validation"]["pairs"])
    assert (score.greedy, score.known) == (first["validation"]["greedy"], first["validation"]["known"])
    assert score.misses() == []


def test_short_fp8_run_raises_validation_accuracy(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = coordinator_start(run_dir, "--recipe", "fp8", "--steps", "40", "--val-every", "0")
    args += ["--set", "val_size=256"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = read_metrics(run_dir)
    base, final = records[0]["val_accuracy"], records[-1]["val_accuracy"]
    assert final >= base + 0.15, f"val accuracy {base} -> {final}"
    assert "summary:" in proc.stdout and "final_val_accuracy" in proc.stdout
