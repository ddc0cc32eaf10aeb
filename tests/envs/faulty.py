"""User code that misbehaves, for the tests of its workers (coordinator/user_code.py): rewards and an
environment that hang, crash, leak or raise on some inputs and behave on the others."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (a reward worker imports this module: nothing heavier than it needs)
    from coordinator.environments import Policy
    from coordinator.problems import Problem

_hoard: list[bytearray] = []


def misbehave(how: str) -> float:
    """Never returns a reward: ``how`` says what happens instead."""
    if how == "hang":
        time.sleep(3600)
    elif how == "crash":
        os._exit(3)
    elif how == "leak":
        while True:  # until the worker's memory cap stops it
            _hoard.append(bytearray(32 * 2**20))
    elif how == "raise":
        raise ZeroDivisionError("the reward divided by zero")
    elif how == "nan":
        return float("nan")
    raise AssertionError(how)


def _reward_that(how: str):  # type: ignore[no-untyped-def]
    def reward(prompt: str, completion: str, answer: str) -> float:
        """Misbehaves on the completion "1"; scores any other 1."""
        return misbehave(how) if completion == "1" else 1.0

    return reward


hang_on_one = _reward_that("hang")
crash_on_one = _reward_that("crash")
leak_on_one = _reward_that("leak")
raise_on_one = _reward_that("raise")
nan_on_one = _reward_that("nan")


class FaultyArith:
    """Sums over the completions API, one turn each; the episodes of the first problem of each step take
    their turn, then misbehave as ``how`` says (the factory ``FaultyArith.of(how)``)."""

    def __init__(self, seed: int, how: str) -> None:
        from coordinator.tasks import ArithTask

        self.task, self.how = ArithTask(seed, val_size=4), how

    @classmethod
    def of(cls, how: str):  # type: ignore[no-untyped-def]
        return lambda seed: cls(seed, how)

    def train_problems(self, step: int, count: int) -> list[Problem]:
        return self.task.train_problems(step, count)

    def val_problems(self) -> list[Problem]:
        return self.task.val_problems()

    def play(self, problem: Problem, policy: Policy) -> float:
        from coordinator.tasks import first_line

        answer = policy.client.completions.create(
            model=policy.model, prompt=problem.prompt, **policy.sampling
        )
        if problem.id.endswith("-0"):
            return misbehave(self.how)
        return 1.0 if first_line(answer.choices[0].text) == problem.answer else 0.0

    def close(self) -> None:
        pass


hanging = FaultyArith.of("hang")
crashing = FaultyArith.of("crash")
leaking = FaultyArith.of("leak")
raising = FaultyArith.of("raise")
