"""An environment: `coordinator start --env examples.environment:AskTwice`. Sums asked as a chat; a wrong
answer is told so and gets one more try (reward 1 on the first, 0.5 on the second)."""

from __future__ import annotations

import random

from coordinator.environments import Policy
from coordinator.problems import Problem


class AskTwice:
    def __init__(self, seed: int) -> None:
        self.seed = seed

    def _problem(self, pid: str, rng: random.Random) -> Problem:
        a, b = rng.randint(0, 19), rng.randint(0, 19)
        question = f"What is {a} + {b}?"
        return Problem(pid, question, str(a + b), messages=(("user", question),))

    def train_problems(self, step: int, count: int) -> list[Problem]:
        rng = random.Random(f"{self.seed}:train:{step}")  # the same problems when a step is replayed
        return [self._problem(f"s{step}-{i}", rng) for i in range(count)]

    def val_problems(self) -> list[Problem]:
        rng = random.Random(f"{self.seed}:val")
        return [self._problem(f"val-{i}", rng) for i in range(16)]

    def play(self, problem: Problem, policy: Policy) -> float:
        messages = [{"role": "user", "content": problem.prompt}]
        for turn in range(2):
            reply = policy.chat(messages)
            if problem.answer in reply.replace(".", " ").split():
                return 1.0 / (turn + 1)
            messages += [
                {"role": "assistant", "content": reply},
                {"role": "user", "content": f"No. {problem.prompt}"},
            ]
        return 0.0

    def close(self) -> None:
        pass
