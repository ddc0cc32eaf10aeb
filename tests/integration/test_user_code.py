"""User code in worker processes (coordinator/user_code.py): a --reward function or an --env episode that
hangs, crashes, leaks or raises costs that one sample (scored 0, with the reason), the workers keep
serving the other samples, and every worker is reaped. Episodes play against the real replica's face."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from coordinator.config import TaskConfig
from coordinator.environments import EpisodeRunner, PlayedEpisode, load_environment
from coordinator.problems import CallFailed, Problem
from coordinator.tasks import ArithTask, CustomReward
from fp8rl.v1 import common_pb2
from tests.conftest import InProcessRollout

FAULTS = [("hang", "timed out"), ("crash", "crashed"), ("leak", "out of memory"), ("raise", "raised")]
LIMITS = TaskConfig(reward_deadline_s=5.0, user_code_memory_mb=256)  # (generous: a busy machine)


def gone(pid: int) -> bool:
    """The process has exited and been reaped (no zombie left)."""
    return not Path(f"/proc/{pid}").exists()


def outcome(score, problem: Problem, completion: str) -> float | CallFailed:  # type: ignore[no-untyped-def]
    try:
        return float(score(problem, completion))
    except CallFailed as exc:
        return exc


@pytest.mark.parametrize(("how", "reason"), [*FAULTS, ("nan", "raised")])
def test_a_reward_that_misbehaves_costs_only_its_completion(how: str, reason: str) -> None:
    task = CustomReward(ArithTask(seed=0), f"tests.envs.faulty:{how}_on_one", LIMITS)
    problem = task.val_problems()[0]
    try:
        start = time.monotonic()
        with ThreadPoolExecutor(max_workers=4, thread_name_prefix="reward") as threads:  # as batches.py
            scores = list(threads.map(lambda c: outcome(task.reward, problem, c), ["0", "1", "2", "1"]))
        assert time.monotonic() - start < 30
        assert scores[0] == scores[2] == 1.0
        for failed in (scores[1], scores[3]):
            assert isinstance(failed, CallFailed) and failed.reason == reason, failed
        assert task.reward(problem, "3") == 1.0  # the workers serve on
        pids = task.fn.pids
        assert pids
    finally:
        task.close()
    assert all(gone(pid) for pid in pids)


def test_a_reward_that_cannot_be_loaded_fails_the_configuration() -> None:
    with pytest.raises(ValueError, match="has no callable missing"):
        CustomReward(ArithTask(seed=0), "tests.envs.faulty:missing", LIMITS)


def play_twice_each(
    runner: EpisodeRunner, problems: list[Problem], rollout: InProcessRollout, http: str, label: str
) -> tuple[list[PlayedEpisode], list[Exception]]:
    """Two episodes of each problem on the shared replica's face (at the version it holds); and what the
    replica failed (an episode played again elsewhere)."""
    failures: list[Exception] = []
    played = runner.play(
        [(p, 2) for p in problems],
        common_pb2.SamplingParams(temperature=1.0, max_tokens=6),
        rollout.service.version,
        {"replica-grpc": http.removeprefix("http://")},
        label,
        lambda _, exc: failures.append(exc),
    )
    return played, failures


@pytest.mark.parametrize(("how", "reason"), FAULTS)
def test_an_episode_that_misbehaves_costs_only_that_episode(
    rollout_fp8: InProcessRollout, replica_http: str, how: str, reason: str
) -> None:
    """Two problems, two episodes each: the first problem's episodes take their turn and misbehave;
    they score 0 with that turn recorded, the others are played as usual."""
    spec = {"hang": "hanging", "crash": "crashing", "leak": "leaking", "raise": "raising"}[how]
    spec = f"tests.envs.faulty:{spec}"
    problems = load_environment(spec, seed=0).train_problems(0, 2)
    runner = EpisodeRunner(spec, 0, None, deadline_s=10.0, memory_mb=512)
    try:
        played, failures = play_twice_each(runner, problems, rollout_fp8, replica_http, f"faulty-{how}")
        pids = runner.players.pids
    finally:
        runner.close()
    assert not failures  # (the replica did nothing wrong: no episode was played again elsewhere)
    bad = [e for e in played if e.problem.id == problems[0].id]
    good = [e for e in played if e.problem.id == problems[1].id]
    assert len(bad) == len(good) == 2
    for e in bad:
        assert e.reward == 0.0 and e.failure is not None and e.failure.reason == reason, e.failure
        assert e.turns == 1 and len(e.recorded["samples"]) == 1  # the turn it took before the fault
    assert all(e.failure is None and e.turns == 1 for e in good)
    assert pids and all(gone(pid) for pid in pids)
