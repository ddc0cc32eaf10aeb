"""`coordinator start --env module:factory` end to end: an embedded run on the tiny model whose episodes
play two turns against the replica's episode URLs; each episode becomes one sample whose loss mask
covers the policy's tokens only, and every step appears once. The run is exact (`--consistency
exact`): the logprobs recorded turn by turn must be the trainer's to the bit, so a token or a logprob
misplaced in an episode's record shows."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from coordinator.metrics import read_metrics
from tests.support import coordinator_start

pytestmark = pytest.mark.slow


def test_a_multi_turn_environment_trains_from_recorded_episodes(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = coordinator_start(run_dir, "--env", "tests.envs.arith_retry:ArithRetry", "--consistency", "exact")
    args += ["--steps", "3", "--prompts-per-step", "6", "--group-size", "4", "--max-tokens", "4"]
    args += ["--val-every", "2"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=400)
    out = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, out
    assert "Traceback" not in out, out
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2, 3], records
    steps = records[1:]
    for r in steps:
        # One sample per episode (every second turn extends its first), 24 episodes a step.
        assert r["episode_samples"] == 24 and 1 <= r["episode_turns_mean"] <= 2, r
        # The trainer trained and measured the policy's tokens only: what the episodes sampled.
        assert r["trained_tokens"] == r["rollout_tokens"] > 0, r
        assert r["token_mult_prob_error"] == 1.0 and r["gen_kl_error"] == 0.0, r
    # Some episodes took a second turn, whose prompt holds the environment's tokens (not trained).
    assert any(r["episode_turns_mean"] > 1 for r in steps), steps
    assert "val_accuracy" in records[0] and "val_accuracy" in records[2]
