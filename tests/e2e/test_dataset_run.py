"""`coordinator start --task dataset` end to end with math-verify installed: the embedded run on the shipped
tiny model, a dataset of sums (whose reference answers only math-verify's numeric comparison accepts) and
GSM8K sample rows, more prompts per step than training rows (so rows repeat within a step under ids of
their own) and the default validation size (held out at most half the rows)."""

from __future__ import annotations

import importlib.util
import json
import random
import subprocess
from pathlib import Path

import pytest

from coordinator.metrics import read_metrics
from fp8rl import arith
from fp8rl.data import GSM8K_SAMPLE
from tests.support import coordinator_start

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("math_verify") is None, reason="math-verify is part of the dev extra"
    ),
]


def test_a_dataset_run_scores_with_math_verify_off_the_main_thread(tmp_path: Path) -> None:
    # Sums the tiny model learnt, answered "46.0": math-verify finds "46" equal, exact match would not.
    sums = [
        {"question": arith.prompt(a, b), "answer": f"{a + b}.0"}
        for a, b in arith.train_pairs(random.Random(0), 24)
    ]
    gsm8k = [json.loads(line) for line in GSM8K_SAMPLE.read_text().splitlines()[:8]]
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in sums + gsm8k))  # 32 rows: 16 validate
    run_dir = tmp_path / "run"
    args = coordinator_start(run_dir, "--task", "dataset", "--dataset", str(data), "--prompt-key", "question")
    args += ["--steps", "2", "--prompts-per-step", "20", "--group-size", "4", "--max-tokens", "4"]
    args += ["--val-every", "0"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    out = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, out
    assert "threaded environment" not in out and "Traceback" not in out, out
    assert "validation holds out 16 of the 32 rows, not val_size 128" in proc.stderr
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2]  # 20 prompts of 16 rows: repeats, ids of their own
    assert all(r["reward_failures"] == 0 for r in records[1:])
    # Scored by math-verify: exact match scores "46" against "46.0" as 0, so every reward would be 0.
    assert records[0]["val_accuracy"] > 0 and max(r["reward_mean"] for r in records[1:]) > 0, records
