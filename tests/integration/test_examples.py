"""The examples of docs/rewards-and-environments.md, as printed there, run as the coordinator runs them:
the reward in its workers, the environment's episodes against the real replica's face."""

from __future__ import annotations

from pathlib import Path

from coordinator.config import TaskConfig
from coordinator.environments import EpisodeRunner, load_environment
from coordinator.problems import Problem
from coordinator.tasks import CustomReward, DatasetTask
from tests.conftest import InProcessRollout
from tests.integration.test_user_code import play_twice_each

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "rewards-and-environments.md").read_text()


def test_the_page_prints_the_examples_as_they_are() -> None:
    for example in ("reward.py", "environment.py"):
        assert (ROOT / "examples" / example).read_text().rstrip() in PAGE


def test_the_example_reward_scores_in_its_workers() -> None:
    problem = Problem("row-0", "How many?", "Natalia sold 48 clips.\n#### 72")
    rows = DatasetTask([problem], [problem], seed=0)
    task = CustomReward(rows, "examples.reward:exact_and_brief", TaskConfig())
    try:
        assert task.reward(problem, "So 48 + 24 = 72.") == 1.0
        assert task.reward(problem, "So 48 + 24 = 72, or 73") == 0.0
        assert task.reward(problem, "x" * 250 + " 72") == 0.8
    finally:
        task.close()


def test_the_example_environment_plays_its_episodes(rollout_fp8: InProcessRollout, replica_http: str) -> None:
    spec = "examples.environment:AskTwice"
    problems = load_environment(spec, seed=0).train_problems(0, 2)
    assert problems == load_environment(spec, seed=0).train_problems(0, 2)  # (a replayed step: the same)
    runner = EpisodeRunner(spec, 0, None)
    try:
        played, failures = play_twice_each(runner, problems, rollout_fp8, replica_http, "example")
    finally:
        runner.close()
    assert not failures
    assert len(played) == 4
    for e in played:
        assert e.failure is None and e.reward in (0.0, 0.5, 1.0)
        assert e.turns == (1 if e.reward == 1.0 else 2) and len(e.recorded["samples"]) == 1
